//! What the binding asks of a worker's capture beyond the step protocol: its layers and geometry, where the step
//! stands, pipeline stages' slots, the opt-in skip of non-finite samples, and its totals. The binding goes through
//! these, never into the session itself.

use super::WorkerSession;
use crate::attribution::layers::LayerPlan;
use crate::capture::step::SessionStats;
use crate::capture::tensor::TensorDesc;
use crate::error::CoreResult;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

impl WorkerSession {
    /// The captured layers: ids, convention, capture points.
    pub fn layers(&self) -> &LayerPlan {
        &self.session.config().layers
    }

    /// (slots, width, stored dtype) of one step's rows: what a device arena is sized by.
    pub fn geometry(&self) -> (usize, usize, DType) {
        let c = self.session.config();
        (c.layers.num_slots(), c.hidden_size, c.out_dtype)
    }

    /// Checks that `point` (a compiled graph's tap's) is slot `slot`'s capture point.
    pub fn check_point(&self, slot: usize, point: i32) -> CoreResult<()> {
        self.session.check_point(slot, Some(point)).map(|_| ())
    }

    /// The shape contract's step-independent part on a slot's tensors seen outside a step.
    pub fn check_shape(&self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>) -> CoreResult<()> {
        self.session.check_shape(slot, hidden, residual)
    }

    pub fn in_step(&self) -> bool {
        self.session.in_step()
    }

    pub fn planned(&self) -> bool {
        self.session.planned()
    }

    /// Whether rows are scattered on the assembler thread.
    pub fn background(&self) -> bool {
        self.session.background()
    }

    pub fn device_bytes(&self) -> usize {
        self.session.device_bytes()
    }

    /// Prompt rows per request in the planned step, in the runner's order.
    pub fn step_rows(&self) -> Vec<(String, usize)> {
        self.session.step_rows()
    }

    /// Pipeline parallelism: the slots this rank neither captures nor receives.
    pub fn set_absent_slots(&mut self, slots: &[usize]) -> CoreResult<()> {
        self.session.set_absent_slots(slots)
    }

    /// This step's rows of `slots` as one message for the assembling pipeline stage.
    pub fn export_slots(&self, slots: &[usize]) -> CoreResult<Vec<u8>> {
        self.session.export_slots(slots)
    }

    /// Writes another stage's message into this step; returns the slots filled.
    pub fn import_slots(&mut self, message: &[u8], sender: &str) -> CoreResult<Vec<usize>> {
        self.session.import_slots(message, sender)
    }

    /// Opt-in: skip samples with NaN/Inf values instead of failing.
    pub fn set_skip_nonfinite(&mut self, skip: bool) {
        self.session.set_skip_nonfinite(skip)
    }

    /// Samples skipped for non-finite values since the last call: (sample, request id, why).
    pub fn take_skipped(&mut self) -> Vec<(SampleKey, String, String)> {
        self.session.take_skipped()
    }

    /// Drops the step in progress (its forward failed).
    pub fn abandon_step(&mut self) -> CoreResult<()> {
        self.session.abandon_step()
    }

    /// Running totals, the requests alive now and the bytes of samples held.
    pub fn totals(&self) -> (&SessionStats, usize, usize) {
        (self.session.stats(), self.session.tracker().live_requests(), self.session.held_bytes())
    }

    /// Requests whose samples could not be stored, each failed alone (a server's output), so far.
    pub fn failed_requests(&self) -> u64 {
        match &self.output {
            super::Output::Files(w) => w.failed_requests(),
            _ => 0,
        }
    }
}
