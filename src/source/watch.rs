//! Watching a manifests file or directory: every change is converted and sent as complete lists
//! of Services, EndpointSlices and this node's Node.
//!
//! Files are compared by path, size, modification time and inode every poll interval, so editor
//! saves (write in place or rename over) are seen. If the path cannot be read, the last good
//! load stays in force: a file moved away for a moment must not wipe a node's rules. A change
//! is held back while a file is being written in place (modified within the settle time, or
//! emptied within the hold limit, as a file is between its truncation and its first write) and
//! read again when it changed while read: a half-written file would otherwise load as fewer
//! objects, or none, and remove services until the next poll. A change held back for the hold
//! limit is loaded as it is, with a warning, so that a writer that never stops cannot keep the
//! node on old rules; a file emptied on purpose is believed once it is that old.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant, SystemTime};

use tracing::{debug, info, warn};

use super::{SourceEvent, manifests};

type Fingerprint = Vec<(PathBuf, u64, i64, i64, u64)>;

/// How the watcher polls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Polling {
    /// How often the files are compared.
    pub interval: Duration,
    /// How long every file must be unmodified before a change is loaded.
    pub settle: Duration,
    /// How long a change may be held back before it is loaded as it is.
    pub hold_limit: Duration,
}

impl Polling {
    /// Polls every `interval`, loads files quiet for 50 ms, holds a change back for at most 5 s.
    pub(crate) fn every(interval: Duration) -> Polling {
        Polling { interval, settle: Duration::from_millis(50), hold_limit: Duration::from_secs(5) }
    }
}

/// Why a file looks unfinished, so that a change is not loaded yet.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Hold {
    /// A file was modified within the settle time.
    Writing(PathBuf),
    /// A file was emptied within the hold limit: truncated, not written yet.
    Empty(PathBuf),
}

impl std::fmt::Display for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hold::Writing(file) => write!(f, "{} is being written", file.display()),
            Hold::Empty(file) => write!(f, "{} is empty", file.display()),
        }
    }
}

fn fingerprint(path: &Path) -> Option<Fingerprint> {
    let files = manifests::manifest_files(path).ok()?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let m = std::fs::metadata(&f).ok()?;
        out.push((f, m.len(), m.mtime(), m.mtime_nsec(), m.ino()));
    }
    Some(out)
}

/// Why the files of `print` look unfinished at `now`, if they do. An empty file left alone for
/// the hold limit (a placeholder) is finished. A modification time in the future (a skewed
/// clock) counts as long past, or the file would be held back for nothing.
fn unfinished(print: &Fingerprint, now: SystemTime, polling: &Polling) -> Option<Hold> {
    print.iter().find_map(|(file, len, secs, nsecs, _)| {
        let modified = u64::try_from(*secs)
            .ok()
            .and_then(|s| SystemTime::UNIX_EPOCH.checked_add(Duration::new(s, u32::try_from(*nsecs).unwrap_or(0))));
        let age = modified.and_then(|m| now.duration_since(m).ok());
        if age.is_some_and(|age| age < polling.settle) {
            Some(Hold::Writing(file.clone()))
        } else if *len == 0 && age.is_some_and(|age| age < polling.hold_limit) {
            Some(Hold::Empty(file.clone()))
        } else {
            None
        }
    })
}

/// Loads manifests and converts them into what the agent is sent: the objects' problems, then
/// the three complete lists. Malformed documents are logged here (they name no object).
pub(crate) fn load_events(path: &Path, hostname: &str) -> Result<Vec<SourceEvent>, manifests::ManifestError> {
    let loaded = manifests::load(path)?;
    for p in &loaded.problems {
        warn!("{p}");
    }
    let (services, slices, malformed) = (loaded.services.len(), loaded.slices.len(), loaded.problems.len());
    let (updates, problems) = loaded.into_updates(hostname);
    info!(
        path = %path.display(),
        services,
        slices,
        problems = malformed + problems.len(),
        "manifests loaded"
    );
    let mut events = vec![SourceEvent::Problems(problems)];
    events.extend(updates.into_iter().map(SourceEvent::Update));
    Ok(events)
}

/// Sends the manifests under `path` now and after every change, until `stop` is set or the
/// receiver goes away. Runs on the calling thread.
pub(crate) fn watch_manifests(
    path: &Path,
    hostname: &str,
    tx: &Sender<SourceEvent>,
    stop: &AtomicBool,
    polling: Polling,
) {
    let mut last: Option<Fingerprint> = None;
    // Since when the current change has been held back.
    let mut held_since: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let now = fingerprint(path);
        match now.as_ref().filter(|print| Some(*print) != last.as_ref()) {
            Some(print) => {
                let overdue = held_since.is_some_and(|since| since.elapsed() >= polling.hold_limit);
                if !overdue && let Some(hold) = unfinished(print, SystemTime::now(), &polling) {
                    if held_since.is_none() {
                        debug!(path = %path.display(), "holding the change back: {hold}");
                    }
                    held_since.get_or_insert_with(Instant::now);
                    // Soon again, but never a busy loop.
                    std::thread::sleep(polling.settle.min(polling.interval).max(Duration::from_millis(1)));
                    continue;
                }
                if overdue {
                    warn!(
                        path = %path.display(),
                        "the manifests were still changing after {:?}: loading them as they are", polling.hold_limit
                    );
                    held_since = None;
                }
                match load_events(path, hostname) {
                    Ok(_) if !overdue && fingerprint(path) != now => {
                        debug!(path = %path.display(), "holding the change back: the manifests changed while read");
                        held_since.get_or_insert_with(Instant::now);
                    }
                    Ok(events) => {
                        for event in events {
                            if tx.send(event).is_err() {
                                return;
                            }
                        }
                        last = now;
                        held_since = None;
                    }
                    Err(e) => {
                        warn!("{e}; keeping the last loaded manifests");
                        held_since = None;
                    }
                }
            }
            None => {
                held_since = None;
                if now.is_none() && last.is_some() {
                    warn!(path = %path.display(), "manifests unreadable; keeping the last loaded ones");
                    last = None;
                }
            }
        }
        std::thread::sleep(polling.interval);
    }
}

/// Starts [`watch_manifests`] on its own thread.
pub(crate) fn spawn_manifest_watcher(
    path: PathBuf,
    hostname: String,
    tx: Sender<SourceEvent>,
    stop: Arc<AtomicBool>,
    polling: Polling,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("manifests".into())
        .spawn(move || watch_manifests(&path, &hostname, &tx, &stop, polling))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Change, Update};
    use std::sync::mpsc::Receiver;

    fn print_of(len: u64, at: SystemTime) -> Fingerprint {
        let since = at.duration_since(SystemTime::UNIX_EPOCH).expect("after the epoch");
        let secs = i64::try_from(since.as_secs()).expect("seconds");
        vec![(PathBuf::from("a.yaml"), len, secs, i64::from(since.subsec_nanos()), 1)]
    }

    #[test]
    fn a_file_modified_just_now_or_emptied_lately_is_unfinished() {
        let polling = Polling::every(Duration::from_millis(200));
        let settle = polling.settle;
        let now = SystemTime::now();
        let writing = Some(Hold::Writing(PathBuf::from("a.yaml")));
        assert_eq!(unfinished(&print_of(10, now - settle / 2), now, &polling), writing);
        assert_eq!(unfinished(&print_of(10, now - settle), now, &polling), None);
        assert_eq!(unfinished(&print_of(10, now - Duration::from_secs(3600)), now, &polling), None);
        // A clock behind the file's time must not hold it back.
        assert_eq!(unfinished(&print_of(10, now + Duration::from_secs(5)), now, &polling), None);
        // Truncated and not written yet; an empty placeholder left alone is finished.
        let lately = now - Duration::from_secs(1);
        assert_eq!(unfinished(&print_of(0, lately), now, &polling), Some(Hold::Empty(PathBuf::from("a.yaml"))));
        let old = now - Duration::from_secs(60);
        assert_eq!(unfinished(&print_of(0, old), now, &polling), None);
        // Every file counts: one fresh file among old ones holds the change.
        let mut both = print_of(10, old);
        both.extend(print_of(10, now));
        assert_eq!(unfinished(&both, now, &polling), writing);
    }

    const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n\
                       spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, protocol: TCP}]}\n";

    /// Watches `file` with `polling` and returns the receiver and a stop for the watcher.
    fn watch(file: &Path, polling: Polling) -> (Receiver<SourceEvent>, impl FnOnce(Receiver<SourceEvent>)) {
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let watcher = spawn_manifest_watcher(file.to_path_buf(), "node1".into(), tx, Arc::clone(&stop), polling)
            .expect("watcher");
        let end = move |rx: Receiver<SourceEvent>| {
            stop.store(true, Ordering::Relaxed);
            drop(rx);
            watcher.join().expect("joined");
        };
        (rx, end)
    }

    /// The number of services in the first complete list of Services sent within 10 s.
    fn first_services(rx: &Receiver<SourceEvent>) -> Option<usize> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match rx.recv_timeout(left) {
                Ok(SourceEvent::Update(Update::Service(Change::Reset(list)))) => return Some(list.len()),
                Ok(_) => {}
                // The deadline, or a watcher gone.
                Err(_) => return None,
            }
        }
        None
    }

    #[test]
    fn a_truncated_file_is_loaded_only_once_its_writer_is_done() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("cluster.yaml");
        std::fs::write(&file, "").expect("truncated");
        // A settle time far above the writer's pause: only a watcher that does not wait fails.
        let polling = Polling {
            interval: Duration::from_millis(5),
            settle: Duration::from_secs(1),
            ..Polling::every(Duration::ZERO)
        };
        let (rx, end) = watch(&file, polling);
        std::thread::sleep(Duration::from_millis(10));
        std::fs::write(&file, WEB).expect("written");
        let services = first_services(&rx);
        end(rx);
        assert_eq!(services, Some(1), "the first load saw the written file");
    }

    #[test]
    fn an_empty_file_is_held_back_then_believed() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("cluster.yaml");
        std::fs::write(&file, WEB).expect("written");
        let polling = Polling {
            interval: Duration::from_millis(5),
            settle: Duration::ZERO,
            hold_limit: Duration::from_millis(300),
        };
        let (rx, end) = watch(&file, polling);
        assert_eq!(first_services(&rx), Some(1));
        let emptied = Instant::now();
        std::fs::write(&file, "").expect("emptied");
        let services = first_services(&rx);
        let waited = emptied.elapsed();
        end(rx);
        assert_eq!(services, Some(0), "an empty file held for the hold limit is loaded");
        // Held (a watcher that does not hold loads within a poll of 5 ms); the file's time is
        // the kernel's coarse clock, a few milliseconds behind, so the bound has a margin.
        assert!(waited >= polling.hold_limit - Duration::from_millis(50), "loaded after {waited:?}");
    }
}
