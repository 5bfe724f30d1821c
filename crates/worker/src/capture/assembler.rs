//! The assembler thread: scatter jobs run off the worker's thread, in step order, on step buffers
//! handed over by ownership, so the next forward starts while the previous step is being copied into
//! per-request buffers.
//!
//! Invariants:
//! - a step buffer (a CPU arena or a device's pinned host buffer) belongs to exactly one side at a
//!   time: the worker fills it, `submit` moves it here, and it comes back through `returned` once
//!   its rows are copied. The worker blocks only when every buffer of its ring is here
//!   (backpressure), so host memory is the ring, never more;
//! - messages run in the order they were sent: a request's rows are scattered before its completion,
//!   and a drop (request aborted) runs after every earlier step's rows of that request;
//! - completed samples go from this thread, with their step, to the sink when one is set (the output's release
//!   gate, which holds them until the ranks agreed on their step; a full writer queue blocks this thread, whose
//!   buffers then stop coming back: backpressure reaches the worker through the ring), else to a list the worker
//!   takes;
//! - the first error (or panic) goes to the capture's [`Failure`] and is reported by the next
//!   `take_ready`; later jobs still run, so buffers keep coming back and the worker never waits forever;
//! - dropping the assembler stops and joins the thread (the session drops it before its device,
//!   whose pinned memory the thread may be reading).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use crate::capture::arena::Arena;
use crate::capture::device::PinnedStep;
use crate::capture::rows::StepRows;
use crate::capture::scatter::{Scatter, ScatterJob};
use crate::failure::Failure;
use crate::sample::Handoff;
use crate::sample::Sample;
use crate::{core_err, error::CoreResult};

/// What failed, in the capture's [`Failure`].
const ORIGIN: &str = "the assembler thread failed earlier";

/// A step's rows in host memory, owned: a CPU arena or a device's pinned buffer.
pub enum StepBuffer {
    Arena(Arena),
    Pinned(Box<dyn PinnedStep>),
}

impl StepBuffer {
    pub fn rows(&self) -> CoreResult<Box<dyn StepRows + Sync + '_>> {
        match self {
            StepBuffer::Arena(a) => Ok(Box::new(a)),
            StepBuffer::Pinned(d) => d.rows(),
        }
    }
}

enum Msg {
    Step(ScatterJob, StepBuffer),
    Drop(String),
    Sink(Option<Arc<dyn Handoff>>),
    Quantize,
    Fence(Sender<()>),
    /// Tests only: the thread waits until the sender is used or dropped.
    #[cfg(test)]
    Hold(Receiver<()>),
}

/// Completed samples waiting for `take_ready` (when no sink is set).
type Ready = Arc<Mutex<Vec<Sample>>>;

fn lock(m: &Mutex<Vec<Sample>>) -> std::sync::MutexGuard<'_, Vec<Sample>> {
    // Poisoned only if the thread panicked holding it; the samples are still whole.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct Assembler {
    tx: Option<Sender<Msg>>,
    back: Receiver<StepBuffer>,
    ready: Ready,
    failure: Failure,
    held: Arc<AtomicUsize>,
    handle: Option<JoinHandle<()>>,
}

/// Where the thread's samples go: the sink, or the worker's list.
struct Outlet {
    sink: Option<Arc<dyn Handoff>>,
    ready: Ready,
}

impl Outlet {
    fn deliver(&self, step: u64, samples: Vec<Sample>) -> CoreResult<()> {
        match &self.sink {
            Some(w) => samples.into_iter().try_for_each(|s| w.submit(step, s)),
            None => {
                lock(&self.ready).extend(samples);
                Ok(())
            }
        }
    }
}

fn run(rx: Receiver<Msg>, back: Sender<StepBuffer>, ready: Ready, failure: Failure, mut scatter: Scatter) {
    let mut out = Outlet { sink: None, ready };
    for msg in rx.iter() {
        match msg {
            Msg::Step(job, buf) => {
                let step = job.step;
                // With a sink, each sample goes to the writer as soon as its rows are copied (from the
                // scatter thread that copied them), so writing starts while the step is still copied.
                // A full writer queue does not hold the step buffer: those samples wait in `overflow`.
                let overflow = Mutex::new(Vec::new());
                let submit = |s: Sample| match &out.sink {
                    Some(w) => {
                        if let Some(s) = w.try_submit(step, s)? {
                            overflow.lock().unwrap_or_else(|p| p.into_inner()).push(s);
                        }
                        Ok(())
                    }
                    None => Ok(()),
                };
                let emit: Option<crate::capture::scatter::Emit<'_>> = if out.sink.is_some() { Some(&submit) } else { None };
                let r = catch_unwind(AssertUnwindSafe(|| buf.rows().and_then(|rows| scatter.run(job, &*rows, emit))))
                    .unwrap_or_else(|_| Err(core_err!(Output, "step {step}: the assembler thread panicked while copying rows")));
                // The worker may be waiting for this buffer; it gets it back even after an error.
                let _ = back.send(buf);
                let late = overflow.into_inner().unwrap_or_else(|p| p.into_inner());
                let r = r.and_then(|mut samples| {
                    samples.extend(late);
                    out.deliver(step, samples)
                });
                if let Err(e) = r {
                    failure.report(ORIGIN, e);
                }
            }
            Msg::Drop(req_id) => scatter.drop_request(&req_id),
            Msg::Sink(s) => out.sink = s,
            Msg::Quantize => {
                if let Err(e) = scatter.set_quantized() {
                    failure.report(ORIGIN, e);
                }
            }
            Msg::Fence(ack) => {
                let _ = ack.send(());
            }
            #[cfg(test)]
            Msg::Hold(release) => {
                let _ = release.recv();
            }
        }
    }
}

impl Assembler {
    /// Starts the thread; `scatter` (holding no request yet) moves onto it. Its errors go to `failure`.
    pub fn start(scatter: Scatter, failure: Failure) -> CoreResult<Assembler> {
        let (tx, rx) = unbounded::<Msg>();
        let (back_tx, back) = unbounded::<StepBuffer>();
        let ready: Ready = Arc::new(Mutex::new(Vec::new()));
        let held = scatter.held_counter();
        let (r, f) = (Arc::clone(&ready), failure.clone());
        let handle = std::thread::Builder::new()
            .name("hscapture-assembler".into())
            .spawn(move || run(rx, back_tx, r, f, scatter))
            .map_err(|e| core_err!(Output, "cannot start the assembler thread: {e}").caused_by(&e))?;
        Ok(Assembler { tx: Some(tx), back, ready, failure, held, handle: Some(handle) })
    }

    fn send(&self, m: Msg) -> CoreResult<()> {
        match &self.tx {
            Some(tx) => tx.send(m).map_err(|_| core_err!(Output, "the assembler thread has stopped; see the error it reported first")),
            None => Err(core_err!(Output, "the assembler was stopped")),
        }
    }

    /// Queues a step's job with its rows.
    pub fn submit(&self, job: ScatterJob, buf: StepBuffer) -> CoreResult<()> {
        self.send(Msg::Step(job, buf))
    }

    /// Queues the drop of a request's partial sample (after every step already queued).
    pub fn drop_request(&self, req_id: &str) -> CoreResult<()> {
        self.send(Msg::Drop(req_id.to_string()))
    }

    /// Where completed samples go from now on: the writer (through `w`), or, with None, the list
    /// `take_ready` empties. Returns once the thread has switched (and dropped any earlier submitter,
    /// so a writer can finish).
    pub fn set_sink(&self, w: Option<Arc<dyn Handoff>>) -> CoreResult<()> {
        self.send(Msg::Sink(w))?;
        self.fence()
    }

    /// Rows arrive as fp8 codes and scales from now on (see [`Scatter::set_quantized`]); the thread, and the sink
    /// it hands samples to, stay. Returns once the thread has switched.
    pub fn set_quantized(&self) -> CoreResult<()> {
        self.send(Msg::Quantize)?;
        self.fence()
    }

    /// A step buffer whose rows are copied: waits for one when `block` (None if the thread is gone).
    pub fn returned(&self, block: bool) -> Option<StepBuffer> {
        if block {
            crate::blocking::section(|| self.back.recv().ok())
        } else {
            self.back.try_recv().ok()
        }
    }

    /// Tests only: stops the thread (after the messages already queued) until the returned sender is
    /// used or dropped.
    #[cfg(test)]
    pub(crate) fn hold(&self) -> Sender<()> {
        let (tx, rx) = bounded::<()>(1);
        let _ = self.send(Msg::Hold(rx));
        tx
    }

    /// Waits until every message sent so far has run.
    pub fn fence(&self) -> CoreResult<()> {
        let (ack, done) = bounded::<()>(1);
        self.send(Msg::Fence(ack))?;
        crate::blocking::section(|| done.recv())
            .map_err(|_| core_err!(Output, "the assembler thread stopped before finishing its queue"))?;
        self.check()
    }

    /// The capture's first failure (this thread's, or another part's), if there is one.
    pub fn check(&self) -> CoreResult<()> {
        match self.failure.first() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Samples completed since the last call; the capture's first failure instead, if there is one.
    pub fn take_ready(&self) -> CoreResult<Vec<Sample>> {
        self.check()?;
        Ok(std::mem::take(&mut *lock(&self.ready)))
    }

    /// Bytes held: requests in progress and completed samples not yet taken.
    pub fn held_bytes(&self) -> usize {
        self.held.load(Ordering::Relaxed) + lock(&self.ready).iter().map(|s| s.data.len()).sum::<usize>()
    }
}

impl Drop for Assembler {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = crate::blocking::section(|| h.join());
        }
    }
}

#[cfg(test)]
#[path = "tests/assembler.rs"]
mod tests;
