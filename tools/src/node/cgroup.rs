//! A cgroup root of the node's own, in every hierarchy of the machine's cgroup v1 layout (and
//! the unified one beside it): kubelet's `cgroupRoot`, and a `node` group below it for the
//! node's own daemons (containerd, kubelet, the shims), so that every process the node ever
//! started can be found, and killed, by its cgroup. Removed, deepest first, on drop.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::error::NodeError;

/// Where the machine mounts its cgroup hierarchies.
const CGROUP_FS: &str = "/sys/fs/cgroup";

/// One cgroup hierarchy as the machine mounts it: its directory under `/sys/fs/cgroup`, its
/// filesystem type and mount options (what a node's private mount namespace repeats).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hierarchy {
    pub dir: String,
    pub fstype: String,
    pub options: String,
}

/// The machine's cgroup hierarchies, read from `/proc/self/mountinfo`.
pub fn hierarchies() -> Result<Vec<Hierarchy>, NodeError> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_mountinfo(&text))
}

/// The cgroup mounts of a mountinfo text, with the options that select the hierarchy (the
/// controllers, or `name=`; `rw` and the like are left out).
fn parse_mountinfo(text: &str) -> Vec<Hierarchy> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let mount_point = left.split_whitespace().nth(4).unwrap_or("");
        let mut right = right.split_whitespace();
        let fstype = right.next().unwrap_or("");
        let _source = right.next();
        let super_options = right.next().unwrap_or("");
        let Some(dir) = mount_point.strip_prefix(&format!("{CGROUP_FS}/")) else { continue };
        if dir.contains('/') {
            continue;
        }
        let options = match fstype {
            "cgroup" => super_options
                .split(',')
                .filter(|o| !matches!(*o, "rw" | "ro") && !o.starts_with("release_agent") && *o != "clone_children")
                .collect::<Vec<_>>()
                .join(","),
            "cgroup2" => String::new(),
            _ => continue,
        };
        out.push(Hierarchy { dir: dir.to_string(), fstype: fstype.to_string(), options });
    }
    out
}

/// A cgroup subtree `/<name>` in every hierarchy.
#[derive(Debug)]
pub struct CgroupRoot {
    name: String,
    hierarchies: Vec<Hierarchy>,
}

impl CgroupRoot {
    /// Creates `/<name>` and `/<name>/node` in every hierarchy (cpuset's copied from the root, as
    /// a v1 cpuset needs its cpus and mems before a task may join).
    pub fn create(name: &str) -> Result<CgroupRoot, NodeError> {
        let root = CgroupRoot { name: name.to_string(), hierarchies: hierarchies()? };
        if root.hierarchies.is_empty() {
            return Err(NodeError::Setup(format!("no cgroup hierarchy is mounted under {CGROUP_FS}")));
        }
        for h in &root.hierarchies {
            let base = Path::new(CGROUP_FS).join(&h.dir);
            for sub in [name.to_string(), format!("{name}/node")] {
                let dir = base.join(&sub);
                std::fs::create_dir_all(&dir)
                    .map_err(|e| NodeError::Setup(format!("cannot create cgroup {}: {e}", dir.display())))?;
                if h.options.split(',').any(|o| o == "cpuset") {
                    for file in ["cpuset.cpus", "cpuset.mems"] {
                        let value = std::fs::read_to_string(base.join(file))?;
                        std::fs::write(dir.join(file), value.trim())?;
                    }
                }
            }
        }
        Ok(root)
    }

    /// The root's path inside each hierarchy (kubelet's `cgroupRoot`).
    pub fn path(&self) -> String {
        format!("/{}", self.name)
    }

    /// The `cgroup.procs` file a node daemon writes itself into before it starts (the pids
    /// hierarchy: the one that finds every process again).
    pub fn procs_file(&self) -> Result<PathBuf, NodeError> {
        let pids = self
            .hierarchies
            .iter()
            .find(|h| h.options.split(',').any(|o| o == "pids"))
            .ok_or_else(|| NodeError::Setup("no pids cgroup hierarchy".into()))?;
        Ok(Path::new(CGROUP_FS).join(&pids.dir).join(&self.name).join("node/cgroup.procs"))
    }

    /// Every process in the subtree (in any hierarchy: a container's process sits in the pod's
    /// cgroups, a shim in `node`).
    pub fn processes(&self) -> Vec<i32> {
        let mut pids = Vec::new();
        for h in &self.hierarchies {
            collect_procs(&Path::new(CGROUP_FS).join(&h.dir).join(&self.name), &mut pids);
        }
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// The processes in a cgroup named `name` anywhere below the root (kubelet names a pod's
    /// `pod<UID>`), in the pids hierarchy.
    pub fn processes_of(&self, name: &str) -> Vec<i32> {
        let Some(pids) = self.hierarchies.iter().find(|h| h.options.split(',').any(|o| o == "pids")) else {
            return Vec::new();
        };
        let mut dirs = Vec::new();
        collect_dirs(&Path::new(CGROUP_FS).join(&pids.dir).join(&self.name), &mut dirs);
        let mut out = Vec::new();
        for dir in dirs.iter().filter(|d| d.file_name().is_some_and(|n| n == name)) {
            collect_procs(dir, &mut out);
        }
        out
    }

    /// SIGKILLs every process of the subtree until none is left (a forking process is caught
    /// on a later round), waiting at most `within`.
    pub fn kill_all(&self, within: Duration) -> Result<(), NodeError> {
        let deadline = Instant::now() + within;
        loop {
            let pids = self.processes();
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(NodeError::Setup(format!("processes {pids:?} of cgroup {} survived SIGKILL", self.name)));
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Removes the subtree's directories, deepest first (a cgroup directory is removed with
    /// `rmdir`; its files are the kernel's).
    fn remove(&self) -> Result<(), NodeError> {
        let mut failed = Vec::new();
        for h in &self.hierarchies {
            let top = Path::new(CGROUP_FS).join(&h.dir).join(&self.name);
            let mut dirs = Vec::new();
            collect_dirs(&top, &mut dirs);
            dirs.sort_by_key(|d| std::cmp::Reverse(d.components().count()));
            for dir in dirs {
                if let Err(e) = std::fs::remove_dir(&dir)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    failed.push(format!("{}: {e}", dir.display()));
                }
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(NodeError::Setup(format!("cannot remove cgroups: {}", failed.join("; "))))
        }
    }
}

impl Drop for CgroupRoot {
    fn drop(&mut self) {
        if let Err(e) = self.kill_all(Duration::from_secs(10)) {
            eprintln!("node cgroup {}: {e}", self.name);
        }
        // A killed process leaves its cgroup a moment after it is reaped.
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Err(e) = self.remove() {
            if Instant::now() > deadline {
                eprintln!("{e}");
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn collect_procs(dir: &Path, out: &mut Vec<i32>) {
    if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
    }
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_procs(&entry.path(), out);
        }
    }
}

fn collect_dirs(dir: &Path, out: &mut Vec<PathBuf>) {
    if !dir.is_dir() {
        return;
    }
    out.push(dir.to_path_buf());
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_dirs(&entry.path(), out);
        }
    }
}

/// Removes the cgroup roots of nodes whose process is gone (a crashed or killed test): names are
/// `nftp-<node>-<pid>`, as for the lab's namespaces.
pub fn cleanup_stale() {
    remove_where(|pid| !Path::new(&format!("/proc/{pid}")).exists());
}

/// Kills every process in this process's node cgroups and removes them (an interrupted run).
pub fn remove_own() {
    let own = std::process::id();
    remove_where(|pid| pid == own);
}

/// Removes the node cgroup roots whose maker's PID `pick`s.
fn remove_where(pick: impl Fn(u32) -> bool) {
    let Ok(hierarchies) = hierarchies() else { return };
    let mut chosen = std::collections::BTreeSet::new();
    for h in &hierarchies {
        let Ok(entries) = std::fs::read_dir(Path::new(CGROUP_FS).join(&h.dir)) else { continue };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // nftp-<node>-<pid>: a node's name may hold dashes itself.
            let Some(rest) = name.strip_prefix("nftp-") else { continue };
            if let Some(pid) = rest.rsplit_once('-').and_then(|(_, p)| p.parse::<u32>().ok())
                && pick(pid)
            {
                chosen.insert(name);
            }
        }
    }
    for name in chosen {
        drop(CgroupRoot { name, hierarchies: hierarchies.clone() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machines_cgroup_v1_layout_is_read_from_mountinfo() {
        let text = "\
35 26 0:30 / /sys/fs/cgroup rw,relatime - tmpfs cgroup rw,mode=755
36 35 0:31 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
37 35 0:32 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
38 35 0:33 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,release_agent=/x,name=systemd
39 35 0:34 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
40 26 0:35 / /sys/fs/cgroup/pids/nested rw - cgroup cgroup rw,pids
41 26 0:36 / /proc rw - proc proc rw
";
        let got = parse_mountinfo(text);
        let dirs: Vec<(&str, &str)> = got.iter().map(|h| (h.dir.as_str(), h.options.as_str())).collect();
        assert_eq!(
            dirs,
            [("cpu", "cpu"), ("cpu,cpuacct", "cpu,cpuacct"), ("systemd", "xattr,name=systemd"), ("unified", "")]
        );
        assert_eq!(got[3].fstype, "cgroup2");
    }
}
