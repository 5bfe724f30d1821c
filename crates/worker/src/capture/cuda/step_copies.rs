//! After an armed step's forward: fp8 quantization on the forward's stream, then the copies of the step's rows (or
//! codes and scales), checksums, counts and stamps to its pinned buffer on the copy stream (`CudaDevice::end_step`);
//! rows copied early (`early_copies.rs`) are not copied again.

use cudarc::driver::{sys, CudaView, DevicePtr};

use super::ring::{HostBuf, Region};
use super::*;

/// Where a step's copies go: `height` runs of `width` bytes into `host`'s block from byte `at`, `pitch` apart.
pub(super) struct HostRuns<'a> {
    pub host: &'a HostBuf,
    pub at: usize,
    pub pitch: usize,
}

impl<'a> HostRuns<'a> {
    /// Every slot's part of `region`, from slot `first`.
    pub fn slots(host: &'a HostBuf, region: Region, first: usize) -> HostRuns<'a> {
        HostRuns { host, at: region.slot(first), pitch: region.pitch }
    }

    pub fn at(host: &'a HostBuf, at: usize) -> HostRuns<'a> {
        HostRuns { host, at, pitch: 0 }
    }
}

/// A step's copy of `height` runs of `width` bytes, `src_pitch` apart in the source and `dst_pitch` apart in the
/// destination block from `dst_at`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Runs {
    pub width: usize,
    pub height: usize,
    pub src_pitch: usize,
    pub dst_at: usize,
    pub dst_pitch: usize,
}

impl Runs {
    /// Whether the copy fits a source of `src_bytes` and a block of `block_bytes`: None when there is nothing to
    /// copy, else whether it goes as one strided copy (more than one run, both pitches within `max_pitch`) or run
    /// by run; an error naming the sizes when it overruns either (a bug in the caller's arithmetic).
    pub fn plan(&self, src_bytes: usize, block_bytes: usize, max_pitch: usize) -> Result<Option<bool>, KernelError> {
        let Runs { width, height, src_pitch, dst_at, dst_pitch } = *self;
        if width == 0 || height == 0 {
            return Ok(None);
        }
        let extent = |pitch: usize| (height - 1).checked_mul(pitch).and_then(|b| b.checked_add(width));
        let (need_src, need_dst) = (extent(src_pitch), extent(dst_pitch).and_then(|b| b.checked_add(dst_at)));
        if height > 1 && (src_pitch < width || dst_pitch < width)
            || need_src.is_none_or(|n| n > src_bytes)
            || need_dst.is_none_or(|n| n > block_bytes)
        {
            return Err(KernelError(format!(
                "a step's copy of {height} × {width} bytes (pitches {src_pitch} and {dst_pitch}) overruns a device view \
                 of {src_bytes} bytes or a pinned block of {block_bytes} from byte {dst_at}"
            )));
        }
        Ok(Some(height > 1 && src_pitch <= max_pitch && dst_pitch <= max_pitch))
    }
}

/// The parameters of a strided device-to-host copy. Every field named: the memory types are enums without a zero
/// value, so `mem::zeroed` is not an option (it aborts the process).
fn strided_dtoh(src: u64, src_pitch: usize, dst: *mut u8, dst_pitch: usize, width: usize, height: usize) -> sys::CUDA_MEMCPY2D {
    sys::CUDA_MEMCPY2D {
        srcXInBytes: 0,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_pitch,
        dstXInBytes: 0,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
        dstHost: dst as *mut std::ffi::c_void,
        dstDevice: 0,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_pitch,
        WidthInBytes: width,
        Height: height,
    }
}

/// Copies `height` runs of `width` bytes from `src` (its runs `src_pitch` bytes apart, starting at its first byte) to
/// `dst` on `stream`: one strided copy (`cuMemcpy2DAsync`) where both pitches are within the device's
/// `max_pitch`, else a copy per run. Exactly these bytes: cudarc's `memcpy_dtoh` copies `size_of_val(dst)`, a pinned
/// buffer's whole capacity (measured on the H200: ~10 ms of copies a decode step, vLLM's sampled-token copy queued
/// behind them, decode at 0.6× of plain). The caller has made the context current (`end_step`).
pub(super) fn copy_runs<T>(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, T>,
    src_pitch: usize,
    dst: &HostRuns<'_>,
    width: usize,
    height: usize,
    max_pitch: usize,
) -> Result<(), KernelError> {
    let (block, src_bytes) = (dst.host.block(), src.len() * std::mem::size_of::<T>());
    let runs = Runs { width, height, src_pitch, dst_at: dst.at, dst_pitch: dst.pitch };
    let Some(strided) = runs.plan(src_bytes, block.len(), max_pitch)? else {
        return Ok(());
    };
    let (from, _record) = src.device_ptr(stream);
    let to = |k: usize| block.addr(dst.at + k * dst.pitch).ok_or_else(|| KernelError("a pinned block's address".into()));
    if strided {
        let p = strided_dtoh(from, src_pitch, to(0)?, dst.pitch, width, height);
        // SAFETY: both extents are within their allocations (checked above: the view is of this device's arena,
        // the block is page-locked host memory of this context) and no host code reads the block's bytes until
        // the ring's `copies_done` for this buffer completes.
        return drv("cuMemcpy2DAsync", unsafe { sys::cuMemcpy2DAsync_v2(&p, stream.cu_stream()) }.result());
    }
    for k in 0..height {
        // SAFETY: as above, run by run.
        let r =
            unsafe { sys::cuMemcpyDtoHAsync_v2(to(k)? as *mut std::ffi::c_void, from + (k * src_pitch) as u64, width, stream.cu_stream()) };
        drv("cuMemcpyDtoHAsync", r.result())?;
    }
    Ok(())
}

impl CudaDevice {
    /// fp8: quantizes the armed step's rows on the forward's stream into its half's codes and scales.
    pub(super) fn quantize_step(&self, a: &Armed) -> CoreResult<()> {
        let ArmedLayout { slots, capacity: cap, width: w, .. } = self.arena.layout;
        let Some((codes, scales)) = self.arena.fp8.as_ref() else {
            bail!(Compatibility, "a quantizing device step ended without a code arena");
        };
        let s = &a.stream;
        let args = Fp8Args {
            arena: address(&self.arena.data, s) + (self.arena.data_base(a.half) * self.arena.row_bytes()) as u64,
            dtype: self.arena.dtype,
            slot_stride: (cap * w) as i64,
            slots: slots as i32,
            n_rows: a.rows as i32,
            width: w as i32,
            codes: address(codes, s) + (a.half * slots * cap * w) as u64,
            scales: address(scales, s) + (a.half * cap * 4) as u64,
        };
        // SAFETY: the arena's rows, the half's codes and scales are this device's allocations of `slots × capacity ×
        // width` elements and `capacity` scales; the launch follows the step's captures on their stream.
        unsafe { self.kernel.launch_fp8(&args, s) }.map_err(kerr)
    }

    /// Enqueues the copies of the armed step (after `forward_done`) into the current host buffer: each region's
    /// slots in one strided copy (rows or codes, checksums, counts), the stamps and fp8 scales in one copy each.
    pub(super) fn copy_step(&mut self, a: &Armed) -> CoreResult<()> {
        let ArmedLayout { slots, capacity: cap, width: w, .. } = self.arena.layout;
        let (n, half, max_pitch) = (a.rows, a.half, self.max_pitch);
        let (arena, copy, quantize, early) = (&self.arena, &self.copy, self.quantize, &self.early);
        let host: &HostBuf = self.ring.current_mut()?;
        let view = |e: crate::CoreError| KernelError(e.message);
        // `len` bytes from slot 0 of `half`'s part of a [half][slot][capacity] buffer, as bytes.
        let stat = (half * slots) * cap;
        let span = (slots - 1) * cap + n;
        guarded("enqueueing the copies to host", || {
            drv("cuStreamWaitEvent", copy.wait(&self.forward_done))?;
            if let Some((codes, _)) = arena.fp8.as_ref().filter(|_| quantize) {
                let src = part(codes, stat * w..(stat + span) * w, "fp8 codes").map_err(view)?;
                copy_runs(copy, &src, cap * w, &HostRuns::slots(host, host.data, 0), n * w, slots, max_pitch)?;
            } else {
                // The slots not copied early (all of them unless the step was large), in runs of neighbours.
                let rb = arena.row_bytes();
                let mut slot = 0;
                while slot < slots {
                    if early.policy.copied(slot) {
                        slot += 1;
                        continue;
                    }
                    let run = (slot..slots).take_while(|&s| !early.policy.copied(s)).count();
                    let at = (arena.data_base(half) + slot * cap) * rb;
                    let src = part(&arena.data, at..at + ((run - 1) * cap + n) * rb, "rows").map_err(view)?;
                    copy_runs(copy, &src, cap * rb, &HostRuns::slots(host, host.data, slot), n * rb, run, max_pitch)?;
                    slot += run;
                }
            }
            let sums = part(&arena.sums, stat..stat + span, "checksums").map_err(view)?;
            copy_runs(copy, &sums, cap * 8, &HostRuns::slots(host, host.sums, 0), n * 8, slots, max_pitch)?;
            let bad = part(&arena.bad, stat..stat + span, "non-finite counts").map_err(view)?;
            copy_runs(copy, &bad, cap * 4, &HostRuns::slots(host, host.bad, 0), n * 4, slots, max_pitch)?;
            let st = half * slots * STAMP_WORDS;
            let stamps = part(&arena.stamps, st..st + slots * STAMP_WORDS, "stamps").map_err(view)?;
            copy_runs(copy, &stamps, 0, &HostRuns::at(host, host.stamps_at), slots * STAMP_WORDS * 4, 1, max_pitch)?;
            if let (Some((_, scales)), Some(at)) = (arena.fp8.as_ref(), host.scales_at) {
                let src = part(scales, half * cap..half * cap + n, "fp8 scales").map_err(view)?;
                copy_runs(copy, &src, 0, &HostRuns::at(host, at), n * 4, 1, max_pitch)?;
            }
            drv("cuEventRecord", self.half_free[half].record(copy))
        })
        .map_err(kerr)?;
        self.half_used[half] = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{strided_dtoh, sys, Runs};

    #[test]
    fn a_strided_copys_parameters_are_built_without_a_gpu() {
        let mut host = [0u8; 8];
        let p = strided_dtoh(0x1000, 4096, host.as_mut_ptr(), 512, 256, 4);
        assert!(matches!(p.srcMemoryType, sys::CUmemorytype::CU_MEMORYTYPE_DEVICE));
        assert!(matches!(p.dstMemoryType, sys::CUmemorytype::CU_MEMORYTYPE_HOST));
        assert_eq!((p.srcDevice, p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height), (0x1000, 4096, 512, 256, 4));
        assert_eq!(p.dstHost as *const u8, host.as_ptr());
        assert!(p.srcArray.is_null() && p.dstArray.is_null() && p.srcHost.is_null());
    }

    #[test]
    fn a_copys_runs_fit_both_sides_or_are_refused() {
        // A decode step: 4 slots × 64 rows of 8 KiB in an arena of 16,384 rows per slot, into a 64-row buffer.
        let (cap, rows, rb) = (16384usize, 64usize, 8192usize);
        let runs = Runs { width: rows * rb, height: 4, src_pitch: cap * rb, dst_at: 0, dst_pitch: rows * rb };
        let src = 3 * cap * rb + rows * rb;
        assert_eq!(runs.plan(src, 4 * rows * rb, usize::MAX).unwrap(), Some(true), "one strided copy");
        assert_eq!(runs.plan(src, 4 * rows * rb, cap * rb - 1).unwrap(), Some(false), "a pitch past the device's limit");
        assert!(runs.plan(src - 1, 4 * rows * rb, usize::MAX).is_err(), "one byte past the device view");
        assert!(runs.plan(src, 4 * rows * rb - 1, usize::MAX).is_err(), "one byte past the pinned block");
        let shifted = Runs { dst_at: 64, ..runs };
        assert!(shifted.plan(src, 4 * rows * rb, usize::MAX).is_err(), "the block's offset counts");
        let narrow = Runs { dst_pitch: rows * rb - 1, ..runs };
        assert!(narrow.plan(src, 8 * rows * rb, usize::MAX).is_err(), "runs that would overlap in the block");
        let one = Runs { height: 1, src_pitch: 0, dst_pitch: 0, ..runs };
        assert_eq!(one.plan(rows * rb, rows * rb, 0).unwrap(), Some(false), "a single run is a plain copy");
        assert_eq!(Runs { width: 0, ..runs }.plan(0, 0, 0).unwrap(), None, "a step without rows copies nothing");
        let huge = Runs { height: usize::MAX, ..runs };
        assert!(huge.plan(usize::MAX, usize::MAX, usize::MAX).is_err(), "an overflowing extent is an error, not a wrap");
    }
}
