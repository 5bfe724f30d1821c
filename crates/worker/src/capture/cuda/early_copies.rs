//! Early copies: in a large armed step (a prefill), each slot's rows go to the host as soon as that slot's kernel
//! ran, on the copy stream, while the forward computes the layers after it. The step's end then copies what is
//! left: the checksums, counts and stamps, and the slots not copied early. Without them a step's copies start only
//! once its whole forward is done, and the engine waits for them whenever the next step must account this one (a
//! step without rows keeps the steps' order that way): ~17 ms of a 323-ms DeepSeek-V3 prefill step at 55 GB/s.
//!
//! Invariants:
//! - only eagerly run launches copy early (a replayed graph runs no host code), never one being recorded into a
//!   CUDA graph (the copy stream would join the capture), never with fp8 on the device (its scales span every slot);
//! - a slot launched again in the same step (a layer that runs twice) keeps the last launch's rows, as the copies
//!   at the step's end would: its kernel waits for the early copy before it (which must not read rows being
//!   overwritten), and the rows are copied again after it;
//! - an early copy writes the step's own host buffer (`ring.rs`: taken at `arm`), before the step's `copies_done`;
//! - a slot copied early and then written again by a replayed graph in the same step (no host code runs) would keep
//!   the eager launch's rows: vLLM runs a forward either eagerly or as graphs, never a layer both ways in one step.

use cudarc::driver::sys::CUstreamCaptureStatus;

use super::step_copies::copy_to_pinned;
use super::*;

pub(super) struct EarlyCopies {
    /// Steps with fewer bytes of rows per slot copy at the end only (`HSCAPTURE_EARLY_COPY_MIB`): an early copy costs
    /// a few driver calls per launch, a few µs, which a decode step's rows (64 × 4,096 × 2 bytes: 10 µs at 55 GB/s)
    /// would not repay.
    min_bytes: usize,
    /// Per slot: recorded on the forward's stream after the slot's kernel.
    launched: Vec<CudaEvent>,
    /// Per slot: recorded on the copy stream after the slot's early copy.
    copied: Vec<CudaEvent>,
    /// The armed step copies early.
    on: bool,
    /// Per slot: its rows of the armed step were copied early.
    done: Vec<bool>,
}

impl EarlyCopies {
    pub(super) fn new(ctx: &Arc<cudarc::driver::CudaContext>, slots: usize, min_bytes: usize) -> Result<EarlyCopies, KernelError> {
        let events = || (0..slots).map(|_| drv("cuEventCreate", ctx.new_event(None))).collect::<Result<Vec<_>, _>>();
        Ok(EarlyCopies { min_bytes, launched: events()?, copied: events()?, on: false, done: vec![false; slots] })
    }

    /// A step of `bytes` bytes of rows per slot is armed.
    pub(super) fn arm(&mut self, bytes: usize, quantize: bool) {
        self.on = !quantize && bytes > 0 && bytes >= self.min_bytes;
        self.done.fill(false);
    }

    /// The step ended or was disarmed: the next copies are the step's end's.
    pub(super) fn off(&mut self) {
        self.on = false;
        self.done.fill(false);
    }

    /// Whether `slot`'s rows of the armed step are on their way to the host already.
    pub(super) fn copied(&self, slot: usize) -> bool {
        self.done.get(slot).copied().unwrap_or(false)
    }
}

impl CudaDevice {
    /// Before `slot`'s kernel on `s`: whether this launch copies early (`after_launch`). A launch being recorded into
    /// a graph turns early copies off for the step (the end copies every slot again, after the whole forward).
    pub(super) fn before_launch(&mut self, slot: usize, s: &Arc<CudaStream>) -> Result<bool, KernelError> {
        if !self.early.on || self.armed.is_none() {
            return Ok(false);
        }
        // Being captured, or a stream whose state cannot be read (a legacy stream while another captures): no copy
        // that a graph could take in, for the rest of the step. A launch recorded into a graph may replay after the
        // session (the control block then stays: the module's invariants).
        if !matches!(s.capture_status(), Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)) {
            self.early.off();
            self.recorded = true;
            return Ok(false);
        }
        if self.early.copied(slot) {
            // The launch overwrites the rows the early copy before it reads.
            drv("cuStreamWaitEvent", s.wait(&self.early.copied[slot]))?;
        }
        // Copied again only once `after_launch` succeeds; until then the step's end copies the slot.
        self.early.done[slot] = false;
        Ok(true)
    }

    /// After `slot`'s kernel on `s`: the copy stream waits for it and copies the slot's rows of the armed step.
    pub(super) fn after_launch(&mut self, slot: usize, s: &Arc<CudaStream>) -> CoreResult<()> {
        let Some(a) = self.armed.as_ref() else {
            bail!(Compatibility, "an early copy without an armed step");
        };
        let (half, rows) = (a.half, a.rows);
        let src = self.arena.slot_rows(half, slot, rows)?;
        let host = self.ring.current_mut()?;
        let (copy, early) = (&self.copy, &self.early);
        guarded("enqueueing an early copy to host", || {
            drv("cuEventRecord", early.launched[slot].record(s))?;
            drv("cuStreamWaitEvent", copy.wait(&early.launched[slot]))?;
            copy_to_pinned(copy, &src, &mut host.data[slot])?;
            drv("cuEventRecord", early.copied[slot].record(copy))
        })
        .map_err(kerr)?;
        self.early.done[slot] = true;
        Ok(())
    }
}
