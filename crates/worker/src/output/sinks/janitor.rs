//! The staging directory cleans itself: a server's files that no client collected, lock files left behind, the
//! hidden partial files of a server that died, and worker error records of an earlier run would otherwise pile up
//! until the disk is full. A sweep removes what is older than the collection time and held by nobody — a file whose
//! lock any process holds (this one, or another server sharing the directory) is never touched.

use std::fs::{File, TryLockError};
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::output::atomic::is_partial;

/// How long a client has to collect its file (speculators' client gives up on a lock after 10 s).
pub const COLLECT_WITHIN: Duration = Duration::from_secs(600);
/// Sweeps at most this often (a sweep lists the directory).
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// Where workers leave their errors for the driver (`failures.py`).
pub const ERRORS_DIR: &str = ".hscapture-errors";

/// What a sweep removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub files: usize,
    pub locks: usize,
    pub partials: usize,
    pub error_records: usize,
}

impl Swept {
    pub fn is_empty(&self) -> bool {
        *self == Swept::default()
    }
}

impl std::fmt::Display for Swept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "removed {} files no client collected, {} stale lock files, {} partial files of a stopped writer and {} \
             error records of an earlier run",
            self.files, self.locks, self.partials, self.error_records
        )
    }
}

fn older_than(meta: &std::fs::Metadata, age: Duration, now: SystemTime) -> bool {
    meta.modified().ok().and_then(|m| now.duration_since(m).ok()).is_some_and(|d| d >= age)
}

/// Whether some process holds `lock` (this one included: flock excludes between open files).
fn held(lock: &Path) -> bool {
    match File::open(lock) {
        Ok(f) => matches!(f.try_lock(), Err(TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

/// Removes from `root` what is older than `age` and held by nobody: sample files and their lock files, lock files
/// alone, partial files; and error records older than `started` (an earlier run's). Errors listing or removing one
/// entry skip it (a sweep never fails the capture).
pub fn sweep(root: &Path, age: Duration, started: SystemTime) -> Swept {
    let now = SystemTime::now();
    let mut out = Swept::default();
    let Ok(entries) = std::fs::read_dir(root) else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let (path, Ok(meta)) = (e.path(), e.metadata()) else { continue };
        if !meta.is_file() || !older_than(&meta, age, now) {
            continue;
        }
        if is_partial(&name) {
            if std::fs::remove_file(&path).is_ok() {
                out.partials += 1;
            }
        } else if let Some(stem) = name.strip_suffix(".safetensors.lock") {
            let data = root.join(format!("{stem}.safetensors"));
            if !data.exists() && !held(&path) && std::fs::remove_file(&path).is_ok() {
                out.locks += 1;
            }
        } else if name.ends_with(".safetensors") {
            let lock = root.join(format!("{name}.lock"));
            if !held(&lock) && std::fs::remove_file(&path).is_ok() {
                out.files += 1;
                if std::fs::remove_file(&lock).is_ok() {
                    out.locks += 1;
                }
            }
        }
    }
    if let Ok(records) = std::fs::read_dir(root.join(ERRORS_DIR)) {
        for e in records.flatten() {
            let stale = e.metadata().ok().and_then(|m| m.modified().ok()).is_some_and(|m| m < started);
            if stale && std::fs::remove_file(e.path()).is_ok() {
                out.error_records += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn age(path: &Path, secs: u64) {
        let t = SystemTime::now() - Duration::from_secs(secs);
        fs::File::options().write(true).open(path).unwrap().set_modified(t).unwrap();
    }

    #[test]
    fn what_nobody_collected_or_holds_goes_the_rest_stays() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n);
        for n in ["old.safetensors", "old.safetensors.lock", "new.safetensors", "orphan.safetensors.lock", ".x.safetensors.partial-9-1"] {
            fs::write(p(n), b"x").unwrap();
        }
        for n in ["held.safetensors", "held.safetensors.lock"] {
            fs::write(p(n), b"x").unwrap();
        }
        fs::create_dir(p(ERRORS_DIR)).unwrap();
        fs::write(p(ERRORS_DIR).join("rank0.json"), b"{}").unwrap();
        for n in ["old.safetensors", "old.safetensors.lock", "orphan.safetensors.lock", ".x.safetensors.partial-9-1", "held.safetensors"] {
            age(&p(n), 3600);
        }
        age(&p(ERRORS_DIR).join("rank0.json"), 3600);
        let lock = fs::File::open(p("held.safetensors.lock")).unwrap();
        lock.lock().unwrap(); // a writer (here, or another server) is on it
        let swept = sweep(d.path(), COLLECT_WITHIN, SystemTime::now() - Duration::from_secs(60));
        assert_eq!(swept, Swept { files: 1, locks: 2, partials: 1, error_records: 1 }, "{swept}");
        let left: std::collections::BTreeSet<String> =
            fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        let want: std::collections::BTreeSet<String> =
            ["new.safetensors", "held.safetensors", "held.safetensors.lock", ERRORS_DIR].iter().map(|s| s.to_string()).collect();
        assert_eq!(left, want);
        assert!(swept.to_string().starts_with("removed 1 files no client collected"), "{swept}");
        drop(lock);
    }
}
