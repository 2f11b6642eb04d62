//! A run's record: the Markdown it prints ([`Report`]) and the dated results file it keeps, with
//! its plots beside it ([`Record`]), headed by the command, the commit and the machine.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::error::BenchError;

/// The Markdown a run prints, kept for its results file.
#[derive(Debug, Default)]
pub struct Report {
    text: String,
}

impl Report {
    /// Prints `section` and keeps it.
    pub fn add(&mut self, section: &str) {
        print!("{section}");
        let _ = std::io::Write::flush(&mut std::io::stdout());
        self.text.push_str(section);
    }

    /// Everything printed so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Where a run's results file and plots go: `DIR/DATE.md`, or `DIR/DATE-HHMM.md` when the
/// day already has one (UTC), plots beside it named after it.
#[derive(Debug, Clone)]
pub struct Record {
    dir: PathBuf,
    stem: String,
    /// The run's start, `YYYY-MM-DD HH:MM` UTC.
    started: String,
}

/// The source tree's results directory (this crate is its `tools/`).
fn docs_results() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/performance/results")
}

impl Record {
    /// A record in `dir`; without one, in the source tree's `docs/performance/results`, or
    /// (`temporary`: a `--quick` run not asked to record) in a temporary directory.
    pub fn new(dir: Option<&Path>, temporary: bool) -> Result<Record, BenchError> {
        let dir = match dir {
            Some(dir) => dir.to_path_buf(),
            None if temporary => std::env::temp_dir().join("nftproxy-bench-quick"),
            None => {
                let dir = docs_results();
                if !dir.is_dir() {
                    return Err(BenchError::Worker(format!(
                        "{} does not exist (the binary was built from another tree): pass --results DIR",
                        dir.display()
                    )));
                }
                dir
            }
        };
        std::fs::create_dir_all(&dir)?;
        let now = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
        let (date, hhmm) = (&now[..10], format!("{}{}", &now[11..13], &now[14..16]));
        let stem = if dir.join(format!("{date}.md")).exists() { format!("{date}-{hhmm}") } else { date.to_string() };
        Ok(Record { dir, stem, started: format!("{date} {}:{}", &now[11..13], &now[14..16]) })
    }

    /// The results file.
    pub fn results(&self) -> PathBuf {
        self.dir.join(format!("{}.md", self.stem))
    }

    /// A file beside the results file (`DATE[-HHMM]-<suffix>`).
    pub fn file(&self, suffix: &str) -> PathBuf {
        self.dir.join(format!("{}-{suffix}", self.stem))
    }

    /// How the results file links to `path`: by name when it is beside it.
    pub fn link(&self, path: &Path) -> String {
        match (path.parent(), path.file_name()) {
            (Some(dir), Some(name)) if dir == self.dir => name.to_string_lossy().into_owned(),
            _ => path.display().to_string(),
        }
    }

    /// The results file's head: the command, the commit, the machine, and the run's `note`.
    pub fn header(&self, note: Option<&str>) -> String {
        let command: Vec<String> = std::env::args().skip(1).collect();
        let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
        let mut out = format!(
            "# {} UTC: `nftproxy {}`\n\n{}; {profile} build. {}",
            self.started,
            command.join(" "),
            commit(),
            machine()
        );
        if let Some(note) = note {
            out.push_str(&format!("\n{note}\n"));
        }
        out
    }
}

/// The commit of the source tree the binary was built from, as git sees it now.
fn commit() -> String {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(&repo)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["log", "-1", "--format=%h (%cs)"]) {
        Some(head) => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            format!("Commit {head}{}", if dirty { " with uncommitted changes" } else { "" })
        }
        None => "Commit unknown (no git tree)".into(),
    }
}

/// One line describing the machine: CPU, cores, kernel, nft.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = tool_output("uname", &["-r"]);
    let nft = tool_output("nft", &["--version"]);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<u64>().unwrap_or(0)))
        .unwrap_or(0);
    let iptables = tool_output("iptables", &["--version"]);
    format!("Machine: {cpu}, {cores} cores, {} GiB RAM, Linux {kernel}, {nft}, {iptables}.\n", mem / 1024 / 1024)
}

/// The first line(s) a tool prints (its version), or `no PROGRAM`.
pub fn tool_output(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| format!("no {program}"))
}
