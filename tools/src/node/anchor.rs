//! The node's private mount namespace, held open by one process (`sleep infinity`, started with
//! `unshare --mount` inside the node's network namespace) that every node daemon joins with
//! `nsenter`. Its mounts make the node look like a machine of its own without touching the
//! machine's:
//!
//! - `/run` is a fresh tmpfs (containerd's state, the pods' network namespaces, the xtables
//!   lock): gone when the node "reboots", as on a real node;
//! - `/etc` and `/var` are overlays whose upper layers sit in the node's directory (its disk):
//!   what kubelet, containerd and CNI write there implicitly (`/var/log/containers`, CNI's
//!   cache) stays the node's and survives a reboot;
//! - `/usr/lib` is an overlay too, holding an empty `/lib/modules` (kubeadm's kube-proxy
//!   DaemonSet mounts it; this machine's kernel has no modules);
//! - the machine's cgroup hierarchies are mounted again under `/sys/fs/cgroup` (`ip netns exec`
//!   mounts a fresh `/sys`, whose `fs/cgroup` is empty: kubelet stops at "failed to find cgroup
//!   mounts");
//! - kubelet's kernel tunables (`vm.overcommit_memory`, `kernel.panic`, …) are read-only files
//!   with the values it wants, so that it finds them set and never writes the machine's own.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cgroup::Hierarchy;
use super::error::NodeError;

/// kubelet's kernel tunables and the values it sets when they differ (`setupKernelTunables`).
const KUBELET_TUNABLES: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

/// Directories overlaid with an upper layer in the node's directory.
const OVERLAID: [&str; 3] = ["/etc", "/var", "/usr/lib"];

/// The process holding the node's mount namespace; killed on drop (the namespace goes with the
/// last process in it).
#[derive(Debug)]
pub struct Anchor {
    child: Child,
}

impl Anchor {
    /// Starts the holder in network namespace `netns`, as a member of the cgroup whose
    /// `cgroup.procs` is `procs`, and mounts the node's filesystem view (above) with `disk` as
    /// the node's persistent directory.
    pub fn start(netns: &str, procs: &Path, disk: &Path, cgroups: &[Hierarchy]) -> Result<Anchor, NodeError> {
        let child = in_cgroup(procs, "ip")
            .args(["netns", "exec", netns, "unshare", "--mount", "--propagation", "private", "sleep", "infinity"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| NodeError::Setup(format!("cannot start the node's mount namespace: {e}")))?;
        let anchor = Anchor { child };
        anchor.wait_for_namespace(netns)?;
        anchor.mount_all(disk, cgroups)?;
        Ok(anchor)
    }

    /// The holder's PID: `nsenter -t PID -m -n` enters the node.
    pub fn pid(&self) -> u32 {
        // `ip netns exec` and `unshare` exec in place: the child is the holder itself.
        self.child.id()
    }

    /// `unshare` has made the namespace once the holder's mount namespace differs from ours.
    fn wait_for_namespace(&self, netns: &str) -> Result<(), NodeError> {
        let ours = std::fs::read_link("/proc/self/ns/mnt")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let theirs = std::fs::read_link(format!("/proc/{}/ns/mnt", self.pid())).ok();
            let exe = std::fs::read_link(format!("/proc/{}/exe", self.pid())).ok();
            if theirs.is_some_and(|t| t != ours) && exe.is_some_and(|e| e.ends_with("sleep")) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(NodeError::Setup(format!("the mount namespace of node {netns} did not come up")))
    }

    /// Runs a command inside the node (its network and mount namespaces).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.args(["-t", &self.pid().to_string(), "-m", "-n", "--", program]);
        c
    }

    fn run(&self, program: &str, args: &[&str]) -> Result<(), NodeError> {
        let out = self.command(program).args(args).output()?;
        if !out.status.success() {
            return Err(NodeError::Setup(format!(
                "{program} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    fn mount_all(&self, disk: &Path, cgroups: &[Hierarchy]) -> Result<(), NodeError> {
        self.run("mount", &["-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run"])?;
        self.run("mkdir", &["-p", "/run/netns", "/run/containerd", "/run/lock"])?;
        for dir in OVERLAID {
            let name = dir.trim_start_matches('/').replace('/', "-");
            let (upper, work) = (disk.join(format!("{name}-upper")), disk.join(format!("{name}-work")));
            std::fs::create_dir_all(&upper)?;
            std::fs::create_dir_all(&work)?;
            let options = format!("lowerdir={dir},upperdir={},workdir={}", upper.display(), work.display());
            self.run("mount", &["-t", "overlay", "overlay", "-o", &options, dir])?;
        }
        self.run("mkdir", &["-p", "/usr/lib/modules"])?;
        self.run("mount", &["-t", "tmpfs", "-o", "mode=755", "cgroup", "/sys/fs/cgroup"])?;
        for h in cgroups {
            let target = format!("/sys/fs/cgroup/{}", h.dir);
            self.run("mkdir", &["-p", &target])?;
            let mut args = vec!["-t", h.fstype.as_str()];
            if !h.options.is_empty() {
                args.extend(["-o", h.options.as_str()]);
            }
            args.extend([h.fstype.as_str(), target.as_str()]);
            self.run("mount", &args)?;
        }
        let tunables = disk.join("tunables");
        std::fs::create_dir_all(&tunables)?;
        for (key, value) in KUBELET_TUNABLES {
            let file: PathBuf = tunables.join(key.replace('/', "."));
            std::fs::write(&file, format!("{value}\n"))?;
            let file = file.to_string_lossy();
            self.run("mount", &["--bind", "-o", "ro", &file, &format!("/proc/sys/{key}")])?;
        }
        Ok(())
    }
}

impl Drop for Anchor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A command that first writes its own PID into `procs` (a `cgroup.procs` file), then execs
/// `program`: it and everything it starts belong to that cgroup from the first instruction.
pub fn in_cgroup(procs: &Path, program: &str) -> Command {
    let mut c = Command::new("sh");
    c.args(["-c", r#"echo $$ > "$0" && exec "$@""#]).arg(procs).arg(program);
    c
}
