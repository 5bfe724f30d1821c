//! The device side of a session, behind a trait so that the session's logic does not depend on
//! CUDA (and is tested on CPU with a host-memory stand-in).
//!
//! Protocol per step: `reset(rows)` when the plan is fixed; `capture` once per slot (enqueues the
//! capture kernel on the caller's stream and the copy of that slot's rows to host memory on a side
//! stream); `end_step` (marks the step's copies); `wait` (blocks until the copies are done and
//! returns the host view; called when the next step begins, or at flush). One step is in flight at a
//! time; the device arena and the host buffer are reused every step.

use crate::error::CoreResult;
use crate::rows::StepRows;
use crate::tensor::TensorDesc;
use hscapture_kernels::RowRun;

pub trait DeviceBackend: Send + Sync {
    /// The most rows per slot one step may capture (the fixed arena's size).
    fn capacity(&self) -> usize;
    /// Bytes of device memory and of pinned host memory held.
    fn allocated(&self) -> (usize, usize);
    /// Starts a step of `rows` captured rows per slot, to be computed from the given row runs.
    fn reset(&mut self, rows: usize, runs: &[RowRun]) -> CoreResult<()>;
    /// Enqueues the capture of `slot` from `hidden` (+ `residual`) on `stream` (a raw CUDA stream).
    ///
    /// # Safety
    /// The descriptors must describe live device memory that stays allocated and unmodified until
    /// the enqueued work has run on `stream`.
    unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, stream: u64) -> CoreResult<()>;
    /// Marks the end of the step's copies.
    fn end_step(&mut self) -> CoreResult<()>;
    /// Waits for the step's copies and returns its rows in host memory.
    fn wait(&mut self) -> CoreResult<&(dyn StepRows + Sync)>;
}
