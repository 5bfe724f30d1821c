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

use super::step_copies::{copy_runs, HostRuns};
use super::*;

/// Which launches of the armed step copy early, apart from the events that carry them out: no CUDA here, so that
/// the rules are tested on any machine.
#[derive(Debug)]
pub(super) struct EarlyPolicy {
    /// Steps with fewer bytes of rows per slot copy at the end only (`HSCAPTURE_EARLY_COPY_MIB`): an early copy costs
    /// a few driver calls per launch, a few µs, which a decode step's rows (64 × 4,096 × 2 bytes: 10 µs at 55 GB/s)
    /// would not repay.
    min_bytes: usize,
    /// The armed step copies early.
    on: bool,
    /// Per slot: its rows of the armed step are on their way to the host (an early copy was enqueued after its last
    /// launch).
    done: Vec<bool>,
}

impl EarlyPolicy {
    pub(super) fn new(slots: usize, min_bytes: usize) -> EarlyPolicy {
        EarlyPolicy { min_bytes, on: false, done: vec![false; slots] }
    }

    /// A step of `bytes` bytes of rows per slot is armed.
    pub(super) fn arm(&mut self, bytes: usize, quantize: bool) {
        self.on = !quantize && bytes > 0 && bytes >= self.min_bytes;
        self.done.fill(false);
    }

    /// The step ended, was disarmed, or is being recorded into a graph: the step's end copies every slot.
    pub(super) fn off(&mut self) {
        self.on = false;
        self.done.fill(false);
    }

    pub(super) fn on(&self) -> bool {
        self.on
    }

    /// A launch of `slot` that will copy early: whether its kernel must first wait for the slot's previous early
    /// copy (it overwrites the rows that copy reads). Until `enqueued`, the slot is the step's end's to copy.
    pub(super) fn launch(&mut self, slot: usize) -> bool {
        let wait = self.copied(slot);
        if let Some(d) = self.done.get_mut(slot) {
            *d = false;
        }
        wait
    }

    /// `slot`'s early copy is enqueued after its launch.
    pub(super) fn enqueued(&mut self, slot: usize) {
        if let Some(d) = self.done.get_mut(slot) {
            *d = true;
        }
    }

    /// Whether `slot`'s rows of the armed step are on their way to the host already (the step's end skips them).
    pub(super) fn copied(&self, slot: usize) -> bool {
        self.done.get(slot).copied().unwrap_or(false)
    }
}

/// The early copies' policy and, per slot, the events that order them.
pub(super) struct EarlyCopies {
    pub(super) policy: EarlyPolicy,
    /// Per slot: recorded on the forward's stream after the slot's kernel.
    launched: Vec<CudaEvent>,
    /// Per slot: recorded on the copy stream after the slot's early copy.
    copied: Vec<CudaEvent>,
}

impl EarlyCopies {
    pub(super) fn new(ctx: &Arc<cudarc::driver::CudaContext>, slots: usize, min_bytes: usize) -> Result<EarlyCopies, KernelError> {
        let events = || (0..slots).map(|_| drv("cuEventCreate", ctx.new_event(None))).collect::<Result<Vec<_>, _>>();
        Ok(EarlyCopies { policy: EarlyPolicy::new(slots, min_bytes), launched: events()?, copied: events()? })
    }
}

impl CudaDevice {
    /// Before `slot`'s kernel on `s`: whether this launch copies early (`after_launch`). A launch being recorded into
    /// a graph turns early copies off for the step (the end copies every slot again, after the whole forward).
    pub(super) fn before_launch(&mut self, slot: usize, s: &Arc<CudaStream>) -> Result<bool, KernelError> {
        if !self.early.policy.on() || self.armed.is_none() {
            return Ok(false);
        }
        // Being captured, or a stream whose state cannot be read (a legacy stream while another captures): no copy
        // that a graph could take in, for the rest of the step. A launch recorded into a graph may replay after the
        // session (the control block then stays: the module's invariants).
        if !matches!(s.capture_status(), Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)) {
            self.early.policy.off();
            self.recorded = true;
            return Ok(false);
        }
        if self.early.policy.launch(slot) {
            drv("cuStreamWaitEvent", s.wait(&self.early.copied[slot]))?;
        }
        Ok(true)
    }

    /// After `slot`'s kernel on `s`: the copy stream waits for it and copies the slot's rows of the armed step.
    pub(super) fn after_launch(&mut self, slot: usize, s: &Arc<CudaStream>) -> CoreResult<()> {
        let Some(a) = self.armed.as_ref() else {
            bail!(Compatibility, "an early copy without an armed step");
        };
        let (half, rows) = (a.half, a.rows);
        let src = self.arena.slot_rows(half, slot, rows)?;
        let rb = self.arena.row_bytes();
        let host = self.ring.current_mut()?;
        let (copy, early, max_pitch) = (&self.copy, &self.early, self.max_pitch);
        guarded("enqueueing an early copy to host", || {
            drv("cuEventRecord", early.launched[slot].record(s))?;
            drv("cuStreamWaitEvent", copy.wait(&early.launched[slot]))?;
            copy_runs(copy, &src, 0, &HostRuns::slots(host, host.data, slot), rows * rb, 1, max_pitch)?;
            drv("cuEventRecord", early.copied[slot].record(copy))
        })
        .map_err(kerr)?;
        self.early.policy.enqueued(slot);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::EarlyPolicy;

    #[test]
    fn only_large_unquantized_steps_copy_early() {
        let mut p = EarlyPolicy::new(2, 4 << 20);
        p.arm((4 << 20) - 1, false);
        assert!(!p.on(), "a step below the threshold copies at its end");
        p.arm(4 << 20, true);
        assert!(!p.on(), "fp8 on the device scales over every slot: copies at the end");
        p.arm(0, false);
        assert!(!p.on());
        p.arm(4 << 20, false);
        assert!(p.on());
        let mut every = EarlyPolicy::new(1, 1);
        every.arm(1, false);
        assert!(every.on(), "a threshold of one byte: every step with rows");
    }

    #[test]
    fn a_slot_launched_again_waits_and_is_copied_again() {
        let mut p = EarlyPolicy::new(2, 1);
        p.arm(1 << 20, false);
        assert!(!p.launch(0), "a first launch has no copy to wait for");
        p.enqueued(0);
        assert!(p.copied(0) && !p.copied(1));
        assert!(p.launch(0), "a second launch waits for the first early copy");
        assert!(!p.copied(0), "until its own copy is enqueued the step's end copies the slot (the last rows)");
        p.enqueued(0);
        assert!(p.copied(0));
    }

    #[test]
    fn a_new_step_or_a_recorded_launch_leaves_every_slot_to_the_end() {
        let mut p = EarlyPolicy::new(2, 1);
        p.arm(1 << 20, false);
        p.launch(1);
        p.enqueued(1);
        p.off();
        assert!(!p.on() && !p.copied(1), "off: the end copies every slot, the one copied early too");
        p.arm(1 << 20, false);
        p.launch(0);
        p.enqueued(0);
        p.arm(1 << 20, false);
        assert!(!p.copied(0), "a new step starts with nothing copied");
        assert!(!p.copied(7), "a slot that does not exist was never copied");
    }
}
