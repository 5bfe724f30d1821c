//! A capture session on one worker: the coordinator of the parts it owns — the step protocol
//! ([`StepProtocol`]: attribution, the slots a step holds, the shape contract), the step buffers
//! ([`StepBuffers`]), device steps in flight ([`DeviceSteps`]) and accounting ([`Accounting`]).
//!
//! Per step: [`Session::begin_step`] with the scheduler output; [`Session::plan`] with the order the
//! runner used (before the forward, or at its first hook); on a device, [`Session::arm`] before the forward;
//! [`Session::capture`] once per layer slot (a replayed CUDA graph runs the device's launches without calling it);
//! [`Session::end_step`]. Host captures are accounted at `end_step`; device captures later, in step
//! order (see `device_steps.rs`), once their stamps show that the forward captured every slot (`stamps.rs`). [`Session::flush`] accounts every step in flight. Each call that
//! accounts returns the [`StepOutcome`]s of the steps it accounted, oldest first: the step checksum
//! for the cross-rank check and, inline, the completed samples. The calls that account, and how many
//! steps each does, depend only on the sequence of steps and the configuration, so every rank of a
//! group accounts the same steps at the same calls.

use std::sync::Arc;

use crate::attribution::layers::CapturePoint;
use crate::attribution::plan::{Event, StepInput, StepPlan, Tracker};
use crate::capture::accounting::Accounting;
use crate::capture::contract::{check_layer, check_tensor, slot_name};
use crate::capture::device::{DeviceBackend, PinnedStep};
use crate::capture::device_steps::DeviceSteps;
pub use crate::capture::protocol::CompletionHook;
use crate::capture::protocol::StepProtocol;
use crate::capture::scatter::{Geometry, RefusalHook, ScatterJob};
use crate::capture::stamps::verify as verify_stamps;
use crate::capture::step::elapsed_ns;
pub use crate::capture::step::{Aborted, SessionConfig, SessionStats, StepOutcome};
use crate::capture::step_buffers::StepBuffers;
use crate::capture::tensor::{Device, TensorDesc};
use crate::failure::Failure;
use crate::sample::pool::BufferPool;
use crate::sample::Handoff;
use crate::sample::Sample;
use crate::sample::SampleKey;
use crate::{bail, ensure, error::CoreResult};

pub struct Session {
    protocol: StepProtocol,
    accounting: Accounting,
    /// Before `device`: dropped (its thread joined) first, since it may read the device's buffers.
    buffers: StepBuffers,
    device: Option<DeviceSteps>,
    /// The arm number of the step in progress, once armed on the device.
    armed: Option<u32>,
    /// The last arm number given out (never 0: 0 is the device's "disarmed").
    arms: u32,
    /// Each slot's capture point, as its taps and stamps carry it.
    points: Vec<i32>,
    failure: Failure,
    pool: Arc<BufferPool>,
    aborted: Vec<Aborted>,
}

impl Session {
    pub fn new(cfg: SessionConfig) -> CoreResult<Session> {
        Session::with_failure(cfg, Failure::new())
    }

    /// A session whose parts report into `failure` (shared with the writer of the same capture).
    pub fn with_failure(cfg: SessionConfig, failure: Failure) -> CoreResult<Session> {
        ensure!(cfg.hidden_size > 0, Config, "hidden size must be positive, found 0");
        let pool = Arc::new(BufferPool::new(256));
        let geo = Geometry { slots: cfg.layers.num_slots(), width: cfg.hidden_size, dtype: cfg.out_dtype, quantized: false };
        let names: Arc<[String]> = (0..geo.slots).map(|s| crate::capture::contract::slot_name(&cfg.layers, s)).collect();
        let points = cfg.layers.points().into_iter().map(|p| p.code()).collect();
        Ok(Session {
            buffers: StepBuffers::new(geo, names, Arc::clone(&pool), failure.clone()),
            protocol: StepProtocol::new(cfg),
            accounting: Accounting::default(),
            device: None,
            armed: None,
            arms: 0,
            points,
            failure,
            pool,
            aborted: Vec::new(),
        })
    }

    /// Calls `hook` with the request id of every request whose prompt completes, when the step that
    /// completes it ends (and of every sample that captures generated tokens, when it opens).
    pub fn set_completion_hook(&mut self, hook: CompletionHook) {
        self.protocol.set_completion_hook(hook);
    }

    fn fresh(&self) -> bool {
        self.accounting.stats.steps == 0 && !self.in_step() && self.steps_in_flight() == 0
    }

    /// Opt-in: skip (and report) samples with NaN/Inf values instead of failing the step.
    pub fn set_skip_nonfinite(&mut self, skip: bool) {
        self.accounting.skip_nonfinite = skip;
    }

    /// Samples skipped since the last call — for non-finite values (opt-in), or refused for degenerate states —:
    /// (sample, request id, why).
    pub fn take_skipped(&mut self) -> Vec<(SampleKey, String, String)> {
        let mut out = std::mem::take(&mut self.accounting.skipped);
        for r in self.buffers.refusals().take() {
            self.accounting.stats.skipped += 1;
            out.push((r.sample, r.req_id, format!("degenerate states: {}", r.why)));
        }
        out
    }

    /// Called at once, on the thread that refused it, for each sample refused for degenerate states (a server gives
    /// up the request's staging lock there: its client finds no file instead of waiting).
    pub fn set_refusal_hook(&mut self, hook: RefusalHook) {
        self.buffers.refusals().set_hook(hook);
    }

    /// Moves the scatter of rows onto the assembler thread, with a ring of `ring` (≥ 2) CPU arenas
    /// (the device path has its own ring). Only before the first step.
    pub fn set_background(&mut self, ring: usize) -> CoreResult<()> {
        ensure!(self.fresh(), Config, "background assembly is chosen before the first step");
        self.buffers.set_background(ring)
    }

    /// Where the assembler thread hands completed samples, with their steps: the output's gate, or `take_ready`
    /// (None).
    pub fn set_sink(&mut self, w: Option<Arc<dyn Handoff>>) -> CoreResult<()> {
        self.buffers.set_sink(w)
    }

    pub fn background(&self) -> bool {
        self.buffers.background()
    }

    pub fn config(&self) -> &SessionConfig {
        self.protocol.config()
    }

    pub fn stats(&self) -> &SessionStats {
        &self.accounting.stats
    }

    /// The capture's failure flag (shared with its writer).
    pub fn failure(&self) -> &Failure {
        &self.failure
    }

    /// The pool sample buffers come from; the writer returns them there.
    pub fn pool(&self) -> Arc<BufferPool> {
        Arc::clone(&self.pool)
    }

    pub fn tracker(&self) -> &Tracker {
        self.protocol.tracker()
    }

    /// Host bytes held: step arenas, partly captured requests (and, in the background, completed
    /// samples not yet handed over), the device path's pinned buffers.
    pub fn held_bytes(&self) -> usize {
        self.buffers.arena_bytes() + self.request_bytes() + self.device.as_ref().map_or(0, |d| d.allocated().1)
    }

    /// Host bytes held by requests whose prompt is not complete.
    pub fn request_bytes(&self) -> usize {
        self.buffers.request_bytes()
    }

    /// Registers a step's scheduler output. Device steps in flight beyond the one overlap leaves are
    /// accounted first; their outcomes are returned, oldest first.
    pub fn begin_step(&mut self, input: StepInput) -> CoreResult<Vec<StepOutcome>> {
        let keep = self.device.as_ref().map_or(0, DeviceSteps::keep);
        let prev = self.collect_device_steps(keep)?;
        self.buffers.reclaim(false, self.device.as_mut())?;
        for e in self.protocol.begin(input)? {
            if let Event::Aborted { req_id, sample, captured, prompt_len } = e {
                self.accounting.stats.aborted += 1;
                self.aborted.push(Aborted { req_id: req_id.clone(), sample, captured, prompt_len });
                let now = match self.device.as_mut() {
                    Some(d) => d.defer_drop(req_id),
                    None => Some(req_id),
                };
                if let Some(r) = now {
                    self.drop_request(&r)?;
                }
            }
        }
        self.armed = None;
        Ok(prev)
    }

    /// A request refused at admission (`WorkerSession`), counted with the session's totals.
    pub fn count_refused(&mut self) {
        self.accounting.stats.refused += 1;
    }

    fn drop_request(&mut self, req_id: &str) -> CoreResult<()> {
        self.accounting.drop_request(req_id);
        self.buffers.drop_request(req_id)
    }

    fn scatter(&mut self, job: ScatterJob, pinned: Option<Box<dyn PinnedStep>>) -> CoreResult<Vec<Sample>> {
        self.buffers.scatter(job, pinned, self.device.as_mut())
    }

    /// Samples the assembler thread completed since the last call; with `fence`, after waiting for
    /// every step handed to it so far. Reports the capture's first failure.
    pub fn take_ready(&mut self, fence: bool) -> CoreResult<Vec<Sample>> {
        self.buffers.take_ready(fence, self.device.as_mut())
    }

    pub fn in_step(&self) -> bool {
        self.protocol.in_step()
    }

    pub fn planned(&self) -> bool {
        self.protocol.current_plan().is_some()
    }

    /// Prompt rows per request of the planned step, in the runner's order (empty before `plan`).
    pub fn step_rows(&self) -> Vec<(String, usize)> {
        self.protocol.current_plan().map(|p| p.segments.iter().map(|s| (s.req_id.clone(), s.len)).collect()).unwrap_or_default()
    }

    /// Fixes the step's row layout from the runner's request order.
    pub fn plan(&mut self, order: &[String]) -> CoreResult<&StepPlan> {
        let rows = self.protocol.plan(order)?.arena_rows;
        self.buffers.arena_mut().reset(rows);
        match self.protocol.current_plan() {
            Some(p) => Ok(p),
            None => bail!(Attribution, "the step plan was lost"),
        }
    }

    /// Captures slot `slot` from `hidden` (+ `residual`): host tensors into the arena now, for the planned rows;
    /// device tensors through the device's capture kernel on `stream` (a raw CUDA stream handle), armed first if the
    /// step was not (a step planned at the forward's first hook). `point`: the capture point a compiled graph's tap
    /// carries, checked against the slot's own. Outside a step a device tensor's launch writes nothing: that is
    /// the launch a CUDA graph records when vLLM captures it.
    ///
    /// # Safety
    /// Both descriptors must describe live memory of the described extent that nobody writes while
    /// this call runs (host) or until the work enqueued on `stream` has run (device).
    pub unsafe fn capture(
        &mut self,
        slot: usize,
        point: Option<i32>,
        hidden: &TensorDesc,
        residual: Option<&TensorDesc>,
        stream: u64,
    ) -> CoreResult<()> {
        let want = self.check_point(slot, point)?;
        let layers = &self.protocol.config().layers;
        let Device::Cuda(_) = hidden.device else {
            let a = self.protocol.admit(slot, hidden, residual)?;
            // SAFETY: forwarded from this function's contract (host tensors).
            return unsafe { self.buffers.capture_host(slot, &a.name, (hidden, residual), a.rows, &a.runs) };
        };
        let name = slot_name(layers, slot);
        ensure!(
            self.device.is_some(),
            Compatibility,
            "{name}: the tensor is on {} but the device path is not enabled here; the Python worker falls back to \
             host copies when it cannot enable it",
            hidden.device
        );
        match self.protocol.current_plan() {
            Some(plan) => {
                check_layer(self.protocol.config(), plan, &name, hidden, residual)?;
                self.arm(stream)?;
            }
            None => check_tensor(self.protocol.config(), &name, hidden, residual)?,
        }
        let Some(dev) = self.device.as_mut() else {
            bail!(Compatibility, "{name}: the device path is gone");
        };
        // SAFETY: forwarded from this function's contract.
        unsafe { dev.launch(slot, want, hidden, residual, stream) }
    }

    /// Ends the step: checks that every slot was captured and commits attribution. Host captures are
    /// accounted now (after any device step still in flight) and the outcomes returned; device
    /// captures later. On error the step is abandoned.
    pub fn end_step(&mut self) -> CoreResult<Vec<StepOutcome>> {
        let r = self.end_step_inner();
        if r.is_err() {
            // The step's own error is the one reported; a disarm that fails too has its own next.
            let _ = self.abandon_step();
        }
        r
    }

    fn end_step_inner(&mut self) -> CoreResult<Vec<StepOutcome>> {
        // An armed step's stamps show which slots its forward captured (a replayed CUDA graph calls no hook); a device
        // step with no rows to capture has nothing to show. Any other step must have captured every slot here.
        let planned_rows = self.protocol.current_plan().map_or(0, |p| p.arena_rows);
        let check_slots = self.armed.is_none() && (self.device.is_none() || planned_rows > 0);
        let (plan, events) = self.protocol.end(check_slots)?;
        if let Some(arm) = self.armed.take() {
            let Some(dev) = self.device.as_mut() else {
                bail!(Compatibility, "step {} was armed on the device but the device path is gone", plan.step);
            };
            let t = std::time::Instant::now();
            dev.end(plan, events, arm)?;
            self.accounting.stats.device_end_ns += elapsed_ns(t);
            // Overlap: the step before is accounted now, while this one is queued on the device behind
            // it (so that at the end of a run only the last step is left to assemble).
            let keep = dev.keep();
            return if keep == 0 { Ok(Vec::new()) } else { self.collect_device_steps(keep) };
        }
        // A step without device captures (none ran: no forward, or no hooked layer) keeps step order.
        let mut outs = self.collect_device_steps(0)?;
        let slots = self.protocol.slots();
        let (present, own) = (slots.present(), slots.own());
        let (mut out, job) = self.accounting.account(self.protocol.config(), plan, events, self.buffers.arena(), &present, &own)?;
        out.completed = self.scatter(job, None)?;
        out.aborted = std::mem::take(&mut self.aborted);
        outs.push(out);
        Ok(outs)
    }

    /// Drops the step in progress after a failed forward (disarmed first: later forwards capture nothing).
    pub fn abandon_step(&mut self) -> CoreResult<()> {
        self.protocol.abandon();
        match (self.armed.take(), self.device.as_mut()) {
            (Some(_), Some(dev)) => dev.disarm(),
            _ => Ok(()),
        }
    }

    /// Declares the slots this rank will neither capture nor receive (pipeline parallelism: the layers
    /// of other stages, on a rank that does not assemble).
    pub fn set_absent_slots(&mut self, slots: &[usize]) -> CoreResult<()> {
        ensure!(
            slots.is_empty() || !self.buffers.quantized(),
            Config,
            "slots {slots:?} absent from a session whose device quantizes to fp8 over every slot"
        );
        self.protocol.set_absent(slots)
    }

    /// This step's rows of `slots` (captured here) as one message for the assembling stage.
    pub fn export_slots(&self, slots: &[usize]) -> CoreResult<Vec<u8>> {
        let step = self.protocol.step();
        ensure!(
            self.armed.is_none(),
            Compatibility,
            "step {step}: pipeline stages exchange host rows; this step was captured on the device"
        );
        self.protocol.export(self.buffers.arena(), slots)
    }

    /// Writes another stage's message into this step's arena; returns the slots it filled.
    pub fn import_slots(&mut self, bytes: &[u8], from: &str) -> CoreResult<Vec<usize>> {
        self.protocol.import(self.buffers.arena_mut(), bytes, from)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The assembler thread may be reading the device's pinned buffers: stop it first.
        self.buffers.stop();
        self.device = None;
    }
}

#[path = "session_device.rs"]
mod device_side;

#[cfg(test)]
#[path = "tests/session.rs"]
pub(crate) mod tests;

#[cfg(test)]
#[path = "tests/host_device.rs"]
mod host_device;

#[cfg(test)]
#[path = "tests/quantized.rs"]
mod quantized;

#[cfg(test)]
#[path = "tests/fuzz.rs"]
mod fuzz;

#[cfg(test)]
#[path = "tests/stage_exchange.rs"]
mod stages_tests;

#[cfg(test)]
#[path = "tests/overlap.rs"]
mod overlap_tests;
