//! The step protocol of one rank: the open step and its plan (attribution, [`Tracker`]), the layer
//! slots it holds ([`SlotMask`]), the shape contract each capture meets, and the hook called when a
//! request's sample is opened or its prompt completes. It holds no rows: the session routes each
//! admitted capture to the step buffers or the device path.

use std::sync::Arc;

use crate::attribution::plan::{Event, StepInput, StepPlan, Tracker};
use crate::capture::arena::Arena;
use crate::capture::contract::{check_layer, slot_name};
use crate::capture::slots::SlotMask;
use crate::capture::stage_exchange;
use crate::capture::step::SessionConfig;
use crate::capture::tensor::TensorDesc;
use crate::{bail, ensure, error::CoreResult};
use hscapture_kernels::RowRun;

/// Called with a request id when its sample opens (its first step, when it captures generated tokens; rows None)
/// or completes (its rows), at the end of that step: before its rows are accounted and before vLLM can answer the
/// request (the per-request locks of a staging directory are taken there).
pub type CompletionHook = Arc<dyn Fn(&str, Option<usize>) -> CoreResult<()> + Send + Sync>;

pub struct StepProtocol {
    cfg: SessionConfig,
    tracker: Tracker,
    slots: SlotMask,
    on_complete: Option<CompletionHook>,
}

/// A capture the contract admitted: its slot's name and the planned rows to read.
pub struct Admitted {
    pub name: String,
    pub rows: usize,
    pub runs: Vec<RowRun>,
}

impl StepProtocol {
    pub fn new(cfg: SessionConfig) -> StepProtocol {
        let slots = SlotMask::new(cfg.layers.num_slots());
        StepProtocol { cfg, tracker: Tracker::new(), slots, on_complete: None }
    }

    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    pub fn slots(&self) -> &SlotMask {
        &self.slots
    }

    pub fn set_completion_hook(&mut self, hook: CompletionHook) {
        self.on_complete = Some(hook);
    }

    pub fn slot_name(&self, slot: usize) -> String {
        slot_name(&self.cfg.layers, slot)
    }

    fn notify(&self, req_id: &str, rows: Option<usize>) -> CoreResult<()> {
        self.on_complete.as_ref().map_or(Ok(()), |hook| hook(req_id, rows))
    }

    /// Opens a step from the scheduler output; returns attribution's events (the hook has run for each
    /// sample opened: it completes after its response, so what must precede that is taken now).
    pub fn begin(&mut self, input: StepInput) -> CoreResult<Vec<Event>> {
        let events = self.tracker.begin_step(input)?;
        for e in &events {
            if let Event::Opened { req_id } = e {
                self.notify(req_id, None)?;
            }
        }
        self.slots.new_step();
        Ok(events)
    }

    /// Fixes the step's row layout from the runner's request order.
    pub fn plan(&mut self, order: &[String]) -> CoreResult<&StepPlan> {
        self.tracker.plan(order)
    }

    pub fn current_plan(&self) -> Option<&StepPlan> {
        self.tracker.current_plan()
    }

    pub fn step(&self) -> u64 {
        self.tracker.step()
    }

    pub fn in_step(&self) -> bool {
        self.tracker.in_step()
    }

    /// Checks slot `slot`'s tensors against the planned step and marks the slot held (each slot once
    /// per step).
    pub fn admit(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>) -> CoreResult<Admitted> {
        let name = self.slot_name(slot);
        let Some(plan) = self.tracker.current_plan() else {
            bail!(Attribution, "{name}: captured outside a planned step (a forward outside `execute_model`?)");
        };
        let rows = check_layer(&self.cfg, plan, &name, hidden, residual)?;
        let runs = plan.runs();
        self.slots.fill(slot, &name)?;
        Ok(Admitted { name, rows, runs })
    }

    /// Closes the step: with `check_slots`, every expected slot held (when a forward ran; a device checks its
    /// stamps instead), attribution committed, the hook called for each request whose prompt completed. Returns
    /// the step's plan (an empty one when no forward ran) and events.
    pub fn end(&mut self, check_slots: bool) -> CoreResult<(StepPlan, Vec<Event>)> {
        let step = self.tracker.step();
        let plan = self.tracker.current_plan().cloned();
        if plan.is_some() && check_slots {
            let missing = self.slots.missing();
            ensure!(
                missing.is_empty(),
                ShapeContract,
                "step {step}: the forward ran but {} never reached its hook; expected all {} layer slots, found {} \
                 (is the model's forward skipping hooked layers?)",
                missing.iter().map(|&s| self.slot_name(s)).collect::<Vec<_>>().join(", "),
                self.slots.expected(),
                self.slots.expected() - missing.len()
            );
        }
        let events = self.tracker.commit()?;
        for e in &events {
            if let Event::Completed { req_id, token_ids, .. } = e {
                self.notify(req_id, Some(token_ids.len()))?;
            }
        }
        Ok((plan.unwrap_or(StepPlan { step, ..Default::default() }), events))
    }

    /// Drops the step in progress (a failed forward, or a failed end).
    pub fn abandon(&mut self) {
        self.tracker.abandon();
    }

    /// Declares the slots this rank will neither capture nor receive (another pipeline stage's layers).
    pub fn set_absent(&mut self, slots: &[usize]) -> CoreResult<()> {
        ensure!(
            slots.is_empty() || !self.cfg.assemble,
            Config,
            "the assembling rank must hold every slot; slots {slots:?} would be missing from its samples"
        );
        self.slots.set_absent(slots)
    }

    /// This step's rows of `slots` (captured here, in `arena`) as one message for the assembling stage.
    pub fn export(&self, arena: &Arena, slots: &[usize]) -> CoreResult<Vec<u8>> {
        stage_exchange::export(self.step(), self.current_plan(), &self.slots, arena, slots, |s| self.slot_name(s))
    }

    /// Writes another stage's message into `arena` and marks its slots held; returns them.
    pub fn import(&mut self, arena: &mut Arena, bytes: &[u8], from: &str) -> CoreResult<Vec<usize>> {
        let (step, layers) = (self.tracker.step(), &self.cfg.layers);
        stage_exchange::import(step, self.tracker.current_plan(), &mut self.slots, arena, bytes, from, |s| slot_name(layers, s))
    }
}

#[cfg(test)]
#[path = "tests/protocol.rs"]
mod tests;
