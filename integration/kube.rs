//! The Kubernetes watch path end to end: `nftproxy run --kubeconfig` in node1 against a test
//! API server speaking the real list/watch wire format. The kernel follows every event, a 410
//! forces a relist that catches up on missed changes, dropped connections reconnect, and the
//! rules survive the API server going away.

use std::time::Duration;

use crate::common::apiserver::{FakeApi, objects};
use crate::common::*;
use nftproxy::net::L4Proto;
use serde_json::Value;

fn svc<'a>(name: &'a str, ip: &'a str, endpoints: &'a [Ep<'a>]) -> Svc<'a> {
    Svc { name, cluster_ip: ip, endpoints, ..Default::default() }
}

fn apply_all(api: &FakeApi, yaml: &str) {
    for obj in objects(yaml) {
        api.apply(obj);
    }
}

fn only(yaml: &str, kind: &str) -> Vec<Value> {
    objects(yaml).into_iter().filter(|o| o["kind"] == kind).collect()
}

#[test]
fn the_kernel_follows_the_api_server() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let mut api = FakeApi::start(&lab.lab.node("node1").ns);
    apply_all(&api, &services_yaml(&[svc("web", "10.96.0.10", &[WEB_1, WEB_2])]));
    // An object another proxy owns, and one that cannot be programmed.
    let mut foreign = only(&services_yaml(&[svc("other", "10.96.0.50", &[WEB_1])]), "Service").remove(0);
    foreign["metadata"]["labels"] = serde_json::json!({"service.kubernetes.io/service-proxy-name": "someone-else"});
    api.apply(foreign);
    let mut broken = only(&services_yaml(&[svc("broken", "10.96.0.60", &[])]), "Service").remove(0);
    broken["spec"]["clusterIP"] = Value::String("10.96.0.999".into());
    api.apply(broken);

    let kubeconfig = lab.write("kubeconfig", &api.kubeconfig());
    let _proxy = lab.run_proxy_from(&["--kubeconfig", kubeconfig.to_str().unwrap()], &[]);
    let within = Duration::from_secs(5);
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 30);
    assert_eq!(t.by_backend.len(), 2, "{t:?}\n{}", lab.proxy_log());
    assert!(!lab.listing().contains("10.96.0.50"), "another proxy's service is left alone");
    assert!(
        lab.eventually(within, || api.events().iter().any(|e| e["regarding"]["name"] == "broken")),
        "an Event names the service that cannot be programmed: {:?}",
        api.events()
    );

    // ADDED: a new service.
    apply_all(&api, &services_yaml(&[svc("api", "10.96.0.11", &[WEB_3])]));
    assert!(
        lab.eventually(within, || lab.ask("client", L4Proto::Tcp, "10.96.0.11:80").is_ok_and(|a| a.backend == "web-3"))
    );
    // MODIFIED: endpoints of web change.
    for slice in only(&services_yaml(&[svc("web", "10.96.0.10", &[WEB_3])]), "EndpointSlice") {
        api.apply(slice);
    }
    assert!(lab.eventually(within, || {
        let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 10);
        t.by_backend.keys().collect::<Vec<_>>() == vec!["web-3"]
    }));
    // DELETED: the api service goes.
    api.delete("Service", "default", "api");
    assert!(lab.eventually(within, || !lab.listing().contains("10.96.0.11")));

    // A change the watch never delivers, then 410 Gone: the relist catches up. A watcher's
    // retries back off (0.8 s, then 1.6 s, then 3.2 s, each up to twice that with jitter), and a
    // request cut short by the next step fails again, so these steps wait longer.
    let resumed = Duration::from_secs(20);
    let (lists_before, _) = api.requests();
    for slice in only(&services_yaml(&[svc("web", "10.96.0.10", &[WEB_1])]), "EndpointSlice") {
        api.apply_silently(slice);
    }
    api.expire_watches();
    assert!(
        lab.eventually(resumed, || lab
            .ask("client", L4Proto::Tcp, "10.96.0.10:80")
            .is_ok_and(|a| a.backend == "web-1")),
        "relist applied the missed change\n{}",
        lab.proxy_log()
    );
    assert!(api.requests().0 > lists_before, "the watchers listed again");

    // A dropped connection: the watch resumes and later events still arrive.
    api.drop_connections();
    apply_all(&api, &services_yaml(&[svc("late", "10.96.0.12", &[WEB_2])]));
    assert!(
        lab.eventually(resumed, || lab.ask("client", L4Proto::Tcp, "10.96.0.12:80").is_ok()),
        "a watch resumed after its connection dropped\n{}",
        lab.proxy_log()
    );

    // Settled: every watcher is back (the relist and the reconnect are done).
    assert!(lab.eventually(resumed, || lab.tally("client", L4Proto::Tcp, "10.96.0.12:80", 10).failed() == 0));

    // The API server goes away: rules stay, traffic flows, the proxy keeps running.
    api.stop();
    std::thread::sleep(Duration::from_secs(2));
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.12:80", 20);
    assert_eq!(t.failed(), 0, "{t:?}\n{}", lab.proxy_log());
    assert!(matches!(lab.http_get("node1", "127.0.0.1:10256", "/livez"), Ok((200, _))));
}
