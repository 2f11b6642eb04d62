//! Watching a manifests file or directory: every change is converted and sent as complete lists
//! of Services, EndpointSlices and this node's Node.
//!
//! Files are compared by path, size, modification time and inode every poll interval, so editor
//! saves (write in place or rename over) are seen. If the path cannot be read, the last good
//! load stays in force: a file moved away for a moment must not wipe a node's rules. A file
//! written in place is loaded only once it has been quiet for [`SETTLE`] and did not change
//! while it was read: a writer caught between truncating and writing would otherwise load as
//! no objects, and remove every service until the next poll.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::time::{Duration, SystemTime};

use tracing::{info, warn};

use super::{SourceEvent, manifests};

type Fingerprint = Vec<(PathBuf, u64, i64, i64, u64)>;

/// How long the newest file must be unmodified before it is loaded.
const SETTLE: Duration = Duration::from_millis(50);

fn fingerprint(path: &Path) -> Option<Fingerprint> {
    let files = manifests::manifest_files(path).ok()?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let m = std::fs::metadata(&f).ok()?;
        out.push((f, m.len(), m.mtime(), m.mtime_nsec(), m.ino()));
    }
    Some(out)
}

/// Whether no file of `print` was modified within [`SETTLE`] of `now`. A modification time in
/// the future (a skewed clock) counts as settled, or the file would never load.
fn settled(print: &Fingerprint, now: SystemTime) -> bool {
    print.iter().all(|(_, _, secs, nsecs, _)| {
        let modified = u64::try_from(*secs)
            .ok()
            .and_then(|s| SystemTime::UNIX_EPOCH.checked_add(Duration::new(s, u32::try_from(*nsecs).unwrap_or(0))));
        modified.and_then(|m| now.duration_since(m).ok()).is_none_or(|age| age >= SETTLE)
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
    interval: Duration,
) {
    let mut last: Option<Fingerprint> = None;
    while !stop.load(Ordering::Relaxed) {
        let now = fingerprint(path);
        let changed = now.as_ref().is_some_and(|print| Some(print) != last.as_ref());
        if changed && !now.as_ref().is_some_and(|print| settled(print, SystemTime::now())) {
            std::thread::sleep(SETTLE.min(interval));
            continue;
        }
        if changed {
            match load_events(path, hostname) {
                // Written to while it was read: the next poll loads what the writer ends with.
                Ok(_) if fingerprint(path) != now => {}
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

#[cfg(test)]
mod tests {
    use super::*;

    fn print_modified_at(at: SystemTime) -> Fingerprint {
        let since = at.duration_since(SystemTime::UNIX_EPOCH).expect("after the epoch");
        let secs = i64::try_from(since.as_secs()).expect("seconds");
        vec![(PathBuf::from("a.yaml"), 10, secs, i64::from(since.subsec_nanos()), 1)]
    }

    #[test]
    fn a_file_modified_just_now_is_not_settled() {
        let now = SystemTime::now();
        assert!(!settled(&print_modified_at(now - SETTLE / 2), now));
        assert!(settled(&print_modified_at(now - SETTLE), now));
        assert!(settled(&print_modified_at(now - Duration::from_secs(3600)), now));
        // A clock behind the file's time must not hold it back for ever.
        assert!(settled(&print_modified_at(now + Duration::from_secs(5)), now));
        // Every file counts: one fresh file among old ones holds the load.
        let mut both = print_modified_at(now - Duration::from_secs(60));
        both.extend(print_modified_at(now));
        assert!(!settled(&both, now));
    }

    #[test]
    fn a_truncated_file_is_loaded_only_once_its_writer_is_done() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("cluster.yaml");
        std::fs::write(&file, "").expect("truncated");
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let watcher =
            spawn_manifest_watcher(file.clone(), "node1".into(), tx, Arc::clone(&stop), Duration::from_millis(5))
                .expect("watcher");
        // The writer finishes within the settle time: the empty file is never loaded.
        std::thread::sleep(SETTLE / 5);
        std::fs::write(
            &file,
            "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\n\
             spec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80, protocol: TCP}]}\n",
        )
        .expect("written");
        let services = rx
            .iter()
            .find_map(|event| match event {
                SourceEvent::Update(crate::index::Update::Service(crate::index::Change::Reset(list))) => {
                    Some(list.len())
                }
                _ => None,
            })
            .expect("an update");
        stop.store(true, Ordering::Relaxed);
        drop(rx);
        watcher.join().expect("joined");
        assert_eq!(services, 1, "the first load saw the written file");
    }
}
