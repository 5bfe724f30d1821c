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
    /// Requests whose lock could not be taken, and why: their samples are never written (`hold_or_fail`).
    unheld: Mutex<HashMap<String, crate::CoreError>>,
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
            unheld: Mutex::new(HashMap::new()),
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
        // Rows count once their lock is held: a sample whose lock failed waits for no file.
        let fresh = |rows: Option<usize>| rows.map(|r| self.fresh_rows.fetch_add(r, Ordering::Relaxed));
        if let Some(h) = self.lock().get_mut(req_id) {
            h.rows = h.rows.or(rows); // held already: not locked twice (which would wait for itself)
            fresh(rows);
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
        fresh(rows);
        Ok(())
    }

    fn unheld(&self) -> std::sync::MutexGuard<'_, HashMap<String, crate::CoreError>> {
        self.unheld.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// [`Locks::hold`] for a server, where a lock that cannot be taken (a full disk, the directory removed) fails
    /// only its request: its sample is never written ([`Locks::take_unheld`]), so its client, finding neither lock
    /// nor file, meets an error rather than a file no lock guarded. It stays failed: a request that captures its
    /// generated tokens is held again when it completes, after its response, whose client may have found nothing
    /// already; a file written then would be nobody's.
    pub fn hold_or_fail(&self, req_id: &str, rows: Option<usize>) {
        if self.unheld().contains_key(req_id) {
            return;
        }
        if let Err(e) = self.hold(req_id, rows) {
            self.unheld().insert(req_id.to_string(), e);
        }
    }

    /// Why request `req_id`'s lock could not be taken, if it could not; forgotten here (its sample is the last to
    /// ask).
    pub fn take_unheld(&self, req_id: &str) -> Option<crate::CoreError> {
        self.unheld().remove(req_id)
    }

    /// Releases request `req_id`'s lock: its file is in place (or will never be).
    pub fn release(&self, req_id: &str) {
        self.lock().remove(req_id);
        self.freed.notify_all();
    }

    /// Releases request `req_id`'s lock and removes its lock file, if this process holds it: the request ended
    /// without a sample (aborted), so no response names the file and no client will come for either.
    pub fn abandon(&self, req_id: &str) {
        self.unheld().remove(req_id);
        if self.lock().remove(req_id).is_some() {
            let _ = std::fs::remove_file(lock_path(&self.root.join(file_name(req_id))));
        }
        self.freed.notify_all();
    }

    /// Gives up every lock this process holds and removes their lock files: the capture failed, so none of their
    /// files will be written; a client waiting for one finds no file (an error), never a lock held for ever.
    pub fn abandon_all(&self) {
        self.unheld().clear();
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
#[path = "tests/staging.rs"]
mod tests;
