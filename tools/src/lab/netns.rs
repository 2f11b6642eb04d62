//! Named network namespaces that delete themselves, and running code inside them.

use std::fs::File;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use nix::sched::{CloneFlags, setns};

use super::error::LabError;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A network namespace created with `ip netns add`, deleted (with everything in it) on drop.
#[derive(Debug)]
pub struct Netns {
    name: String,
}

impl Netns {
    /// Creates a namespace named `nftp-<role>-<pid>-<n>`, with loopback up.
    pub fn create(role: &str) -> Result<Netns, LabError> {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("nftp-{role}-{}-{n}", std::process::id());
        run_checked(Command::new("ip").args(["netns", "add", &name]))?;
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The namespace's name (as `ip netns` knows it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip <args>` inside the namespace.
    pub fn ip(&self, args: &[&str]) -> Result<Output, LabError> {
        run_checked(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Runs a command inside the namespace and returns its output (failing on a non-zero exit).
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<Output, LabError> {
        run_checked(Command::new("ip").args(["netns", "exec", &self.name, program]).args(args))
    }

    /// A command that runs inside the namespace (for callers that want to spawn it).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `f` on a fresh thread that has entered this namespace; sockets it opens live here.
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, LabError> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    enter(&path)?;
                    Ok(f())
                })
                .join()
                .map_err(|_| LabError::ThreadPanicked(self.name.clone()))?
        })
    }

    /// Spawns a long-lived thread inside this namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<Result<T, LabError>> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            enter(&path)?;
            Ok(f())
        })
    }
}

/// Moves the calling thread into the namespace at `path`.
pub fn enter(path: &str) -> Result<(), LabError> {
    let file = File::open(path).map_err(|e| LabError::Enter(path.to_string(), e.to_string()))?;
    setns(&file, CloneFlags::CLONE_NEWNET).map_err(|e| LabError::Enter(path.to_string(), e.to_string()))
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).output();
    }
}

/// Runs a command, turning a non-zero exit into an error carrying its stderr.
pub fn run_checked(cmd: &mut Command) -> Result<Output, LabError> {
    let out = cmd.output().map_err(|e| LabError::Spawn(format!("{cmd:?}"), e.to_string()))?;
    if !out.status.success() {
        return Err(LabError::Command {
            command: format!("{cmd:?}"),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(out)
}
