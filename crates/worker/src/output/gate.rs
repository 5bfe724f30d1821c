//! The release gate in front of a worker's destination: only what the tensor-parallel ranks agreed on is stored.
//!
//! Capture hands every finished sample here with the step that completed it (inline, from the worker's thread; in
//! the background, from the assembler thread), through [`Handoff`]. A sample of a step not yet released waits
//! here; [`Gate::release`] (called once the ranks' meeting over the steps accounted so far passed) passes those
//! steps' samples on; a sample of a step already released passes at once. Samples of steps never released are
//! dropped with the gate ([`Gate::close`]), never written or journaled.
//!
//! Invariants: the lock is never held while a sample is passed on (a full writer queue blocks the passing thread,
//! not the other side); a step is released once and for all (`released` only grows), so a sample checked against
//! it under the lock is either held and later released, or passed on now — never both, never neither.

use std::sync::{Mutex, MutexGuard};

use crate::core_err;
use crate::error::CoreResult;
use crate::output::sinks::writer::Submitter;
use crate::sample::{Handoff, Sample};

/// Where released samples go.
pub enum Onward {
    /// The writer's queue (files, per-request files, a store).
    Writer(Submitter),
    /// Kept for the caller (the speculators RPC surface), taken with [`Gate::take_kept`].
    Memory,
    /// A rank that only verifies: released samples are dropped.
    Discard,
}

struct State {
    released: Option<u64>,
    held: Vec<(u64, Sample)>,
    kept: Vec<Sample>,
    /// None once closed: nothing passes any more (the writer's threads may finish).
    onward: Option<Onward>,
}

pub struct Gate {
    state: Mutex<State>,
}

/// A sample on its way out of the lock.
enum Pass {
    Held,
    To(Submitter, Sample),
    Done,
}

impl Gate {
    pub fn new(onward: Onward) -> Gate {
        Gate { state: Mutex::new(State { released: None, held: Vec::new(), kept: Vec::new(), onward: Some(onward) }) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Poisoned only if a thread panicked holding it; the samples are still whole.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides under the lock what happens to `sample` of `step`: held, kept, dropped, or (returned) for the writer.
    fn admit(&self, step: u64, sample: Sample) -> CoreResult<Pass> {
        let mut st = self.lock();
        if st.released.is_none_or(|r| step > r) {
            st.held.push((step, sample));
            return Ok(Pass::Held);
        }
        pass(&mut st, sample)
    }

    /// Steps up to `upto` are agreed on: their samples go on (in step order), and later samples of those steps pass
    /// at once.
    pub fn release(&self, upto: u64) -> CoreResult<()> {
        let mut now = Vec::new();
        {
            let mut st = self.lock();
            st.released = Some(st.released.map_or(upto, |r| r.max(upto)));
            let held = std::mem::take(&mut st.held);
            let (ready, later): (Vec<_>, Vec<_>) = held.into_iter().partition(|(step, _)| *step <= upto);
            st.held = later;
            let mut ready = ready;
            ready.sort_by_key(|(step, _)| *step);
            for (_, s) in ready {
                if let Pass::To(w, s) = pass(&mut st, s)? {
                    now.push((w, s));
                }
            }
        }
        now.into_iter().try_for_each(|(w, s)| w.submit(s))
    }

    /// Samples kept for the caller ([`Onward::Memory`]), removed from the gate.
    pub fn take_kept(&self) -> Vec<Sample> {
        std::mem::take(&mut self.lock().kept)
    }

    /// Samples waiting for a release.
    pub fn held(&self) -> usize {
        self.lock().held.len()
    }

    /// Nothing passes from now on: held samples (of steps never agreed on) are dropped, and the gate lets go of the
    /// writer's queue, whose threads finish once every other submitter is gone too.
    pub fn close(&self) {
        let mut st = self.lock();
        st.held.clear();
        st.onward = None;
    }
}

/// `sample` of a released step: kept, dropped, or the writer's (passed on by the caller, outside the lock).
fn pass(st: &mut State, sample: Sample) -> CoreResult<Pass> {
    match &st.onward {
        Some(Onward::Writer(w)) => Ok(Pass::To(w.clone(), sample)),
        Some(Onward::Memory) => {
            st.kept.push(sample);
            Ok(Pass::Done)
        }
        Some(Onward::Discard) => Ok(Pass::Done),
        None => Err(core_err!(Output, "{}: released after the output was closed; it cannot be stored", sample.key)),
    }
}

impl Handoff for Gate {
    fn try_submit(&self, step: u64, sample: Sample) -> CoreResult<Option<Sample>> {
        match self.admit(step, sample)? {
            Pass::To(w, s) => w.try_submit(s),
            Pass::Held | Pass::Done => Ok(None),
        }
    }

    fn submit(&self, step: u64, sample: Sample) -> CoreResult<()> {
        match self.admit(step, sample)? {
            Pass::To(w, s) => w.submit(s),
            Pass::Held | Pass::Done => Ok(()),
        }
    }
}

#[cfg(test)]
#[path = "tests/gate.rs"]
mod tests;
