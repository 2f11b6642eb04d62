//! The kernel conntrack settings kube-proxy writes at start-up (its `conntrack:` configuration
//! and `--conntrack-*` flags), computed as upstream does:
//!
//! - `nf_conntrack_max` = max(`maxPerCore` × CPUs, `min`); `maxPerCore: 0` leaves it (and `min`)
//!   alone. As newer upstream releases (k/k#142035), a higher value already set is kept.
//! - the conntrack `hashsize` (a module parameter under `/sys`) is raised to max/4 only when it
//!   is smaller;
//! - the TCP established and close-wait timeouts and the UDP timeouts, in seconds; 0 leaves a
//!   value alone;
//! - `nf_conntrack_tcp_be_liberal` = 1 when asked; `false` never writes 0.
//!
//! Each value is written only when it differs from what the kernel has. `nf_conntrack_max` and
//! `hashsize` are global, so only a process in the host's network namespace with a writable
//! `/proc/sys` and `/sys` can change them: in a container, a privileged one (`nftproxy
//! conntrack-sysctls`, the DaemonSet's init container). The roots are paths so tests can point
//! them at a directory.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// kube-proxy's `conntrack:` settings with its defaults filled in; 0 (and `false` for
/// be-liberal) leaves a value as the kernel has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConntrackSysctls {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackSysctls {
    /// kube-proxy's defaults (`pkg/proxy/apis/config/v1alpha1/defaults.go`).
    fn default() -> Self {
        ConntrackSysctls {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// Where the kernel's settings are read and written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SysctlRoots {
    /// `/proc/sys`.
    pub proc_sys: PathBuf,
    /// `/sys` (the conntrack module's `hashsize`, the online CPUs).
    pub sys: PathBuf,
}

impl Default for SysctlRoots {
    fn default() -> Self {
        SysctlRoots { proc_sys: PathBuf::from("/proc/sys"), sys: PathBuf::from("/sys") }
    }
}

/// One kernel value kube-proxy sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Sysctl {
    Max,
    Hashsize,
    TcpTimeoutEstablished,
    TcpTimeoutCloseWait,
    TcpBeLiberal,
    UdpTimeout,
    UdpTimeoutStream,
}

impl Sysctl {
    /// The name an operator knows it by.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Sysctl::Max => "nf_conntrack_max",
            Sysctl::Hashsize => "nf_conntrack hashsize",
            Sysctl::TcpTimeoutEstablished => "nf_conntrack_tcp_timeout_established",
            Sysctl::TcpTimeoutCloseWait => "nf_conntrack_tcp_timeout_close_wait",
            Sysctl::TcpBeLiberal => "nf_conntrack_tcp_be_liberal",
            Sysctl::UdpTimeout => "nf_conntrack_udp_timeout",
            Sysctl::UdpTimeoutStream => "nf_conntrack_udp_timeout_stream",
        }
    }

    /// Its file under `roots`.
    pub(crate) fn path(self, roots: &SysctlRoots) -> PathBuf {
        match self {
            Sysctl::Hashsize => roots.sys.join("module/nf_conntrack/parameters/hashsize"),
            other => roots.proc_sys.join("net/netfilter").join(other.name()),
        }
    }
}

/// What happened to one value.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Written; what the kernel had before, if it could be read.
    Set { was: Option<u64> },
    /// The kernel already had it.
    Unchanged,
    /// Left alone: the kernel's value is already at least what kube-proxy computes.
    KeptHigher { current: u64 },
    /// The value could not be read or written.
    Failed(io::Error),
}

/// One value and what happened to it.
#[derive(Debug)]
pub(crate) struct Applied {
    pub sysctl: Sysctl,
    pub value: u64,
    pub outcome: Outcome,
}

impl fmt::Display for Applied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, value) = (self.sysctl.name(), self.value);
        match &self.outcome {
            Outcome::Set { was: Some(was) } => write!(f, "{name} = {value} (was {was})"),
            Outcome::Set { was: None } => write!(f, "{name} = {value}"),
            Outcome::Unchanged => write!(f, "{name} = {value} (unchanged)"),
            Outcome::KeptHigher { current } => write!(f, "{name} = {current} (kept: at least {value})"),
            Outcome::Failed(e) => write!(f, "{name} = {value}: not set: {e}"),
        }
    }
}

/// Everything one application did, in upstream's order.
#[derive(Debug, Default)]
pub(crate) struct SysctlReport {
    pub applied: Vec<Applied>,
}

impl SysctlReport {
    /// The values that could not be set.
    pub(crate) fn failures(&self) -> impl Iterator<Item = &Applied> {
        self.applied.iter().filter(|a| matches!(a.outcome, Outcome::Failed(_)))
    }

    /// One line naming every value that could not be set, with the reason: `None` when all
    /// were set.
    pub(crate) fn failure_summary(&self) -> Option<String> {
        let parts: Vec<String> = self
            .failures()
            .map(|a| match &a.outcome {
                Outcome::Failed(e) => format!("{}={} ({e})", a.sysctl.name(), a.value),
                _ => String::new(),
            })
            .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }

    /// Whether start-up must refuse, as kube-proxy ≤ 1.35 does: any value it could not set,
    /// except `hashsize` on a read-only `/sys` (a warning there).
    pub(crate) fn refuses_start_up(&self) -> bool {
        self.failures().any(|a| match &a.outcome {
            Outcome::Failed(e) => !(a.sysctl == Sysctl::Hashsize && e.raw_os_error() == Some(libc::EROFS)),
            _ => false,
        })
    }
}

/// `nf_conntrack_max` as kube-proxy computes it; 0 leaves it alone.
pub(crate) fn conntrack_max(settings: &ConntrackSysctls, cpus: u64) -> u64 {
    if settings.max_per_core == 0 {
        return 0;
    }
    (u64::from(settings.max_per_core) * cpus).max(u64::from(settings.min))
}

/// The machine's online CPUs (from `/sys`, as upstream counts the topology rather than this
/// process's CPU quota), else the CPUs this process may run on.
pub(crate) fn machine_cpus(roots: &SysctlRoots) -> u64 {
    std::fs::read_to_string(roots.sys.join("devices/system/cpu/online"))
        .ok()
        .and_then(|text| cpu_list_len(text.trim()))
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get() as u64).unwrap_or(1))
}

/// The number of CPUs in a kernel CPU list such as `0-3,6,8-9`.
fn cpu_list_len(list: &str) -> Option<u64> {
    list.split(',').filter(|p| !p.is_empty()).try_fold(0u64, |n, part| {
        let count = match part.split_once('-') {
            Some((a, b)) => b.trim().parse::<u64>().ok()?.checked_sub(a.trim().parse::<u64>().ok()?)? + 1,
            None => part.trim().parse::<u64>().map(|_| 1).ok()?,
        };
        Some(n + count)
    })
}

fn read(path: &Path) -> io::Result<u64> {
    let text = std::fs::read_to_string(path)?;
    text.trim()
        .parse()
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, format!("{:?} is not a number", text.trim())))
}

/// Writes `value` unless the kernel has it already (a failed read is treated as different, as
/// upstream does).
fn set(roots: &SysctlRoots, sysctl: Sysctl, value: u64) -> Applied {
    let path = sysctl.path(roots);
    let was = read(&path).ok();
    let outcome = if was == Some(value) {
        Outcome::Unchanged
    } else {
        match std::fs::write(&path, value.to_string()) {
            Ok(()) => Outcome::Set { was },
            Err(e) => Outcome::Failed(e),
        }
    };
    Applied { sysctl, value, outcome }
}

/// Applies `settings` under `roots` with `cpus` CPUs, in upstream's order (max, hashsize, TCP
/// timeouts, be-liberal, UDP timeouts), going on past failures.
pub(crate) fn apply(settings: &ConntrackSysctls, roots: &SysctlRoots, cpus: u64) -> SysctlReport {
    let mut report = SysctlReport::default();
    let max = conntrack_max(settings, cpus);
    if max > 0 {
        let path = Sysctl::Max.path(roots);
        report.applied.push(match read(&path) {
            Ok(current) if current > max => {
                Applied { sysctl: Sysctl::Max, value: max, outcome: Outcome::KeptHigher { current } }
            }
            _ => set(roots, Sysctl::Max, max),
        });
        // Only grown: the kernel refuses it outside the host's network namespace, and a larger
        // table needs no change.
        let buckets = max / 4;
        report.applied.push(match read(&Sysctl::Hashsize.path(roots)) {
            Ok(current) if current >= buckets => {
                Applied { sysctl: Sysctl::Hashsize, value: buckets, outcome: Outcome::KeptHigher { current } }
            }
            Ok(_) => set(roots, Sysctl::Hashsize, buckets),
            Err(e) => Applied { sysctl: Sysctl::Hashsize, value: buckets, outcome: Outcome::Failed(e) },
        });
    }
    let timeouts = [
        (Sysctl::TcpTimeoutEstablished, settings.tcp_established_timeout),
        (Sysctl::TcpTimeoutCloseWait, settings.tcp_close_wait_timeout),
    ];
    for (sysctl, timeout) in timeouts {
        if !timeout.is_zero() {
            report.applied.push(set(roots, sysctl, timeout.as_secs()));
        }
    }
    if settings.tcp_be_liberal {
        report.applied.push(set(roots, Sysctl::TcpBeLiberal, 1));
    }
    for (sysctl, timeout) in
        [(Sysctl::UdpTimeout, settings.udp_timeout), (Sysctl::UdpTimeoutStream, settings.udp_stream_timeout)]
    {
        if !timeout.is_zero() {
            report.applied.push(set(roots, sysctl, timeout.as_secs()));
        }
    }
    report
}

/// What `run` does at start-up: applies the settings and logs what it changed, and at most one
/// warning naming every value it could not set (a container without a writable `/proc/sys`;
/// the DaemonSet's privileged init container sets them before `run` starts, so `run` finds
/// them in place and writes nothing).
pub(crate) fn apply_at_start_up(settings: &ConntrackSysctls, roots: &SysctlRoots) {
    let report = apply(settings, roots, machine_cpus(roots));
    log(&report);
    if let Some(failed) = report.failure_summary() {
        tracing::warn!(
            failed,
            "cannot set conntrack sysctls (read-only /proc/sys or /sys, or not the host's network namespace); \
             run `nftproxy conntrack-sysctls` with privileges before nftproxy (the DaemonSet's init container does), \
             or set conntrack.maxPerCore and the timeouts to 0 to leave them alone"
        );
    }
}

/// Logs each value written or kept.
pub(crate) fn log(report: &SysctlReport) {
    for a in &report.applied {
        match &a.outcome {
            Outcome::Set { was } => {
                tracing::info!(sysctl = a.sysctl.name(), value = a.value, was, "set conntrack sysctl")
            }
            Outcome::Unchanged | Outcome::KeptHigher { .. } => tracing::debug!("{a}"),
            Outcome::Failed(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc/sys` and `/sys` with the kernel's usual defaults.
    fn roots(hashsize: u64, max: u64) -> (tempfile::TempDir, SysctlRoots) {
        let dir = tempfile::tempdir().unwrap();
        let roots = SysctlRoots { proc_sys: dir.path().join("proc/sys"), sys: dir.path().join("sys") };
        std::fs::create_dir_all(roots.proc_sys.join("net/netfilter")).unwrap();
        std::fs::create_dir_all(roots.sys.join("module/nf_conntrack/parameters")).unwrap();
        std::fs::create_dir_all(roots.sys.join("devices/system/cpu")).unwrap();
        std::fs::write(roots.sys.join("devices/system/cpu/online"), "0-1,4\n").unwrap();
        let defaults = [
            (Sysctl::Max, max),
            (Sysctl::Hashsize, hashsize),
            (Sysctl::TcpTimeoutEstablished, 432000),
            (Sysctl::TcpTimeoutCloseWait, 60),
            (Sysctl::TcpBeLiberal, 0),
            (Sysctl::UdpTimeout, 30),
            (Sysctl::UdpTimeoutStream, 120),
        ];
        for (s, v) in defaults {
            std::fs::write(s.path(&roots), format!("{v}\n")).unwrap();
        }
        (dir, roots)
    }

    fn value(roots: &SysctlRoots, s: Sysctl) -> u64 {
        read(&s.path(roots)).unwrap()
    }

    #[test]
    fn upstream_defaults_on_a_small_machine() {
        let (_dir, roots) = roots(16384, 65536);
        let cpus = machine_cpus(&roots);
        assert_eq!(cpus, 3, "0-1,4");
        let report = apply(&ConntrackSysctls::default(), &roots, cpus);
        assert!(report.failure_summary().is_none(), "{report:?}");
        // 32768 × 3 < 131072: the minimum wins; hashsize grows to a quarter of it.
        assert_eq!(value(&roots, Sysctl::Max), 131072);
        assert_eq!(value(&roots, Sysctl::Hashsize), 32768);
        assert_eq!(value(&roots, Sysctl::TcpTimeoutEstablished), 86400);
        assert_eq!(value(&roots, Sysctl::TcpTimeoutCloseWait), 3600);
        // Unset by default: left as the kernel has them.
        assert_eq!(value(&roots, Sysctl::TcpBeLiberal), 0);
        assert_eq!(value(&roots, Sysctl::UdpTimeout), 30);
        assert_eq!(value(&roots, Sysctl::UdpTimeoutStream), 120);
        let text: Vec<String> = report.applied.iter().map(|a| a.to_string()).collect();
        assert_eq!(text[0], "nf_conntrack_max = 131072 (was 65536)");
        // A second run finds everything in place.
        let again = apply(&ConntrackSysctls::default(), &roots, cpus);
        assert!(again.applied.iter().all(|a| matches!(a.outcome, Outcome::Unchanged | Outcome::KeptHigher { .. })));
    }

    #[test]
    fn per_core_scaling_and_every_setting() {
        let (_dir, roots) = roots(262144, 65536);
        let settings = ConntrackSysctls {
            max_per_core: 65536,
            min: 1,
            tcp_be_liberal: true,
            udp_timeout: Duration::from_secs(45),
            udp_stream_timeout: Duration::from_secs(300),
            ..Default::default()
        };
        assert_eq!(conntrack_max(&settings, 8), 524288);
        apply(&settings, &roots, 8);
        assert_eq!(value(&roots, Sysctl::Max), 524288);
        assert_eq!(value(&roots, Sysctl::Hashsize), 262144, "already large enough: not shrunk");
        assert_eq!(value(&roots, Sysctl::TcpBeLiberal), 1);
        assert_eq!(value(&roots, Sysctl::UdpTimeout), 45);
        assert_eq!(value(&roots, Sysctl::UdpTimeoutStream), 300);
    }

    #[test]
    fn zero_leaves_values_alone_and_a_higher_max_is_kept() {
        let (_dir, roots) = roots(1024, 4096);
        let zero = ConntrackSysctls {
            max_per_core: 0,
            min: 999_999,
            tcp_established_timeout: Duration::ZERO,
            tcp_close_wait_timeout: Duration::ZERO,
            ..Default::default()
        };
        assert!(apply(&zero, &roots, 4).applied.is_empty());
        assert_eq!((value(&roots, Sysctl::Max), value(&roots, Sysctl::Hashsize)), (4096, 1024));
        std::fs::write(Sysctl::Max.path(&roots), "1048576").unwrap();
        let report = apply(&ConntrackSysctls::default(), &roots, 2);
        assert_eq!(value(&roots, Sysctl::Max), 1048576, "an operator's higher limit stays");
        assert!(matches!(report.applied[0].outcome, Outcome::KeptHigher { current: 1048576 }));
        assert_eq!(value(&roots, Sysctl::Hashsize), 32768, "grown to the computed max / 4");
    }

    #[test]
    fn every_value_that_cannot_be_set_is_named_once() {
        let dir = tempfile::tempdir().unwrap();
        let roots = SysctlRoots { proc_sys: dir.path().join("missing"), sys: dir.path().join("missing-too") };
        let report = apply(&ConntrackSysctls::default(), &roots, 2);
        let summary = report.failure_summary().unwrap();
        for name in [
            "nf_conntrack_max=131072",
            "nf_conntrack hashsize=32768",
            "tcp_timeout_established=86400",
            "close_wait=3600",
        ] {
            assert_eq!(summary.matches(name).count(), 1, "{name} in {summary}");
        }
        assert!(report.refuses_start_up());
    }

    #[test]
    fn only_a_read_only_sys_for_hashsize_is_tolerated() {
        let failed = |sysctl, errno| SysctlReport {
            applied: vec![Applied { sysctl, value: 1, outcome: Outcome::Failed(io::Error::from_raw_os_error(errno)) }],
        };
        assert!(!failed(Sysctl::Hashsize, libc::EROFS).refuses_start_up());
        assert!(failed(Sysctl::Hashsize, libc::EACCES).refuses_start_up());
        assert!(failed(Sysctl::Max, libc::EROFS).refuses_start_up());
        assert!(!SysctlReport::default().refuses_start_up());
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(cpu_list_len("0"), Some(1));
        assert_eq!(cpu_list_len("0-7"), Some(8));
        assert_eq!(cpu_list_len("0-1,4,6-7"), Some(5));
        assert_eq!(cpu_list_len("x"), None);
        assert_eq!(cpu_list_len("3-1"), None);
    }
}
