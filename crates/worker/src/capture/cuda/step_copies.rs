//! After an armed step's forward: fp8 quantization on the forward's stream, then the copies of the step's rows (or
//! codes and scales), checksums, counts and stamps to its pinned buffer on the copy stream (`CudaDevice::end_step`).

use super::*;

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
        let (n, half, rb) = (a.rows, a.half, self.arena.row_bytes());
        let data_base = self.arena.data_base(half);
        let (arena, copy, quantize) = (&self.arena, &self.copy, self.quantize);
        let host = self.ring.current_mut()?;
        let view = |e: crate::CoreError| KernelError(e.message);
        guarded("enqueueing the copies to host", || {
            drv("cuStreamWaitEvent", copy.wait(&self.forward_done))?;
            for slot in 0..slots {
                let stat = (half * slots + slot) * cap;
                if let Some((codes, _)) = arena.fp8.as_ref().filter(|_| quantize) {
                    let at = stat * w;
                    drv(
                        "cuMemcpyDtoHAsync",
                        copy.memcpy_dtoh(&part(codes, at..at + n * w, "fp8 codes").map_err(view)?, &mut host.data[slot]),
                    )?;
                } else {
                    let at = (data_base + slot * cap) * rb;
                    drv(
                        "cuMemcpyDtoHAsync",
                        copy.memcpy_dtoh(&part(&arena.data, at..at + n * rb, "rows").map_err(view)?, &mut host.data[slot]),
                    )?;
                }
                drv(
                    "cuMemcpyDtoHAsync",
                    copy.memcpy_dtoh(&part(&arena.sums, stat..stat + n, "checksums").map_err(view)?, &mut host.sums[slot]),
                )?;
                drv(
                    "cuMemcpyDtoHAsync",
                    copy.memcpy_dtoh(&part(&arena.bad, stat..stat + n, "non-finite counts").map_err(view)?, &mut host.bad[slot]),
                )?;
            }
            let st = half * slots * STAMP_WORDS;
            drv(
                "cuMemcpyDtoHAsync",
                copy.memcpy_dtoh(&part(&arena.stamps, st..st + slots * STAMP_WORDS, "stamps").map_err(view)?, &mut host.stamps),
            )?;
            if let (Some((_, scales)), Some(dst)) = (arena.fp8.as_ref(), host.scales.as_mut()) {
                drv("cuMemcpyDtoHAsync", copy.memcpy_dtoh(&part(scales, half * cap..half * cap + n, "fp8 scales").map_err(view)?, dst))?;
            }
            drv("cuEventRecord", self.half_free[half].record(copy))
        })
        .map_err(kerr)?;
        self.half_used[half] = true;
        Ok(())
    }
}
