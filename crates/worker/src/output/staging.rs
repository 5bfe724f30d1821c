//! Per-request files for a client that collects them (the KV-connector face, `connector.py`): request `r`'s
//! sample is written to `DIR/<r>.safetensors`, the path the server's response names, and `DIR/<r>.safetensors.lock`
//! is held (an exclusive `flock`) by the writing process from the step in which the request's prompt completed —
//! before any response for it can exist — until the file is renamed into place. A client that finds the lock waits
//! for it (speculators' `generate-offline-data` does) and then owns both files; the lock file is never removed
//! here, since the client removes it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::{core_err, error::CoreResult};

/// The file name of request `req_id`'s sample: the id with anything but `[A-Za-z0-9._-]` replaced by `_`.
pub fn file_name(req_id: &str) -> String {
    let safe: String = req_id.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' }).collect();
    format!("{safe}.safetensors")
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

/// The locks this process holds, by request id.
#[derive(Debug)]
pub struct Locks {
    root: PathBuf,
    held: Mutex<HashMap<String, File>>,
    pub slow_disk: SlowDisk,
}

impl Locks {
    pub fn new(root: &Path, slow_disk: SlowDisk) -> Locks {
        Locks { root: root.to_path_buf(), held: Mutex::new(HashMap::new()), slow_disk }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, File>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates and locks request `req_id`'s lock file (before its response can exist).
    pub fn hold(&self, req_id: &str) -> CoreResult<()> {
        if self.lock().contains_key(req_id) {
            return Ok(()); // held already (a request that captures its generated tokens is held from its start)
        }
        let path = lock_path(&self.root.join(file_name(req_id)));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| core_err!(Output, "cannot create {}: {e}; the staging directory must be writable", path.display()))?;
        file.lock().map_err(|e| core_err!(Output, "cannot lock {}: {e}", path.display()))?;
        self.lock().insert(req_id.to_string(), file);
        Ok(())
    }

    /// Releases request `req_id`'s lock: its file is in place (or will never be).
    pub fn release(&self, req_id: &str) {
        self.lock().remove(req_id);
    }

    /// Releases request `req_id`'s lock and removes its lock file, if this process holds it: the request ended
    /// without a sample (aborted), so no response names the file and no client will come for either.
    pub fn abandon(&self, req_id: &str) {
        if self.lock().remove(req_id).is_some() {
            let _ = std::fs::remove_file(lock_path(&self.root.join(file_name(req_id))));
        }
    }

    pub fn held(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::TryLockError;

    #[test]
    fn a_lock_is_held_until_released_and_its_file_left_for_the_client() {
        let d = tempfile::tempdir().unwrap();
        let locks = Locks::new(d.path(), SlowDisk::default());
        assert_eq!(file_name("cmpl-a1/b 2"), "cmpl-a1_b_2.safetensors");
        locks.hold("r-1").unwrap();
        let path = lock_path(&d.path().join(file_name("r-1")));
        let other = File::open(&path).unwrap();
        assert!(matches!(other.try_lock(), Err(TryLockError::WouldBlock)), "a client waits while the writer holds it");
        locks.release("r-1");
        other.try_lock().unwrap();
        assert!(path.exists(), "the client removes the lock file, not the writer");
        assert_eq!(locks.held(), 0);
        locks.hold("r-2").unwrap();
        locks.hold("r-2").unwrap(); // held already: not locked twice (which would wait for itself)
        locks.abandon("r-2");
        assert!(!lock_path(&d.path().join(file_name("r-2"))).exists(), "an abandoned request's lock file is removed");
        locks.abandon("r-1"); // not held (released before): its file is the client's, left alone
        assert!(path.exists());
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
