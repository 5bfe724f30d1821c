//! Assembly: a planned step's captured rows, once in host memory, checked (finite values) and
//! scattered into per-request samples (`[L, n_slots, H]`); completed samples handed out.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::plan::{Event, SampleKey, Segment, StepPlan};
use crate::pool::BufferPool;
use crate::rows::{step_checksum, StepRows};
use crate::sample::Sample;
use crate::session::{SessionConfig, SessionStats, StepOutcome};
use crate::{bail, ensure, error::CoreResult};

pub struct Assembly {
    bufs: HashMap<String, Vec<u8>>,
    emitted: HashSet<SampleKey>,
    pub stats: SessionStats,
    pub pool: Arc<BufferPool>,
    /// Opt-in: a request with NaN/Inf values is skipped (reported, not written) instead of failing the run.
    pub skip_nonfinite: bool,
    /// Requests with non-finite values so far: the first finding, as a message.
    poisoned: HashMap<String, String>,
    /// Samples skipped for non-finite values: (sample, request id, why).
    pub skipped: Vec<(SampleKey, String, String)>,
}

impl Default for Assembly {
    fn default() -> Self {
        Assembly {
            bufs: HashMap::new(),
            emitted: HashSet::new(),
            stats: SessionStats::default(),
            pool: Arc::new(BufferPool::new(256)),
            skip_nonfinite: false,
            poisoned: HashMap::new(),
            skipped: Vec::new(),
        }
    }
}

/// Copies a segment's rows of every slot into its request's buffer (`[L, slots, width]`).
fn scatter_segment(seg: &Segment, buf: &mut [u8], rows: &dyn StepRows, slots: usize, rb: usize) {
    for k in 0..seg.len {
        let pos = seg.dst_pos + k;
        for s in 0..slots {
            let o = (pos * slots + s) * rb;
            buf[o..o + rb].copy_from_slice(rows.row(s, seg.arena_row + k));
        }
    }
}

fn slot_name(cfg: &SessionConfig, slot: usize) -> String {
    let id = cfg.layers.ids.get(slot).copied().unwrap_or(usize::MAX);
    format!("layer id {id} ({} convention, slot {slot})", cfg.layers.convention.name())
}

impl Assembly {
    /// Bytes held by requests whose prompt is not complete yet.
    pub fn held_bytes(&self) -> usize {
        self.bufs.values().map(Vec::len).sum()
    }

    /// Drops a request's partial sample (it ended before its prompt was complete).
    pub fn drop_request(&mut self, req_id: &str) {
        self.poisoned.remove(req_id);
        if let Some(b) = self.bufs.remove(req_id) {
            self.pool.put(b);
        }
    }

    /// Finds NaN/Inf values in the step's prompt rows. By default the first is an error naming sample,
    /// layer, positions and count; with `skip_nonfinite` each affected request is remembered and its
    /// sample is skipped when it completes.
    fn check_finite(&mut self, cfg: &SessionConfig, plan: &StepPlan, rows: &dyn StepRows, present: &[bool]) -> CoreResult<()> {
        for slot in (0..cfg.layers.num_slots()).filter(|&s| present[s]) {
            for seg in &plan.segments {
                let counts: Vec<u32> = (0..seg.len).map(|k| rows.nonfinite(slot, seg.arena_row + k)).collect();
                let bad: u64 = counts.iter().map(|&c| u64::from(c)).sum();
                if bad > 0 {
                    let first = counts.iter().position(|&c| c > 0).unwrap_or(0);
                    let msg = format!(
                        "{} (request {:?}), {}: {bad} NaN/Inf values in prompt positions {}..{} (first at position {}), \
                         shape [{}, {}] {}",
                        seg.sample,
                        seg.req_id,
                        slot_name(cfg, slot),
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

    /// Scatters a step's rows into the requests' buffers, in parallel over requests (each segment
    /// writes only its own request's buffer) when the step is large.
    fn scatter(&mut self, plan: &StepPlan, rows: &(dyn StepRows + Sync), slots: usize, rb: usize) {
        let mut work: Vec<(&Segment, Vec<u8>)> = plan
            .segments
            .iter()
            .map(|seg| {
                let buf = self.bufs.remove(&seg.req_id).unwrap_or_else(|| self.pool.get(seg.prompt_len * slots * rb));
                (seg, buf)
            })
            .collect();
        let bytes = plan.arena_rows * slots * rb;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8).min(work.len());
        if threads <= 1 || bytes < (8 << 20) {
            for (seg, buf) in &mut work {
                scatter_segment(seg, buf, rows, slots, rb);
            }
        } else {
            let per = work.len().div_ceil(threads);
            std::thread::scope(|sc| {
                for chunk in work.chunks_mut(per) {
                    sc.spawn(move || {
                        for (seg, buf) in chunk.iter_mut() {
                            scatter_segment(seg, buf, rows, slots, rb);
                        }
                    });
                }
            });
        }
        for (seg, buf) in work {
            self.bufs.insert(seg.req_id.clone(), buf);
        }
    }

    /// Absorbs a step: checks, checksums, scatters (when this rank assembles) and completes samples.
    /// `present` marks the slots this rank holds (all of them, except on a pipeline stage that does
    /// not assemble: there only its own layers'); checks cover those, the checksum the slots in `own`
    /// (captured by this rank, not received from another stage: what its tensor-parallel peers hold).
    pub fn absorb(
        &mut self,
        cfg: &SessionConfig,
        plan: &StepPlan,
        events: Vec<Event>,
        rows: &(dyn StepRows + Sync),
        present: &[bool],
        own: &[bool],
    ) -> CoreResult<StepOutcome> {
        let slots = cfg.layers.num_slots();
        ensure!(
            !cfg.assemble || present.iter().all(|&p| p),
            Compatibility,
            "step {}: this rank assembles samples but holds only slots {:?}; the other pipeline stages' rows never arrived",
            plan.step,
            (0..slots).filter(|&s| present[s]).collect::<Vec<_>>()
        );
        self.check_finite(cfg, plan, rows, present)?;
        let checksum = step_checksum(rows, own, plan.arena_rows);
        let mut out = StepOutcome { step: plan.step, checksum, rows: plan.arena_rows, ..Default::default() };
        let rb = cfg.hidden_size * cfg.out_dtype.size();
        if cfg.assemble {
            self.scatter(plan, rows, slots, rb);
        }
        for e in events {
            if let Event::Completed { req_id, sample, token_ids } = e {
                ensure!(
                    self.emitted.insert(sample.clone()),
                    Output,
                    "{sample} was completed twice in this run: two prompts carry the same sample index"
                );
                if let Some(why) = self.poisoned.remove(&req_id) {
                    if let Some(b) = self.bufs.remove(&req_id) {
                        self.pool.put(b);
                    }
                    self.stats.skipped += 1;
                    self.skipped.push((sample, req_id, why));
                    continue;
                }
                self.stats.samples += 1;
                if !cfg.assemble {
                    continue;
                }
                let data = self.bufs.remove(&req_id).unwrap_or_default();
                let (rows_n, width) = (token_ids.len(), cfg.hidden_size);
                ensure!(
                    data.len() == rows_n * slots * width * cfg.out_dtype.size(),
                    ShapeContract,
                    "{sample}: assembled {} bytes, expected [{rows_n}, {slots}, {width}] {}",
                    data.len(),
                    cfg.out_dtype
                );
                out.completed.push(Sample { key: sample, req_id, token_ids, data, rows: rows_n, slots, width, dtype: cfg.out_dtype });
            }
        }
        self.stats.steps += 1;
        self.stats.rows += out.rows as u64;
        Ok(out)
    }
}
