//! The device side of a session, behind a trait so that the session's logic does not depend on
//! CUDA (and is tested on CPU with a host-memory stand-in).
//!
//! Protocol per step: `reset(rows)` when the plan is fixed (takes a free host buffer of the ring);
//! `capture` once per slot (enqueues the capture kernel on the caller's stream and the copy of that
//! slot's rows to host memory on a side stream); `end_step` (marks the step's copies: the step is in
//! flight); `wait` (blocks until the copies of the oldest step in flight are done and hands out its
//! host buffer); `recycle` (the buffer comes back once its rows are assembled, possibly steps later,
//! from the assembler thread).
//!
//! Several steps may be in flight: a step's first capture makes the caller's stream wait (on the
//! device, never the host) for the copies of the step before it, so the device arena, reused every
//! step, is overwritten only once it has been read. The session decides how many steps it leaves in
//! flight when the next one begins (one, so that vLLM prepares step N+1 while step N still runs).

use crate::capture::rows::StepRows;
use crate::capture::tensor::TensorDesc;
use crate::error::CoreResult;
use hscapture_kernels::RowRun;

/// One step's rows in a device path's pinned host buffer, handed out by `wait` and given back by
/// `recycle`.
pub trait PinnedStep: Send + Sync {
    /// Which buffer of the device's ring this is.
    fn ring_slot(&self) -> usize;
    /// The rows, readable (a device's buffers answer once the copies into them are done).
    fn rows(&self) -> CoreResult<Box<dyn StepRows + Sync + '_>>;
}

pub trait DeviceBackend: Send + Sync {
    /// The most rows per slot one step may capture (the fixed arena's size).
    fn capacity(&self) -> usize;
    /// Bytes of device memory and of pinned host memory held.
    fn allocated(&self) -> (usize, usize);
    /// Host buffers free for a step's copies.
    fn free_host(&self) -> usize;
    /// Host buffers in the ring.
    fn ring(&self) -> usize;
    /// Whether the device quantizes each step to fp8 (its host buffers hold codes and per-row scales).
    fn quantizes(&self) -> bool {
        false
    }
    /// Starts a step of `rows` captured rows per slot, to be computed from the given row runs; takes a
    /// free host buffer (an error if none is). Steps in flight stay in flight.
    fn reset(&mut self, rows: usize, runs: &[RowRun]) -> CoreResult<()>;
    /// Enqueues the capture of `slot` from `hidden` (+ `residual`) on `stream` (a raw CUDA stream).
    ///
    /// # Safety
    /// The descriptors must describe live device memory that stays allocated and unmodified until
    /// the enqueued work has run on `stream`.
    unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, stream: u64) -> CoreResult<()>;
    /// Marks the end of the step's copies; the step is in flight until `wait` collects it.
    fn end_step(&mut self) -> CoreResult<()>;
    /// Waits for the copies of the oldest step in flight and hands out its host buffer.
    fn wait(&mut self) -> CoreResult<Box<dyn PinnedStep>>;
    /// Takes back a host buffer handed out by `wait` once its rows are no longer read.
    fn recycle(&mut self, buf: Box<dyn PinnedStep>) -> CoreResult<()>;
}
