//! The pinned host side of the device path: a ring of host buffers the copy stream fills, one step each, in size
//! classes (a step takes the smallest free buffer that holds its rows: `host_pool.rs`).
//!
//! A buffer is taken for a step (`take`), filled by that step's copies, queued in flight (`end`), handed out once
//! its copies are done (`wait_oldest`, as a [`CudaPinnedStep`] that shares it) and given back (`recycle`). The
//! copies of a later step go into a buffer only through [`HostRing::current_mut`], which refuses one that a
//! handed-out step still shares: no copy can write rows the assembler thread reads.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DeviceRepr, DriverError, PinnedHostSlice};

use crate::capture::device::PinnedStep;
use crate::capture::host_pool::HostPool;
use crate::capture::rows::{SlotRows, StepRows};
use crate::{bail, core_err, error::CoreResult};
use hscapture_kernels::armed::STAMP_WORDS;
use hscapture_kernels::Stamp;

fn cuda_err(what: &str, e: DriverError) -> crate::CoreError {
    core_err!(Compatibility, "CUDA: {what}: {e:?}")
}

/// `n` elements of page-locked host memory, not write-combined (the assembler thread reads it).
fn pinned<T: DeviceRepr>(ctx: &Arc<CudaContext>, n: usize) -> Result<PinnedHostSlice<T>, DriverError> {
    // SAFETY: u8/u32/u64/f32 are valid for every bit pattern, the pages come zeroed from the kernel, and a row is
    // read only once a copy of the step that holds it wrote it (the step's plan names the rows it copied).
    unsafe { ctx.alloc_pinned_with_flags::<T>(n, 0) }
}

/// One pinned host buffer: per slot the step's rows (fp8: codes, a byte per value), their checksums and
/// non-finite counts; each slot's stamp; with fp8 a scale per row. Read only after the buffer's `copies_done` event
/// (`HostRing`), which follows every copy into it: the context tracks no events of its own (`launch.rs`).
pub struct HostBuf {
    pub data: Vec<PinnedHostSlice<u8>>,
    pub sums: Vec<PinnedHostSlice<u64>>,
    pub bad: Vec<PinnedHostSlice<u32>>,
    pub stamps: PinnedHostSlice<u32>,
    pub scales: Option<PinnedHostSlice<f32>>,
    /// Bytes of one row in `data` (fp8: the width).
    row_bytes: usize,
}

impl HostBuf {
    fn new(ctx: &Arc<CudaContext>, slots: usize, capacity: usize, row_bytes: usize, quantize: bool) -> Result<HostBuf, DriverError> {
        let stamps = pinned(ctx, slots * STAMP_WORDS)?;
        let mut b = HostBuf { data: Vec::new(), sums: Vec::new(), bad: Vec::new(), stamps, scales: None, row_bytes };
        for _ in 0..slots {
            b.data.push(pinned(ctx, capacity * row_bytes)?);
            b.sums.push(pinned(ctx, capacity)?);
            b.bad.push(pinned(ctx, capacity)?);
        }
        if quantize {
            b.scales = Some(pinned(ctx, capacity)?);
        }
        Ok(b)
    }

    /// The rows, once every copy into this buffer is done.
    fn view(&self) -> Result<SlotRows<'_>, DriverError> {
        Ok(SlotRows {
            data: self.data.iter().map(|d| d.as_slice()).collect::<Result<_, _>>()?,
            sums: self.sums.iter().map(|d| d.as_slice()).collect::<Result<_, _>>()?,
            bad: self.bad.iter().map(|d| d.as_slice()).collect::<Result<_, _>>()?,
            scales: self.scales.as_ref().map(|s| s.as_slice()).transpose()?,
            row_bytes: self.row_bytes,
        })
    }
}

/// A step's rows in one pinned buffer of the ring, handed out by `wait` (shared with the ring until recycled).
pub struct CudaPinnedStep {
    ring_slot: usize,
    buf: Arc<HostBuf>,
}

impl PinnedStep for CudaPinnedStep {
    fn ring_slot(&self) -> usize {
        self.ring_slot
    }
    fn rows(&self) -> CoreResult<Box<dyn StepRows + Sync + '_>> {
        Ok(Box::new(self.buf.view().map_err(|e| cuda_err("reading a step's host buffer", e))?))
    }
    fn stamps(&self) -> CoreResult<Vec<Stamp>> {
        let words = self.buf.stamps.as_slice().map_err(|e| cuda_err("reading a step's stamps", e))?;
        Ok(words.chunks_exact(STAMP_WORDS).map(Stamp::from_words).collect())
    }
}

pub struct HostRing {
    bufs: Vec<Arc<HostBuf>>,
    /// Per buffer: recorded on the copy stream after the copies of the step it holds.
    copies_done: Vec<CudaEvent>,
    /// Which buffer is where, by size class (`host_pool.rs`).
    pool: HostPool,
}

impl HostRing {
    /// `classes`: (buffers, rows per slot) per size class (`HostPool::new`).
    pub fn new(ctx: &Arc<CudaContext>, classes: &[(usize, usize)], slots: usize, row_bytes: usize, quantize: bool) -> CoreResult<HostRing> {
        let pool = HostPool::new(classes)?;
        let mut r = HostRing { bufs: Vec::with_capacity(pool.len()), copies_done: Vec::with_capacity(pool.len()), pool };
        for i in 0..r.pool.len() {
            let cap = r.pool.capacity(i);
            r.bufs.push(Arc::new(HostBuf::new(ctx, slots, cap, row_bytes, quantize).map_err(|e| cuda_err("cuMemHostAlloc", e))?));
            r.copies_done.push(ctx.new_event(None).map_err(|e| cuda_err("cuEventCreate", e))?);
        }
        Ok(r)
    }

    /// Rows per slot of each buffer.
    pub fn capacities(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.pool.len()).map(|i| self.pool.capacity(i))
    }

    /// Buffers a step of `rows` rows can take now.
    pub fn available(&self, rows: usize) -> usize {
        self.pool.available(rows)
    }

    /// A buffer for the step being captured, of `rows` rows (a step abandoned before `end` left its buffer; it is
    /// reused if it holds them).
    pub fn take(&mut self, rows: usize) -> CoreResult<()> {
        self.pool.take(rows).map(|_| ())
    }

    /// The current step's buffer, to copy into: refused while a handed-out step still shares it.
    pub fn current_mut(&mut self) -> CoreResult<&mut HostBuf> {
        let Some(i) = self.pool.current() else {
            bail!(Compatibility, "a device step copied before it was reset");
        };
        Arc::get_mut(&mut self.bufs[i])
            .ok_or_else(|| core_err!(Compatibility, "host buffer {i} is still being read; it was not given back"))
    }

    /// Ends the current step: its copies (enqueued on `copy`) are marked, the buffer is in flight.
    pub fn end(&mut self, copy: &CudaStream) -> CoreResult<()> {
        let Some(i) = self.pool.current() else {
            bail!(Compatibility, "a device step ended before it was reset");
        };
        self.copies_done[i].record(copy).map_err(|e| cuda_err("cuEventRecord", e))?;
        self.pool.end()?;
        Ok(())
    }

    /// Waits for the copies of the oldest step in flight and hands its buffer out. The step leaves the queue whatever
    /// happens (the session's queue of pending steps stays paired with it); on failure its buffer goes back unread.
    pub fn wait_oldest(&mut self) -> CoreResult<CudaPinnedStep> {
        let i = self.pool.pop_oldest()?;
        // Most often done already (two steps in flight): then no section, so nothing is let go of.
        let done = &self.copies_done[i];
        let waited = if done.is_complete() { Ok(()) } else { crate::blocking::section(|| done.synchronize()) };
        if let Err(e) = waited {
            self.pool.give_back(i)?;
            return Err(cuda_err("cuEventSynchronize", e));
        }
        Ok(CudaPinnedStep { ring_slot: i, buf: Arc::clone(&self.bufs[i]) })
    }

    /// Takes back a buffer `wait_oldest` handed out.
    pub fn recycle(&mut self, step: Box<dyn PinnedStep>) -> CoreResult<()> {
        let i = step.ring_slot();
        drop(step);
        self.pool.give_back(i)
    }
}
