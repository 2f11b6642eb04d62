//! Watching a manifests file or directory: every change is converted and sent as complete lists
//! of Services, EndpointSlices and this node's Node.
//!
//! Files are compared by path, size, modification time and inode every poll interval, so editor
//! saves (write in place or rename over) are seen. If the path cannot be read, the last good
//! load stays in force: a file moved away for a moment must not wipe a node's rules.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

use tracing::{info, warn};

use super::{SourceEvent, manifests};

type Fingerprint = Vec<(PathBuf, u64, i64, i64, u64)>;

fn fingerprint(path: &Path) -> Option<Fingerprint> {
    let files = manifests::manifest_files(path).ok()?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let m = std::fs::metadata(&f).ok()?;
        out.push((f, m.len(), m.mtime(), m.mtime_nsec(), m.ino()));
    }
    Some(out)
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
    interval: Duration,
) {
    let mut last: Option<Fingerprint> = None;
    while !stop.load(Ordering::Relaxed) {
        let now = fingerprint(path);
        if now.is_some() && now != last {
            match load_events(path, hostname) {
                Ok(events) => {
                    for event in events {
                        if tx.send(event).is_err() {
                            return;
                        }
                    }
                    last = now;
                }
                Err(e) => warn!("{e}; keeping the last loaded manifests"),
            }
        } else if now.is_none() && last.is_some() {
            warn!(path = %path.display(), "manifests unreadable; keeping the last loaded ones");
            last = None;
        }
        std::thread::sleep(interval);
    }
}

/// Starts [`watch_manifests`] on its own thread.
pub(crate) fn spawn_manifest_watcher(
    path: PathBuf,
    hostname: String,
    tx: Sender<SourceEvent>,
    stop: Arc<AtomicBool>,
    interval: Duration,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("manifests".into())
        .spawn(move || watch_manifests(&path, &hostname, &tx, &stop, interval))
}
