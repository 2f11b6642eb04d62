//! nftproxy's tools, apart from the node agent: a lab of network namespaces ([`lab`]), the demo
//! ([`demo`]), the scale benchmark ([`bench`](mod@bench)) with its synthetic clusters ([`cluster`]),
//! wrappers of the kernel for tests ([`netfilter`]: fault injection, recording), a test
//! Kubernetes API server ([`apiserver`]), the processes they start and measure ([`process`]) and
//! the node's container images ([`images`]). They use only nftproxy's public API; `nftproxy demo` and `nftproxy bench`
//! run the `nftproxy-tools` binary that sits next to `nftproxy`.

pub mod apiserver;
pub mod bench;
pub mod cluster;
pub mod controlplane;
pub mod demo;
pub mod differences;
pub mod images;
pub mod lab;
pub mod netfilter;
pub mod node;
pub mod process;
pub mod random;

use std::path::PathBuf;

/// The `nftproxy` binary the tools run (the demo's proxy, the benchmark's agent): the one next
/// to this executable, else `nftproxy` on the `PATH`.
pub fn nftproxy_binary() -> PathBuf {
    let sibling = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join("nftproxy")));
    match sibling {
        Some(path) if path.is_file() => path,
        _ => PathBuf::from("nftproxy"),
    }
}
