//! A capture session on one worker: attribution ([`Tracker`]), capture into the step arena (host
//! [`Arena`] or a [`DeviceBackend`]), the shape contract, and assembly of per-request samples.
//!
//! Per step: [`Session::begin_step`] with the scheduler output; [`Session::plan`] with the order the
//! runner used (at the first hook of the forward); [`Session::capture`] once per layer slot;
//! [`Session::end_step`]. Host captures are accounted at `end_step`; device captures are copied to
//! host memory asynchronously and accounted later, in step order: with overlap (the default of the
//! device path) when the next step ends, so that step N+1 begins, and vLLM prepares and launches
//! it, while step N's forward and copies still run (the host then waits for step N with step N+1
//! already queued behind it on the device); without it when the next step begins.
//! [`Session::flush`] accounts every step in flight. Each call that accounts returns the
//! [`StepOutcome`]s of the steps it accounted, oldest first: the step checksum for the cross-rank
//! check and, inline, the completed samples. The calls that account, and how many steps each does,
//! depend only on the sequence of steps and the configuration, so every rank of a group accounts
//! the same steps at the same calls.
//!
//! A request that ends (finished or preempted before its prompt was complete) while a step holding
//! its rows is in flight is dropped only once that step is accounted.
//!
//! Assembly is split: the checks, the checksum and completion (`assembly.rs`) run here; the copy of
//! rows into per-request buffers (`scatter.rs`) runs inline or, after [`Session::set_background`],
//! on the assembler thread (`assembler.rs`), which gets each step's host buffer by ownership (a ring
//! of CPU arenas, or the device's ring of pinned buffers). Samples it completes are collected with
//! [`Session::take_ready`].

use crate::arena::Arena;
use crate::assembler::Assembler;
use crate::assembly::Assembly;
use crate::device::DeviceBackend;
use crate::scatter::{Geometry, Scatter};
use crate::layers::LayerPlan;
use crate::plan::{Event, SampleKey, StepInput, StepPlan, Tracker};
use crate::sample::Sample;
use crate::tensor::{Device, TensorDesc};
use crate::{bail, ensure, error::CoreResult};
use hscapture_kernels::{capture_rows, DType};

/// What a session captures and how.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub layers: LayerPlan,
    pub hidden_size: usize,
    /// dtype of the model's activations (what hooks see).
    pub model_dtype: DType,
    /// dtype of the stored states.
    pub out_dtype: DType,
    /// Assemble samples (the writing rank) or only check and checksum (the other ranks).
    pub assemble: bool,
}

/// A request that ended before its prompt was complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aborted {
    pub req_id: String,
    pub sample: SampleKey,
    pub captured: usize,
    pub prompt_len: usize,
}

/// The result of a step.
#[derive(Debug, Default)]
pub struct StepOutcome {
    pub step: u64,
    pub checksum: u64,
    pub rows: usize,
    pub completed: Vec<Sample>,
    pub aborted: Vec<Aborted>,
}

/// Running totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub steps: u64,
    pub rows: u64,
    pub samples: u64,
    pub aborted: u64,
    /// Samples skipped for non-finite values (opt-in).
    pub skipped: u64,
}

struct Pending {
    plan: StepPlan,
    events: Vec<Event>,
    /// Requests that ended after this step: dropped once its rows are assembled.
    drops: Vec<String>,
}

/// Where rows are scattered: on the worker's thread, or on the assembler thread.
enum Scattering {
    Inline(Scatter),
    Background(Assembler),
}

/// An empty scatter for `cfg`'s samples, recycling buffers through `pool`.
fn new_scatter(cfg: &SessionConfig, pool: &std::sync::Arc<crate::pool::BufferPool>) -> Scatter {
    let geo = Geometry { slots: cfg.layers.num_slots(), width: cfg.hidden_size, dtype: cfg.out_dtype };
    Scatter::new(geo, std::sync::Arc::clone(pool))
}

pub struct Session {
    cfg: SessionConfig,
    tracker: Tracker,
    arena: Arena,
    /// Before `device`: dropped (its thread joined) first, since it may read the device's host buffers.
    scattering: Scattering,
    /// CPU arenas of the ring not in use, and how many exist (background assembly only).
    spare_arenas: Vec<Arena>,
    arenas: usize,
    ring: usize,
    /// Device host buffers with the assembler thread (not yet given back to the device).
    device_out: usize,
    device: Option<Box<dyn DeviceBackend>>,
    assembly: Assembly,
    filled: Vec<bool>,
    /// Slots this rank neither captures nor receives (another pipeline stage's layers, on a rank that
    /// does not assemble).
    absent: Vec<bool>,
    /// Slots of this step received from another stage (not part of this rank's checksum).
    imported: Vec<bool>,
    on_device: bool,
    /// Device steps in flight, oldest first.
    pending: std::collections::VecDeque<Pending>,
    /// Device steps left in flight when the next step begins (0 or 1).
    keep_in_flight: usize,
    /// The first failure to collect a device step: its rows (and any drops after it) are lost, so the
    /// session refuses every later step rather than write requests with gaps.
    broken: Option<crate::CoreError>,
    aborted: Vec<Aborted>,
}

impl Session {
    pub fn new(cfg: SessionConfig) -> CoreResult<Session> {
        ensure!(cfg.hidden_size > 0, Config, "hidden size must be positive, found 0");
        let slots = cfg.layers.num_slots();
        let arena = Arena::new(slots, cfg.hidden_size, cfg.out_dtype);
        let assembly = Assembly::default();
        let scatter = new_scatter(&cfg, &assembly.pool);
        Ok(Session {
            cfg,
            tracker: Tracker::new(),
            arena,
            scattering: Scattering::Inline(scatter),
            spare_arenas: Vec::new(),
            arenas: 1,
            ring: 1,
            device_out: 0,
            device: None,
            assembly,
            filled: vec![false; slots],
            absent: vec![false; slots],
            imported: vec![false; slots],
            on_device: false,
            pending: std::collections::VecDeque::new(),
            keep_in_flight: 0,
            broken: None,
            aborted: Vec::new(),
        })
    }

    /// Opt-in: skip (and report) samples with NaN/Inf values instead of failing the step.
    pub fn set_skip_nonfinite(&mut self, skip: bool) {
        self.assembly.skip_nonfinite = skip;
    }

    /// Samples skipped for non-finite values since the last call: (sample, request id, why).
    pub fn take_skipped(&mut self) -> Vec<(SampleKey, String, String)> {
        std::mem::take(&mut self.assembly.skipped)
    }

    /// Captures device tensors through `device` from now on; with `overlap`, a step begins while the
    /// previous device step is still in flight (its forward and copies), which needs a ring of at
    /// least 2 host buffers. Once, before the first step (the assembler thread may later hold the
    /// device's host buffers).
    pub fn set_device(&mut self, device: Box<dyn DeviceBackend>, overlap: bool) -> CoreResult<()> {
        ensure!(
            self.device.is_none() && self.pending.is_empty() && self.assembly.stats.steps == 0 && !self.tracker.in_step(),
            Config,
            "the device path is enabled once, before the first step"
        );
        ensure!(
            !overlap || device.ring() >= 2,
            Config,
            "overlapping device steps needs a ring of at least 2 host buffers (one in flight, one being filled); found {}",
            device.ring()
        );
        self.device = Some(device);
        self.keep_in_flight = usize::from(overlap);
        Ok(())
    }

    pub fn has_device(&self) -> bool {
        self.device.is_some()
    }

    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &SessionStats {
        &self.assembly.stats
    }

    /// The pool sample buffers come from; the writer returns them there.
    pub fn pool(&self) -> std::sync::Arc<crate::pool::BufferPool> {
        std::sync::Arc::clone(&self.assembly.pool)
    }

    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Host bytes held: the step arenas, partly captured requests (and, in the background, completed
    /// samples not yet handed over), the device path's pinned buffers.
    pub fn held_bytes(&self) -> usize {
        self.arena.allocated_bytes()
            + self.spare_arenas.iter().map(Arena::allocated_bytes).sum::<usize>()
            + self.request_bytes()
            + self.device.as_ref().map_or(0, |d| d.allocated().1)
    }

    /// Device bytes held by the device path's arena.
    pub fn device_bytes(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.allocated().0)
    }

    /// Registers a step's scheduler output. Device steps in flight beyond the one overlap leaves (none
    /// without overlap) are assembled first; their outcomes are returned, oldest first.
    pub fn begin_step(&mut self, input: StepInput) -> CoreResult<Vec<StepOutcome>> {
        let prev = self.collect_device_steps(self.keep_in_flight)?;
        self.reclaim(false)?;
        for e in self.tracker.begin_step(input)? {
            if let Event::Aborted { req_id, sample, captured, prompt_len } = e {
                self.assembly.stats.aborted += 1;
                self.aborted.push(Aborted { req_id: req_id.clone(), sample, captured, prompt_len });
                match self.pending.back_mut() {
                    Some(p) => p.drops.push(req_id),
                    None => self.drop_request(&req_id)?,
                }
            }
        }
        self.filled.iter_mut().for_each(|f| *f = false);
        self.imported.iter_mut().for_each(|f| *f = false);
        self.on_device = false;
        Ok(prev)
    }

    /// Forgets a request's partial sample (it ended before its prompt was complete).
    fn drop_request(&mut self, req_id: &str) -> CoreResult<()> {
        self.assembly.drop_request(req_id);
        match &mut self.scattering {
            Scattering::Inline(sc) => sc.drop_request(req_id),
            Scattering::Background(a) => a.drop_request(req_id)?,
        }
        Ok(())
    }

    /// Accounts for every device step still in flight (waiting for their copies), oldest first.
    /// Their samples are in the outcomes (inline) or come later through [`Session::take_ready`].
    pub fn flush(&mut self) -> CoreResult<Vec<StepOutcome>> {
        self.collect_device_steps(0)
    }

    /// Device steps in flight (ended, not yet accounted).
    pub fn steps_in_flight(&self) -> usize {
        self.pending.len()
    }

    fn collect_device_steps(&mut self, keep: usize) -> CoreResult<Vec<StepOutcome>> {
        if let Some(e) = &self.broken {
            return Err(crate::CoreError {
                kind: e.kind,
                message: format!(
                    "an earlier device step could not be collected, so this session captures nothing more (its \
                     requests would have gaps); the first failure: {}",
                    e.message
                ),
            });
        }
        let mut outs = Vec::new();
        while self.pending.len() > keep {
            match self.collect_device_step() {
                Ok(o) => outs.push(o),
                Err(e) => {
                    self.broken = Some(e.clone());
                    return Err(e);
                }
            }
        }
        Ok(outs)
    }

    fn collect_device_step(&mut self) -> CoreResult<StepOutcome> {
        let Some(p) = self.pending.pop_front() else {
            bail!(Compatibility, "no device step is in flight");
        };
        let Some(dev) = self.device.as_mut() else {
            bail!(Compatibility, "a device step is pending but the device path is gone");
        };
        let buf = dev.wait()?;
        let present: Vec<bool> = self.absent.iter().map(|a| !a).collect();
        let (mut out, job) = match self.assembly.account(&self.cfg, &p.plan, p.events, buf.as_rows(), &present, &present) {
            Ok(x) => x,
            Err(e) => {
                dev.recycle(buf)?;
                return Err(e);
            }
        };
        out.completed = self.scatter(job, Some(buf))?;
        for r in &p.drops {
            self.drop_request(r)?;
        }
        out.aborted = std::mem::take(&mut self.aborted);
        Ok(out)
    }

    /// Whether a step is in progress (between `begin_step` and `end_step`).
    pub fn in_step(&self) -> bool {
        self.tracker.in_step()
    }

    /// Whether the step in progress has its plan.
    pub fn planned(&self) -> bool {
        self.tracker.current_plan().is_some()
    }

    /// Prompt rows per request of the planned step, in the runner's order (empty before `plan`).
    pub fn step_rows(&self) -> Vec<(String, usize)> {
        self.tracker
            .current_plan()
            .map(|p| p.segments.iter().map(|s| (s.req_id.clone(), s.len)).collect())
            .unwrap_or_default()
    }

    /// Fixes the step's row layout from the runner's request order.
    pub fn plan(&mut self, order: &[String]) -> CoreResult<&StepPlan> {
        let plan = self.tracker.plan(order)?;
        let (step, rows, runs) = (plan.step, plan.arena_rows, plan.runs());
        self.arena.reset(rows);
        // Every free host buffer of the device's ring is with the assembler thread: wait for one (none
        // free and none out is the device's error to report, in `reset`).
        while self.device_out > 0 && self.device.as_ref().is_some_and(|d| d.free_host() == 0) {
            self.reclaim(true)?;
        }
        if let Some(dev) = self.device.as_mut() {
            ensure!(
                rows <= dev.capacity(),
                ShapeContract,
                "step {step}: {rows} prompt rows do not fit the device arena of {} rows (sized from \
                 max_num_batched_tokens)",
                dev.capacity()
            );
            dev.reset(rows, &runs)?;
        }
        match self.tracker.current_plan() {
            Some(p) => Ok(p),
            None => bail!(Attribution, "the step plan was lost"),
        }
    }

    fn slot_name(&self, slot: usize) -> String {
        let id = self.cfg.layers.ids.get(slot).copied().unwrap_or(usize::MAX);
        format!("layer id {id} ({} convention, slot {slot})", self.cfg.layers.convention.name())
    }

    /// Checks a layer's tensors against the contract and returns the number of rows to read.
    fn check_inputs(&self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>) -> CoreResult<usize> {
        let name = self.slot_name(slot);
        let Some(plan) = self.tracker.current_plan() else {
            bail!(Attribution, "{name}: captured outside a planned step (a forward outside `execute_model`?)");
        };
        ensure!(
            hidden.width() == self.cfg.hidden_size,
            ShapeContract,
            "{name}: expected hidden size {}, found a tensor of shape {:?}",
            self.cfg.hidden_size,
            hidden.shape
        );
        ensure!(
            hidden.dtype == self.cfg.model_dtype,
            ShapeContract,
            "{name}: expected dtype {}, found {}",
            self.cfg.model_dtype,
            hidden.dtype
        );
        ensure!(
            hidden.rows() >= plan.total_tokens,
            ShapeContract,
            "{name}: the step scheduled {} tokens but the layer produced {} rows (shape {:?}); a residual stream \
             sharded across ranks is not replicated and must be gathered",
            plan.total_tokens,
            hidden.rows(),
            hidden.shape
        );
        if let Some(r) = residual {
            ensure!(
                r.shape == hidden.shape && r.dtype == hidden.dtype,
                ShapeContract,
                "{name}: residual {:?} {} does not match hidden states {:?} {}",
                r.shape,
                r.dtype,
                hidden.shape,
                hidden.dtype
            );
        }
        Ok(plan.total_tokens)
    }

    fn mark_filled(&mut self, slot: usize) -> CoreResult<()> {
        let name = self.slot_name(slot);
        ensure!(slot < self.filled.len(), ShapeContract, "{name}: slot {slot} does not exist");
        ensure!(
            !self.filled[slot],
            ShapeContract,
            "{name} was captured twice in one step: a decoder layer ran twice in one forward, or two hooks are \
             registered on it"
        );
        self.filled[slot] = true;
        Ok(())
    }

    /// Captures slot `slot` from `hidden` (+ `residual`) for the planned rows: host tensors into the
    /// arena now, device tensors through the device path on `stream` (a raw CUDA stream handle).
    ///
    /// # Safety
    /// Both descriptors must describe live memory of the described extent that nobody writes while
    /// this call runs (host) or until the work enqueued on `stream` has run (device).
    pub unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, stream: u64) -> CoreResult<()> {
        let rows = self.check_inputs(slot, hidden, residual)?;
        let name = self.slot_name(slot);
        if let Device::Cuda(_) = hidden.device {
            let Some(dev) = self.device.as_mut() else {
                bail!(
                    Compatibility,
                    "{name}: the tensor is on {} but the device path is not enabled here; the Python worker falls \
                     back to host copies when it cannot enable it",
                    hidden.device
                );
            };
            // SAFETY: forwarded from this function's contract.
            unsafe { dev.capture(slot, hidden, residual, stream)? };
            self.on_device = true;
            return self.mark_filled(slot);
        }
        // SAFETY: forwarded from this function's contract.
        let h = unsafe { hidden.cpu_rows(&name, rows)? };
        // SAFETY: as above.
        let r = match residual {
            Some(r) => Some(unsafe { r.cpu_rows(&name, rows)? }),
            None => None,
        };
        let runs = match self.tracker.current_plan() {
            Some(p) => p.runs(),
            None => bail!(Attribution, "{name}: no plan"),
        };
        self.mark_filled(slot)?;
        let mut target = self.arena.target(slot, &name)?;
        capture_rows(&h, r.as_ref(), &runs, &mut target).map_err(|e| crate::core_err!(ShapeContract, "{name}: {e}"))
    }

    /// Ends the step: checks that every slot was captured and commits attribution. Host captures are
    /// assembled now (after any device step still in flight) and the outcomes returned; device
    /// captures later: with overlap, the previous device step is assembled now and this one when the
    /// next ends; without, this one when the next begins. On error the step is abandoned.
    pub fn end_step(&mut self) -> CoreResult<Vec<StepOutcome>> {
        let r = self.end_step_inner();
        if r.is_err() {
            self.tracker.abandon();
        }
        r
    }

    fn end_step_inner(&mut self) -> CoreResult<Vec<StepOutcome>> {
        let step = self.tracker.step();
        let plan = self.tracker.current_plan().cloned();
        if plan.is_some() {
            let missing: Vec<usize> = (0..self.filled.len()).filter(|&s| !self.filled[s] && !self.absent[s]).collect();
            ensure!(
                missing.is_empty(),
                ShapeContract,
                "step {step}: the forward ran but {} never reached its hook; expected all {} layer slots, found {} \
                 (is the model's forward skipping hooked layers?)",
                missing.iter().map(|&s| self.slot_name(s)).collect::<Vec<_>>().join(", "),
                self.filled.len() - self.absent.iter().filter(|&&a| a).count(),
                self.filled.len() - missing.len()
            );
        }
        let events = self.tracker.commit()?;
        let plan = plan.unwrap_or(StepPlan { step, ..Default::default() });
        if self.on_device {
            if let Some(dev) = self.device.as_mut() {
                dev.end_step()?;
            }
            self.pending.push_back(Pending { plan, events, drops: Vec::new() });
            // Overlap: the step before is accounted now, while this one is queued on the device behind
            // it (so that at the end of a run only the last step is left to assemble).
            return match self.keep_in_flight {
                0 => Ok(Vec::new()),
                keep => self.collect_device_steps(keep),
            };
        }
        // A step without device captures (none ran: no forward, or no hooked layer) keeps step order.
        let mut outs = self.collect_device_steps(0)?;
        let present: Vec<bool> = self.absent.iter().map(|a| !a).collect();
        let own: Vec<bool> = present.iter().zip(&self.imported).map(|(p, i)| *p && !i).collect();
        let (mut out, job) = self.assembly.account(&self.cfg, &plan, events, &self.arena, &present, &own)?;
        out.completed = self.scatter(job, None)?;
        out.aborted = std::mem::take(&mut self.aborted);
        outs.push(out);
        Ok(outs)
    }

    /// Drops the step in progress after a failed forward.
    pub fn abandon_step(&mut self) {
        self.tracker.abandon();
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // The assembler thread may be reading the device's pinned buffers: stop it first.
        self.scattering = Scattering::Inline(new_scatter(&self.cfg, &self.assembly.pool));
        self.device = None;
    }
}

#[path = "session_ring.rs"]
mod ring;

#[path = "session_stages.rs"]
mod stages_exchange;

#[cfg(test)]
#[path = "tests/session.rs"]
mod tests;

#[cfg(test)]
#[path = "tests/fuzz.rs"]
mod fuzz;

#[cfg(test)]
#[path = "tests/stages.rs"]
mod stages_tests;

#[cfg(test)]
#[path = "tests/overlap.rs"]
mod overlap_tests;
