//! The node's images as `scripts/images` builds them (`$NFTPROXY_IMAGES`, else the script runs):
//! each holds what the manifests that name it expect, and each answers when containerd runs it.
//! The containerd is a throwaway one: its own root, state and socket under a temporary
//! directory, in a network namespace and a private mount namespace of its own (a fresh `/run`),
//! its containers in a cgroup subtree of its own, all removed afterwards. (Root needed: the
//! images' files keep their owners and capabilities.)

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use nftproxy_tools::controlplane::UpstreamBins;
use nftproxy_tools::images::{Image, Images};
use serde_json::Value;

use crate::common::skip_unless_privileged;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// An image archive taken apart: its config and its layer unpacked.
struct Unpacked {
    _dir: tempfile::TempDir,
    config: Value,
    layer_digest: String,
    layer_tar: PathBuf,
    root: PathBuf,
}

impl Unpacked {
    fn new(image: &Image) -> Unpacked {
        let dir = tempfile::tempdir().unwrap();
        let layout = dir.path().join("layout");
        let root = dir.path().join("root");
        std::fs::create_dir_all(&layout).unwrap();
        std::fs::create_dir_all(&root).unwrap();
        run(Command::new("tar").arg("-xf").arg(&image.archive).arg("-C").arg(&layout));
        let blob = |digest: &str| layout.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
        let index = json(&layout.join("index.json"));
        let entry = &index["manifests"][0];
        assert_eq!(index["manifests"].as_array().unwrap().len(), 1, "{}: one manifest", image.name);
        assert_eq!(entry["annotations"]["io.containerd.image.name"], image.reference.as_str());
        assert_eq!(entry["digest"], image.digest.as_str());
        let manifest = json(&blob(entry["digest"].as_str().unwrap()));
        let config = json(&blob(manifest["config"]["digest"].as_str().unwrap()));
        let layers = manifest["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 1, "{}: one layer", image.name);
        let layer_digest = layers[0]["digest"].as_str().unwrap().to_string();
        let layer_tar = dir.path().join("layer.tar");
        let gz = std::fs::File::open(blob(&layer_digest)).unwrap();
        let tar = std::fs::File::create(&layer_tar).unwrap();
        run(Command::new("gzip").arg("-dc").stdin(gz).stdout(tar));
        let diff_id = format!("sha256:{}", sha256_hex(&std::fs::read(&layer_tar).unwrap()));
        assert_eq!(config["rootfs"]["diff_ids"][0], diff_id.as_str(), "{}: the config names its layer", image.name);
        run(Command::new("tar").arg("-xpf").arg(&layer_tar).arg("-C").arg(&root));
        Unpacked { _dir: dir, config: config["config"].clone(), layer_digest, layer_tar, root }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }

    fn link(&self, p: &str) -> String {
        std::fs::read_link(self.path(p)).unwrap_or_else(|e| panic!("{p}: {e}")).to_string_lossy().into_owned()
    }

    /// Whether `p` names a file in the image, symlinks resolved inside the image.
    fn exists(&self, p: &str) -> bool {
        let mut path = p.to_string();
        for _ in 0..16 {
            let mut resolved = PathBuf::from("/");
            let mut rest: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
            rest.reverse();
            let mut relinked = None;
            while let Some(c) = rest.pop() {
                match c {
                    "." => continue,
                    ".." => {
                        resolved.pop();
                        continue;
                    }
                    _ => resolved.push(c),
                }
                let on_disk = self.path(resolved.to_str().unwrap());
                match std::fs::symlink_metadata(&on_disk) {
                    Err(_) => return false,
                    Ok(m) if m.file_type().is_symlink() => {
                        let target = std::fs::read_link(&on_disk).unwrap();
                        let base = resolved.parent().unwrap().to_path_buf();
                        let mut next = if target.is_absolute() { target } else { base.join(target) };
                        rest.reverse();
                        for r in rest.drain(..) {
                            next.push(r);
                        }
                        relinked = Some(next.to_string_lossy().into_owned());
                        break;
                    }
                    Ok(_) => {}
                }
            }
            match relinked {
                Some(next) => path = next,
                None => return true,
            }
        }
        false
    }

    fn strings(&self, key: &str) -> Vec<String> {
        self.config[key]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(bytes))
}

fn daemonset_images() -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("deploy/daemonset.yaml")).unwrap();
    let ds: DaemonSet = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| <Value as serde::Deserialize>::deserialize(doc).unwrap())
        .find(|v| v["kind"] == "DaemonSet")
        .map(|v| serde_json::from_value(v).unwrap())
        .unwrap();
    let pod = ds.spec.unwrap().template.spec.unwrap();
    pod.containers.iter().chain(pod.init_containers.iter().flatten()).filter_map(|c| c.image.clone()).collect()
}

/// The `ENTRYPOINT`, `CMD` and `LABEL` of deploy/Containerfile's last stage.
fn containerfile_config() -> (Vec<String>, Vec<String>, Vec<(String, String)>) {
    let text = std::fs::read_to_string(repo().join("deploy/Containerfile")).unwrap();
    let last = text.rsplit("\nFROM ").next().unwrap();
    let line = |key: &str| last.lines().find_map(|l| l.strip_prefix(key)).unwrap_or_else(|| panic!("no {key}"));
    let entrypoint: Vec<String> = serde_json::from_str(line("ENTRYPOINT ")).unwrap();
    let cmd: Vec<String> = serde_json::from_str(line("CMD ")).unwrap();
    let labels = line("LABEL ")
        .split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect();
    (entrypoint, cmd, labels)
}

#[test]
fn the_images_hold_what_their_manifests_expect() {
    if skip_unless_privileged() {
        return;
    }
    let images = Images::locate().unwrap();
    let version = env!("CARGO_PKG_VERSION");
    for image in images.all() {
        eprintln!(
            "{:<48} {:>6.1} MiB compressed, {:>6.1} MiB unpacked, {}",
            image.name,
            image.size as f64 / 1048576.0,
            image.unpacked as f64 / 1048576.0,
            &image.digest[..19]
        );
    }

    // deploy/'s DaemonSet runs this image: its args go to nftproxy (the entrypoint).
    let release = images.get(&format!("nftproxy:{version}")).unwrap();
    for name in daemonset_images() {
        assert_eq!(images.get(&name).unwrap().name, release.name, "deploy/daemonset.yaml names {name}");
    }
    assert_eq!(release.reference, format!("docker.io/library/nftproxy:{version}"), "the name the CRI looks up");
    let nftproxy = Unpacked::new(release);
    let (entrypoint, cmd, labels) = containerfile_config();
    assert_eq!(nftproxy.strings("Entrypoint"), ["/usr/local/bin/nftproxy"]);
    assert_eq!(nftproxy.strings("Entrypoint"), entrypoint, "the Containerfile's entrypoint");
    assert_eq!(nftproxy.strings("Cmd"), cmd, "the Containerfile's command");
    assert_eq!(nftproxy.config["User"], "0");
    for (k, v) in &labels {
        assert_eq!(nftproxy.config["Labels"][k], v.as_str(), "the Containerfile's label {k}");
    }
    assert_eq!(nftproxy.config["Labels"]["org.opencontainers.image.version"], version);
    // The image swap: kubeadm's DaemonSet runs /usr/local/bin/kube-proxy.
    assert_eq!(nftproxy.link("/usr/local/bin/kube-proxy"), "nftproxy");
    for needed in [
        "/usr/local/bin/nftproxy",
        "/lib64/ld-linux-x86-64.so.2",
        "/usr/lib/x86_64-linux-gnu/libnftnl.so.11",
        "/usr/lib/x86_64-linux-gnu/libmnl.so.0",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/etc/ssl/certs/ca-certificates.crt",
        "/usr/share/doc/nftproxy/jemalloc-COPYING",
        "/usr/share/doc/libnftnl11/copyright",
        "/var/lib/dpkg/status.d/libnftnl11",
        "/etc/passwd",
        "/tmp",
    ] {
        assert!(nftproxy.exists(needed), "nftproxy's image lacks {needed}");
    }
    // nftproxy runs no program: no shell, no nft, no iptables.
    for absent in ["/bin/sh", "/usr/sbin/nft", "/usr/sbin/iptables", "/usr/sbin/xtables-nft-multi"] {
        assert!(!nftproxy.exists(absent), "nftproxy's image holds {absent}");
    }
    // deploy/Containerfile's step makes the same tree (owners, modes, links, bytes): given the
    // image's own binary, `scripts/images rootfs` gives back the image's files.
    let rootfs = tempfile::tempdir().unwrap();
    run(Command::new(repo().join("scripts/images"))
        .args(["rootfs", "nftproxy"])
        .arg(nftproxy.path("/usr/local/bin/nftproxy"))
        .arg(rootfs.path()));
    assert_eq!(tree(rootfs.path()), tree(&nftproxy.root), "scripts/images rootfs and the offline image differ");

    // The rollout build: the same files, another digest.
    let rollout = images.get(&format!("nftproxy:{version}-rollout")).unwrap();
    assert_ne!(rollout.digest, release.digest);
    assert_eq!(Unpacked::new(rollout).layer_digest, nftproxy.layer_digest);

    // kubeadm's names: every image a node runs before any workload.
    let upstream = UpstreamBins::locate().unwrap();
    let k8s = kubernetes_version();
    let listed =
        run(Command::new(upstream.path("kubeadm")).args(["config", "images", "list", "--kubernetes-version", &k8s]));
    let listed = String::from_utf8_lossy(&listed.stdout);
    for wanted in ["kube-proxy", "pause", "coredns"] {
        let name = listed.lines().find(|l| l.contains(&format!("/{wanted}:"))).unwrap_or_else(|| panic!("{listed}"));
        images.get(name).unwrap_or_else(|e| panic!("kubeadm {k8s} runs {name}: {e}"));
    }
    // The e2e framework's: agnhost, glibc-dns-testing (agnhost's files) and distroless-iptables
    // (kube-proxy's files). The framework also names an older agnhost and images no Services
    // spec uses; those are not built.
    let e2e = run(Command::new(upstream.path("e2e.test")).arg("--list-images"));
    let e2e = String::from_utf8_lossy(&e2e.stdout).into_owned();
    let e2e_name =
        |part: &str| e2e.lines().find(|l| l.contains(part)).map(str::to_string).unwrap_or_else(|| panic!("{e2e}"));
    let agnhost_name = images.all().iter().find(|i| i.name.contains("/e2e-test-images/agnhost:")).unwrap().name.clone();
    assert!(e2e.lines().any(|l| l == agnhost_name), "e2e.test names {agnhost_name}:\n{e2e}");
    for part in
        ["/e2e-test-images/glibc-dns-testing:", "/build-image/distroless-iptables:", "/e2e-test-images/nginx:1.27"]
    {
        images.get(&e2e_name(part)).unwrap();
    }

    let proxy = Unpacked::new(images.get(&format!("registry.k8s.io/kube-proxy:{k8s}")).unwrap());
    assert_eq!(proxy.strings("Entrypoint"), ["/go-runner"]);
    for name in ["iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore"] {
        assert_eq!(proxy.link(&format!("/usr/sbin/{name}")), "iptables-wrapper", "{name}");
    }
    for needed in [
        "/usr/local/bin/kube-proxy",
        "/go-runner",
        "/usr/sbin/xtables-legacy-multi",
        "/usr/sbin/xtables-nft-multi",
        "/usr/sbin/iptables-legacy",
        "/usr/sbin/ip6tables-nft-restore",
        "/usr/sbin/nft",
        "/usr/sbin/ipset",
        "/usr/sbin/modprobe",
        "/bin/sh",
        "/usr/lib/x86_64-linux-gnu/xtables/libxt_comment.so",
        "/usr/lib/x86_64-linux-gnu/libnftables.so.1",
    ] {
        assert!(proxy.exists(needed), "the kube-proxy image lacks {needed}");
    }

    let coredns = Unpacked::new(images.get(listed.lines().find(|l| l.contains("/coredns:")).unwrap()).unwrap());
    assert_eq!(coredns.strings("Entrypoint"), ["/coredns"]);
    assert_eq!(coredns.config["User"], "65532:65532");
    let layer = std::fs::read(&coredns.layer_tar).unwrap();
    assert!(
        layer.windows(32).any(|w| w == b"SCHILY.xattr.security.capability"),
        "/coredns carries the file capability that lets it bind port 53"
    );

    let dns = Unpacked::new(images.get(&e2e_name("/glibc-dns-testing:")).unwrap());
    assert!(dns.strings("Entrypoint").is_empty() && dns.strings("Cmd") == ["bash"]);
    assert!(dns.exists("/usr/bin/dig") && dns.exists("/usr/bin/getent"));
    let distroless = Unpacked::new(images.get(&e2e_name("/distroless-iptables:")).unwrap());
    assert_eq!(distroless.layer_digest, proxy.layer_digest, "distroless-iptables is kube-proxy's files");

    let nginx = Unpacked::new(images.get(&e2e_name("/e2e-test-images/nginx:1.27")).unwrap());
    assert_eq!(nginx.strings("Cmd"), ["nginx", "-g", "daemon off;"]);
    assert!(nginx.exists("/etc/nginx/sites-enabled/default"));

    let agnhost = Unpacked::new(images.get(&agnhost_name).unwrap());
    assert_eq!(agnhost.strings("Entrypoint"), ["/agnhost"]);
    assert_eq!(agnhost.strings("Cmd"), ["pause"]);
    assert_eq!(agnhost.link("/agnhost-2"), "agnhost");
    for needed in ["/uploads", "/localhost.crt", "/localhost.key", "/coredns", "/bin/sh", "/usr/bin/dig", "/bin/nc"] {
        assert!(agnhost.exists(needed), "agnhost lacks {needed}");
    }
    let group = std::fs::read_to_string(agnhost.path("/etc/group")).unwrap();
    assert!(group.lines().any(|l| l == "group-defined-in-image:x:50000:user-defined-in-image"), "{group}");

    let pause = Unpacked::new(images.get(listed.lines().find(|l| l.contains("/pause:")).unwrap()).unwrap());
    assert_eq!(pause.strings("Entrypoint"), ["/pause"]);
    assert_eq!(pause.config["User"], "65535:65535");
}

/// Every path under `dir` with its type, owner, mode, link target and, for files, SHA-256.
fn tree(dir: &Path) -> String {
    let out = run(Command::new("sh").current_dir(dir).arg("-c").arg(
        "find . -printf '%p %y %U:%G %m %l\n' | LC_ALL=C sort && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum",
    ));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn kubernetes_version() -> String {
    let text = std::fs::read_to_string(repo().join("upstream/go.mod")).unwrap();
    text.lines()
        .find_map(|l| l.trim().strip_prefix("k8s.io/kubernetes "))
        .map(|v| v.trim().to_string())
        .expect("upstream/go.mod requires k8s.io/kubernetes")
}

/// A containerd of the test's own; everything it started is stopped, and everything it made is
/// removed, on drop.
struct Containerd {
    dir: tempfile::TempDir,
    netns: String,
    namespace: String,
    child: std::process::Child,
    pid: u32,
    mount_ns: PathBuf,
    ids: u32,
}

const CGROUP_FS: &str = "/sys/fs/cgroup";

impl Containerd {
    fn start() -> Containerd {
        let dir = tempfile::tempdir().unwrap();
        let netns = format!("nftp-img-{}", std::process::id());
        let config = dir.path().join("config.toml");
        // Only what `ctr` uses: no CRI, nothing under the machine's /var/lib or /opt.
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{root}\"\nstate = \"/run/containerd\"\n\
                 disabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{sock}\"\n\
                 [plugins.\"io.containerd.internal.v1.opt\"]\n  path = \"{opt}\"\n",
                root = dir.path().join("root").display(),
                sock = dir.path().join("containerd.sock").display(),
                opt = dir.path().join("opt").display(),
            ),
        )
        .unwrap();
        run(Command::new("ip").args(["netns", "add", &netns]));
        let log = std::fs::File::create(dir.path().join("containerd.log")).unwrap();
        // A private /run: the shims' sockets, runc's state and the stdio FIFOs stay there.
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{netns}"))
            .args(["unshare", "--mount", "--propagation", "private", "sh", "-c"])
            .arg(format!("mount -t tmpfs -o mode=755 tmpfs /run && exec containerd --config {}", config.display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut c = Containerd {
            netns,
            namespace: format!("nftp-images-{}", std::process::id()),
            pid: child.id(),
            child,
            mount_ns: PathBuf::new(),
            ids: 0,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.dir.path().join("containerd.sock").exists() {
            assert!(Instant::now() < deadline, "containerd did not start:\n{}", c.log());
            std::thread::sleep(Duration::from_millis(100));
        }
        c.mount_ns = std::fs::read_link(format!("/proc/{}/ns/mnt", c.pid)).unwrap();
        c
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("containerd.log")).unwrap_or_default()
    }

    /// `ctr` in containerd's namespaces (the FIFOs it makes must be where the shims look).
    fn ctr(&self) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &self.pid.to_string(), "-m", "-n", "timeout", "120", "ctr", "-a"])
            .arg(self.dir.path().join("containerd.sock"))
            .args(["-n", &self.namespace]);
        cmd
    }

    fn import(&self, image: &Image) {
        let out = run(self.ctr().args(["images", "import"]).arg(&image.archive));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&image.reference) && text.contains(&image.digest), "{text}");
    }

    fn next_id(&mut self) -> String {
        self.ids += 1;
        format!("c{}", self.ids)
    }

    /// Runs `args` in a container of `image` (the image's user and environment) to its end.
    fn run(&mut self, image: &Image, args: &[&str]) -> String {
        let id = self.next_id();
        let out = run(self.ctr().args(["run", "--rm", &image.reference, &id]).args(args));
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    }

    /// Starts `image` with its own entrypoint (and `args` as its command, if any), checks that it
    /// still runs after `settle`, then stops it with SIGTERM and checks that it ends.
    fn starts(&mut self, image: &Image, args: &[&str], settle: Duration) {
        let id = self.next_id();
        let mut cmd = self.ctr();
        cmd.args(["run", "-d"]);
        if !args.is_empty() {
            // ctr's process args replace entrypoint and command: name the entrypoint again.
            let entry = Unpacked::new(image).strings("Entrypoint");
            cmd.args([&image.reference, &id]).args(entry).args(args);
        } else {
            cmd.args([&image.reference, &id]);
        }
        run(&mut cmd);
        std::thread::sleep(settle);
        let tasks = run(self.ctr().args(["tasks", "ls"]));
        let tasks = String::from_utf8_lossy(&tasks.stdout).into_owned();
        assert!(
            tasks.lines().any(|l| l.starts_with(&format!("{id} ")) && l.contains("RUNNING")),
            "{} is not running after {settle:?}:\n{tasks}",
            image.name
        );
        run(self.ctr().args(["tasks", "kill", "-s", "SIGTERM", &id]));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let tasks = run(self.ctr().args(["tasks", "ls"]));
            let tasks = String::from_utf8_lossy(&tasks.stdout).into_owned();
            if tasks.lines().any(|l| l.starts_with(&format!("{id} ")) && l.contains("STOPPED")) {
                break;
            }
            assert!(Instant::now() < deadline, "{} did not stop on SIGTERM:\n{tasks}", image.name);
            std::thread::sleep(Duration::from_millis(200));
        }
        run(self.ctr().args(["tasks", "delete", &id]));
        run(self.ctr().args(["containers", "delete", &id]));
    }

    fn cgroup_dirs(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(CGROUP_FS) else { return Vec::new() };
        entries.flatten().map(|e| e.path().join(&self.namespace)).filter(|p| p.is_dir()).collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        let kill = |pid: &str| {
            let _ = Command::new("kill").args(["-KILL", pid]).stderr(Stdio::null()).status();
        };
        // The containers (by their cgroups), then containerd and its shims (by their mount
        // namespace: only they live in it).
        for dir in self.cgroup_dirs() {
            for sub in std::fs::read_dir(&dir).into_iter().flatten().flatten().filter(|e| e.path().is_dir()) {
                for pid in std::fs::read_to_string(sub.path().join("cgroup.procs")).unwrap_or_default().lines() {
                    kill(pid);
                }
            }
        }
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.parse::<u32>().is_ok()
                && std::fs::read_link(entry.path().join("ns/mnt")).ok().as_ref() == Some(&self.mount_ns)
            {
                kill(&name);
            }
        }
        kill(&self.pid.to_string());
        let _ = self.child.wait();
        let deadline = Instant::now() + Duration::from_secs(10);
        for dir in self.cgroup_dirs() {
            let mut subs: Vec<PathBuf> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect();
            subs.push(dir);
            for sub in subs {
                while std::fs::remove_dir(&sub).is_err() && sub.exists() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.netns]).status();
    }
}

#[test]
fn the_images_answer_in_containerd() {
    if skip_unless_privileged() {
        return;
    }
    let images = Images::locate().unwrap();
    let version = env!("CARGO_PKG_VERSION");
    let k8s = kubernetes_version();
    let mut containerd = Containerd::start();
    for image in images.all() {
        containerd.import(image);
    }

    let nftproxy = images.get(&format!("nftproxy:{version}")).unwrap();
    let said = containerd.run(nftproxy, &["/usr/local/bin/nftproxy", "--version"]);
    assert!(said.contains(version), "{said}");
    let said = containerd.run(nftproxy, &["/usr/local/bin/nftproxy", "help"]);
    assert!(said.contains("Usage"), "{said}");
    // Under kube-proxy's name it takes kube-proxy's flags.
    let said = containerd.run(nftproxy, &["/usr/local/bin/kube-proxy", "--version"]);
    assert!(said.contains(version), "{said}");

    let proxy = images.get(&format!("registry.k8s.io/kube-proxy:{k8s}")).unwrap();
    let said = containerd.run(proxy, &["/usr/local/bin/kube-proxy", "--version"]);
    assert_eq!(said.trim(), format!("Kubernetes {k8s}"));
    // The wrapper picks nft on a node whose kubelet left no hint (a fresh container network
    // namespace), and legacy where kubelet's hint chain is among legacy's rules.
    // (The image has no readlink: `test -ef` compares what the link and the backend resolve to.)
    let said = containerd.run(
        proxy,
        &[
            "sh",
            "-c",
            "iptables --version && [ /usr/sbin/iptables-save -ef /usr/sbin/xtables-nft-multi ] && echo relinked",
        ],
    );
    assert!(said.contains("(nf_tables)") && said.contains("relinked"), "{said}");
    let id = containerd.next_id();
    let said = run(containerd.ctr().args(["run", "--rm", "--privileged", &proxy.reference, &id]).args([
        "sh",
        "-c",
        "xtables-legacy-multi iptables -t mangle -N KUBE-IPTABLES-HINT && iptables --version \
         && [ /usr/sbin/ip6tables-restore -ef /usr/sbin/xtables-legacy-multi ] && echo relinked",
    ]));
    let said = String::from_utf8_lossy(&said.stdout);
    assert!(said.contains("(legacy)") && said.contains("relinked"), "{said}");
    let said = containerd.run(proxy, &["sh", "-c", "nft --version && ipset -h | grep -m1 '^ipset v'"]);
    assert!(said.contains("nftables v") && said.contains("ipset v"), "{said}");

    let pause = images.get("registry.k8s.io/pause:3.10.2").unwrap();
    containerd.starts(pause, &[], Duration::from_secs(1));

    let coredns = images.all().iter().find(|i| i.name.starts_with("registry.k8s.io/coredns/coredns:")).unwrap();
    let tag = coredns.name.rsplit(':').next().unwrap().trim_start_matches('v');
    let said = containerd.run(coredns, &["/coredns", "-version"]);
    assert!(said.contains(&format!("CoreDNS-{tag}")), "{said}");
    // As its user (65532), it binds port 53: the file capability survived the layer.
    containerd.starts(coredns, &["-dns.port", "53"], Duration::from_secs(2));

    // nginx (the EndpointSlice specs' pods) serves with its own command until stopped.
    let nginx = images.all().iter().find(|i| i.name.contains("/e2e-test-images/nginx:")).unwrap();
    let said = containerd.run(nginx, &["nginx", "-t"]);
    assert!(said.contains("test is successful"), "{said}");
    containerd.starts(nginx, &[], Duration::from_secs(2));

    let agnhost = images.all().iter().find(|i| i.name.contains("/e2e-test-images/agnhost:")).unwrap();
    let said = containerd.run(agnhost, &["/agnhost", "--help"]);
    assert!(said.contains("netexec") && said.contains("pause"), "{said}");
    // The tools the e2e specs run through `kubectl exec` (iperf 2 exits 1 after printing its
    // version).
    let said = containerd.run(
        agnhost,
        &[
            "sh",
            "-c",
            "set -e; bash -c 'echo bash'; dig -v 2>&1; nslookup -version; curl --version | head -1; \
             wget --version | head -1; nc -h 2>&1 | head -1; ip -V; ss -V; socat -V | head -2; { iperf -v 2>&1 || true; }; \
             getent group group-defined-in-image; id user-defined-in-image; hostname; timeout 1 sleep 0; seq 1 2; \
             ps; awk 'BEGIN { print 1 }'; ping -c1 -W1 127.0.0.1; test -d /uploads",
        ],
    );
    for expected in [
        "bash",
        "DiG 9",
        "curl ",
        "Wget",
        "OpenBSD netcat",
        "iproute2",
        "socat",
        "iperf version 2",
        "50000(group-defined-in-image)",
        "1 received",
    ] {
        assert!(said.contains(expected), "agnhost lacks what prints {expected:?}:\n{said}");
    }
}
