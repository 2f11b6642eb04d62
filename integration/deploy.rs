//! The manifests in `deploy/` parse into their Kubernetes types and grant only what a service
//! proxy needs. (No root needed.)

use std::collections::BTreeSet;
use std::path::Path;

use clap::CommandFactory;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use serde_json::Value;

fn docs(file: &str) -> Vec<Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(file);
    let text = std::fs::read_to_string(&path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

fn typed<T: serde::de::DeserializeOwned>(v: &Value) -> T {
    serde_path_to_error::deserialize(v.clone()).unwrap_or_else(|e| panic!("{}: {}", e.path(), e.inner()))
}

#[test]
fn rbac_grants_exactly_what_a_service_proxy_needs() {
    let docs = docs("rbac.yaml");
    let sa: ServiceAccount = typed(&docs[0]);
    let role: ClusterRole = typed(&docs[1]);
    let binding: ClusterRoleBinding = typed(&docs[2]);
    let mut grants = BTreeSet::new();
    for rule in role.rules.unwrap_or_default() {
        assert!(rule.resource_names.is_none() && rule.non_resource_urls.is_none());
        for group in rule.api_groups.unwrap_or_default() {
            for resource in rule.resources.clone().unwrap_or_default() {
                for verb in &rule.verbs {
                    grants.insert(format!("{group}/{resource}:{verb}"));
                }
            }
        }
    }
    let expected: BTreeSet<String> = [
        "/services:get",
        "/services:list",
        "/services:watch",
        "/nodes:get",
        "/nodes:list",
        "/nodes:watch",
        "discovery.k8s.io/endpointslices:get",
        "discovery.k8s.io/endpointslices:list",
        "discovery.k8s.io/endpointslices:watch",
        "networking.k8s.io/servicecidrs:get",
        "networking.k8s.io/servicecidrs:list",
        "networking.k8s.io/servicecidrs:watch",
        "/events:create",
        "/events:patch",
        "events.k8s.io/events:create",
        "events.k8s.io/events:patch",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(grants, expected);
    assert_eq!(binding.role_ref.name, role.metadata.name.clone().unwrap());
    let subject = &binding.subjects.unwrap()[0];
    assert_eq!(Some(&subject.name), sa.metadata.name.as_ref());
    assert_eq!(subject.namespace, sa.metadata.namespace);
}

#[test]
fn the_daemonset_replaces_kube_proxy_with_least_privilege() {
    let ds: DaemonSet = typed(&docs("daemonset.yaml")[0]);
    let pod = ds.spec.unwrap().template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.priority_class_name.as_deref(), Some("system-node-critical"));
    assert!(pod.tolerations.unwrap().iter().any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()));
    assert_eq!(pod.service_account_name.as_deref(), Some("nftproxy"));
    assert_eq!(pod.containers.len(), 1);
    let c = &pod.containers[0];
    let sec = c.security_context.clone().unwrap();
    assert_eq!(sec.privileged, Some(false));
    assert_eq!(sec.allow_privilege_escalation, Some(false));
    let caps = sec.capabilities.unwrap();
    assert_eq!(caps.drop.unwrap(), vec!["ALL"]);
    assert_eq!(caps.add.unwrap(), vec!["NET_ADMIN"]);
    let probe = c.liveness_probe.clone().unwrap().http_get.unwrap();
    assert_eq!(probe.path.as_deref(), Some("/livez"));
    let args = c.args.clone().unwrap();
    assert_eq!(args[0], "run");
    assert!(args.contains(&"--config=/etc/nftproxy/config.yaml".to_string()));
    // What the latest sizing table derives (bench::sizing::resources), request and limit.
    let (file, derived) = sizing();
    let resources = c.resources.clone().unwrap();
    let memory = |q: Option<
        std::collections::BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { q.unwrap()["memory"].0.clone() };
    assert_eq!(memory(resources.requests.clone()), format!("{}Mi", derived.request_mib), "the request of {file}");
    assert_eq!(memory(resources.limits.clone()), format!("{}Mi", derived.limit_mib), "the limit of {file}");
    let mounts = |c: &k8s_openapi::api::core::v1::Container| -> Vec<(String, String)> {
        c.volume_mounts.clone().unwrap().into_iter().map(|m| (m.name, m.mount_path)).collect()
    };
    // Only the init container is privileged: it writes the conntrack sysctls from the same
    // configuration and exits, so the long-running container needs no writable /proc/sys.
    let inits = pod.init_containers.clone().unwrap();
    assert_eq!(inits.len(), 1);
    let init = &inits[0];
    assert_eq!(init.image, c.image);
    assert_eq!(init.security_context.clone().unwrap().privileged, Some(true));
    let init_args = init.args.clone().unwrap();
    assert_eq!(init_args[0], "conntrack-sysctls");
    assert!(init_args.contains(&"--config=/etc/nftproxy/config.yaml".to_string()));
    // The long-running container also holds iptables' lock while it removes kube-proxy's
    // iptables-legacy leftovers: the node's own file.
    let mut with_lock = mounts(init);
    with_lock.push(("xtables-lock".into(), "/run/xtables.lock".into()));
    assert_eq!(mounts(c), with_lock);
    let volumes = pod.volumes.unwrap();
    let lock = volumes.iter().find(|v| v.name == "xtables-lock").and_then(|v| v.host_path.clone()).unwrap();
    assert_eq!((lock.path.as_str(), lock.type_.as_deref()), ("/run/xtables.lock", Some("FileOrCreate")));
    let volume = &volumes[0];
    let cm: ConfigMap = typed(&docs("configmap.yaml")[0]);
    assert_eq!(volume.config_map.as_ref().map(|c| c.name.clone()), cm.metadata.name.clone());
    // The binary takes the init container's arguments.
    let mut argv = vec!["nftproxy".to_string()];
    argv.extend(init_args);
    nftproxy::cli::Cli::command().try_get_matches_from(argv).expect("conntrack-sysctls arguments parse");
}

/// The latest results file with a sizing table, and the memory request and limit it derives.
fn sizing() -> (String, nftproxy_tools::bench::sizing::Resources) {
    use nftproxy_tools::bench::sizing;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/performance/results");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    for file in files.iter().rev().filter(|f| f.extension().is_some_and(|e| e == "md")) {
        let text = std::fs::read_to_string(file).unwrap();
        if text.contains(sizing::TABLE_HEAD) {
            let derived = sizing::resources(&sizing::peaks_in(&text)).expect("the table derives resources");
            return (file.file_name().unwrap().to_string_lossy().into_owned(), derived);
        }
    }
    panic!("no results file has a sizing table (nftproxy bench --sizing …)");
}

/// docs/install.md's sizing section gives the DaemonSet's memory request and limit as the
/// latest sizing table derives them, and names that table.
#[test]
fn the_sizing_docs_quote_the_latest_table() {
    let (file, derived) = sizing();
    let install = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/install.md")).unwrap();
    let section = &install[install.find("### Sizing").unwrap()..];
    let section = &section[..section[4..].find("\n### ").map_or(section.len(), |e| e + 4)];
    assert!(section.contains(&file), "install.md's sizing names {file}:\n{section}");
    for figure in [format!("{}Mi", derived.request_mib), format!("{}Mi", derived.limit_mib)] {
        assert!(section.contains(&figure), "install.md's sizing gives {figure}:\n{section}");
    }
}

#[test]
fn the_shipped_config_is_read_without_warnings() {
    let cm: ConfigMap = typed(&docs("configmap.yaml")[0]);
    let text = cm.data.unwrap().remove("config.yaml").unwrap();
    let (settings, warnings) = nftproxy::config::kubeproxy::KubeProxyConfiguration::parse(&text).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(settings.validate(), Ok(()));
    assert_eq!(settings.masquerade_bit(), 14);
    assert_eq!(settings.conntrack.max_per_core, Some(32768));
    assert_eq!(
        settings.conntrack.tcp_close_wait_timeout,
        Some(nftproxy::config::duration::GoDuration::from_secs(3600))
    );
}

#[test]
fn the_container_build_is_multi_stage() {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/Containerfile")).unwrap();
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2);
    // The build stage is pinned by digest; the image is only the root filesystem it made, the one
    // scripts/images makes offline from the same lock (integration/images.rs checks that image's
    // files: the kube-proxy link, the libraries).
    assert!(froms[0].contains("@sha256:"), "{}", froms[0]);
    assert_eq!(froms[1], "FROM scratch");
    assert!(text.contains("COPY deploy/image-packages.lock "));
    assert!(text.contains("libnftnl11") && text.contains("libmnl0"), "the headers match the lock's libraries");
    assert!(text.contains("RUN scripts/images rootfs nftproxy target/release/nftproxy /rootfs"));
    assert!(text.contains("COPY --from=build /rootfs /"));
    assert!(text.contains(&format!("org.opencontainers.image.version={}", env!("CARGO_PKG_VERSION"))));
    // Every workspace member is copied into the build stage, or the build cannot resolve it.
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let members = manifest.lines().find(|l| l.starts_with("members")).expect("workspace members");
    for member in members.split('"').skip(1).step_by(2).filter(|m| *m != ".") {
        assert!(text.contains(&format!("COPY {member} {member}")), "the Containerfile does not copy {member}/");
    }
}

/// The node agent talks netlink only: no module of the `nftproxy` crate may start a program
/// (`nft`, `iptables`, `conntrack`, …) but the one that hands `nftproxy demo` and `nftproxy
/// bench` to the tools binary. The lab, the demo and the benchmark's anchors live in `tools/`.
#[test]
fn the_node_agent_never_runs_external_programs() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let allowed = [src.join("tools_binary.rs")];
    let mut stack = vec![src.clone()];
    let mut checked = 0;
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if allowed.iter().any(|a| path.starts_with(a)) {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for needle in
                    ["Command::new", "process::Command", "Command::spawn", "libc::exec", "execvp", "posix_spawn"]
                {
                    assert!(
                        !text.contains(needle),
                        "{} uses {needle}: the agent must not run programs",
                        path.display()
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 40, "only {checked} files checked");
}
