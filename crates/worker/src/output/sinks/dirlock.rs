//! `OUT/.hscapture.writer.lock`: held (an exclusive `flock`) by the process that writes a capture's files,
//! for as long as it may write. A driver that starts on the directory takes it briefly after its own lock,
//! so that no file of an earlier run's engine (a process outliving its driver) can appear after the
//! directory changed hands; two processes never write one capture at once.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::{bail, core_err, error::CoreResult};

pub const FILE: &str = ".hscapture.writer.lock";

/// The lock, released when dropped (and by the kernel when the process dies).
#[derive(Debug)]
pub struct WriterLock {
    _file: File,
}

impl WriterLock {
    /// Takes the writer lock of `root`; refused (naming the holder) when another process holds it.
    pub fn acquire(root: &Path) -> CoreResult<WriterLock> {
        let path = root.join(FILE);
        let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(|e| {
            core_err!(Output, "cannot open {}: {e}; choose an output directory you can write", path.display()).caused_by(&e)
        })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                bail!(
                    Output,
                    "another process (pid {}) is writing a capture into {}; expected one writer per output directory: \
                     wait for it to finish or choose another output directory",
                    holder.trim(),
                    root.display()
                );
            }
            Err(TryLockError::Error(e)) => bail!(Output, "cannot lock {}: {e}", path.display()),
        }
        let pid = std::process::id().to_string();
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(pid.as_bytes()))
            .map_err(|e| core_err!(Output, "cannot write {}: {e}", path.display()).caused_by(&e))?;
        Ok(WriterLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_writer_per_directory() {
        let d = tempfile::tempdir().unwrap();
        let held = WriterLock::acquire(d.path()).unwrap();
        let e = WriterLock::acquire(d.path()).unwrap_err();
        assert!(e.message.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(held);
        WriterLock::acquire(d.path()).unwrap();
    }
}
