//! A capture session on one worker: attribution ([`Tracker`]), capture into the step [`Arena`], the
//! shape contract, and assembly of per-request samples.
//!
//! Per step: [`Session::begin_step`] with the scheduler output; [`Session::plan`] with the order the
//! runner used (at the first hook of the forward); [`Session::capture`] once per layer slot;
//! [`Session::end_step`], which checks the contract, assembles and returns completed samples and the
//! step checksum for the cross-rank check.

use std::collections::{HashMap, HashSet};

use crate::arena::Arena;
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
}

pub struct Session {
    cfg: SessionConfig,
    tracker: Tracker,
    arena: Arena,
    bufs: HashMap<String, Vec<u8>>,
    emitted: HashSet<SampleKey>,
    aborted: Vec<Aborted>,
    stats: SessionStats,
}

impl Session {
    pub fn new(cfg: SessionConfig) -> CoreResult<Session> {
        ensure!(cfg.hidden_size > 0, Config, "hidden size must be positive, found 0");
        let arena = Arena::new(cfg.layers.num_slots(), cfg.hidden_size, cfg.out_dtype);
        Ok(Session {
            cfg,
            tracker: Tracker::new(),
            arena,
            bufs: HashMap::new(),
            emitted: HashSet::new(),
            aborted: Vec::new(),
            stats: SessionStats::default(),
        })
    }

    pub fn config(&self) -> &SessionConfig {
        &self.cfg
    }

    pub fn stats(&self) -> &SessionStats {
        &self.stats
    }

    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Bytes held by the arena and by partly captured requests.
    pub fn held_bytes(&self) -> usize {
        self.arena.allocated_bytes() + self.bufs.values().map(Vec::len).sum::<usize>()
    }

    pub fn begin_step(&mut self, input: StepInput) -> CoreResult<()> {
        let events = self.tracker.begin_step(input)?;
        for e in events {
            if let Event::Aborted { req_id, sample, captured, prompt_len } = e {
                self.bufs.remove(&req_id);
                self.stats.aborted += 1;
                self.aborted.push(Aborted { req_id, sample, captured, prompt_len });
            }
        }
        Ok(())
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
        let rows = self.tracker.plan(order)?.arena_rows;
        self.arena.reset(rows);
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

    /// Captures slot `slot` from `hidden` (+ `residual`) for the planned rows.
    ///
    /// # Safety
    /// Both descriptors must describe live CPU memory of the described extent that nobody writes
    /// while this call runs.
    pub unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>) -> CoreResult<()> {
        let rows = self.check_inputs(slot, hidden, residual)?;
        let name = self.slot_name(slot);
        ensure!(
            hidden.device == Device::Cpu,
            Compatibility,
            "{name}: the tensor is on {}; this path reads host memory (move it with `.cpu()` first)",
            hidden.device
        );
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
        let mut target = self.arena.target(slot, &name)?;
        capture_rows(&h, r.as_ref(), &runs, &mut target).map_err(|e| crate::core_err!(ShapeContract, "{name}: {e}"))
    }

    fn check_finite(&self, plan: &StepPlan) -> CoreResult<()> {
        for slot in 0..self.cfg.layers.num_slots() {
            for seg in &plan.segments {
                let bad: u64 = (0..seg.len).map(|k| u64::from(self.arena.nonfinite(slot, seg.arena_row + k))).sum();
                if bad > 0 {
                    let first = (0..seg.len).find(|&k| self.arena.nonfinite(slot, seg.arena_row + k) > 0).unwrap_or(0);
                    let sample = self.tracker.sample(&seg.req_id).cloned().unwrap_or(SampleKey::Request(seg.req_id.clone()));
                    bail!(
                        NonFinite,
                        "{sample} (request {:?}), {}: {bad} NaN/Inf values in prompt positions {}..{} (first at \
                         position {}), shape [{}, {}] {}; the model produced non-finite activations — check the \
                         weights and the dtype (float16 overflows where bfloat16 does not)",
                        seg.req_id,
                        self.slot_name(slot),
                        seg.dst_pos,
                        seg.dst_pos + seg.len,
                        seg.dst_pos + first,
                        seg.len,
                        self.cfg.hidden_size,
                        self.cfg.out_dtype
                    );
                }
            }
        }
        Ok(())
    }

    fn scatter(&mut self, plan: &StepPlan) {
        let slots = self.cfg.layers.num_slots();
        let rb = self.arena.row_bytes();
        for seg in &plan.segments {
            let prompt_len = self.tracker.prompt_len(&seg.req_id).unwrap_or(0);
            let buf = self.bufs.entry(seg.req_id.clone()).or_insert_with(|| vec![0u8; prompt_len * slots * rb]);
            for k in 0..seg.len {
                let pos = seg.dst_pos + k;
                for s in 0..slots {
                    let o = (pos * slots + s) * rb;
                    buf[o..o + rb].copy_from_slice(self.arena.row(s, seg.arena_row + k));
                }
            }
        }
    }

    /// Ends the step: checks that every slot was captured and every value is finite, assembles, and
    /// returns the completed samples and the step checksum. On error the step is abandoned.
    pub fn end_step(&mut self) -> CoreResult<StepOutcome> {
        let r = self.end_step_inner();
        if r.is_err() {
            self.tracker.abandon();
        }
        r
    }

    fn end_step_inner(&mut self) -> CoreResult<StepOutcome> {
        let step = self.tracker.step();
        let mut out = StepOutcome { step, ..Default::default() };
        if let Some(plan) = self.tracker.current_plan().cloned() {
            let missing = self.arena.missing_slots();
            ensure!(
                missing.is_empty(),
                ShapeContract,
                "step {step}: the forward ran but {} never reached its hook; expected all {} layer slots, found \
                 {} (is the model's forward skipping hooked layers?)",
                missing.iter().map(|&s| self.slot_name(s)).collect::<Vec<_>>().join(", "),
                self.cfg.layers.num_slots(),
                self.cfg.layers.num_slots() - missing.len()
            );
            self.check_finite(&plan)?;
            out.checksum = self.arena.checksum();
            out.rows = plan.arena_rows;
            if self.cfg.assemble {
                self.scatter(&plan);
            }
        }
        for e in self.tracker.commit()? {
            if let Event::Completed { req_id, sample, token_ids } = e {
                ensure!(
                    self.emitted.insert(sample.clone()),
                    Output,
                    "{sample} was completed twice in this run: two prompts carry the same sample index"
                );
                self.stats.samples += 1;
                if !self.cfg.assemble {
                    continue;
                }
                let data = self.bufs.remove(&req_id).unwrap_or_default();
                let (slots, width) = (self.cfg.layers.num_slots(), self.cfg.hidden_size);
                let rows = token_ids.len();
                ensure!(
                    data.len() == rows * slots * width * self.cfg.out_dtype.size(),
                    ShapeContract,
                    "{sample}: assembled {} bytes, expected [{rows}, {slots}, {width}] {}",
                    data.len(),
                    self.cfg.out_dtype
                );
                out.completed.push(Sample { key: sample, req_id, token_ids, data, rows, slots, width, dtype: self.cfg.out_dtype });
            }
        }
        out.aborted = std::mem::take(&mut self.aborted);
        self.stats.steps += 1;
        self.stats.rows += out.rows as u64;
        Ok(out)
    }

    /// Drops the step in progress after a failed forward.
    pub fn abandon_step(&mut self) {
        self.tracker.abandon();
    }
}

#[cfg(test)]
#[path = "tests/session.rs"]
mod tests;
