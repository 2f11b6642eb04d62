//! `/debug/services` and `nftproxy status` against `nftproxy run` in the lab: what is
//! programmed, what was left out and why, and the bounds of the answer.

use std::time::Duration;

use crate::common::*;

/// The web service, plus one with a port out of range (ignored, the rest programmed).
fn manifests() -> String {
    format!(
        r#"{}---
apiVersion: v1
kind: Service
metadata: {{name: odd, namespace: other}}
spec:
  clusterIP: 10.96.0.30
  ports: [{{name: a, port: 80}}, {{name: b, port: 70000}}]
"#,
        web_manifests(&[WEB_1, WEB_2, WEB_3])
    )
}

fn status(lab: &ClusterLab, args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["status", "--metrics-address", "127.0.0.1:10249"];
    all.extend_from_slice(args);
    let out = lab.nftproxy(&all);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn status_shows_what_run_programmed_and_what_it_left_out() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let path = lab.write("cluster.yaml", &manifests());
    let _proxy = lab.run_proxy(&path, &[]);
    let (ok, text, err) = status(&lab, &[]);
    assert!(ok, "{err}");
    for line in [
        "node node1, tables nftproxy (owned by this nftproxy)\n",
        "last sync: success at ",
        "(full, startup, ",
        "default/web:http  TCP 80\n",
        "  addresses  ClusterIP 10.96.0.10\n",
        "  policy     internal Cluster\n",
        "  endpoints  IPv4 cluster: 10.244.1.10:8080, 10.244.1.11:8080, 10.244.2.10:8080; 3 known\n",
        "default/web:dns  UDP 53\n",
        "default/empty:http  TCP 80\n",
        "  endpoints  IPv4 cluster: none; 0 known\n",
        "other/odd:a  TCP 80\n",
        "problems in objects (latest per object):\n",
        "  Service other/odd: spec.ports[1].port ignored: ",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }

    // An edit shows in the next answer, as programmed by the next sync: the problem is gone.
    rewrite(&path, &web_manifests(&[WEB_1]));
    assert!(
        lab.eventually(Duration::from_secs(10), || {
            let (_, text, _) = status(&lab, &["--service", "default/web"]);
            text.contains("  endpoints  IPv4 cluster: 10.244.1.10:8080; 1 known\n")
                && text.contains("(partial, changes, ")
                && !text.contains("problems in objects")
        }),
        "{}",
        status(&lab, &["--service", "default/web"]).1
    );

    // The JSON, bounded.
    let (ok, json, err) = status(&lab, &["--output", "json", "--limit", "1"]);
    assert!(ok, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(doc["servicePorts"].as_array().unwrap().len(), 1, "{json}");
    assert_eq!(doc["servicePortsTotal"], 4, "{json}");
    assert_eq!(doc["truncated"], true);
    assert_eq!(doc["servicePorts"][0]["service"], "default/empty");
    assert_eq!(doc["lastSync"]["result"], "success");

    // Bad requests are refused with a reason; other paths of the metrics port still answer.
    let (code, body) = lab.http_get("node1", "127.0.0.1:10249", "/debug/services?limit=0").unwrap();
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("limit must be a number"), "{body}");
    let (ok, _, err) = status(&lab, &["--service", "web"]);
    assert!(!ok && err.contains("service must be NAMESPACE/NAME"), "{err}");
    let (code, body) = lab.http_get("node1", "127.0.0.1:10249", "/proxyMode").unwrap();
    assert_eq!((code, body.as_str()), (200, "nftables"));
}

#[test]
fn status_says_when_nothing_answers() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let (ok, _, err) = status(&lab, &[]);
    assert!(!ok);
    assert!(err.contains("cannot reach nftproxy's metrics server at 127.0.0.1:10249"), "{err}");
}

/// `/debug/services` names every service and endpoint of the node: opening `/metrics` to
/// Prometheus (a non-loopback metrics address) does not open it too; `--debug-bind-address`
/// serves it on an address of its own.
#[test]
fn debug_services_stays_off_an_exposed_metrics_address() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let path = lab.write("cluster.yaml", &manifests());
    let exposed = lab.run_proxy(&path, &["--metrics-bind-address", "0.0.0.0:10249"]);
    let get = |addr: &str, path: &str| lab.http_get("node1", addr, path).map(|(code, _)| code).unwrap_or(0);
    assert_eq!(get("127.0.0.1:10249", "/metrics"), 200);
    assert_eq!(get("127.0.0.1:10249", "/debug/services"), 404, "{}", lab.proxy_log());
    assert!(lab.proxy_log().contains("/debug/services is not served"), "{}", lab.proxy_log());
    drop(exposed);

    let _own =
        lab.run_proxy(&path, &["--metrics-bind-address", "0.0.0.0:10249", "--debug-bind-address", "127.0.0.1:10259"]);
    assert_eq!(get("127.0.0.1:10249", "/debug/services"), 404);
    assert_eq!(get("127.0.0.1:10259", "/metrics"), 404, "only /debug/services there");
    let (ok, text, err) = {
        let out = lab.nftproxy(&["status", "--metrics-address", "127.0.0.1:10259"]);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    assert!(ok, "{err}");
    assert!(text.contains("default/web:http"), "{text}");
}
