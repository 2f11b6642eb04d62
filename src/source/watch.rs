//! Watching a manifests file or directory: every change becomes a [`Snapshot`].
//!
//! Files are compared by path, size, modification time and inode every poll interval, so editor
//! saves (write in place or rename over) are seen. If the path cannot be read, the last good
//! snapshot stays in force: a file moved away for a moment must not wipe a node's rules.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

use tracing::{info, warn};

use super::manifests::{self, Manifests};
use super::{Event, Kind, Snapshot};

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

/// Loads manifests into a snapshot, logging every problem.
pub fn load_snapshot(path: &Path) -> Result<Snapshot, manifests::ManifestError> {
    let Manifests { services, slices, nodes, problems, .. } = manifests::load(path)?;
    for p in &problems {
        warn!("{p}");
    }
    Ok(Snapshot { services, slices, nodes, problems: problems.len() })
}

/// Sends a snapshot of `path` now and after every change, until `stop` is set or the receiver
/// goes away. Runs on the calling thread.
pub fn watch_manifests(path: &Path, tx: &Sender<Event>, stop: &AtomicBool, interval: Duration) {
    let mut last: Option<Fingerprint> = None;
    let mut synced = false;
    while !stop.load(Ordering::Relaxed) {
        let now = fingerprint(path);
        if now.is_some() && now != last {
            match load_snapshot(path) {
                Ok(snapshot) => {
                    info!(path = %path.display(), services = snapshot.services.len(), slices = snapshot.slices.len(), "manifests loaded");
                    if tx.send(Event::Snapshot(Box::new(snapshot))).is_err() {
                        return;
                    }
                    if !synced {
                        for kind in [Kind::Services, Kind::EndpointSlices, Kind::Nodes] {
                            let _ = tx.send(Event::Synced(kind));
                        }
                        synced = true;
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
pub fn spawn_manifest_watcher(
    path: PathBuf,
    tx: Sender<Event>,
    stop: Arc<AtomicBool>,
    interval: Duration,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("manifests".into()).spawn(move || watch_manifests(&path, &tx, &stop, interval))
}
