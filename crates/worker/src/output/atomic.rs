//! Files that appear whole or not at all: written under a temporary name in the same directory,
//! optionally flushed to disk, then renamed into place.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::CoreResult;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// The temporary name used while `path` is being written: `.{name}.partial-{pid}-{n}`, hidden and
/// never matching a finished file's pattern.
pub fn partial_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.partial-{}-{n}", std::process::id()))
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> crate::error::CoreError {
    let hint = match e.raw_os_error() {
        Some(28) => "; the disk is full: free space or choose another output directory",
        Some(13) | Some(1) => "; permission denied: choose a directory you can write",
        Some(30) => "; the file system is read-only",
        _ => "",
    };
    crate::core_err!(Output, "{what} {}: {e}{hint}", path.display())
}

/// Writes `path` atomically: `fill` writes the content into a buffered temporary file; with `durable`
/// the file (and then its directory) is flushed to disk before and after the rename.
pub fn write_atomic(
    path: &Path,
    durable: bool,
    fill: impl FnOnce(&mut BufWriter<&File>) -> std::io::Result<()>,
) -> CoreResult<u64> {
    let tmp = partial_path(path);
    let result = (|| -> CoreResult<u64> {
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
        {
            let mut w = BufWriter::with_capacity(1 << 20, &file);
            fill(&mut w).map_err(|e| io_err("cannot write", &tmp, e))?;
            w.flush().map_err(|e| io_err("cannot write", &tmp, e))?;
        }
        if durable {
            file.sync_all().map_err(|e| io_err("cannot flush", &tmp, e))?;
        }
        let len = file.metadata().map_err(|e| io_err("cannot stat", &tmp, e))?.len();
        drop(file);
        fs::rename(&tmp, path).map_err(|e| io_err("cannot rename into place", path, e))?;
        if durable {
            if let Some(dir) = path.parent() {
                // Persist the rename; a directory that cannot be opened for sync is not an error.
                if let Ok(d) = File::open(dir) {
                    let _ = d.sync_all();
                }
            }
        }
        Ok(len)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
#[path = "tests/atomic.rs"]
mod tests;
