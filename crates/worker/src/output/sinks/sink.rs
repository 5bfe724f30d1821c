//! Where finished samples go. A [`Sink`] takes one sample at a time (from any writer thread) and
//! answers with its record once the sample is safely there; [`FileSink`] writes files in a
//! [`Format`] under an output root, atomically, and journals each one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::output::atomic::{write_placed, writeback, Durability};
use crate::output::formats::Format;
use crate::output::ledger::journal::Journal;
use crate::output::ledger::record::{Identity, SampleRecord};
use crate::output::sinks::dirlock::WriterLock;
use crate::output::sinks::staging::{self, Locks};
use crate::sample::Sample;
use crate::sample::SampleKey;
use crate::{core_err, ensure, error::CoreError, error::CoreResult};

pub trait Sink: Send + Sync {
    /// Stores `sample`; returns its record once it is safely stored.
    fn put(&self, sample: &Sample) -> Result<SampleRecord, NotStored>;
}

/// Why a sample was not stored, and whom that fails: the sink decides, since it knows whether the sample's client
/// learns of it by itself.
#[derive(Debug)]
pub enum NotStored {
    /// Its request alone: the client learns of it (a per-request file is absent once its lock goes; the store holds
    /// the object's error marker), and the sink takes the next sample (`failed.rs`).
    Request(CoreError),
    /// The capture: a gap nobody would learn of otherwise (a capture directory's, or a store that takes no error
    /// marker either).
    Capture(CoreError),
}

impl NotStored {
    pub fn error(&self) -> &CoreError {
        match self {
            NotStored::Request(e) | NotStored::Capture(e) => e,
        }
    }
}

impl From<CoreError> for NotStored {
    fn from(e: CoreError) -> NotStored {
        NotStored::Capture(e)
    }
}

/// How a sink lays files out under its root.
pub enum Layout {
    /// A capture directory: the format's files and folder, the journal, one writing process.
    Capture,
    /// Per-request files that a client collects (`staging.rs`): `<request id>.safetensors`, each with its lock
    /// held until the file is in place; no journal (the client moves the files away), a shared directory.
    Staging(Arc<Locks>),
}

/// Files in `format` under `root`, each written atomically (durably when asked), then journaled.
pub struct FileSink {
    /// Held for as long as this sink may write (first: released last); none for a staging directory.
    _lock: Option<WriterLock>,
    root: PathBuf,
    format: Box<dyn Format>,
    identity: Identity,
    durability: Durability,
    journal: Option<Journal>,
    locks: Option<Arc<Locks>>,
}

impl FileSink {
    /// Creates the format's folder under `root`, takes the directory's writer lock and opens the journal
    /// (refused when another process writes there, or when the journal belongs to another identity).
    pub fn open(root: &Path, format: Box<dyn Format>, identity: Identity, durability: Durability) -> CoreResult<FileSink> {
        FileSink::with_layout(root, format, identity, durability, Layout::Capture)
    }

    /// As [`FileSink::open`], in `layout`.
    pub fn with_layout(
        root: &Path,
        format: Box<dyn Format>,
        identity: Identity,
        durability: Durability,
        layout: Layout,
    ) -> CoreResult<FileSink> {
        let staging = matches!(layout, Layout::Staging(_));
        let dir = if staging { root.to_path_buf() } else { root.join(format.folder()) };
        std::fs::create_dir_all(&dir).map_err(|e| {
            core_err!(Output, "cannot create the output directory {}: {e}; choose a directory you can write", dir.display()).caused_by(&e)
        })?;
        let (lock, journal, locks) = match layout {
            Layout::Capture => {
                (Some(WriterLock::acquire(root)?), Some(Journal::open(root, &identity, durability == Durability::Fsync)?), None)
            }
            Layout::Staging(locks) => {
                ensure!(
                    format.per_request_files(),
                    Config,
                    "per-request files are safetensors files; the {} format cannot be served that way",
                    format.name()
                );
                (None, None, Some(locks))
            }
        };
        Ok(FileSink { _lock: lock, root: root.to_path_buf(), format, identity, durability, journal, locks })
    }
}

impl Sink for FileSink {
    fn put(&self, sample: &Sample) -> Result<SampleRecord, NotStored> {
        match &self.locks {
            // A per-request file that cannot be written fails its request alone: its client finds no file once the
            // lock goes (or no lock and no file), and the next request's file may fit.
            Some(locks) => self.put_file(sample, Some(locks)).map_err(NotStored::Request),
            None => Ok(self.put_file(sample, None)?),
        }
    }
}

impl FileSink {
    fn put_file(&self, sample: &Sample, locks: Option<&Arc<Locks>>) -> CoreResult<SampleRecord> {
        let file = match locks {
            Some(locks) => {
                if let Some(e) = locks.take_unheld(&sample.req_id) {
                    let why = format!("its lock could not be taken, so its file is not written and its client finds none: {}", e.message);
                    return Err(CoreError { message: why, ..e });
                }
                locks.slow_disk.wait();
                staging::file_name(&sample.req_id)
            }
            None => self.format.file(&sample.key),
        };
        let path = self.root.join(&file);
        let placed = self
            .format
            .encode(sample, &self.identity)
            .and_then(|parts| write_placed(&path, self.durability, |w| parts.iter().try_for_each(|p| w.write_all(p))));
        if let Some(locks) = locks {
            locks.release(&sample.req_id); // the file is in place, or never will be (its client finds none)
        }
        let (written, placed_file) = placed?;
        if let Some(f) = placed_file {
            writeback(f, &path)?; // after the release: the client moves the file meanwhile, the data follows it
        }
        let (index, request_id) = match &sample.key {
            SampleKey::Index(i) => (Some(*i), None),
            SampleKey::Request(_) => (None, Some(sample.req_id.clone())),
        };
        let rec = SampleRecord { index, request_id, file, length: sample.rows, checksum: written.checksum, bytes: written.bytes };
        if let Some(j) = &self.journal {
            j.append(&rec)?;
        }
        Ok(rec)
    }
}
