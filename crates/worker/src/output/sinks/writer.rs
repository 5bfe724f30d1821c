//! The writer: a pool of threads that hand assembled samples to a [`Sink`].
//!
//! Samples go through a bounded queue: when the sink is slower than capture, `submit` blocks
//! (backpressure) instead of letting memory grow. A failed write goes to the capture's [`Failure`]
//! and is reported by the next `submit`, `poll` or `finish`; the samples already queued are still
//! written (they are whole and correct); a panicking thread is reported, never silently lost. A sample the sink
//! could not store for its request alone ([`NotStored::Request`]: a server's, whose client learns of it by itself)
//! is counted in [`FailedRequests`] instead, and the writer goes on; a panic still fails the capture (it is
//! hscapture's bug, not the request's).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Sender, TrySendError};

use crate::failure::Failure;
use crate::output::ledger::record::SampleRecord;
use crate::output::sinks::failed::FailedRequests;
use crate::output::sinks::sink::{NotStored, Sink};
use crate::sample::pool::BufferPool;
use crate::sample::Sample;
use crate::{core_err, error::CoreResult};

/// What failed, in the capture's [`Failure`].
const ORIGIN: &str = "the writer failed earlier";

/// How samples are written.
#[derive(Clone, Debug)]
pub struct WriterConfig {
    pub threads: usize,
    /// Samples waiting to be written before `submit` blocks.
    pub queue: usize,
    /// Where written samples' buffers go back for reuse.
    pub pool: Option<Arc<BufferPool>>,
    /// Keep each written sample's record for `take_records` (a capture directory's ledger).
    pub keep_records: bool,
}

/// Records kept for a driver that never takes them (a long-lived `vllm serve` with a capture directory: its journal on
/// disk has every record) are bounded: past this many, the oldest half goes.
pub const UNTAKEN_RECORDS: usize = 1 << 16;

#[derive(Default)]
struct Shared {
    records: Vec<SampleRecord>,
    /// Records dropped because nobody took them (`UNTAKEN_RECORDS`), not yet reported.
    dropped: usize,
    /// Samples written or failed so far.
    done: u64,
    /// Samples that failed their requests alone.
    failed: FailedRequests,
}

struct State {
    shared: Mutex<Shared>,
    progress: Condvar,
    /// Samples accepted by the queue so far (from the writer and its submitters).
    submitted: AtomicU64,
    failure: Failure,
}

pub struct Writer {
    tx: Option<Sender<Sample>>,
    handles: Vec<JoinHandle<()>>,
    state: Arc<State>,
}

/// Queues samples for a writer from another thread (the assembler's). The writer's threads stop only
/// once every submitter is dropped: drop it before [`Writer::finish`].
#[derive(Clone)]
pub struct Submitter {
    tx: Sender<Sample>,
    state: Arc<State>,
}

fn check(state: &State) -> CoreResult<()> {
    match state.failure.first() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn stopped() -> crate::CoreError {
    core_err!(Output, "the writer has stopped; no more samples can be written")
}

impl Submitter {
    /// Queues a sample if the queue has room; gives it back when the queue is full.
    pub fn try_submit(&self, sample: Sample) -> CoreResult<Option<Sample>> {
        check(&self.state)?;
        self.state.submitted.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(sample) {
            Ok(()) => Ok(None),
            Err(e) => {
                self.state.submitted.fetch_sub(1, Ordering::SeqCst);
                match e {
                    TrySendError::Full(s) => Ok(Some(s)),
                    TrySendError::Disconnected(_) => Err(stopped()),
                }
            }
        }
    }

    /// Queues a sample; blocks while the queue is full (backpressure). Reports an earlier failure.
    pub fn submit(&self, sample: Sample) -> CoreResult<()> {
        check(&self.state)?;
        // Counted before the send, so that `drain` never sees a written sample it was not told of.
        self.state.submitted.fetch_add(1, Ordering::SeqCst);
        let sent = match self.tx.try_send(sample) {
            Ok(()) => Ok(()),
            // Only a full queue is waited for (a section: see `crate::blocking`).
            Err(TrySendError::Full(s)) => crate::blocking::section(|| self.tx.send(s).map_err(drop)),
            Err(TrySendError::Disconnected(_)) => Err(()),
        };
        sent.map_err(|()| {
            self.state.submitted.fetch_sub(1, Ordering::SeqCst);
            stopped()
        })
    }
}

fn lock(m: &Mutex<Shared>) -> std::sync::MutexGuard<'_, Shared> {
    // A poisoned lock only means a writer thread panicked while holding it; the data is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Writer {
    /// Starts `cfg.threads` threads writing into `sink`; their failures go to `failure`.
    pub fn start(sink: Arc<dyn Sink>, cfg: WriterConfig, failure: Failure) -> CoreResult<Writer> {
        let (tx, rx) = bounded::<Sample>(cfg.queue.max(1));
        let state = Arc::new(State { shared: Mutex::default(), progress: Condvar::new(), submitted: AtomicU64::new(0), failure });
        let mut handles = Vec::new();
        for t in 0..cfg.threads.max(1) {
            let (rx, state, sink, pool) = (rx.clone(), Arc::clone(&state), Arc::clone(&sink), cfg.pool.clone());
            let keep = cfg.keep_records;
            let h = std::thread::Builder::new()
                .name(format!("hscapture-writer-{t}"))
                .spawn(move || {
                    for sample in rx.iter() {
                        let r = catch_unwind(AssertUnwindSafe(|| sink.put(&sample)));
                        if let Some(p) = &pool {
                            p.put(sample.data);
                        }
                        let mut g = lock(&state.shared);
                        let r = match r {
                            Ok(Ok(rec)) => Ok(Some(rec)),
                            Ok(Err(NotStored::Request(e))) => {
                                g.failed.record(&sample.req_id, &e);
                                Ok(None)
                            }
                            Ok(Err(NotStored::Capture(e))) => Err(e),
                            Err(_) => Err(core_err!(Output, "the writer thread panicked while writing {}", sample.key)),
                        };
                        match r {
                            Ok(None) => {}
                            Ok(Some(rec)) if keep => {
                                if g.records.len() >= UNTAKEN_RECORDS {
                                    g.records.drain(..UNTAKEN_RECORDS / 2);
                                    g.dropped += UNTAKEN_RECORDS / 2;
                                }
                                g.records.push(rec)
                            }
                            Ok(Some(_)) => {}
                            Err(e) => {
                                state.failure.report(ORIGIN, e);
                            }
                        }
                        g.done += 1;
                        state.progress.notify_all();
                    }
                })
                .map_err(|e| core_err!(Output, "cannot start a writer thread: {e}").caused_by(&e))?;
            handles.push(h);
        }
        Ok(Writer { tx: Some(tx), handles, state })
    }

    /// Reports the capture's first failure, if any.
    pub fn poll(&self) -> CoreResult<()> {
        check(&self.state)
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
        crate::blocking::section(|| {
            let mut g = lock(&self.state.shared);
            while g.done < self.state.submitted.load(Ordering::SeqCst) {
                g = self.state.progress.wait(g).unwrap_or_else(|p| p.into_inner());
            }
        });
        self.poll()
    }

    /// How many records were dropped, untaken, since the last call.
    pub fn take_dropped(&self) -> usize {
        std::mem::take(&mut lock(&self.state.shared).dropped)
    }

    /// The log line for the requests whose samples failed since the last one, when one is due (see
    /// [`FailedRequests::take_note`]; `last`: the output is finishing).
    pub fn take_failed_note(&self, last: bool) -> Option<String> {
        lock(&self.state.shared).failed.take_note(std::time::Instant::now(), last)
    }

    /// Requests whose samples could not be stored (each failed alone), so far.
    pub fn failed_requests(&self) -> u64 {
        lock(&self.state.shared).failed.total()
    }

    /// Records written so far (removed from the writer).
    pub fn take_records(&self) -> Vec<SampleRecord> {
        std::mem::take(&mut lock(&self.state.shared).records)
    }

    /// Waits for every queued sample, stops the threads and returns the records not yet taken.
    pub fn finish(&mut self) -> CoreResult<Vec<SampleRecord>> {
        self.tx = None;
        for h in self.handles.drain(..) {
            if crate::blocking::section(|| h.join()).is_err() {
                self.state.failure.report(ORIGIN, core_err!(Output, "a writer thread panicked"));
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
pub(crate) mod tests;
