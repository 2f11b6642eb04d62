//! The `nftproxy` binary as the end-to-end benchmark runs it: a process in a benchmark
//! namespace, its JSON log read as it is written (each `synced` line is a commit, with the
//! sync's reason, kind and duration), and its CPU time and memory read from `/proc`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime};

use serde_json::Value;

use super::error::BenchError;
use crate::lab::Netns;
use crate::process::{self, ProcessGroup};

/// One line of the agent's JSON log.
#[derive(Debug, Clone)]
pub struct LogLine {
    /// When the line was logged (the agent's clock: this machine's).
    pub at: SystemTime,
    pub message: String,
    pub fields: Value,
}

/// A `synced` line: one committed sync.
#[derive(Debug, Clone, Copy)]
pub struct Commit {
    /// When the sync finished (right after the kernel's answer).
    pub at: SystemTime,
    /// How long the sync took, planning to commit.
    pub took: Duration,
    /// The kernel's share of it (netlink transaction sent to its answer).
    pub kernel: Duration,
    pub full: bool,
    /// Services whose changes the sync carried.
    pub changed: usize,
}

impl Commit {
    /// When the sync started.
    pub fn started(&self) -> SystemTime {
        self.at.checked_sub(self.took).unwrap_or(self.at)
    }
}

impl LogLine {
    fn parse(line: &str) -> Option<LogLine> {
        let v: Value = serde_json::from_str(line).ok()?;
        let at = humantime::parse_rfc3339(v["timestamp"].as_str()?).ok()?;
        let message = v["message"].as_str().unwrap_or_default().to_string();
        Some(LogLine { at, message, fields: v })
    }

    /// The sync this line reports, when it is a `synced` line.
    pub fn commit(&self) -> Option<Commit> {
        if self.message != "synced" {
            return None;
        }
        let field = |name: &str| -> Option<Duration> {
            let ms: f64 = self.fields[name].as_str()?.parse().ok()?;
            Some(Duration::from_secs_f64(ms / 1000.0))
        };
        Some(Commit {
            at: self.at,
            took: field("ms")?,
            kernel: field("kernel_ms").unwrap_or_default(),
            full: self.fields["span"]["full"].as_bool().unwrap_or(false),
            changed: self.fields["changed"].as_u64().unwrap_or(0) as usize,
        })
    }

    /// The reason the sync ran (`startup`, `changes`, `periodic`…), for span lines.
    pub fn reason(&self) -> &str {
        self.fields["span"]["reason"].as_str().unwrap_or_default()
    }
}

/// A running `nftproxy` process.
pub struct Agent {
    process: ProcessGroup,
    lines: Receiver<LogLine>,
    /// Lines read so far and not yet taken.
    backlog: Vec<LogLine>,
    /// Warnings and errors the agent logged (reported if the benchmark fails).
    pub complaints: Vec<String>,
    pub started: SystemTime,
}

impl Agent {
    /// Starts `nftproxy <args> --logging-format json` in `ns`.
    pub fn start(ns: &Netns, args: &[String]) -> Result<Agent, BenchError> {
        let binary = crate::nftproxy_binary();
        let started = SystemTime::now();
        let mut command = ns.command(&binary.to_string_lossy());
        command.args(args).args(["--logging-format", "json"]).stdout(Stdio::null()).stderr(Stdio::piped());
        let mut process =
            ProcessGroup::spawn(&mut command).map_err(|e| BenchError::Tool("nftproxy".into(), e.to_string()))?;
        let stderr = process.take_stderr().ok_or_else(|| BenchError::Worker("no stderr".into()))?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(parsed) = LogLine::parse(&line)
                    && tx.send(parsed).is_err()
                {
                    break;
                }
            }
        });
        Ok(Agent { process, lines, backlog: Vec::new(), complaints: Vec::new(), started })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.process.id()
    }

    /// Remembers what the agent complained about.
    fn note(&mut self, line: &LogLine) {
        let level = line.fields["level"].as_str().unwrap_or_default();
        if level == "WARN" || level == "ERROR" {
            self.complaints.push(format!("{level} {}: {}", line.message, line.fields));
        }
    }

    /// Waits until a line satisfies `want` (lines before it are dropped); fails after `timeout`
    /// or when the process exits.
    pub fn wait_for(&mut self, timeout: Duration, want: impl Fn(&LogLine) -> bool) -> Result<LogLine, BenchError> {
        if let Some(i) = self.backlog.iter().position(&want) {
            let line = self.backlog[i].clone();
            self.backlog.drain(..=i);
            return Ok(line);
        }
        self.backlog.clear();
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if want(&line) => return Ok(line),
                Ok(line) => self.note(&line),
                Err(RecvTimeoutError::Timeout) => {
                    return Err(BenchError::Worker(format!(
                        "nftproxy did not log what the benchmark waits for within {timeout:?}; it said: {}",
                        self.complaints.join("; ")
                    )));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(BenchError::Worker(format!("nftproxy exited: {}", self.complaints.join("; "))));
                }
            }
        }
    }

    /// The next committed sync.
    pub fn next_commit(&mut self, timeout: Duration) -> Result<(Commit, String), BenchError> {
        let line = self.wait_for(timeout, |l| l.commit().is_some())?;
        let reason = line.reason().to_string();
        line.commit().map(|c| (c, reason)).ok_or_else(|| BenchError::Worker("unreadable synced line".into()))
    }

    /// Every line logged since the last call (without waiting).
    pub fn drain(&mut self) -> Vec<LogLine> {
        while let Ok(line) = self.lines.try_recv() {
            self.note(&line);
            self.backlog.push(line);
        }
        std::mem::take(&mut self.backlog)
    }

    /// CPU time used so far (user and system).
    pub fn cpu(&self) -> Duration {
        process::cpu_time(self.pid()).unwrap_or_default()
    }

    /// Resident memory now, bytes.
    pub fn rss(&self) -> u64 {
        process::rss(self.pid())
    }

    /// Peak resident memory so far, bytes.
    pub fn peak_rss(&self) -> u64 {
        process::peak_rss(self.pid())
    }

    /// Stops the process (SIGTERM, then SIGKILL after 5 s) and reaps it.
    pub fn stop(mut self) {
        self.process.stop(Duration::from_secs(5));
    }
}

/// What a short-lived command cost: its wall time and peak memory.
#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct Cost {
    pub wall: Duration,
    pub peak_rss: u64,
}

/// Runs `nftproxy <args>` to completion in `ns` (through a worker process, so the peak memory
/// read is this command's alone) and returns its cost; its standard output is discarded.
pub fn measure(ns: &Netns, args: &[String]) -> Result<Cost, BenchError> {
    let exe = std::env::current_exe()?;
    let binary = crate::nftproxy_binary();
    let out = ns
        .command(&exe.to_string_lossy())
        .args(["bench-worker", "--phase", "measure", "--"])
        .arg(&binary)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()?;
    if !out.status.success() {
        return Err(BenchError::Worker(format!(
            "nftproxy {}: {}",
            args.first().map(String::as_str).unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .map_err(|e| BenchError::Worker(format!("unreadable measure report: {e}")))
}

/// The size of a file, bytes.
pub fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn synced_lines_are_commits() {
        let line = r#"{"timestamp":"2026-11-23T23:26:18.588777Z","level":"INFO","message":"synced","services":20,"changed":3,"ms":"9.8","kernel_ms":"2.5","target":"nftproxy::sync","span":{"full":true,"reason":"startup","name":"sync"}}"#;
        let parsed = LogLine::parse(line).unwrap();
        let c = parsed.commit().unwrap();
        assert!(c.full);
        assert_eq!(c.changed, 3);
        assert_eq!(c.took, Duration::from_secs_f64(0.0098));
        assert_eq!(c.kernel, Duration::from_secs_f64(0.0025));
        assert_eq!(parsed.reason(), "startup");
        assert_eq!(c.at.duration_since(c.started()).unwrap(), c.took);
        assert!(LogLine::parse("not json").is_none());
        assert!(LogLine::parse(r#"{"timestamp":"2026-11-23T23:26:18Z","message":"x"}"#).unwrap().commit().is_none());
    }
}
