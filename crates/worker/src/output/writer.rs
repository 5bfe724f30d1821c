//! The writer: a pool of threads that turn assembled samples into files.
//!
//! Samples go through a bounded queue: when the disk is slower than capture, `submit` blocks
//! (backpressure) instead of letting memory grow. A failed write is kept and reported by the next
//! `submit`, `poll` or `finish`; a panicking thread is reported, never silently lost.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Sender, TrySendError};
use serde::{Deserialize, Serialize};

use crate::attribution::plan::SampleKey;
use crate::output::pool::BufferPool;
use crate::output::safetensors::write_sample_file_with;
use crate::output::sample::{content_checksum, Sample};
use crate::{core_err, error::CoreError, error::CoreResult};

/// Where and how samples are written.
#[derive(Clone, Debug)]
pub struct WriterConfig {
    /// The output root; files go to `root/hidden_states/`.
    pub root: PathBuf,
    pub threads: usize,
    /// Samples waiting to be written before `submit` blocks.
    pub queue: usize,
    /// fsync each file (and its directory) before it is declared done.
    pub durable: bool,
    /// Metadata stored in every file's safetensors header.
    pub metadata: HashMap<String, String>,
    /// Where written samples' buffers go back for reuse.
    pub pool: Option<Arc<BufferPool>>,
    /// zstd level for byte-plane compression of the states (`compress.rs`); None stores them as is.
    pub compress: Option<i32>,
}

/// The journal beside `hidden_states/`: one JSON line per finished sample, appended (and, when durable,
/// synced) only after the sample's file is in place: the manifest of runs that never end (online serving).
pub const JOURNAL: &str = "records.jsonl";

/// The journal file, opened on the first line and kept open; its own lock keeps each line whole and
/// keeps its syncs from holding up the writer threads' shared state.
struct Journal {
    path: PathBuf,
    file: Mutex<Option<std::fs::File>>,
}

impl Journal {
    fn append(&self, rec: &SampleRecord, durable: bool) -> CoreResult<()> {
        use std::io::Write;
        let path = &self.path;
        let line = serde_json::to_string(rec).map_err(|e| core_err!(Output, "cannot encode the record of {}: {e}", rec.file))?;
        let mut g = self.file.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            let f = std::fs::OpenOptions::new().create(true).append(true).open(path).map_err(|e| {
                core_err!(Output, "cannot open {}: {e}; choose an output directory you can write", path.display())
            })?;
            *g = Some(f);
        }
        let Some(f) = g.as_mut() else {
            return Err(core_err!(Output, "cannot open {}", path.display()));
        };
        f.write_all(format!("{line}\n").as_bytes())
            .and_then(|_| if durable { f.sync_data() } else { Ok(()) })
            .map_err(|e| core_err!(Output, "cannot append to {}: {e} (disk full?)", path.display()))
    }
}

/// One written sample, as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleRecord {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub index: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub request_id: Option<String>,
    /// Path relative to the output root.
    pub file: String,
    pub length: usize,
    pub checksum: String,
    pub bytes: u64,
}

#[derive(Default)]
struct Shared {
    records: Vec<SampleRecord>,
    errors: Vec<CoreError>,
    /// Samples written or failed so far.
    done: u64,
}

#[derive(Default)]
struct State {
    shared: Mutex<Shared>,
    progress: Condvar,
    /// Samples accepted by the queue so far (from the writer and its submitters).
    submitted: AtomicU64,
}

pub struct Writer {
    tx: Option<Sender<Sample>>,
    handles: Vec<JoinHandle<()>>,
    state: Arc<State>,
    dir: PathBuf,
}

/// Queues samples for a writer from another thread (the assembler's). The writer's threads stop only
/// once every submitter is dropped: drop it before [`Writer::finish`].
#[derive(Clone)]
pub struct Submitter {
    tx: Sender<Sample>,
    state: Arc<State>,
}

fn first_error(state: &State) -> CoreResult<()> {
    match lock(&state.shared).errors.first() {
        Some(e) => Err(e.clone()),
        None => Ok(()),
    }
}

impl Submitter {
    /// Queues a sample if the queue has room; gives it back when the queue is full.
    pub fn try_submit(&self, sample: Sample) -> CoreResult<Option<Sample>> {
        first_error(&self.state)?;
        self.state.submitted.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(sample) {
            Ok(()) => Ok(None),
            Err(e) => {
                self.state.submitted.fetch_sub(1, Ordering::SeqCst);
                match e {
                    TrySendError::Full(s) => Ok(Some(s)),
                    TrySendError::Disconnected(_) => Err(core_err!(Output, "the writer has stopped; no more samples can be written")),
                }
            }
        }
    }

    /// Queues a sample; blocks while the queue is full (backpressure). Reports an earlier failed write.
    pub fn submit(&self, sample: Sample) -> CoreResult<()> {
        first_error(&self.state)?;
        // Counted before the send, so that `drain` never sees a written sample it was not told of.
        self.state.submitted.fetch_add(1, Ordering::SeqCst);
        self.tx.send(sample).map_err(|_| {
            self.state.submitted.fetch_sub(1, Ordering::SeqCst);
            core_err!(Output, "the writer has stopped; no more samples can be written")
        })
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    // A poisoned lock only means a writer thread panicked while holding it; the data is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn write_one(dir: &std::path::Path, sample: &Sample, cfg_meta: &HashMap<String, String>, durable: bool, compress: Option<i32>) -> CoreResult<SampleRecord> {
    let name = format!("{}.safetensors", sample.file_stem());
    let bytes = write_sample_file_with(&dir.join(&name), sample, cfg_meta, durable, compress)?;
    let (index, request_id) = match &sample.key {
        SampleKey::Index(i) => (Some(*i), None),
        SampleKey::Request(_) => (None, Some(sample.req_id.clone())),
    };
    Ok(SampleRecord {
        index,
        request_id,
        file: format!("hidden_states/{name}"),
        length: sample.rows,
        checksum: content_checksum(&sample.data),
        bytes,
    })
}

impl Writer {
    pub fn start(cfg: WriterConfig) -> CoreResult<Writer> {
        let dir = cfg.root.join("hidden_states");
        std::fs::create_dir_all(&dir).map_err(|e| {
            core_err!(Output, "cannot create the output directory {}: {e}; choose a directory you can write", dir.display())
        })?;
        let (tx, rx) = bounded::<Sample>(cfg.queue.max(1));
        let state = Arc::new(State::default());
        let journal = Arc::new(Journal { path: cfg.root.join(JOURNAL), file: Mutex::new(None) });
        let mut handles = Vec::new();
        for t in 0..cfg.threads.max(1) {
            let (rx, state, dir, meta, pool) = (rx.clone(), Arc::clone(&state), dir.clone(), cfg.metadata.clone(), cfg.pool.clone());
            let journal = Arc::clone(&journal);
            let (durable, compress) = (cfg.durable, cfg.compress);
            let h = std::thread::Builder::new()
                .name(format!("hscapture-writer-{t}"))
                .spawn(move || {
                    for sample in rx.iter() {
                        let r = catch_unwind(AssertUnwindSafe(|| write_one(&dir, &sample, &meta, durable, compress)))
                            .unwrap_or_else(|_| Err(core_err!(Output, "the writer thread panicked while writing {}", sample.key)));
                        if let Some(p) = &pool {
                            p.put(sample.data);
                        }
                        let r = r.and_then(|rec| journal.append(&rec, durable).map(|()| rec));
                        let mut g = lock(&state.shared);
                        match r {
                            Ok(rec) => g.records.push(rec),
                            Err(e) => g.errors.push(e),
                        }
                        g.done += 1;
                        state.progress.notify_all();
                    }
                })
                .map_err(|e| core_err!(Output, "cannot start a writer thread: {e}"))?;
            handles.push(h);
        }
        Ok(Writer { tx: Some(tx), handles, state, dir })
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Reports the first failed write, if any.
    pub fn poll(&self) -> CoreResult<()> {
        first_error(&self.state)
    }

    /// A handle that queues samples from another thread; None once the writer is finished.
    pub fn submitter(&self) -> Option<Submitter> {
        self.tx.as_ref().map(|tx| Submitter { tx: tx.clone(), state: Arc::clone(&self.state) })
    }

    /// Queues a sample; blocks while the queue is full.
    pub fn submit(&mut self, sample: Sample) -> CoreResult<()> {
        self.poll()?;
        match self.submitter() {
            Some(s) => s.submit(sample),
            None => Err(core_err!(Output, "the writer was finished; no more samples can be written")),
        }
    }

    /// Waits until every sample submitted so far is written (the writer keeps running).
    pub fn drain(&self) -> CoreResult<()> {
        let mut g = lock(&self.state.shared);
        while g.done < self.state.submitted.load(Ordering::SeqCst) {
            g = self.state.progress.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        drop(g);
        self.poll()
    }

    /// Records written so far (removed from the writer).
    pub fn take_records(&self) -> Vec<SampleRecord> {
        std::mem::take(&mut lock(&self.state.shared).records)
    }

    /// Waits for every queued sample, stops the threads and returns the records not yet taken.
    pub fn finish(&mut self) -> CoreResult<Vec<SampleRecord>> {
        self.tx = None;
        for h in self.handles.drain(..) {
            if h.join().is_err() {
                lock(&self.state.shared).errors.push(core_err!(Output, "a writer thread panicked"));
            }
        }
        self.poll()?;
        Ok(self.take_records())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

#[cfg(test)]
#[path = "tests/writer.rs"]
mod tests;
