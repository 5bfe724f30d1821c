//! Files that appear whole or not at all: written under a temporary name in the same directory,
//! optionally flushed to disk, then renamed into place (and the directory flushed). Every file's
//! checksum is computed on the way out, so its record vouches for exactly the bytes written.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::CoreResult;
use crate::output::ledger::record::checksum_text;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// What was written: the file's size and `xxh3:` checksum.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    pub bytes: u64,
    pub checksum: String,
}

/// The temporary name used while `path` is being written: `.{name}.partial-{pid}-{n}`, hidden and
/// never matching a finished file's pattern.
pub fn partial_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.partial-{}-{n}", std::process::id()))
}

/// Whether a file name is a temporary left by an interrupted [`write_atomic`].
pub fn is_partial(name: &str) -> bool {
    name.starts_with('.') && name.contains(".partial-")
}

pub fn io_err(what: &str, path: &Path, e: std::io::Error) -> crate::error::CoreError {
    use std::io::ErrorKind;
    let hint = match e.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded => "; the disk is full: free space or choose another output directory",
        ErrorKind::PermissionDenied => "; permission denied: choose a directory you can write",
        ErrorKind::ReadOnlyFilesystem => "; the file system is read-only",
        ErrorKind::NotADirectory => "; a part of the path is a file, not a directory",
        _ => "",
    };
    crate::core_err!(Output, "{what} {}: {e}{hint}", path.display()).caused_by(&e)
}

/// A writer that hashes what passes through it.
struct Hashing<W: Write> {
    inner: W,
    hash: xxhash_rust::xxh3::Xxh3,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Flushes a directory's entries (a rename in it) to disk.
pub fn sync_dir(dir: &Path) -> CoreResult<()> {
    let d = File::open(dir).map_err(|e| io_err("cannot open the directory", dir, e))?;
    d.sync_all().map_err(|e| io_err("cannot flush the directory", dir, e))
}

/// How far a written file is pushed towards the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Renamed into place whole; the kernel writes it back when it chooses.
    Rename,
    /// Renamed into place, then its data written back by the writing thread (`fdatasync`) before that thread takes
    /// the next file: whoever waits for the file is not held up, and the disk, not the kernel's single flusher,
    /// sets the writers' pace. Neither the directory nor a journal is synced, so a crash may lose it.
    Writeback,
    /// Flushed to disk before the rename and its directory after it: it survives a crash once in place.
    Fsync,
}

impl Durability {
    /// The setting's text for the middle level (`true`/`false` name the others).
    pub const WRITEBACK: &'static str = "writeback";

    pub fn from_flag(durable: bool) -> Durability {
        if durable {
            Durability::Fsync
        } else {
            Durability::Rename
        }
    }
}

/// Writes `path` atomically: `fill` writes the content; with `durable` the file is flushed to disk
/// before the rename and its directory after it (a failed directory flush is an error: the rename
/// might not survive a crash). Returns the size and checksum of what was written.
pub fn write_atomic(path: &Path, durable: bool, fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>) -> CoreResult<Written> {
    write_placed(path, Durability::from_flag(durable), fill).map(|(w, _)| w)
}

/// As [`write_atomic`] at any [`Durability`]; with [`Durability::Writeback`] the file, in place, is handed back
/// so that the caller syncs it once it has told whoever waits for it (see [`writeback`]).
pub fn write_placed(
    path: &Path,
    durability: Durability,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> CoreResult<(Written, Option<File>)> {
    let tmp = partial_path(path);
    let fsync = durability == Durability::Fsync;
    let result = (|| -> CoreResult<(Written, File)> {
        let file = OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(|e| io_err("cannot create", &tmp, e))?;
        let written = {
            let mut w = Hashing { inner: BufWriter::with_capacity(1 << 20, &file), hash: xxhash_rust::xxh3::Xxh3::new(), bytes: 0 };
            fill(&mut w).map_err(|e| io_err("cannot write", &tmp, e))?;
            w.flush().map_err(|e| io_err("cannot write", &tmp, e))?;
            Written { bytes: w.bytes, checksum: checksum_text(w.hash.digest()) }
        };
        if fsync {
            file.sync_all().map_err(|e| io_err("cannot flush", &tmp, e))?;
        }
        fs::rename(&tmp, path).map_err(|e| io_err("cannot rename into place", path, e))?;
        Ok((written, file))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    let (written, file) = result?;
    if fsync {
        if let Some(dir) = path.parent() {
            sync_dir(if dir.as_os_str().is_empty() { Path::new(".") } else { dir })?;
        }
    }
    Ok((written, (durability == Durability::Writeback).then_some(file)))
}

/// Writes back the data of a file [`write_placed`] handed over (wherever it has been moved to since).
pub fn writeback(file: File, path: &Path) -> CoreResult<()> {
    file.sync_data().map_err(|e| io_err("cannot write back", path, e))
}

#[cfg(test)]
#[path = "tests/atomic.rs"]
mod tests;
