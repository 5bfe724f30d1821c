//! Device steps in flight: the session's side of a [`DeviceBackend`]. A step armed on the device
//! ends with its copies to host memory still running; it is collected (its copies waited for, its
//! pinned buffer handed out) later, oldest first: with overlap when the next step ends, so that vLLM
//! prepares and launches step N+1 while step N's forward and copies still run; without it when the
//! next step begins.
//!
//! Invariants: this queue and the backend's queue of buffers in flight stay paired (a step leaves
//! both at once, whether its collection succeeds or not); a request that ends while a step holding
//! its rows is in flight is dropped only after that step is collected (its `drops`).

use std::collections::VecDeque;

use crate::attribution::plan::{Event, StepPlan};
use crate::capture::device::{DeviceBackend, PinnedStep};
use crate::capture::tensor::TensorDesc;
use crate::{bail, ensure, error::CoreResult};
use hscapture_kernels::RowRun;

/// An ended device step, waiting for its copies.
pub struct InFlight {
    pub plan: StepPlan,
    /// The step's arm number: what its slots' stamps must show.
    pub arm: u32,
    pub events: Vec<Event>,
    /// Requests that ended after this step: dropped once its rows are assembled.
    pub drops: Vec<String>,
}

pub struct DeviceSteps {
    backend: Box<dyn DeviceBackend>,
    pending: VecDeque<InFlight>,
    /// Steps left in flight when a step ends or the next begins (0: collected when the next begins).
    keep: usize,
}

impl DeviceSteps {
    /// With `in_flight` > 0, that many ended steps stay in flight when a step ends or begins (their copies run while
    /// the next forwards do), which needs a ring of at least `in_flight + 1` host buffers.
    pub fn new(backend: Box<dyn DeviceBackend>, in_flight: usize) -> CoreResult<DeviceSteps> {
        ensure!(in_flight <= 2, Config, "{in_flight} device steps in flight: expected 0, 1 or 2");
        ensure!(
            in_flight == 0 || backend.ring() > in_flight,
            Config,
            "keeping {in_flight} device steps in flight needs a ring of at least {} host buffers ({in_flight} in flight, \
             one being filled); found {}",
            in_flight + 1,
            backend.ring()
        );
        Ok(DeviceSteps { backend, pending: VecDeque::new(), keep: in_flight })
    }

    /// Steps left in flight when the next one begins.
    pub fn keep(&self) -> usize {
        self.keep
    }

    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// (device bytes, pinned host bytes) held.
    pub fn allocated(&self) -> (usize, usize) {
        self.backend.allocated()
    }

    /// Host buffers free for the copies of a step of `rows` rows.
    pub fn free_host(&self, rows: usize) -> usize {
        self.backend.free_host(rows)
    }

    /// Arms a planned step of `rows` rows per slot on the device (see [`DeviceBackend::arm`]).
    pub fn arm(&mut self, step: u64, arm: u32, rows: usize, runs: &[RowRun], stream: u64) -> CoreResult<()> {
        ensure!(
            rows <= self.backend.capacity(),
            ShapeContract,
            "step {step}: {rows} prompt rows do not fit the device arena of {} rows (sized from max_num_batched_tokens)",
            self.backend.capacity()
        );
        self.backend.arm(arm, rows, runs, stream)
    }

    /// Disarms the armed step (its forward failed).
    pub fn disarm(&mut self) -> CoreResult<()> {
        self.backend.disarm()
    }

    /// Enqueues one slot's capture kernel.
    ///
    /// # Safety
    /// As [`DeviceBackend::launch`].
    pub unsafe fn launch(
        &mut self,
        slot: usize,
        point: i32,
        hidden: &TensorDesc,
        residual: Option<&TensorDesc>,
        stream: u64,
    ) -> CoreResult<()> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.backend.launch(slot, point, hidden, residual, stream) }
    }

    /// Ends an armed step: it is in flight until collected.
    pub fn end(&mut self, plan: StepPlan, events: Vec<Event>, arm: u32) -> CoreResult<()> {
        self.backend.end_step()?;
        self.pending.push_back(InFlight { plan, arm, events, drops: Vec::new() });
        Ok(())
    }

    /// Defers the drop of `req_id` until the newest step in flight is collected; gives it back when no
    /// step is in flight (drop it now).
    pub fn defer_drop(&mut self, req_id: String) -> Option<String> {
        match self.pending.back_mut() {
            Some(p) => {
                p.drops.push(req_id);
                None
            }
            None => Some(req_id),
        }
    }

    /// Waits for the oldest step's copies; the step leaves the queue whatever happens.
    pub fn collect_oldest(&mut self) -> CoreResult<(InFlight, Box<dyn PinnedStep>)> {
        let Some(p) = self.pending.pop_front() else {
            bail!(Compatibility, "no device step is in flight");
        };
        let buf = self.backend.wait()?;
        Ok((p, buf))
    }

    /// Takes back a host buffer once its rows are no longer read.
    pub fn recycle(&mut self, buf: Box<dyn PinnedStep>) -> CoreResult<()> {
        self.backend.recycle(buf)
    }
}
