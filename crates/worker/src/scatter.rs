//! The heavy half of assembly: copying a step's rows into per-request buffers (`[L, n_slots, H]`) and
//! handing out the buffers of completed requests as samples. It needs only the step's rows in host
//! memory and a [`ScatterJob`] that the bookkeeping half ([`crate::assembly::Assembly`]) prepared, so it
//! can run on the worker's thread (inline) or on the assembler thread ([`crate::assembler`]).
//!
//! Invariants: a request's buffer is written only by the job of the step that scheduled its rows, in
//! step order; a buffer leaves this struct exactly once (a sample, a discard, or a drop).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::plan::{SampleKey, Segment};
use crate::pool::BufferPool;
use crate::rows::StepRows;
use crate::sample::Sample;
use crate::{ensure, error::CoreResult};
use hscapture_kernels::DType;

/// A request whose prompt is complete: its buffer becomes a sample.
#[derive(Clone, Debug)]
pub struct Completion {
    pub req_id: String,
    pub sample: SampleKey,
    pub token_ids: Vec<i64>,
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

/// The sample geometry: slots per row, hidden width, stored dtype.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    pub slots: usize,
    pub width: usize,
    pub dtype: DType,
}

impl Geometry {
    pub fn row_bytes(&self) -> usize {
        self.width * self.dtype.size()
    }
}

/// Copies a segment's rows of every slot into its request's buffer.
fn scatter_segment(seg: &Segment, buf: &mut [u8], rows: &dyn StepRows, slots: usize, rb: usize) {
    for k in 0..seg.len {
        let pos = seg.dst_pos + k;
        for s in 0..slots {
            let o = (pos * slots + s) * rb;
            buf[o..o + rb].copy_from_slice(rows.row(s, seg.arena_row + k));
        }
    }
}

pub struct Scatter {
    geo: Geometry,
    bufs: HashMap<String, Vec<u8>>,
    pool: Arc<BufferPool>,
    /// Bytes held by requests in progress (read by the session from any thread).
    held: Arc<AtomicUsize>,
}

impl Scatter {
    pub fn new(geo: Geometry, pool: Arc<BufferPool>) -> Scatter {
        Scatter { geo, bufs: HashMap::new(), pool, held: Arc::new(AtomicUsize::new(0)) }
    }

    /// A counter of the bytes held by requests whose prompt is not complete yet.
    pub fn held_counter(&self) -> Arc<AtomicUsize> {
        Arc::clone(&self.held)
    }

    fn update_held(&self) {
        self.held.store(self.bufs.values().map(Vec::len).sum(), Ordering::Relaxed);
    }

    /// Drops a request's partial sample (it ended before its prompt was complete).
    pub fn drop_request(&mut self, req_id: &str) {
        if let Some(b) = self.bufs.remove(req_id) {
            self.pool.put(b);
        }
        self.update_held();
    }

    /// Runs one step's job against that step's rows; returns the completed samples.
    pub fn run(&mut self, job: ScatterJob, rows: &(dyn StepRows + Sync)) -> CoreResult<Vec<Sample>> {
        self.scatter(&job.segments, rows);
        let g = self.geo;
        let mut out = Vec::with_capacity(job.completions.len());
        for c in job.completions {
            let data = self.bufs.remove(&c.req_id).unwrap_or_default();
            let n = c.token_ids.len();
            ensure!(
                data.len() == n * g.slots * g.row_bytes(),
                ShapeContract,
                "{}: assembled {} bytes, expected [{n}, {}, {}] {}",
                c.sample,
                data.len(),
                g.slots,
                g.width,
                g.dtype
            );
            out.push(Sample { key: c.sample, req_id: c.req_id, token_ids: c.token_ids, data, rows: n, slots: g.slots, width: g.width, dtype: g.dtype });
        }
        for r in &job.discard {
            if let Some(b) = self.bufs.remove(r) {
                self.pool.put(b);
            }
        }
        self.update_held();
        Ok(out)
    }

    /// Scatters a step's rows into the requests' buffers, in parallel over requests (each segment
    /// writes only its own request's buffer) when the step is large.
    fn scatter(&mut self, segments: &[Segment], rows: &(dyn StepRows + Sync)) {
        let (slots, rb) = (self.geo.slots, self.geo.row_bytes());
        let mut work: Vec<(&Segment, Vec<u8>)> = segments
            .iter()
            .map(|seg| {
                let buf = self.bufs.remove(&seg.req_id).unwrap_or_else(|| self.pool.get(seg.prompt_len * slots * rb));
                (seg, buf)
            })
            .collect();
        let bytes: usize = segments.iter().map(|s| s.len).sum::<usize>() * slots * rb;
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
}
