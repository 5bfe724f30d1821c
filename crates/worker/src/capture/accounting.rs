//! Accounting, the bookkeeping half of assembly: a planned step's captured rows, once in host memory,
//! checked (finite values), checksummed, and turned into a [`ScatterJob`]: which rows go to which
//! request and which samples are complete. The copying itself, the other half, is
//! [`crate::capture::scatter::Scatter`]'s, inline or on the assembler thread. Everything here reads only
//! the per-row counts and checksums, so it stays on the worker's thread and its errors surface at the
//! step that found them.

use foldhash::{HashMap, HashSet};

use crate::attribution::plan::{Event, StepPlan};
use crate::capture::contract::slot_name;
use crate::capture::rows::{step_checksum, StepRows};
use crate::capture::scatter::{Completion, ScatterJob};
use crate::capture::step::{SessionConfig, SessionStats, StepOutcome};
use crate::sample::SampleKey;
use crate::{bail, ensure, error::CoreResult};

#[derive(Default)]
pub struct Accounting {
    emitted: HashSet<SampleKey>,
    pub stats: SessionStats,
    /// Opt-in: a request with NaN/Inf values is skipped (reported, not written) instead of failing the run.
    pub skip_nonfinite: bool,
    /// Requests with non-finite values so far: the first finding, as a message.
    poisoned: HashMap<String, String>,
    /// Samples skipped for non-finite values: (sample, request id, why).
    pub skipped: Vec<(SampleKey, String, String)>,
    /// Requests whose rows go past their prompt (they capture generated tokens).
    growing: HashSet<String>,
}

impl Accounting {
    /// Forgets a request that ended before its prompt was complete (its buffer is the scatter half's).
    pub fn drop_request(&mut self, req_id: &str) {
        self.poisoned.remove(req_id);
        self.growing.remove(req_id);
    }

    /// Finds NaN/Inf values in the step's prompt rows. By default the first is an error naming sample,
    /// layer, positions and count; with `skip_nonfinite` each affected request is remembered and its
    /// sample is skipped when it completes.
    fn check_finite(&mut self, cfg: &SessionConfig, plan: &StepPlan, rows: &dyn StepRows, present: &[bool]) -> CoreResult<()> {
        for slot in (0..cfg.layers.num_slots()).filter(|&s| present[s]) {
            for seg in &plan.segments {
                // Every row of every step is checked: nothing is allocated unless a value is bad.
                let count = |k: usize| rows.nonfinite(slot, seg.arena_row + k);
                let bad: u64 = (0..seg.len).map(|k| u64::from(count(k))).sum();
                if bad > 0 {
                    let first = (0..seg.len).position(|k| count(k) > 0).unwrap_or(0);
                    let msg = format!(
                        "{} (request {:?}), {}: {bad} NaN/Inf values in prompt positions {}..{} (first at position {}), \
                         shape [{}, {}] {}",
                        seg.sample,
                        seg.req_id,
                        slot_name(&cfg.layers, slot),
                        seg.dst_pos,
                        seg.dst_pos + seg.len,
                        seg.dst_pos + first,
                        seg.len,
                        cfg.hidden_size,
                        cfg.out_dtype
                    );
                    if self.skip_nonfinite {
                        self.poisoned.entry(seg.req_id.clone()).or_insert(msg);
                        continue;
                    }
                    bail!(
                        NonFinite,
                        "{msg}; the model produced non-finite activations — check the weights and the dtype (float16 \
                         overflows where bfloat16 does not), or skip such samples (`on_nonfinite: skip`, \
                         `hscapture extract --on-nonfinite skip`): they are then listed in the manifest"
                    );
                }
            }
        }
        Ok(())
    }

    /// Accounts for a step: checks, checksums, and (when this rank assembles) the job that scatters its
    /// rows and completes its samples. `present` marks the slots this rank holds (all of them, except on
    /// a pipeline stage that does not assemble: there only its own layers'); checks cover those, the
    /// checksum the slots in `own` (captured by this rank, not received from another stage: what its
    /// tensor-parallel peers hold). The outcome's `completed` is left for the scatter half to fill.
    pub fn account(
        &mut self,
        cfg: &SessionConfig,
        plan: StepPlan,
        events: Vec<Event>,
        rows: &dyn StepRows,
        present: &[bool],
        own: &[bool],
    ) -> CoreResult<(StepOutcome, ScatterJob)> {
        let slots = cfg.layers.num_slots();
        ensure!(
            !cfg.assemble || present.iter().all(|&p| p),
            Compatibility,
            "step {}: this rank assembles samples but holds only slots {:?}; the other pipeline stages' rows never arrived",
            plan.step,
            (0..slots).filter(|&s| present[s]).collect::<Vec<_>>()
        );
        self.check_finite(cfg, &plan, rows, present)?;
        let checksum = step_checksum(rows, own, plan.arena_rows);
        let out = StepOutcome { step: plan.step, checksum, rows: plan.arena_rows, ..Default::default() };
        let mut job = ScatterJob { step: plan.step, ..Default::default() };
        if cfg.assemble {
            // A growing request is in every decode step: its id is copied once, when it first grows.
            for s in plan.segments.iter().filter(|s| s.grows) {
                if !self.growing.contains(&s.req_id) {
                    self.growing.insert(s.req_id.clone());
                }
            }
            job.segments = plan.segments;
        }
        for e in events {
            if let Event::Completed { req_id, sample, token_ids, loss_mask } = e {
                // Indexed samples come from the input, where two prompts may carry one index; a request id is
                // completed once by construction (plan.rs), and a server's ids would grow this set for ever.
                ensure!(
                    matches!(sample, SampleKey::Request(_)) || self.emitted.insert(sample.clone()),
                    Output,
                    "{sample} was completed twice in this run: two prompts carry the same sample index"
                );
                if let Some(why) = self.poisoned.remove(&req_id) {
                    self.stats.skipped += 1;
                    self.skipped.push((sample, req_id.clone(), why));
                    if cfg.assemble {
                        job.discard.push(req_id);
                    }
                    continue;
                }
                self.stats.samples += 1;
                if cfg.assemble {
                    let grows = self.growing.remove(&req_id);
                    job.completions.push(Completion { req_id, sample, token_ids, loss_mask, grows });
                }
            }
        }
        self.stats.steps += 1;
        self.stats.rows += out.rows as u64;
        Ok((out, job))
    }
}
