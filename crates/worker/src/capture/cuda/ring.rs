//! The pinned host side of the device path: a ring of host buffers the copy stream fills, one step each, in size
//! classes (a step takes the smallest free buffer that holds its rows: `host_pool.rs`).
//!
//! A buffer is taken for a step (`take`), filled by that step's copies, queued in flight (`end`), handed out once
//! its copies are done (`wait_oldest`, as a [`CudaPinnedStep`] that shares it) and given back (`recycle`). The
//! copies of a later step go into a buffer only through [`HostRing::current_mut`], which refuses one that a
//! handed-out step still shares: no copy can write rows the assembler thread reads.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError};

use super::pinned::PinnedBlock;

use crate::capture::device::PinnedStep;
use crate::capture::host_pool::HostPool;
use crate::capture::rows::{SlotRows, StepRows};
use crate::{bail, core_err, error::CoreResult};
use hscapture_kernels::armed::STAMP_WORDS;
use hscapture_kernels::Stamp;

fn cuda_err(what: &str, e: DriverError) -> crate::CoreError {
    core_err!(Compatibility, "CUDA: {what}: {e:?}")
}

/// Where a per-slot region of a [`HostBuf`] lies: slot `s` starts at byte `at + s * pitch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub at: usize,
    pub pitch: usize,
}

impl Region {
    pub fn slot(&self, s: usize) -> usize {
        self.at + s * self.pitch
    }
}

/// Where each region of a [`HostBuf`] lies in its block: per slot the step's rows (fp8: codes, a byte per value),
/// their checksums and non-finite counts, each region with its slots `capacity` rows apart (so that one strided copy
/// fills a region for every slot); each slot's stamp; with fp8 a scale per row. Each region starts on a 64-byte
/// boundary (the u64 checksums need 8).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostLayout {
    pub data: Region,
    pub sums: Region,
    pub bad: Region,
    pub stamps_at: usize,
    pub scales_at: Option<usize>,
    /// Bytes of the block.
    pub len: usize,
}

impl HostLayout {
    pub fn new(slots: usize, capacity: usize, row_bytes: usize, quantize: bool) -> CoreResult<HostLayout> {
        let overflow = || core_err!(Config, "a pinned host buffer of {capacity} rows × {slots} slots × {row_bytes} bytes overflows");
        let mut len = 0usize;
        let mut region = |pitch: Option<usize>, count: usize| -> CoreResult<Region> {
            let pitch = pitch.ok_or_else(overflow)?;
            let at = len.checked_next_multiple_of(64).ok_or_else(overflow)?;
            len = pitch.checked_mul(count).and_then(|b| b.checked_add(at)).ok_or_else(overflow)?;
            Ok(Region { at, pitch })
        };
        let data = region(capacity.checked_mul(row_bytes), slots)?;
        let sums = region(capacity.checked_mul(8), slots)?;
        let bad = region(capacity.checked_mul(4), slots)?;
        let stamps_at = region(Some(STAMP_WORDS * 4), slots)?.at;
        let scales_at = if quantize { Some(region(capacity.checked_mul(4), 1)?.at) } else { None };
        Ok(HostLayout { data, sums, bad, stamps_at, scales_at, len })
    }
}

/// One pinned host buffer: one page-locked block laid out as [`HostLayout`] says. Read only after the buffer's
/// `copies_done` event (`HostRing`), which follows every copy into it.
pub struct HostBuf {
    block: PinnedBlock,
    slots: usize,
    capacity: usize,
    /// Bytes of one row in `data` (fp8: the width).
    row_bytes: usize,
    pub data: Region,
    pub sums: Region,
    pub bad: Region,
    pub stamps_at: usize,
    pub scales_at: Option<usize>,
}

impl HostBuf {
    fn new(ctx: &Arc<CudaContext>, slots: usize, capacity: usize, row_bytes: usize, quantize: bool) -> CoreResult<HostBuf> {
        let HostLayout { data, sums, bad, stamps_at, scales_at, len } = HostLayout::new(slots, capacity, row_bytes, quantize)?;
        let block = PinnedBlock::new(ctx, len).map_err(|e| cuda_err("cuMemHostAlloc", e))?;
        Ok(HostBuf { block, slots, capacity, row_bytes, data, sums, bad, stamps_at, scales_at })
    }

    pub fn block(&self) -> &PinnedBlock {
        &self.block
    }

    /// `n` values of `T` from byte `at`.
    fn values<T: Copy>(&self, at: usize, n: usize) -> CoreResult<&[T]> {
        // SAFETY: `CudaPinnedStep` hands this buffer out only after its `copies_done` event completed, and the ring
        // copies into it again only once it is given back (`current_mut` refuses a shared buffer); the regions hold
        // u8/u32/u64/f32, valid for every bit pattern.
        unsafe { self.block.slice(at, n) }
            .ok_or_else(|| core_err!(Compatibility, "{n} values at byte {at} overrun a pinned host buffer of {}", self.block.len()))
    }

    /// `n` values of `T` of each slot's part of `r`.
    fn per_slot<T: Copy>(&self, r: Region, n: usize) -> CoreResult<Vec<&[T]>> {
        (0..self.slots).map(|s| self.values(r.slot(s), n)).collect()
    }

    /// The rows, once every copy into this buffer is done.
    fn view(&self) -> CoreResult<SlotRows<'_>> {
        let cap = self.capacity;
        let scales = self.scales_at.map(|at| self.values(at, cap)).transpose()?;
        Ok(SlotRows {
            data: self.per_slot(self.data, cap * self.row_bytes)?,
            sums: self.per_slot(self.sums, cap)?,
            bad: self.per_slot(self.bad, cap)?,
            scales,
            row_bytes: self.row_bytes,
        })
    }

    fn stamps(&self) -> CoreResult<&[u32]> {
        self.values(self.stamps_at, self.slots * STAMP_WORDS)
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
        Ok(Box::new(self.buf.view()?))
    }
    fn stamps(&self) -> CoreResult<Vec<Stamp>> {
        Ok(self.buf.stamps()?.chunks_exact(STAMP_WORDS).map(Stamp::from_words).collect())
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
            r.bufs.push(Arc::new(HostBuf::new(ctx, slots, cap, row_bytes, quantize)?));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_buffers_regions_are_aligned_and_apart() {
        for (slots, cap, rb, q) in [(4, 64, 8192, false), (3, 5, 7, true), (1, 1, 1, false), (5, 16384, 14336, false)] {
            let l = HostLayout::new(slots, cap, rb, q).unwrap();
            let mut spans = vec![(l.data.at, slots * cap * rb), (l.sums.at, slots * cap * 8), (l.bad.at, slots * cap * 4)];
            spans.push((l.stamps_at, slots * STAMP_WORDS * 4));
            spans.extend(l.scales_at.map(|a| (a, cap * 4)));
            assert_eq!((l.data.pitch, l.sums.pitch, l.bad.pitch), (cap * rb, cap * 8, cap * 4));
            for w in spans.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{slots}×{cap}×{rb}: regions overlap: {spans:?}");
            }
            assert!(spans.iter().all(|(at, _)| at % 64 == 0), "{spans:?}");
            let (last, n) = spans[spans.len() - 1];
            assert_eq!(l.len, last + n);
        }
        assert!(HostLayout::new(4, usize::MAX / 8, 16, false).is_err(), "an overflowing size is an error, not a wrap");
    }
}
