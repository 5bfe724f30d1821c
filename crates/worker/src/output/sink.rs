//! Where finished samples go. A [`Sink`] takes one sample at a time (from any writer thread) and
//! answers with its record once the sample is safely there; [`FileSink`] writes files in a
//! [`Format`] under an output root, atomically, and journals each one.

use std::path::{Path, PathBuf};

use crate::attribution::plan::SampleKey;
use crate::output::atomic::write_atomic;
use crate::output::dirlock::WriterLock;
use crate::output::format::Format;
use crate::output::journal::Journal;
use crate::output::record::{Identity, SampleRecord};
use crate::output::sample::Sample;
use crate::{core_err, error::CoreResult};

pub trait Sink: Send + Sync {
    /// Stores `sample`; returns its record once it is safely stored.
    fn put(&self, sample: &Sample) -> CoreResult<SampleRecord>;
}

/// Files in `format` under `root`, each written atomically (durably when asked), then journaled.
pub struct FileSink {
    /// Held for as long as this sink may write (first: released last).
    _lock: WriterLock,
    root: PathBuf,
    format: Box<dyn Format>,
    identity: Identity,
    durable: bool,
    journal: Journal,
}

impl FileSink {
    /// Creates the format's folder under `root`, takes the directory's writer lock and opens the journal
    /// (refused when another process writes there, or when the journal belongs to another identity).
    pub fn open(root: &Path, format: Box<dyn Format>, identity: Identity, durable: bool) -> CoreResult<FileSink> {
        let dir = root.join(format.folder());
        std::fs::create_dir_all(&dir).map_err(|e| {
            core_err!(Output, "cannot create the output directory {}: {e}; choose a directory you can write", dir.display())
        })?;
        let lock = WriterLock::acquire(root)?;
        let journal = Journal::open(root, &identity, durable)?;
        Ok(FileSink { _lock: lock, root: root.to_path_buf(), format, identity, durable, journal })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }
}

impl Sink for FileSink {
    fn put(&self, sample: &Sample) -> CoreResult<SampleRecord> {
        let file = self.format.file(&sample.key);
        let parts = self.format.encode(sample, &self.identity)?;
        let written = write_atomic(&self.root.join(&file), self.durable, |w| parts.iter().try_for_each(|p| w.write_all(p)))?;
        let (index, request_id) = match &sample.key {
            SampleKey::Index(i) => (Some(*i), None),
            SampleKey::Request(_) => (None, Some(sample.req_id.clone())),
        };
        let rec = SampleRecord { index, request_id, file, length: sample.rows, checksum: written.checksum, bytes: written.bytes };
        self.journal.append(&rec)?;
        Ok(rec)
    }
}
