//! The CUDA device path: a fixed device arena ([`arena`]), the capture kernel on PyTorch's stream, and copies on a
//! side stream to a ring of pinned host buffers ([`ring`]); all memory, streams and events are `cudarc`'s owned types.
//!
//! Invariants:
//! - per slot: kernel on the caller's stream → event → copy stream waits on it → copy of that slot's rows; so copies
//!   overlap the rest of the forward, and the compute stream never waits on the host;
//! - the arena is reused every step: before a step's first kernel (and before each later one, in case the caller's
//!   stream changes) the caller's stream waits on the device for the copies of the step before (and so of every
//!   step before it, which the copy stream ran first). So the next step may begin, and be launched, while the
//!   previous one's copies are in flight;
//! - a host buffer is written only by the copies of the step that took it, and read only once they are done (each
//!   pinned slice waits for its own copy) and until it is given back (`ring.rs`);
//! - fp8 (`quantize`): the arena is quantized on the device after the step's last slot (`end_step`, on the stream of
//!   the step's captures: per-token scales over all slots, `fp8.cu`) into the code arena; the copies move codes and
//!   scales (half of bf16's bytes) instead of the rows, so they wait for the last slot instead of overlapping each;
//! - on drop the copy stream is synchronised first: it waited for every kernel that used the arena, so the arena
//!   (freed on that stream) and the pinned buffers go only once no work uses them.

mod arena;
mod ring;

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, DriverError};

use crate::capture::device::{DeviceBackend, PinnedStep};
use crate::capture::tensor::{Device, TensorDesc};
use crate::{bail, core_err, ensure, error::CoreResult};
use arena::{address, part, DeviceArena};
use hscapture_kernels::launch::{guarded, CaptureKernel, Fp8Args, LaunchArgs};
use hscapture_kernels::{DType, KernelError, RowRun};
use ring::HostRing;

fn kerr(e: KernelError) -> crate::CoreError {
    core_err!(Compatibility, "CUDA: {e}")
}

fn drv<T>(what: &str, r: Result<T, DriverError>) -> Result<T, KernelError> {
    r.map_err(|e| KernelError(format!("{what}: {e:?}")))
}

pub struct CudaDevice {
    kernel: CaptureKernel,
    arena: DeviceArena,
    ring: HostRing,
    copy: Arc<CudaStream>,
    /// Per slot: recorded on the captures' stream after the slot's kernel (slot 0's after the fp8 kernel too).
    slot_done: Vec<CudaEvent>,
    /// The caller's stream the last capture ran on, borrowed (the fp8 kernel follows the step's captures there).
    stream: Option<Arc<CudaStream>>,
    quantize: bool,
    src_rows: Vec<i32>,
    rows: usize,
    src_uploaded: bool,
}

impl CudaDevice {
    /// Loads the kernel on `ordinal`, allocates the arena for `capacity` rows per slot and `ring`
    /// pinned host buffers of the same size; with `quantize`, the fp8 code arena and scales, and host buffers that
    /// hold those.
    pub fn new(
        ordinal: i32,
        slots: usize,
        width: usize,
        dtype: DType,
        capacity: usize,
        ring: usize,
        quantize: bool,
    ) -> CoreResult<CudaDevice> {
        ensure!(
            capacity > 0 && slots > 0 && width > 0,
            Config,
            "device arena of {capacity} rows × {slots} slots × {width}: nothing to allocate"
        );
        ensure!(ring > 0, Config, "a ring of {ring} host buffers: at least one is needed");
        // Sizes from the caller (capacity from max_num_batched_tokens): checked before anything is allocated.
        let sized = |what: &str, parts: &[usize]| {
            parts
                .iter()
                .try_fold(1usize, |a, &p| a.checked_mul(p))
                .filter(|n| *n <= isize::MAX as usize)
                .ok_or_else(|| core_err!(Config, "device arena of {capacity} rows × {slots} slots × {width}: its {what} overflow"))
        };
        let row_bytes = sized("row bytes", &[width, dtype.size()])?;
        sized("bytes", &[slots, capacity, row_bytes])?;
        let n_rows = sized("rows", &[slots, capacity])?;
        sized("checksums", &[n_rows, 8])?;
        sized("fp8 codes", &[slots, capacity, width])?;
        let kernel = CaptureKernel::load(ordinal).map_err(kerr)?;
        let ctx = Arc::clone(kernel.context());
        let (copy, arena, slot_done) = guarded("allocating the capture arena", || {
            let copy = drv("cuStreamCreate", ctx.new_stream())?;
            let arena = drv("cuMemAlloc", DeviceArena::new(&copy, slots, capacity, width, dtype, quantize))?;
            let slot_done = (0..slots).map(|_| drv("cuEventCreate", ctx.new_event(None))).collect::<Result<Vec<_>, _>>()?;
            // Other streams use the arena only once its allocation (stream-ordered) and zeroing are done.
            drv("cuStreamSynchronize", copy.synchronize())?;
            Ok((copy, arena, slot_done))
        })
        .map_err(kerr)?;
        let host_row_bytes = if quantize { width } else { row_bytes };
        let ring = HostRing::new(&ctx, ring, slots, capacity, host_row_bytes, quantize)?;
        Ok(CudaDevice {
            kernel,
            arena,
            ring,
            copy,
            slot_done,
            stream: None,
            quantize,
            src_rows: Vec::with_capacity(capacity),
            rows: 0,
            src_uploaded: false,
        })
    }

    pub fn arch(&self) -> &str {
        &self.kernel.arch
    }

    /// fp8: quantizes the step's arena on the stream of its captures (after the last slot), then copies the codes
    /// and scales to the step's host buffer on the copy stream.
    fn quantize_step(&mut self) -> CoreResult<()> {
        let (n, w, cap) = (self.rows, self.arena.width, self.arena.capacity);
        let (Some(s), Some((codes, scales))) = (self.stream.as_ref(), self.arena.fp8.as_ref()) else {
            bail!(Compatibility, "a quantizing device step ended without a capture or a code arena");
        };
        let args = Fp8Args {
            arena: address(&self.arena.data, s),
            dtype: self.arena.dtype,
            slot_stride: (cap * w) as i64,
            slots: self.arena.slots as i32,
            n_rows: n as i32,
            width: w as i32,
            codes: address(codes, s),
            scales: address(scales, s),
        };
        // SAFETY: the arena, codes and scales are this device's allocations of `slots × capacity × width` elements
        // and `capacity` scales; the launch follows the step's captures on their stream.
        unsafe { self.kernel.launch_fp8(&args, s) }.map_err(kerr)?;
        let host = self.ring.current_mut()?;
        let (ev, copy) = (&self.slot_done[0], &self.copy);
        // Slot 0's event is free again: its copies were enqueued already.
        guarded("enqueueing the fp8 copies to host", || {
            drv("cuEventRecord", ev.record(s))?;
            drv("cuStreamWaitEvent", copy.wait(ev))?;
            for (slot, dst) in host.data.iter_mut().enumerate() {
                let src = part(codes, slot * cap * w..slot * cap * w + n * w, "fp8 codes").map_err(|e| KernelError(e.message))?;
                drv("cuMemcpyDtoHAsync", copy.memcpy_dtoh(&src, dst))?;
            }
            if let Some(dst) = host.scales.as_mut() {
                let src = part(scales, 0..n, "fp8 scales").map_err(|e| KernelError(e.message))?;
                drv("cuMemcpyDtoHAsync", copy.memcpy_dtoh(&src, dst))?;
            }
            Ok(())
        })
        .map_err(kerr)
    }
}

impl DeviceBackend for CudaDevice {
    fn capacity(&self) -> usize {
        self.arena.capacity
    }

    fn allocated(&self) -> (usize, usize) {
        let (n, cap) = (self.arena.slots * self.arena.capacity, self.arena.capacity);
        let (host_row, scales) = if self.quantize { (self.arena.width, cap * 4) } else { (self.arena.row_bytes(), 0) };
        (self.arena.bytes(), self.ring.len() * (n * (host_row + 12) + scales))
    }

    fn quantizes(&self) -> bool {
        self.quantize
    }

    fn free_host(&self) -> usize {
        self.ring.available()
    }

    fn ring(&self) -> usize {
        self.ring.len()
    }

    fn reset(&mut self, rows: usize, runs: &[RowRun]) -> CoreResult<()> {
        ensure!(rows <= self.arena.capacity, ShapeContract, "{rows} rows exceed the device arena's {} rows", self.arena.capacity);
        self.ring.take()?;
        self.src_rows.clear();
        self.src_rows.resize(rows, 0);
        for r in runs {
            let (dst, src) = (r.dst_row.checked_add(r.len), r.src_row.checked_add(r.len));
            ensure!(
                dst.is_some_and(|d| d <= rows) && src.is_some_and(|s| s <= i32::MAX as usize),
                ShapeContract,
                "row run {}..+{} from source row {} does not fit a step of {rows} rows",
                r.dst_row,
                r.len,
                r.src_row
            );
            for k in 0..r.len {
                self.src_rows[r.dst_row + k] = (r.src_row + k) as i32;
            }
        }
        self.rows = rows;
        self.src_uploaded = false;
        Ok(())
    }

    unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, stream: u64) -> CoreResult<()> {
        ensure!(slot < self.arena.slots, ShapeContract, "slot {slot} does not exist ({} slots)", self.arena.slots);
        let Device::Cuda(_) = hidden.device else {
            bail!(Compatibility, "the device path got a tensor on {}", hidden.device);
        };
        let h_stride = hidden.row_layout("hidden states")? as i64;
        let r_stride = match residual {
            Some(r) => r.row_layout("residual")? as i64,
            None => 0,
        };
        self.kernel.bind().map_err(kerr)?;
        // The caller's stream, borrowed once per stream rather than once per slot (no allocation per capture).
        let s = match &self.stream {
            Some(s) if s.cu_stream() as u64 == stream => Arc::clone(s),
            _ => {
                // SAFETY: `stream` is the caller's current stream on this device (the trait's contract), alive while
                // its work runs; the handle enqueues this step's work and is replaced when the caller's stream changes.
                let s = unsafe { self.kernel.borrow_stream(stream) };
                self.stream = Some(Arc::clone(&s));
                s
            }
        };
        let (n, cap, rb) = (self.rows, self.arena.capacity, self.arena.row_bytes());
        if let Some(prev) = self.ring.last_copies() {
            // The arena (and the row index) still hold the previous step until its copies ran: the
            // caller's stream waits for them on the device, the host does not wait.
            guarded("cuStreamWaitEvent", || drv("cuStreamWaitEvent", s.wait(prev))).map_err(kerr)?;
        }
        if !self.src_uploaded && n > 0 {
            // Pageable host→device async copy: staged by the driver before the call returns, so the
            // vector may change afterwards; no device synchronisation.
            let mut dst = self.arena.src.try_slice_mut(0..n).ok_or_else(|| core_err!(Compatibility, "{n} source rows exceed the arena"))?;
            guarded("cuMemcpyHtoDAsync", || drv("cuMemcpyHtoDAsync", s.memcpy_htod(&self.src_rows[..], &mut dst))).map_err(kerr)?;
            self.src_uploaded = true;
        }
        let base = slot * cap;
        let arena = &self.arena;
        let args = LaunchArgs {
            hidden: hidden.ptr as u64,
            residual: residual.map_or(0, |r| r.ptr as u64),
            h_stride,
            r_stride,
            in_dtype: hidden.dtype,
            src_rows: address(&arena.src, &s),
            n_rows: n as i32,
            width: arena.width as i32,
            out: address(&arena.data, &s) + (base * rb) as u64,
            out_dtype: arena.dtype,
            row_sums: address(&arena.sums, &s) + (base * 8) as u64,
            nonfinite: address(&arena.bad, &s) + (base * 4) as u64,
        };
        // SAFETY: the arena's buffers are this device's allocations sized for `capacity` rows per slot (n <= capacity,
        // `reset`); the tensors' memory is the caller's contract (alive until the stream has run the kernel).
        unsafe { self.kernel.launch(&args, &s) }.map_err(kerr)?;
        if n == 0 {
            return Ok(());
        }
        let host = self.ring.current_mut()?;
        let (ev, copy, quantize) = (&self.slot_done[slot], &self.copy, self.quantize);
        guarded("enqueueing the copy to host", || {
            drv("cuEventRecord", ev.record(&s))?;
            drv("cuStreamWaitEvent", copy.wait(ev))?;
            let rows = |what| part(&arena.data, base * rb..(base + n) * rb, what).map_err(|e| KernelError(e.message));
            if !quantize {
                drv("cuMemcpyDtoHAsync", copy.memcpy_dtoh(&rows("rows")?, &mut host.data[slot]))?;
            }
            let sums = part(&arena.sums, base..base + n, "checksums").map_err(|e| KernelError(e.message))?;
            drv("cuMemcpyDtoHAsync", copy.memcpy_dtoh(&sums, &mut host.sums[slot]))?;
            let bad = part(&arena.bad, base..base + n, "non-finite counts").map_err(|e| KernelError(e.message))?;
            drv("cuMemcpyDtoHAsync", copy.memcpy_dtoh(&bad, &mut host.bad[slot]))?;
            Ok(())
        })
        .map_err(kerr)
    }

    fn end_step(&mut self) -> CoreResult<()> {
        self.kernel.bind().map_err(kerr)?;
        if self.quantize && self.rows > 0 {
            self.quantize_step()?;
        }
        self.ring.end(&self.copy)
    }

    fn wait(&mut self) -> CoreResult<Box<dyn PinnedStep>> {
        self.kernel.bind().map_err(kerr)?;
        Ok(Box::new(self.ring.wait_oldest()?))
    }

    fn recycle(&mut self, buf: Box<dyn PinnedStep>) -> CoreResult<()> {
        self.ring.recycle(buf)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // The copy stream waited for every kernel that used the arena: once it is done, nothing uses the memory
        // the fields free after this.
        let _ = self.kernel.bind();
        let _ = guarded("synchronising the copy stream", || drv("cuStreamSynchronize", self.copy.synchronize()));
    }
}
