//! Per-service counters (issue 16) with real packets: `nftproxy run` in node1, connections from
//! the client to a ClusterIP, a NodePort, a service without endpoints and a `Local` NodePort
//! without local endpoints; `/metrics` counts each exactly, per service port.

use std::time::Duration;

use crate::common::*;
use nftproxy::net::L4Proto;

const METRICS: &str = "127.0.0.1:10249";

/// The value of the sample `name{labels}` in an exposition, 0 when absent.
fn sample(text: &str, name: &str, labels: &str) -> u64 {
    let prefix = format!("{name}{{{labels}}} ");
    text.lines().find_map(|l| l.strip_prefix(prefix.as_str())).map_or(0, |v| v.trim().parse().expect("a count"))
}

fn labels(service: &str, port: &str, protocol: &str, reason: Option<&str>) -> String {
    let base = format!(
        "namespace=\"default\",service=\"{service}\",port=\"{port}\",protocol=\"{protocol}\",ip_family=\"IPv4\""
    );
    match reason {
        Some(r) => format!("{base},reason=\"{r}\""),
        None => base,
    }
}

struct Scraper<'a> {
    lab: &'a ClusterLab,
}

impl Scraper<'_> {
    fn scrape(&self) -> String {
        let (code, text) = self.lab.http_get("node1", METRICS, "/metrics").expect("metrics");
        assert_eq!(code, 200);
        text
    }

    /// Waits until the sample reads `want` (a scrape is answered from a read up to a second
    /// old), and says what it read last.
    fn expect(&self, name: &str, labels: &str, want: u64) {
        let mut last = 0;
        let reached = self.lab.eventually(Duration::from_secs(5), || {
            last = sample(&self.scrape(), name, labels);
            last == want
        });
        assert!(reached, "{name}{{{labels}}} is {last}, expected {want}:\n{}", self.scrape());
        // Exactly: nothing more arrives later.
        std::thread::sleep(Duration::from_millis(1100));
        assert_eq!(sample(&self.scrape(), name, labels), want, "{name}{{{labels}}} grew after the traffic");
    }
}

#[test]
fn connections_and_rejects_are_counted_per_service_port() {
    if skip_unless_privileged() {
        return;
    }
    let lab = ClusterLab::new();
    let web = Svc {
        name: "web",
        cluster_ip: "10.96.0.10",
        kind: "NodePort",
        node_port: Some(30080),
        endpoints: &[WEB_1, WEB_3],
        ..Default::default()
    };
    let empty = Svc { name: "empty", cluster_ip: "10.96.0.20", ..Default::default() };
    // Endpoints only on node2, externalTrafficPolicy Local: node1 drops its NodePort traffic.
    let remote = Svc {
        name: "remote",
        cluster_ip: "10.96.0.30",
        kind: "NodePort",
        node_port: Some(30090),
        external_local: true,
        endpoints: &[WEB_3],
        ..Default::default()
    };
    let path = lab.write("cluster.yaml", &services_yaml(&[web, empty, remote]));
    let _proxy = lab.run_proxy(&path, &["--metrics-bind-address", METRICS]);
    let scraper = Scraper { lab: &lab };
    let connections = "nftproxy_service_connections_total";
    let rejects = "nftproxy_service_rejects_total";
    let web_http = labels("web", "http", "TCP", None);
    let web_dns = labels("web", "dns", "UDP", None);

    // Nothing yet: every series starts at 0.
    let before = scraper.scrape();
    assert!(before.contains("# TYPE nftproxy_service_connections_total counter"), "{before}");
    assert_eq!(sample(&before, connections, &web_http), 0, "{before}");

    // N connections to the ClusterIP.
    let t = lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 25);
    assert_eq!(t.answered(), 25, "{t:?}");
    scraper.expect(connections, &web_http, 25);
    let u = lab.tally("client", L4Proto::Udp, "10.96.0.10:53", 7);
    assert_eq!(u.answered(), 7, "{u:?}");
    scraper.expect(connections, &web_dns, 7);

    // M more to its NodePort: the same service port's series.
    let t = lab.tally("client", L4Proto::Tcp, "192.168.50.2:30080", 11);
    assert_eq!(t.answered(), 11, "{t:?}");
    scraper.expect(connections, &web_http, 36);

    // A service without endpoints: every attempt rejected, counted with its reason.
    for _ in 0..6 {
        lab.ask("client", L4Proto::Tcp, "10.96.0.20:80").expect_err("no endpoints");
    }
    scraper.expect(rejects, &labels("empty", "http", "TCP", Some("no_endpoints")), 6);
    assert_eq!(sample(&scraper.scrape(), connections, &labels("empty", "http", "TCP", None)), 0);

    // A Local NodePort without endpoints on node1: dropped (UDP: one datagram per attempt, no
    // retransmission to count twice; a tally's asks are distinct flows).
    let u = lab.tally("client", L4Proto::Udp, "192.168.50.2:30091", 3);
    assert_eq!(u.failed(), 3, "no local endpoints: {u:?}");
    scraper.expect(rejects, &labels("remote", "dns", "UDP", Some("no_local_endpoints")), 3);
    // Its ClusterIP still reaches node2's endpoint from a pod: a connection.
    let t = lab.tally("web-1", L4Proto::Tcp, "10.96.0.30:80", 4);
    assert_eq!(t.answered(), 4, "{t:?}");
    scraper.expect(connections, &labels("remote", "http", "TCP", None), 4);

    // The raw counters, as docs/debugging.md shows them.
    let listed = lab.listing();
    assert!(listed.contains("10.96.0.10 . tcp . 80 counter packets 25 bytes"), "{listed}");
}

/// The scrape cost at 10,000 services × 10 endpoints: `nftproxy run` programs the synthetic
/// cluster in a namespace of its own, and `/metrics` is timed when it reads the kernel (the
/// first scrape after the one-second cache) and when the cache answers. Printed, and bounded.
#[test]
fn scrape_cost_at_ten_thousand_services() {
    if skip_unless_privileged() {
        return;
    }
    use nftproxy_tools::cluster::{Size, write_yaml};
    use nftproxy_tools::lab::{netns::Netns, traffic};
    use std::time::Instant;

    let size = Size { services: 10_000, endpoints: 10 };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cluster.yaml");
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_yaml(size, &mut file).unwrap();
    drop(file);
    let ns = Netns::create("scrape").unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let start = |extra: &[&str]| {
        let log = std::fs::File::create(dir.path().join("proxy.log")).unwrap();
        let child = ns
            .command(env!("CARGO_BIN_EXE_nftproxy"))
            .args(["run", "--manifests", path.to_str().unwrap(), "--hostname-override", "node1"])
            .args(["--metrics-bind-address", METRICS, "--healthz-bind-address", "127.0.0.1:10256"])
            .args(["--conntrack-max-per-core", "0"])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Kill(child)
    };
    let rss_mib = |proxy: &Kill| {
        let status = std::fs::read_to_string(format!("/proc/{}/status", proxy.0.id())).unwrap_or_default();
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        kib / 1024
    };
    let proxy = start(&[]);
    let get = |path: &'static str| {
        let target = METRICS.parse().unwrap();
        ns.run(move || {
            let started = Instant::now();
            traffic::http_get(target, path, Duration::from_secs(30)).map(|(code, body)| (code, body, started.elapsed()))
        })
        .unwrap()
    };
    // The first sync is done when every service port has its series.
    let deadline = Instant::now() + Duration::from_secs(300);
    let started = Instant::now();
    loop {
        if let Ok((200, body, _)) = get("/metrics")
            && body.lines().filter(|l| l.starts_with("nftproxy_service_")).count() >= size.services
        {
            break;
        }
        let log = std::fs::read_to_string(dir.path().join("proxy.log")).unwrap_or_default();
        assert!(Instant::now() < deadline, "no first sync:\n{log}");
        std::thread::sleep(Duration::from_millis(500));
    }
    println!("first sync of {size} seen on /metrics after {:?}", started.elapsed());

    let mut read = Vec::new();
    let mut cached = Vec::new();
    let mut series = 0;
    let mut bytes = 0;
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(1100));
        let (code, body, took) = get("/metrics").expect("scrape");
        assert_eq!(code, 200);
        read.push(took);
        series = body.lines().filter(|l| l.starts_with("nftproxy_service_")).count();
        bytes = body.len();
        let (_, _, took) = get("/metrics").expect("cached scrape");
        cached.push(took);
    }
    read.sort();
    cached.sort();
    println!(
        "scrape at {size}: {series} per-service series, {bytes} bytes; reading the kernel: median {:?} (max {:?}); \
         cached: median {:?}",
        read[2], read[4], cached[2]
    );
    // Every service port has its series (the mix gives each one port).
    assert!(series >= size.services, "{series} series");
    // Bounded: well under a scrape interval, even unoptimised.
    assert!(read[2] < Duration::from_secs(2), "scrape reading the kernel took {:?}", read[2]);
    // The fastest of each: a load spike on a busy machine slows single scrapes, not all five.
    assert!(cached[0] < read[0], "the cache answers faster ({:?} vs {:?})", cached[0], read[0]);
    let rss_on = rss_mib(&proxy);
    drop(proxy);

    // The switch: the same node, restarted with --service-counters=false.
    let proxy = start(&["--service-counters=false"]);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Ok((200, body, _)) = get("/metrics")
            && body.contains("kubeproxy_sync_proxy_rules_last_timestamp_seconds{")
        {
            break;
        }
        let log = std::fs::read_to_string(dir.path().join("proxy.log")).unwrap_or_default();
        assert!(Instant::now() < deadline, "no first sync:\n{log}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let mut off = Vec::new();
    let mut off_bytes = 0;
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(1100));
        let (code, body, took) = get("/metrics").expect("scrape");
        assert_eq!(code, 200);
        assert!(!body.contains("nftproxy_service_"), "per-service series with the switch off");
        off.push(took);
        off_bytes = body.len();
    }
    off.sort();
    println!(
        "--service-counters at {size}: on: {series} series, {bytes} bytes, scrape median {:?}, RSS {rss_on} MiB; \
         off: {off_bytes} bytes, scrape median {:?}, RSS {} MiB",
        read[2],
        off[2],
        rss_mib(&proxy)
    );
    assert!(off_bytes * 10 < bytes, "off: {off_bytes} bytes, on: {bytes}");
}

/// A node upgraded from a version without counters: its dispatch sets and maps are recreated
/// with `counter` in the first sync (one transaction, traffic still flowing after it), and the
/// next sync, with counters moved by traffic, has nothing to do: their values never look like
/// a change.
#[test]
fn sets_without_counters_are_recreated_once_and_counts_never_look_like_a_change() {
    if skip_unless_privileged() {
        return;
    }
    use nftproxy::nft::canonical::canonicalize;

    let lab = ClusterLab::new();
    let yaml = web_manifests(&[WEB_1, WEB_3]);
    let counted = lab.render(&yaml);
    let old: String = counted
        .lines()
        .filter(|l| l.trim() != "counter")
        .map(|l| format!("{}\n", l.replace(" counter packets 0 bytes 0", "")))
        .collect();
    assert_ne!(old, counted);
    let path = lab.write("old.nft", &old);
    lab.lab.node("node1").ns.exec("nft", &["-f", path.to_str().unwrap()]).unwrap();
    assert!(!lab.listing().contains("counter"), "{}", lab.listing());
    assert_eq!(lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 3).answered(), 3);

    let first = lab.sync(&yaml);
    assert!(first.contains("1 transaction"), "{first}");
    assert_eq!(canonicalize(&lab.listing()), canonicalize(&counted));
    assert_eq!(lab.tally("client", L4Proto::Tcp, "10.96.0.10:80", 5).answered(), 5);
    assert!(lab.listing().contains("10.96.0.10 . tcp . 80 counter packets 5 bytes"), "{}", lab.listing());
    let second = lab.sync(&yaml);
    assert!(second.contains(" 0 messages"), "counter values are not a change: {second}");
}
