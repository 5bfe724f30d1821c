//! After an armed step's forward: fp8 quantization on the forward's stream, then the copies of the step's rows (or
//! codes and scales), checksums, counts and stamps to its pinned buffer on the copy stream (`CudaDevice::end_step`);
//! rows copied early (`early_copies.rs`) are not copied again.

use cudarc::driver::{result, CudaView, DevicePtr, DeviceRepr, HostSlice, PinnedHostSlice};

use super::*;

/// Copies `src`, exactly its length, to the start of `dst` on `stream`. Not cudarc's `memcpy_dtoh`: that copies
/// `size_of_val(dst)` bytes, a pinned buffer's whole capacity, whatever `src` holds; a decode step of 64 rows then
/// moved every slot's `capacity` rows (measured on the H200: ~10 ms of copies a step, vLLM's sampled-token copy
/// queued behind them, decode at 0.6× of plain). The caller has made the context current (`end_step`).
pub(super) fn copy_to_pinned<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    src: &CudaView<'_, T>,
    dst: &mut PinnedHostSlice<T>,
) -> Result<(), KernelError> {
    let (n, room) = (src.len(), HostSlice::len(dst));
    if n > room {
        return Err(KernelError(format!("a step's copy of {n} elements into a pinned buffer of {room}")));
    }
    let (from, _after_src) = src.device_ptr(stream);
    // SAFETY: the pinned buffer is this context's page-locked allocation; cudarc orders its use on `stream` (the
    // wait on the buffer's event here, the record when `_after_dst` drops after the enqueue); `n` elements fit it.
    let (to, _after_dst) = unsafe { dst.stream_synced_mut_slice(stream) };
    // SAFETY: `from` holds `n` elements of `T` on this device (a view of the arena), `to[..n]` is host memory of
    // the same size that no host code reads until the ring's `copies_done` event for this buffer completes.
    drv("cuMemcpyDtoHAsync", unsafe { result::memcpy_dtoh_async(&mut to[..n], from, stream.cu_stream()) })
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

    /// Enqueues the copies of the armed step (after `forward_done`) into the current host buffer.
    pub(super) fn copy_step(&mut self, a: &Armed) -> CoreResult<()> {
        let ArmedLayout { slots, capacity: cap, width: w, .. } = self.arena.layout;
        let (n, half) = (a.rows, a.half);
        let (arena, copy, quantize, early) = (&self.arena, &self.copy, self.quantize, &self.early);
        let host = self.ring.current_mut()?;
        let view = |e: crate::CoreError| KernelError(e.message);
        guarded("enqueueing the copies to host", || {
            drv("cuStreamWaitEvent", copy.wait(&self.forward_done))?;
            for slot in 0..slots {
                let stat = (half * slots + slot) * cap;
                if let Some((codes, _)) = arena.fp8.as_ref().filter(|_| quantize) {
                    let at = stat * w;
                    copy_to_pinned(copy, &part(codes, at..at + n * w, "fp8 codes").map_err(view)?, &mut host.data[slot])?;
                } else if !early.policy.copied(slot) {
                    copy_to_pinned(copy, &arena.slot_rows(half, slot, n).map_err(view)?, &mut host.data[slot])?;
                }
                copy_to_pinned(copy, &part(&arena.sums, stat..stat + n, "checksums").map_err(view)?, &mut host.sums[slot])?;
                copy_to_pinned(copy, &part(&arena.bad, stat..stat + n, "non-finite counts").map_err(view)?, &mut host.bad[slot])?;
            }
            let st = half * slots * STAMP_WORDS;
            copy_to_pinned(copy, &part(&arena.stamps, st..st + slots * STAMP_WORDS, "stamps").map_err(view)?, &mut host.stamps)?;
            if let (Some((_, scales)), Some(dst)) = (arena.fp8.as_ref(), host.scales.as_mut()) {
                copy_to_pinned(copy, &part(scales, half * cap..half * cap + n, "fp8 scales").map_err(view)?, dst)?;
            }
            drv("cuEventRecord", self.half_free[half].record(copy))
        })
        .map_err(kerr)?;
        self.half_used[half] = true;
        Ok(())
    }
}
