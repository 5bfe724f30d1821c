//! The device side of a session, behind a trait so that the session's logic does not depend on
//! CUDA (and is tested on CPU with a host-memory stand-in).
//!
//! Protocol per step, the same whether the forward runs eagerly or replays a CUDA graph:
//! - `arm` before the forward (the plan is fixed): takes a free host buffer and, on the forward's stream, writes the
//!   step into the device memory the capture kernels read (the control block and the source-row index), after the
//!   copies of the step that last used that half of the arena;
//! - `launch` once per slot during the forward, or never (a replayed graph runs the launches it recorded): one
//!   kernel launch that reads the step from device memory and stamps its slot. A launch outside an armed step writes
//!   nothing, which is what a CUDA graph records at vLLM's start-up;
//! - `end_step` after the forward: disarms, and enqueues the copies of the step's rows, checksums, counts and
//!   stamps to its host buffer on a side stream; the step is in flight;
//! - `wait` blocks until the copies of the oldest step in flight are done and hands out its host buffer; `recycle`
//!   takes it back once its rows are assembled (possibly steps later, from the assembler thread).
//!
//! Several steps may be in flight: the arena has halves (two with overlap), so that step N+1's kernels write one
//! half while step N's copies read the other; a half is armed again only after its last copies ran (a wait on the
//! device, never the host).

use crate::capture::rows::StepRows;
use crate::capture::tensor::TensorDesc;
use crate::error::CoreResult;
use hscapture_kernels::{RowRun, Stamp};

/// One step's rows in a device path's pinned host buffer, handed out by `wait` and given back by
/// `recycle`.
pub trait PinnedStep: Send + Sync {
    /// Which buffer of the device's ring this is.
    fn ring_slot(&self) -> usize;
    /// The rows, readable (a device's buffers answer once the copies into them are done).
    fn rows(&self) -> CoreResult<Box<dyn StepRows + Sync + '_>>;
    /// Each slot's stamp as the step's forward left it.
    fn stamps(&self) -> CoreResult<Vec<Stamp>>;
}

pub trait DeviceBackend: Send + Sync {
    /// The most rows per slot one step may capture (the fixed arena's size).
    fn capacity(&self) -> usize;
    /// Bytes of device memory and of pinned host memory held.
    fn allocated(&self) -> (usize, usize);
    /// Host buffers free for the copies of a step of `rows` rows per slot (buffers come in sizes).
    fn free_host(&self, rows: usize) -> usize;
    /// Host buffers that hold a step of `capacity` rows (the ring's large ones; smaller ones serve smaller steps).
    fn ring(&self) -> usize;
    /// Whether the device quantizes each step to fp8 (its host buffers hold codes and per-row scales).
    fn quantizes(&self) -> bool {
        false
    }
    /// Arms a step (arm number `arm`, never 0) of `rows` captured rows per slot, computed from the given row runs,
    /// on `stream` (a raw CUDA stream: the forward's); takes a free host buffer (an error if none is).
    fn arm(&mut self, arm: u32, rows: usize, runs: &[RowRun], stream: u64) -> CoreResult<()>;
    /// Disarms an armed step whose forward failed (nothing is copied; its host buffer serves the next step).
    fn disarm(&mut self) -> CoreResult<()>;
    /// Enqueues slot `slot`'s capture kernel (capture point `point`, stamped) on `stream`: a single kernel launch,
    /// which a CUDA graph being captured on `stream` records.
    ///
    /// # Safety
    /// The descriptors must describe live device memory that stays allocated and unmodified until the enqueued work
    /// has run on `stream` (a CUDA graph's own memory pool, when it records the launch).
    unsafe fn launch(&mut self, slot: usize, point: i32, hidden: &TensorDesc, residual: Option<&TensorDesc>, stream: u64)
        -> CoreResult<()>;
    /// After the armed step's forward: disarms and enqueues its copies; the step is in flight until `wait` collects
    /// it.
    fn end_step(&mut self) -> CoreResult<()>;
    /// Waits for the copies of the oldest step in flight and hands out its host buffer.
    fn wait(&mut self) -> CoreResult<Box<dyn PinnedStep>>;
    /// Takes back a host buffer handed out by `wait` once its rows are no longer read.
    fn recycle(&mut self, buf: Box<dyn PinnedStep>) -> CoreResult<()>;
}
