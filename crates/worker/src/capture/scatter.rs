//! The heavy half of assembly: copying a step's rows into per-request buffers (`[L, n_slots, H]`) and
//! handing out the buffers of completed requests as samples. It needs only the step's rows in host
//! memory and a [`ScatterJob`] that the bookkeeping half ([`crate::capture::accounting::Assembly`]) prepared, so it
//! can run on the worker's thread (inline) or on the assembler thread ([`crate::capture::assembler`]).
//!
//! Invariants: a request's buffer is written only by the job of the step that scheduled its rows, in
//! step order; a buffer leaves this struct exactly once (a sample, a discard, or a drop).

use foldhash::{HashMap, HashMapExt};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::attribution::plan::Segment;
pub use crate::capture::refusals::{Refusal, RefusalHook, Refusals, SYSTEMATIC};
use crate::capture::rows::StepRows;
use crate::sample::degenerate::degenerate_slot;
use crate::sample::pool::BufferPool;
use crate::sample::Sample;
use crate::sample::SampleKey;
use crate::{ensure, error::CoreResult};
use hscapture_kernels::DType;

/// A request whose prompt is complete: its buffer becomes a sample.
#[derive(Clone, Debug)]
pub struct Completion {
    pub req_id: String,
    pub sample: SampleKey,
    pub token_ids: Vec<i64>,
    pub loss_mask: Option<Vec<u8>>,
    /// The request captured generated tokens: rows past `token_ids` (computed before its finish was known) are
    /// not part of the sample.
    pub grows: bool,
}

/// What one step asks of the scatter half, in order: copy `segments`, emit `completions`, recycle the
/// buffers of `discard` (requests skipped for non-finite values).
#[derive(Clone, Debug, Default)]
pub struct ScatterJob {
    pub step: u64,
    pub segments: Vec<Segment>,
    pub completions: Vec<Completion>,
    pub discard: Vec<String>,
}

impl ScatterJob {
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty() && self.completions.is_empty() && self.discard.is_empty()
    }
}

/// The sample geometry: slots per row, hidden width, the output dtype, and whether rows arrive quantized (fp8
/// codes, one byte per value, and a scale per row: a quantizing device's).
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub slots: usize,
    pub width: usize,
    pub dtype: DType,
    pub quantized: bool,
}

impl Geometry {
    pub fn row_bytes(&self) -> usize {
        self.width * if self.quantized { 1 } else { self.dtype.size() }
    }

    /// Bytes of one token in a request buffer: its slots' values and, quantized, its f32 scale after them (each
    /// token's scale beside its codes, so that a sample that grows by decode rows grows by whole tokens).
    pub fn token_bytes(&self) -> usize {
        self.slots * self.row_bytes() + if self.quantized { 4 } else { 0 }
    }

    /// A request buffer of `tokens` tokens (`token_bytes` each).
    pub fn sample_bytes(&self, tokens: usize) -> usize {
        tokens * self.token_bytes()
    }
}

/// Copies a segment's rows of every slot into its request's buffer (and, quantized, each token's scale after them).
fn scatter_segment(seg: &Segment, buf: &mut [u8], rows: &dyn StepRows, g: Geometry) -> CoreResult<()> {
    let (slots, rb, tb) = (g.slots, g.row_bytes(), g.token_bytes());
    for k in 0..seg.len {
        let pos = seg.dst_pos + k;
        for s in 0..slots {
            let o = pos * tb + s * rb;
            buf[o..o + rb].copy_from_slice(rows.row(s, seg.arena_row + k));
        }
        if g.quantized {
            let Some(scale) = rows.scale(seg.arena_row + k) else {
                crate::bail!(Compatibility, "{}: the step's rows carry no fp8 scales, but the session stores fp8 codes", seg.sample);
            };
            let o = pos * tb + slots * rb;
            buf[o..o + 4].copy_from_slice(&scale.to_le_bytes());
        }
    }
    Ok(())
}

/// A quantized buffer's per-token scales taken out, its codes packed to `[tokens, slots, width]` in place.
fn split_scales(g: Geometry, data: &mut Vec<u8>, tokens: usize) -> Vec<f32> {
    let (codes, tb) = (g.slots * g.row_bytes(), g.token_bytes());
    let mut scales = Vec::with_capacity(tokens);
    for t in 0..tokens {
        let s = &data[t * tb + codes..t * tb + codes + 4];
        scales.push(f32::from_le_bytes([s[0], s[1], s[2], s[3]]));
        data.copy_within(t * tb..t * tb + codes, t * codes);
    }
    data.truncate(tokens * codes);
    scales
}

/// Where completed samples go from the scatter threads (the writer's queue).
pub type Emit<'a> = &'a (dyn Fn(Sample) -> CoreResult<()> + Sync);

/// One segment of a step: the request's buffer, its completion if this step completes it (with its
/// index in the job's completion order), and, once copied, what became of a completed sample.
struct Work<'a> {
    seg: &'a Segment,
    buf: Vec<u8>,
    done: Option<(usize, Completion)>,
    out: Option<CoreResult<(usize, Finished)>>,
}

/// What became of a completed request's buffer.
enum Finished {
    /// Handed to `emit`.
    Emitted,
    Kept(Sample),
    Refused(Refusal),
}

/// A completed request's buffer as a sample: handed to `emit`, returned, or refused.
fn finish(g: Geometry, names: &[String], c: Completion, mut data: Vec<u8>, emit: Option<Emit<'_>>) -> CoreResult<Finished> {
    let n = c.token_ids.len();
    if c.grows && data.len() > g.sample_bytes(n) {
        data.truncate(g.sample_bytes(n));
    }
    ensure!(
        data.len() == g.sample_bytes(n),
        ShapeContract,
        "{}: assembled {} bytes, expected [{n}, {}, {}] {}",
        c.sample,
        data.len(),
        g.slots,
        g.width,
        g.dtype
    );
    let scales: Option<Vec<f32>> = g.quantized.then(|| split_scales(g, &mut data, n));
    if let Some((slot, what)) = degenerate_slot(&c.token_ids, g.slots, g.row_bytes(), &data, scales.as_deref()) {
        let name = names.get(slot).cloned().unwrap_or_else(|| format!("slot {slot}"));
        let why = format!("{name} is {}; expected the states of different tokens to differ", what.describe(n));
        return Ok(Finished::Refused(Refusal { sample: c.sample, req_id: c.req_id, why }));
    }
    let sample = Sample {
        key: c.sample,
        req_id: c.req_id,
        token_ids: c.token_ids,
        data,
        rows: n,
        slots: g.slots,
        width: g.width,
        dtype: g.dtype,
        loss_mask: c.loss_mask,
        scales,
    };
    match emit {
        Some(f) => f(sample).map(|()| Finished::Emitted),
        None => Ok(Finished::Kept(sample)),
    }
}

/// Copies one segment and, if its request is complete, finishes the sample.
fn work_one(w: &mut Work<'_>, rows: &dyn StepRows, g: Geometry, names: &[String], emit: Option<Emit<'_>>) {
    if let Err(e) = scatter_segment(w.seg, &mut w.buf, rows, g) {
        w.out = Some(Err(e));
        return;
    }
    if let Some((i, c)) = w.done.take() {
        let data = std::mem::take(&mut w.buf);
        w.out = Some(finish(g, names, c, data, emit).map(|f| (i, f)));
    }
}

/// Scatters a step's segments, in parallel over requests (each segment writes only its own
/// request's buffer) when the step is large.
fn scatter_all(work: &mut [Work<'_>], rows: &(dyn StepRows + Sync), g: Geometry, names: &[String], emit: Option<Emit<'_>>) {
    let bytes: usize = work.iter().map(|w| w.seg.len).sum::<usize>() * g.slots * g.row_bytes();
    // Read once: `available_parallelism` reads the affinity mask and the cgroup's quota files on every call.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let threads = cores.min(8).min(work.len());
    if threads <= 1 || bytes < (8 << 20) {
        work.iter_mut().for_each(|w| work_one(w, rows, g, names, emit));
        return;
    }
    let per = work.len().div_ceil(threads);
    std::thread::scope(|sc| {
        for chunk in work.chunks_mut(per) {
            sc.spawn(move || chunk.iter_mut().for_each(|w| work_one(w, rows, g, names, emit)));
        }
    });
}

/// A request in progress: its buffer and how many rows of it are written (its prompt's prefix `0..rows`).
struct Partial {
    data: Vec<u8>,
    rows: usize,
}

pub struct Scatter {
    geo: Geometry,
    /// Each slot's name in errors (its layer id and convention).
    names: Arc<[String]>,
    bufs: HashMap<String, Partial>,
    pool: Arc<BufferPool>,
    /// Bytes held by requests in progress (read by the session from any thread).
    held: Arc<AtomicUsize>,
    refusals: Arc<Refusals>,
    /// Degenerate samples since the last sound one.
    degenerate_run: usize,
}

impl Scatter {
    pub fn new(geo: Geometry, pool: Arc<BufferPool>) -> Scatter {
        Scatter::named(geo, pool, (0..geo.slots).map(|s| format!("slot {s}")).collect(), Arc::default())
    }

    /// As `new`, naming each slot in errors, refusing degenerate samples into `refusals`.
    pub fn named(geo: Geometry, pool: Arc<BufferPool>, names: Arc<[String]>, refusals: Arc<Refusals>) -> Scatter {
        Scatter { geo, names, bufs: HashMap::new(), pool, held: Arc::new(AtomicUsize::new(0)), refusals, degenerate_run: 0 }
    }

    /// Counts a finished sample: refused ones are reported (and their hook called) at once; a run of
    /// [`SYSTEMATIC`] of them with none sound between is the capture's error.
    fn settle(&mut self, f: Finished, kept: &mut Vec<Sample>) -> CoreResult<()> {
        match f {
            Finished::Refused(r) => {
                self.degenerate_run += 1;
                let (sample, why) = (r.sample.clone(), r.why.clone());
                self.refusals.push(r);
                ensure!(
                    self.degenerate_run < SYSTEMATIC,
                    DegenerateStates,
                    "{sample}: {why}, and so were the {} samples before it, none sound between them: the hook reads a \
                     tensor that no layer computes this way (a buffer never written or reused, a constant). Check the \
                     capture point (layer ids, convention) and the model's forward",
                    SYSTEMATIC - 1
                );
            }
            Finished::Kept(s) => {
                self.degenerate_run = 0;
                kept.push(s);
            }
            Finished::Emitted => self.degenerate_run = 0,
        }
        Ok(())
    }

    /// Rows arrive as fp8 codes and scales from now on (a quantizing device). Only while no request is held.
    pub fn set_quantized(&mut self) -> CoreResult<()> {
        ensure!(self.bufs.is_empty(), Config, "the scatter's rows become fp8 codes only before the first step");
        self.geo.quantized = true;
        Ok(())
    }

    /// A counter of the bytes held by requests whose prompt is not complete yet.
    pub fn held_counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.held)
    }

    fn update_held(&self) {
        self.held.store(self.bufs.values().map(|p| p.data.len()).sum(), Ordering::Relaxed);
    }

    /// Drops a request's partial sample (it ended before its prompt was complete).
    pub fn drop_request(&mut self, req_id: &str) {
        if let Some(p) = self.bufs.remove(req_id) {
            self.pool.put(p.data);
        }
        self.update_held();
    }

    /// Rows written so far for `req_id` (0 without a held buffer).
    fn rows_held(&self, req_id: &str) -> usize {
        self.bufs.get(req_id).map_or(0, |p| p.rows)
    }

    /// Checks that the job keeps every request's rows a prefix of its prompt and completes only whole
    /// prompts. Attribution guarantees both (plan.rs); they are checked again here, before anything is
    /// copied, because recycled buffers are not zeroed: a request whose earlier rows were lost (a failed
    /// step, a panic on this thread) would otherwise be written with another sample's bytes in the gap.
    fn check_prefixes(&self, job: &ScatterJob) -> CoreResult<()> {
        let mut after: HashMap<&str, usize> = HashMap::new();
        for seg in &job.segments {
            let have = after.get(seg.req_id.as_str()).copied().unwrap_or_else(|| self.rows_held(&seg.req_id));
            ensure!(
                seg.dst_pos <= have && (seg.grows || seg.dst_pos + seg.len <= seg.prompt_len),
                Attribution,
                "{}: prompt rows {}..{} of {} arrived with {have} rows before them; the request's rows would have a \
                 gap (an earlier step's rows were lost)",
                seg.sample,
                seg.dst_pos,
                seg.dst_pos + seg.len,
                seg.prompt_len
            );
            after.insert(&seg.req_id, seg.dst_pos + seg.len);
        }
        for c in &job.completions {
            let have = after.get(c.req_id.as_str()).copied().unwrap_or_else(|| self.rows_held(&c.req_id));
            ensure!(
                have == c.token_ids.len() || (c.grows && have > c.token_ids.len()),
                Attribution,
                "{}: completed with {have} of its {} prompt rows copied; an earlier step's rows were lost",
                c.sample,
                c.token_ids.len()
            );
        }
        Ok(())
    }

    /// Runs one step's job against that step's rows. A request completed by this step becomes a
    /// sample as soon as its rows are copied, on whichever scatter thread copied them: handed to
    /// `emit` there (the writer, which so starts while the rest of the step is still copied), or,
    /// without `emit`, returned in the job's completion order.
    pub fn run(&mut self, job: ScatterJob, rows: &(dyn StepRows + Sync), emit: Option<Emit<'_>>) -> CoreResult<Vec<Sample>> {
        let g = self.geo;
        self.check_prefixes(&job)?;
        let mut completing: HashMap<String, (usize, Completion)> =
            job.completions.into_iter().enumerate().map(|(i, c)| (c.req_id.clone(), (i, c))).collect();
        let mut work: Vec<Work<'_>> = job
            .segments
            .iter()
            .map(|seg| {
                let mut buf = match self.bufs.remove(&seg.req_id) {
                    Some(p) => p.data,
                    None => self.pool.get(g.sample_bytes(seg.prompt_len)),
                };
                if seg.grows && buf.len() < g.sample_bytes(seg.dst_pos + seg.len) {
                    buf.resize(g.sample_bytes(seg.dst_pos + seg.len), 0); // decode rows: one more per step
                }
                Work { seg, buf, done: completing.remove(&seg.req_id), out: None }
            })
            .collect();
        scatter_all(&mut work, rows, g, &self.names, emit);
        let mut finished = Vec::new();
        let mut first_err = None;
        for w in work {
            match w.out {
                Some(Ok(f)) => finished.push(f),
                Some(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                None => {
                    self.bufs.insert(w.seg.req_id.clone(), Partial { data: w.buf, rows: w.seg.dst_pos + w.seg.len });
                }
            }
        }
        // A request completed without rows in this step (none in practice: its last rows complete it).
        let mut rest: Vec<(usize, Completion)> = completing.into_values().collect();
        rest.sort_by_key(|(i, _)| *i);
        for (i, c) in rest {
            let data = self.bufs.remove(&c.req_id).map(|p| p.data).unwrap_or_default();
            match finish(g, &self.names, c, data, emit) {
                Ok(f) => finished.push((i, f)),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        finished.sort_by_key(|(i, _)| *i);
        let mut kept = Vec::new();
        for (_, f) in finished {
            if let Err(e) = self.settle(f, &mut kept) {
                first_err.get_or_insert(e);
            }
        }
        for r in &job.discard {
            if let Some(p) = self.bufs.remove(r) {
                self.pool.put(p.data);
            }
        }
        self.update_held();
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok(kept)
    }
}

#[cfg(test)]
#[path = "tests/scatter.rs"]
mod tests;
