//! The machine's load around a measurement, so that a results file says whether its figures
//! were taken on a quiet machine: the load averages before it, the CPU time other processes used
//! before and during it (everything outside this benchmark's own process tree and the kernel's
//! threads: another engineer's build, a test suite), and the time the hypervisor stole.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

/// Other processes' CPU, in cores, above which a window is not quiet: a tenth of a core is an
/// editor, a shell, a browser tab; a build or a test suite takes one or two.
pub const QUIET_OTHERS: f64 = 0.15;
/// Stolen time, as a share of the machine's CPU time, above which a window is not quiet.
pub const QUIET_STEAL: f64 = 0.05;
/// How long the machine is watched before a part.
pub const BEFORE: Duration = Duration::from_secs(3);

/// Clock ticks a second of `/proc` CPU times (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
const TICKS: f64 = 100.0;

/// What `/proc` says at one instant.
#[derive(Debug, Clone)]
struct Snapshot {
    at: Instant,
    load: [f64; 3],
    /// The machine's busy and stolen ticks (all CPUs), and all of them.
    busy: u64,
    steal: u64,
    total: u64,
    /// CPU ticks (own and reaped children's) of every process of this benchmark's tree.
    ours: BTreeMap<u32, u64>,
}

fn snapshot() -> Snapshot {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut fields = load.split_whitespace().map(|f| f.parse::<f64>().unwrap_or(0.0));
    let load = [fields.next().unwrap_or(0.0), fields.next().unwrap_or(0.0), fields.next().unwrap_or(0.0)];
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    // cpu  user nice system idle iowait irq softirq steal guest guest_nice
    let cpu: Vec<u64> =
        stat.lines().next().unwrap_or_default().split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    let at = |i: usize| cpu.get(i).copied().unwrap_or(0);
    let busy = at(0) + at(1) + at(2) + at(5) + at(6);
    let steal = at(7);
    let total = busy + steal + at(3) + at(4);
    Snapshot { at: Instant::now(), load, busy, steal, total, ours: our_processes() }
}

/// `(parent, CPU ticks with reaped children)` of every process.
fn processes() -> BTreeMap<u32, (u32, u64)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else { return out };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // After the command's closing parenthesis: state, ppid, …; utime, stime, cutime and
        // cstime are fields 14–17 of the whole line.
        let Some((_, rest)) = stat.rsplit_once(')') else { continue };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let ppid = u32::try_from(num(1)).unwrap_or(0);
        out.insert(pid, (ppid, num(11) + num(12) + num(13) + num(14)));
    }
    out
}

/// This benchmark's processes (itself and its descendants, in any namespace) and their ticks.
fn our_processes() -> BTreeMap<u32, u64> {
    let all = processes();
    let me = std::process::id();
    let mut ours: BTreeSet<u32> = BTreeSet::from([me]);
    // Parents before children is not guaranteed by pid order: repeat until nothing is added.
    loop {
        let before = ours.len();
        for (pid, (ppid, _)) in &all {
            if ours.contains(ppid) {
                ours.insert(*pid);
            }
        }
        if ours.len() == before {
            break;
        }
    }
    ours.into_iter().filter_map(|pid| Some((pid, all.get(&pid)?.1))).collect()
}

/// Cores used by everything but this benchmark between two snapshots, and the share of the
/// machine's CPU time stolen.
fn between(a: &Snapshot, b: &Snapshot) -> (f64, f64) {
    let seconds = b.at.duration_since(a.at).as_secs_f64().max(1e-3);
    // Our processes' ticks over the window: those seen at both ends, and those born since.
    let ours: u64 = b.ours.iter().map(|(pid, t)| t.saturating_sub(a.ours.get(pid).copied().unwrap_or(0))).sum();
    let others = b.busy.saturating_sub(a.busy).saturating_sub(ours) as f64 / TICKS / seconds;
    let total = b.total.saturating_sub(a.total).max(1) as f64;
    let steal = b.steal.saturating_sub(a.steal) as f64 / total;
    (others, steal)
}

/// The load around one part of a run.
#[derive(Debug, Clone)]
pub struct Window {
    pub part: String,
    /// The 1-minute load average when the part started.
    pub load_before: f64,
    /// Other processes' CPU in cores, over [`BEFORE`] before the part and during it.
    pub others_before: f64,
    pub others_during: f64,
    /// Stolen time during the part, as a share of the machine's CPU time.
    pub steal_during: f64,
}

impl Window {
    /// Whether nothing else ran to speak of, before or during the part.
    pub fn quiet(&self) -> bool {
        self.others_before <= QUIET_OTHERS && self.others_during <= QUIET_OTHERS && self.steal_during <= QUIET_STEAL
    }
}

/// Watches the machine for [`BEFORE`], then runs `part` and returns its result with the load
/// around it.
pub fn watch<T>(part: &str, f: impl FnOnce() -> T) -> (T, Window) {
    let first = snapshot();
    std::thread::sleep(BEFORE);
    let start = snapshot();
    let out = f();
    let end = snapshot();
    let (others_before, _) = between(&first, &start);
    let (others_during, steal_during) = between(&start, &end);
    let window =
        Window { part: part.to_string(), load_before: start.load[0], others_before, others_during, steal_during };
    (out, window)
}

/// The windows of a run as a Markdown table.
pub fn table(windows: &[Window]) -> String {
    let mut out = String::from(
        "| part | load average (1 min) before | other processes' CPU before / during (cores) | stolen during | quiet |\n|---|---:|---:|---:|---|\n",
    );
    for w in windows {
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} / {:.2} | {:.1}% | {} |\n",
            w.part,
            w.load_before,
            w.others_before,
            w.others_during,
            w.steal_during * 100.0,
            if w.quiet() { "yes" } else { "**no**" }
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(at: Instant, busy: u64, steal: u64, total: u64, ours: &[(u32, u64)]) -> Snapshot {
        Snapshot { at, load: [0.0; 3], busy, steal, total, ours: ours.iter().copied().collect() }
    }

    #[test]
    fn our_own_cpu_is_not_another_process_and_steal_is_a_share() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(2);
        // Over 2 s the machine was busy 300 ticks: 250 ours (one process grew by 150, one was
        // born with 100), so the others used 50 ticks, a quarter of a core; 20 of 400 ticks
        // were stolen.
        let a = snap(t0, 1000, 10, 5000, &[(1, 400), (2, 50)]);
        let b = snap(t1, 1300, 30, 5400, &[(1, 550), (2, 50), (3, 100)]);
        let (others, steal) = between(&a, &b);
        assert!((others - 0.25).abs() < 1e-9, "{others}");
        assert!((steal - 0.05).abs() < 1e-9, "{steal}");
        let quiet = |others_during| Window {
            part: String::new(),
            load_before: 0.0,
            others_before: 0.0,
            others_during,
            steal_during: 0.0,
        };
        assert!(quiet(0.1).quiet());
        assert!(!quiet(0.25).quiet());
    }

    #[test]
    fn this_process_is_in_its_own_tree() {
        let ours = our_processes();
        assert!(ours.contains_key(&std::process::id()));
    }
}
