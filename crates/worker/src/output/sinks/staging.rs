//! Per-request files for a client that collects them (the KV-connector face, `connector.py`): request `r`'s
//! sample is written to `DIR/<r>.safetensors`, the path the server's response names, and `DIR/<r>.safetensors.lock`
//! is held (an exclusive `flock`) by the writing process from the step in which the request's prompt completed —
//! before any response for it can exist — until the file is renamed into place. A client that finds the lock waits
//! for it (speculators' `generate-offline-data` does) and then owns both files; the lock file is never removed
//! here, since the client removes it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::sample::request_stem;
use crate::{core_err, error::CoreResult};

/// The file name of request `req_id`'s sample: its [`request_stem`] (bounded, safe and distinct for distinct ids,
/// whatever the client sent) and `.safetensors`.
pub fn file_name(req_id: &str) -> String {
    format!("{}.safetensors", request_stem(req_id))
}

/// The lock file beside a sample file.
pub fn lock_path(file: &Path) -> PathBuf {
    let mut p = file.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// Tests only: a slow disk, to show that a response comes before its file and that clients wait for the lock.
#[derive(Debug, Clone, Default)]
pub struct SlowDisk {
    /// Each file's write is held back this long.
    pub delay: Duration,
    /// ...and, first, for as long as this file exists (at most [`SlowDisk::MAX_HOLD`]): a stall the test ends.
    pub hold_while: Option<PathBuf>,
}

impl SlowDisk {
    /// A test that forgets its hold file slows the server down; it does not hang it.
    pub const MAX_HOLD: Duration = Duration::from_secs(300);

    pub fn wait(&self) {
        if let Some(hold) = &self.hold_while {
            let start = Instant::now();
            while hold.exists() && start.elapsed() < Self::MAX_HOLD {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        std::thread::sleep(self.delay);
    }
}

/// How long a release waits for room in the backlog before it reports the files stalled and goes on.
pub const STALL_DEADLINE: Duration = Duration::from_secs(60);

/// The backlog did not drain within the deadline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stalled {
    pub files: usize,
    pub rows: usize,
    pub limit: usize,
    pub waited: Duration,
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} files ({} rows) have waited for the writer {:.0} s past the backlog's {} rows: the disk is full, hung \
             or slower than the server, or a writer thread stopped (check the disk and the worker's log); answering \
             anyway, so those requests' clients may time out on their locks",
            self.files,
            self.rows,
            self.waited.as_secs_f64(),
            self.limit
        )
    }
}

/// A held lock: its file, and the sample's rows once the sample is complete (None while a request that captures
/// its generated tokens is still generating).
#[derive(Debug)]
struct Held {
    _file: File,
    rows: Option<usize>,
}

/// The locks this process holds, by request id.
#[derive(Debug)]
pub struct Locks {
    root: PathBuf,
    held: Mutex<HashMap<String, Held>>,
    /// Signalled whenever a lock goes.
    freed: Condvar,
    /// Rows of samples completed since [`Locks::take_completed_rows`] last ran.
    fresh_rows: AtomicUsize,
    pub slow_disk: SlowDisk,
}

/// Checks that `flock` works in `root` the way speculators' client relies on: two open files of one lock exclude each
/// other. A filesystem without it (some network filesystems refuse `flock`, or grant it to everyone) would hand a
/// client a file still being written, so it is refused here, at start-up.
pub fn check_flock(root: &Path) -> CoreResult<()> {
    let probe = root.join(format!(".hscapture-flock-probe-{}", std::process::id()));
    let open = || {
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&probe).map_err(|e| {
            core_err!(Output, "cannot create {}: {e}; the staging directory must exist and be writable", probe.display()).caused_by(&e)
        })
    };
    let result = (|| {
        let (a, b) = (open()?, open()?);
        a.lock().map_err(|e| {
            core_err!(
                Output,
                "flock does not work in {} ({e}); expected a local filesystem with flock: speculators' client waits on each file's lock",
                root.display()
            )
        })?;
        match b.try_lock() {
            Err(std::fs::TryLockError::WouldBlock) => Ok(()),
            Ok(()) => Err(core_err!(
                Output,
                "flock in {} lets two open files hold one lock at once; expected it to exclude (a network filesystem \
                 that fakes locks?): a client would read files still being written. Put the staging directory on a \
                 local filesystem",
                root.display()
            )),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(core_err!(Output, "flock does not work in {} ({e}); expected a local filesystem with flock", root.display()))
            }
        }
    })();
    let _ = std::fs::remove_file(&probe);
    result
}

impl Locks {
    pub fn new(root: &Path, slow_disk: SlowDisk) -> Locks {
        Locks {
            root: root.to_path_buf(),
            held: Mutex::new(HashMap::new()),
            freed: Condvar::new(),
            fresh_rows: AtomicUsize::new(0),
            slow_disk,
        }
    }

    /// The staging directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates and locks request `req_id`'s lock file (before its response can exist); `rows` once its sample is
    /// complete (a request that captures its generated tokens is held from its start, rows unknown).
    pub fn hold(&self, req_id: &str, rows: Option<usize>) -> CoreResult<()> {
        if let Some(rows) = rows {
            self.fresh_rows.fetch_add(rows, Ordering::Relaxed);
        }
        if let Some(h) = self.lock().get_mut(req_id) {
            h.rows = h.rows.or(rows); // held already: not locked twice (which would wait for itself)
            return Ok(());
        }
        let path = lock_path(&self.root.join(file_name(req_id)));
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| {
            core_err!(Output, "cannot create {}: {e}; the staging directory must be writable", path.display()).caused_by(&e)
        })?;
        // Waits while another holder has it (a client still reading an earlier file of the same name): a section.
        let locked = match file.try_lock() {
            Ok(()) => Ok(()),
            Err(std::fs::TryLockError::WouldBlock) => crate::blocking::section(|| file.lock()),
            Err(std::fs::TryLockError::Error(e)) => Err(e),
        };
        locked.map_err(|e| core_err!(Output, "cannot lock {}: {e}", path.display()).caused_by(&e))?;
        self.lock().insert(req_id.to_string(), Held { _file: file, rows });
        Ok(())
    }

    /// Releases request `req_id`'s lock: its file is in place (or will never be).
    pub fn release(&self, req_id: &str) {
        self.lock().remove(req_id);
        self.freed.notify_all();
    }

    /// Releases request `req_id`'s lock and removes its lock file, if this process holds it: the request ended
    /// without a sample (aborted), so no response names the file and no client will come for either.
    pub fn abandon(&self, req_id: &str) {
        if self.lock().remove(req_id).is_some() {
            let _ = std::fs::remove_file(lock_path(&self.root.join(file_name(req_id))));
        }
        self.freed.notify_all();
    }

    /// Gives up every lock this process holds and removes their lock files: the capture failed, so none of their
    /// files will be written; a client waiting for one finds no file (an error), never a lock held for ever.
    pub fn abandon_all(&self) {
        let held: Vec<String> = self.lock().drain().map(|(id, _)| id).collect();
        for id in held {
            let _ = std::fs::remove_file(lock_path(&self.root.join(file_name(&id))));
        }
        self.freed.notify_all();
    }

    pub fn held(&self) -> usize {
        self.lock().len()
    }

    /// Rows of the complete samples whose files are not in place yet: answered, or about to be, with a path a
    /// client waits for.
    pub fn waiting_rows(&self) -> usize {
        self.lock().values().filter_map(|h| h.rows).sum()
    }

    /// Rows of the samples completed since the last call.
    pub fn take_completed_rows(&self) -> usize {
        self.fresh_rows.swap(0, Ordering::Relaxed)
    }

    /// Waits until at most `limit` rows of complete samples wait for their files, or `stop` says why they never
    /// will (the capture failed), or `deadline` passed: then the files are stalled (a full or hung disk, a writer
    /// that stopped), and the wait gives up, saying so — the server goes on answering (those requests' clients
    /// time out on their locks) instead of freezing with no word.
    pub fn wait_for_room(
        &self,
        limit: usize,
        deadline: Duration,
        stop: impl Fn() -> Option<crate::CoreError>,
    ) -> CoreResult<Option<Stalled>> {
        let start = Instant::now();
        if self.lock().values().filter_map(|h| h.rows).sum::<usize>() <= limit {
            return Ok(None); // the common case: no wait, nothing let go of
        }
        crate::blocking::section(|| {
            let mut held = self.lock();
            loop {
                let waiting: usize = held.values().filter_map(|h| h.rows).sum();
                if waiting <= limit {
                    return Ok(None);
                }
                if let Some(e) = stop() {
                    return Err(e);
                }
                if start.elapsed() >= deadline {
                    let files = held.values().filter(|h| h.rows.is_some()).count();
                    return Ok(Some(Stalled { files, rows: waiting, limit, waited: start.elapsed() }));
                }
                held = self.freed.wait_timeout(held, Duration::from_millis(50)).map(|(g, _)| g).unwrap_or_else(|p| p.into_inner().0);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::TryLockError;

    #[test]
    fn ids_of_any_length_and_bytes_get_bounded_safe_distinct_names() {
        assert_eq!(file_name("cmpl-abc-0-1f2e3d4c"), "cmpl-abc-0-1f2e3d4c.safetensors", "vLLM's ids stay readable");
        let long = format!("cmpl-{}-0-1f2e3d4c", "x".repeat(300));
        let names = [
            file_name("x/1"),
            file_name("x_1"),
            file_name("x 1"),
            file_name(&long),
            file_name(&format!("{long}y")),
            file_name(".."),
            file_name(""),
            file_name("é/../../etc"),
            file_name(&"/".repeat(4000)),
        ];
        for n in &names {
            assert!(n.len() + ".lock".len() + ".partial-4294967295-18446744073709551615".len() < 255, "{n}: too long");
            let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~');
            assert!(n.chars().all(safe) && !n.starts_with('.'), "{n}: not a safe name");
        }
        let distinct: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "distinct ids share a name: {names:?}");
        assert_ne!(file_name("x_1~00"), file_name("x/1"), "a verbatim id never takes a digest name's form");
    }

    #[test]
    fn flock_is_checked_where_the_files_go() {
        let d = tempfile::tempdir().unwrap();
        check_flock(d.path()).unwrap();
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 0, "the probe leaves nothing behind");
        let e = check_flock(&d.path().join("missing")).unwrap_err();
        assert!(e.message.contains("must exist and be writable"), "{e}");
    }

    #[test]
    fn ids_that_differ_only_in_unsafe_characters_hold_their_own_locks() {
        // Before, `x/1` and `x_1` shared `x_1.safetensors.lock`: this process would wait on a flock it held itself.
        let d = tempfile::tempdir().unwrap();
        let locks = Locks::new(d.path(), SlowDisk::default());
        locks.hold("x/1", None).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let l = std::sync::Arc::new(locks);
        let l2 = std::sync::Arc::clone(&l);
        std::thread::spawn(move || tx.send(l2.hold("x_1", None).is_ok()).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true), "the second request waited on the first's lock");
        assert_eq!(l.held(), 2);
    }

    #[test]
    fn a_lock_is_held_until_released_and_its_file_left_for_the_client() {
        let d = tempfile::tempdir().unwrap();
        let locks = Locks::new(d.path(), SlowDisk::default());
        assert_eq!(file_name("cmpl-a1-0-b2"), "cmpl-a1-0-b2.safetensors");
        locks.hold("r-1", Some(3)).unwrap();
        let path = lock_path(&d.path().join(file_name("r-1")));
        let other = File::open(&path).unwrap();
        assert!(matches!(other.try_lock(), Err(TryLockError::WouldBlock)), "a client waits while the writer holds it");
        locks.release("r-1");
        other.try_lock().unwrap();
        assert!(path.exists(), "the client removes the lock file, not the writer");
        assert_eq!(locks.held(), 0);
        locks.hold("r-2", None).unwrap();
        locks.hold("r-2", Some(5)).unwrap(); // held already: not locked twice (which would wait for itself)
        assert_eq!((locks.waiting_rows(), locks.take_completed_rows(), locks.take_completed_rows()), (5, 8, 0));
        locks.abandon("r-2");
        assert!(!lock_path(&d.path().join(file_name("r-2"))).exists(), "an abandoned request's lock file is removed");
        locks.abandon("r-1"); // not held (released before): its file is the client's, left alone
        assert!(path.exists());
    }

    #[test]
    fn room_is_waited_for_among_complete_samples_only() {
        let d = tempfile::tempdir().unwrap();
        let locks = std::sync::Arc::new(Locks::new(d.path(), SlowDisk::default()));
        locks.hold("generating", None).unwrap(); // completes after many steps: never waited for
        locks.hold("a", Some(10)).unwrap();
        locks.hold("b", Some(10)).unwrap();
        locks.wait_for_room(20, STALL_DEADLINE, || None).unwrap();
        let l = std::sync::Arc::clone(&locks);
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            l.release("a");
        });
        let t = Instant::now();
        locks.wait_for_room(10, STALL_DEADLINE, || None).unwrap();
        assert!(t.elapsed() >= Duration::from_millis(90), "waited for a's file");
        writer.join().unwrap();
        let e = locks.wait_for_room(0, STALL_DEADLINE, || Some(crate::core_err!(Output, "the writer failed"))).unwrap_err();
        assert!(e.message.contains("the writer failed"), "a failed capture ends the wait: {e}");
    }

    #[test]
    fn a_slow_disk_holds_each_write_while_its_hold_file_exists() {
        let d = tempfile::tempdir().unwrap();
        let hold = d.path().join("hold");
        std::fs::write(&hold, b"").unwrap();
        let disk = SlowDisk { delay: Duration::from_millis(20), hold_while: Some(hold.clone()) };
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            disk.wait();
            tx.send(()).unwrap();
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err(), "held while the file exists");
        std::fs::remove_file(&hold).unwrap();
        rx.recv_timeout(Duration::from_secs(30)).expect("released once it is removed");
        waiter.join().unwrap();
    }
}

#[cfg(test)]
mod stall_tests {
    use super::*;

    #[test]
    fn a_backlog_that_does_not_drain_is_reported_after_the_deadline_not_waited_on_forever() {
        let d = tempfile::tempdir().unwrap();
        let locks = Locks::new(d.path(), SlowDisk::default());
        locks.hold("a", Some(10)).unwrap();
        assert_eq!(locks.wait_for_room(10, Duration::from_secs(5), || None).unwrap(), None, "within the backlog");
        let t = Instant::now();
        let stalled = locks.wait_for_room(4, Duration::from_millis(200), || None).unwrap().expect("stalled");
        assert!(t.elapsed() >= Duration::from_millis(200) && t.elapsed() < Duration::from_secs(5));
        assert_eq!((stalled.files, stalled.rows, stalled.limit), (1, 10, 4));
        assert!(stalled.to_string().contains("the disk is full, hung"), "{stalled}");
        let e = locks.wait_for_room(4, Duration::from_secs(60), || Some(core_err!(Output, "the writer failed")));
        assert!(e.is_err(), "a failed capture ends the wait at once");
    }
}
