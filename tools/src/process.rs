//! Processes the tools start and measure: a child that leads a process group of its own, so
//! that what it starts stops with it, and a process's CPU time and memory as `/proc` tells them.

use std::io;
use std::process::{Child, ChildStderr, Command, ExitStatus};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
use nix::unistd::Pid;

/// A child process leading a process group of its own: upstream kube-proxy's `nft` and
/// `iptables-restore` children stop with it (an `iptables-restore` of 44,000 services outlives
/// a killed parent). Killed with its group when dropped.
#[derive(Debug)]
pub struct ProcessGroup {
    child: Child,
    /// Waited for: its PID (its process group's ID) may be another process's now.
    reaped: bool,
}

impl ProcessGroup {
    /// Spawns `command` as the leader of a new process group.
    pub fn spawn(command: &mut Command) -> io::Result<ProcessGroup> {
        let child = std::os::unix::process::CommandExt::process_group(command, 0).spawn()?;
        Ok(ProcessGroup { child, reaped: false })
    }

    /// The process id (and process group id).
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(i32::MAX))
    }

    /// Its standard error, when it was piped (once).
    pub fn take_stderr(&mut self) -> Option<ChildStderr> {
        self.child.stderr.take()
    }

    /// Whether it has exited, without reaping it: until it is reaped its PID (its process
    /// group's ID) cannot be another process's.
    pub fn exited(&self) -> bool {
        if self.reaped {
            return true;
        }
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        !matches!(waitid(Id::Pid(self.pid()), flags), Ok(WaitStatus::StillAlive))
    }

    /// Waits up to `within` for it to exit by itself; then kills what is left of its group,
    /// reaps it and returns its exit status. `None` if it still runs (or was reaped before).
    pub fn exit_within(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + within;
        while !self.exited() {
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if self.reaped {
            return None;
        }
        let _ = killpg(self.pid(), Signal::SIGKILL);
        let status = self.child.wait().ok();
        self.reaped = true;
        status
    }

    /// Stops it as a DaemonSet rollout does: SIGTERM, and after `grace` SIGKILL to its process
    /// group (itself and the children it started); reaps it.
    pub fn stop(&mut self, grace: Duration) {
        if !self.reaped {
            let _ = kill(self.pid(), Signal::SIGTERM);
        }
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && !self.exited() {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }

    /// SIGKILL to its process group, then reaps it.
    pub fn kill(&mut self) {
        if self.reaped {
            return;
        }
        let _ = killpg(self.pid(), Signal::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.reaped = true;
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

/// User plus system CPU time of a process so far, from `/proc/<pid>/stat` (`None` once it is
/// gone).
pub fn cpu_time(pid: u32) -> Option<Duration> {
    stat_ticks(pid, 11..=12)
}

/// [`cpu_time`] with that of the children it has waited for (`cutime`, `cstime`): upstream
/// kube-proxy's work is partly done by the `nft` and `iptables-restore` it runs.
pub fn cpu_time_with_children(pid: u32) -> Option<Duration> {
    stat_ticks(pid, 11..=14)
}

/// The sum of `/proc/<pid>/stat`'s clock-tick fields `fields` (counted from the state, 0), as
/// time.
fn stat_ticks(pid: u32, fields: std::ops::RangeInclusive<usize>) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces: fields are counted after its closing parenthesis.
    let rest = &stat[stat.rfind(')')? + 2..];
    let values: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.map(|i| values.get(i)?.parse::<u64>().ok()).sum::<Option<u64>>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().unwrap_or(100).max(1) as u64;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / hz))
}

/// Resident memory of a process now, bytes (0 once it is gone).
pub fn rss(pid: u32) -> u64 {
    status_kib(pid, "VmRSS:") * 1024
}

/// Peak resident memory of a process so far, bytes (0 once it is gone).
pub fn peak_rss(pid: u32) -> u64 {
    status_kib(pid, "VmHWM:") * 1024
}

/// A `/proc/<pid>/status` field in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_has_cpu_time_and_memory() {
        let pid = std::process::id();
        assert!(rss(pid) > 0);
        assert!(peak_rss(pid) >= rss(pid));
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_millis(50) {
            std::hint::black_box(spin.elapsed());
        }
        assert!(cpu_time(pid).unwrap() > Duration::ZERO);
        assert!(cpu_time_with_children(pid).unwrap() >= cpu_time(pid).unwrap());
    }

    /// Processes of group `pgid` that are not zombies.
    fn live_members(pgid: u32) -> usize {
        let stats = std::fs::read_dir("/proc").unwrap().flatten().filter_map(|e| {
            e.file_name().to_str()?.parse::<u32>().ok()?;
            std::fs::read_to_string(e.path().join("stat")).ok()
        });
        stats
            .filter(|stat| {
                let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, r)| r).split_whitespace().collect();
                fields.first() != Some(&"Z") && fields.get(2) == Some(&pgid.to_string().as_str())
            })
            .count()
    }

    #[test]
    fn a_stopped_group_takes_its_children_along() {
        // A shell that ignores SIGTERM and leaves a child behind: stop() must kill both.
        let mut group =
            ProcessGroup::spawn(Command::new("sh").args(["-c", "trap '' TERM; sleep 60 & wait"])).expect("spawn sh");
        std::thread::sleep(Duration::from_millis(200));
        let pgid = group.id();
        assert!(!group.exited());
        group.stop(Duration::from_millis(300));
        assert!(group.exited());
        let deadline = Instant::now() + Duration::from_secs(5);
        while live_members(pgid) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(live_members(pgid), 0, "the group's child outlived it");
        let mut quick = ProcessGroup::spawn(Command::new("sh").args(["-c", "exit 3"])).expect("spawn sh");
        assert_eq!(quick.exit_within(Duration::from_secs(10)).and_then(|s| s.code()), Some(3));
    }
}
