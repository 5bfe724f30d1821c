//! The CUDA device path: a fixed device arena, the capture kernel on PyTorch's stream, and copies to
//! a ring of pinned host buffers on a side stream.
//!
//! Invariants:
//! - device memory: one arena of `capacity` rows × `slots` × `width` in the output dtype, plus a
//!   checksum and a non-finite count per row and the step's source-row index, allocated once when the
//!   worker loads the model (before vLLM sizes its KV cache) and freed on drop;
//! - host memory: `ring` pinned buffers with the arena's layout, allocated with it. A step's copies go
//!   to the buffer `reset` took from the free list; `end_step` records the buffer's event after them
//!   and queues the buffer as in flight; `wait` synchronises on the oldest one's event and hands the
//!   buffer out ([`CudaPinnedStep`]); it is written again only after `recycle` gave it back, so the
//!   assembler thread reads it while the next steps copy into the others;
//! - per slot: kernel on the caller's stream → event → side stream waits on it → copy of that slot's
//!   rows; so copies overlap the rest of the forward, and the compute stream never waits on the host;
//! - the arena is reused every step: before a step's first kernel (and before each later one, in
//!   case the caller's stream changes) the caller's stream waits on the device for the event of the
//!   step before (its copies, and those of every step before it, which the copy stream ran first).
//!   So the next step may begin, and be launched, while the previous one's copies are in flight.
//! - fp8 (`quantize`): the arena is quantized on the device after the step's last slot (`end_step`, on the
//!   stream of the step's captures: per-token scales over all slots, `fp8.cu`) into a code arena of one byte per
//!   value and a scale per row; the copies move codes and scales (half of bf16's bytes) instead of the rows, so
//!   they wait for the last slot instead of overlapping each slot.

use std::ffi::c_void;

use cudarc::driver::{result as cu, sys};

use crate::capture::device::{DeviceBackend, PinnedStep};
use crate::capture::rows::StepRows;
use crate::capture::tensor::{Device, TensorDesc};
use crate::{bail, core_err, ensure, error::CoreResult};
use hscapture_kernels::launch::{guarded, CaptureKernel, Fp8Args, LaunchArgs};
use hscapture_kernels::{DType, KernelError, RowRun};

fn kerr(e: KernelError) -> crate::CoreError {
    core_err!(Compatibility, "CUDA: {e}")
}

fn drv<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T, KernelError> {
    r.map_err(|e| KernelError(format!("{what}: {e:?}")))
}

/// One pinned host buffer of the ring (raw allocations; freed by the device's Drop): rows (or, quantizing, codes),
/// and with fp8 a scale per row.
#[derive(Clone, Copy)]
struct Pinned {
    data: *mut u8,
    sums: *mut u64,
    bad: *mut u32,
    scales: *mut f32,
}

pub struct CudaDevice {
    kernel: CaptureKernel,
    slots: usize,
    width: usize,
    dtype: DType,
    capacity: usize,
    d_data: sys::CUdeviceptr,
    d_sums: sys::CUdeviceptr,
    d_bad: sys::CUdeviceptr,
    d_src: sys::CUdeviceptr,
    /// fp8: the code arena and the scales (0 otherwise).
    d_codes: sys::CUdeviceptr,
    d_scales: sys::CUdeviceptr,
    quantize: bool,
    /// The stream the step's captures ran on (the fp8 kernel follows them there).
    stream: u64,
    hosts: Vec<Pinned>,
    free: Vec<usize>,
    /// The host buffer of the step being captured (taken by `reset`, queued by `end_step`).
    cur: Option<usize>,
    /// Buffers of steps ended and not yet collected, oldest first.
    flight: std::collections::VecDeque<usize>,
    /// The buffer of the last step ended: the next step's kernels wait for its copies (its event).
    last: Option<usize>,
    copy_stream: sys::CUstream,
    slot_done: Vec<sys::CUevent>,
    /// Per host buffer: recorded on the copy stream after the copies of the step it holds.
    copies_done: Vec<sys::CUevent>,
    src_rows: Vec<i32>,
    rows: usize,
    src_uploaded: bool,
}

// SAFETY: the raw pointers are this struct's own allocations (device and pinned host memory) and
// driver handles; the session that owns it is used by one thread at a time (Python's call into the
// pyclass), and every method binds the context first.
unsafe impl Send for CudaDevice {}
// SAFETY: shared references only read sizes; every mutation goes through `&mut self`, which the
// owning pyclass hands out to one caller at a time.
unsafe impl Sync for CudaDevice {}

/// A step's rows in one pinned buffer of the ring, handed out by `wait`.
pub struct CudaPinnedStep {
    ring_slot: usize,
    buf: Pinned,
    capacity: usize,
    /// Bytes of one row as the host buffer holds it (codes: `width`).
    row_bytes: usize,
}

// SAFETY: the pointers are pinned host allocations that live until the device drops, which the
// session does only after joining the assembler thread (the only other holder); while a CudaPinnedStep
// exists its buffer is out of the free list, so no copy writes it: reads from any thread are safe.
unsafe impl Send for CudaPinnedStep {}
// SAFETY: as above; the type only reads.
unsafe impl Sync for CudaPinnedStep {}

impl StepRows for CudaPinnedStep {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        let o = (slot * self.capacity + row) * self.row_bytes;
        // SAFETY: each buffer holds slots*capacity rows of row_bytes (allocated in `new`); slot and row
        // are within the step's plan; the step's copies completed before `wait` handed this out.
        unsafe { std::slice::from_raw_parts(self.buf.data.add(o), self.row_bytes) }
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        // SAFETY: as in `row`, for the slots*capacity counts.
        unsafe { *self.buf.bad.add(slot * self.capacity + row) }
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        // SAFETY: as in `row`, for the slots*capacity sums.
        unsafe { *self.buf.sums.add(slot * self.capacity + row) }
    }
    fn scale(&self, row: usize) -> Option<f32> {
        if self.buf.scales.is_null() || row >= self.capacity {
            return None;
        }
        // SAFETY: a quantizing device allocates `capacity` scales per buffer; the step's copies completed.
        Some(unsafe { *self.buf.scales.add(row) })
    }
}

impl PinnedStep for CudaPinnedStep {
    fn ring_slot(&self) -> usize {
        self.ring_slot
    }
    fn as_rows(&self) -> &(dyn StepRows + Sync) {
        self
    }
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
        let kernel = CaptureKernel::load(ordinal).map_err(kerr)?;
        // Sizes from the caller (capacity from max_num_batched_tokens): checked before anything is allocated.
        let sized = |what: &str, parts: &[usize]| {
            parts
                .iter()
                .try_fold(1usize, |a, &p| a.checked_mul(p))
                .filter(|n| *n <= isize::MAX as usize)
                .ok_or_else(|| core_err!(Config, "device arena of {capacity} rows × {slots} slots × {width}: its {what} overflow"))
        };
        let row_bytes = sized("row bytes", &[width, dtype.size()])?;
        let n_data = sized("bytes", &[slots, capacity, row_bytes])?;
        let n_rows = sized("rows", &[slots, capacity])?;
        sized("checksums", &[n_rows, 8])?;
        let n_codes = sized("fp8 codes", &[slots, capacity, width])?;
        let n_host = if quantize { n_codes } else { n_data };
        let mut dev = CudaDevice {
            kernel,
            slots,
            width,
            dtype,
            capacity,
            d_data: 0,
            d_sums: 0,
            d_bad: 0,
            d_src: 0,
            d_codes: 0,
            d_scales: 0,
            quantize,
            stream: 0,
            hosts: Vec::with_capacity(ring),
            free: Vec::with_capacity(ring),
            cur: None,
            flight: std::collections::VecDeque::with_capacity(ring),
            last: None,
            copy_stream: std::ptr::null_mut(),
            slot_done: Vec::with_capacity(slots),
            copies_done: Vec::with_capacity(ring),
            src_rows: Vec::with_capacity(capacity),
            rows: 0,
            src_uploaded: false,
        };
        // Each allocation is stored as soon as it is made, so Drop frees whatever a failure left.
        guarded("allocating the capture arena", || {
            // SAFETY: sizes are non-zero; every handle is released once in Drop.
            unsafe {
                dev.d_data = drv("cuMemAlloc arena", cu::malloc_sync(n_data))?;
                dev.d_sums = drv("cuMemAlloc sums", cu::malloc_sync(n_rows * 8))?;
                dev.d_bad = drv("cuMemAlloc counts", cu::malloc_sync(n_rows * 4))?;
                dev.d_src = drv("cuMemAlloc rows", cu::malloc_sync(capacity * 4))?;
                if quantize {
                    dev.d_codes = drv("cuMemAlloc codes", cu::malloc_sync(n_codes))?;
                    dev.d_scales = drv("cuMemAlloc scales", cu::malloc_sync(capacity * 4))?;
                }
                for i in 0..ring {
                    let data = drv("cuMemHostAlloc", cu::malloc_host(n_host, 0))? as *mut u8;
                    let (sums, bad, scales) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
                    dev.hosts.push(Pinned { data, sums, bad, scales });
                    dev.hosts[i].sums = drv("cuMemHostAlloc", cu::malloc_host(n_rows * 8, 0))? as *mut u64;
                    dev.hosts[i].bad = drv("cuMemHostAlloc", cu::malloc_host(n_rows * 4, 0))? as *mut u32;
                    if quantize {
                        dev.hosts[i].scales = drv("cuMemHostAlloc", cu::malloc_host(capacity * 4, 0))? as *mut f32;
                    }
                    dev.free.push(i);
                }
                dev.copy_stream = drv("cuStreamCreate", cu::stream::create(cu::stream::StreamKind::NonBlocking))?;
                for _ in 0..slots {
                    dev.slot_done.push(drv("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?);
                }
                for _ in 0..ring {
                    dev.copies_done.push(drv("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?);
                }
            }
            Ok(())
        })
        .map_err(kerr)?;
        Ok(dev)
    }

    fn row_bytes(&self) -> usize {
        self.width * self.dtype.size()
    }

    /// Bytes of one row in a host buffer.
    fn host_row_bytes(&self) -> usize {
        if self.quantize {
            self.width
        } else {
            self.row_bytes()
        }
    }

    pub fn arch(&self) -> &str {
        &self.kernel.arch
    }

    /// fp8: quantizes the step's arena on the stream of its captures (after the last slot), then copies the codes
    /// and scales to `host` on the copy stream.
    fn quantize_step(&self, host: Pinned) -> CoreResult<()> {
        let (n, w, cap) = (self.rows, self.width, self.capacity);
        let args = Fp8Args {
            arena: self.d_data,
            dtype: self.dtype,
            slot_stride: (cap * w) as i64,
            slots: self.slots as i32,
            n_rows: n as i32,
            width: w as i32,
            codes: self.d_codes,
            scales: self.d_scales,
        };
        // SAFETY: the arena, codes and scales are this device's allocations of `slots × capacity × width` elements
        // and `capacity` scales; the launch follows the step's captures on their stream.
        unsafe { self.kernel.launch_fp8(&args, self.stream) }.map_err(kerr)?;
        let (ev, cs, s) = (self.slot_done[0], self.copy_stream, self.stream as sys::CUstream);
        guarded("enqueueing the fp8 copies to host", || {
            // SAFETY: the copy stream waits for the fp8 kernel through `ev` (slot 0's event, free again: its copies
            // were enqueued already); the pinned buffer holds `slots × capacity × width` codes and `capacity` scales.
            unsafe {
                drv("cuEventRecord", cu::event::record(ev, s))?;
                drv("cuStreamWaitEvent", cu::stream::wait_event(cs, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT))?;
                for slot in 0..self.slots {
                    let base = slot * cap * w;
                    let hd = std::slice::from_raw_parts_mut(host.data.add(base), n * w);
                    drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hd, self.d_codes + base as u64, cs))?;
                }
                let hs = std::slice::from_raw_parts_mut(host.scales, n);
                drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hs, self.d_scales, cs))?;
            }
            Ok(())
        })
        .map_err(kerr)
    }
}

impl DeviceBackend for CudaDevice {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn allocated(&self) -> (usize, usize) {
        let n = self.slots * self.capacity;
        let fp8 = if self.quantize { (n * self.width + self.capacity * 4, self.capacity * 4) } else { (0, 0) };
        let device = n * (self.row_bytes() + 12) + self.capacity * 4 + fp8.0;
        (device, self.hosts.len() * (n * (self.host_row_bytes() + 12) + fp8.1))
    }

    fn quantizes(&self) -> bool {
        self.quantize
    }

    fn free_host(&self) -> usize {
        self.free.len() + usize::from(self.cur.is_some())
    }

    fn ring(&self) -> usize {
        self.hosts.len()
    }

    fn reset(&mut self, rows: usize, runs: &[RowRun]) -> CoreResult<()> {
        ensure!(rows <= self.capacity, ShapeContract, "{rows} rows exceed the device arena's {} rows", self.capacity);
        if self.cur.is_none() {
            // A step abandoned before `end_step` leaves its buffer in `cur`; it is reused as is.
            let Some(i) = self.free.pop() else {
                bail!(Compatibility, "no free host buffer of the {} in the ring: the session must return one first", self.hosts.len());
            };
            self.cur = Some(i);
        }
        self.src_rows.clear();
        self.src_rows.resize(rows, 0);
        for r in runs {
            for k in 0..r.len {
                self.src_rows[r.dst_row + k] = (r.src_row + k) as i32;
            }
        }
        self.rows = rows;
        self.src_uploaded = false;
        Ok(())
    }

    unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, stream: u64) -> CoreResult<()> {
        ensure!(slot < self.slots, ShapeContract, "slot {slot} does not exist ({} slots)", self.slots);
        let Device::Cuda(_) = hidden.device else {
            bail!(Compatibility, "the device path got a tensor on {}", hidden.device);
        };
        let h_stride = hidden.row_layout("hidden states")? as i64;
        let r_stride = match residual {
            Some(r) => r.row_layout("residual")? as i64,
            None => 0,
        };
        self.kernel.bind().map_err(kerr)?;
        let s = stream as sys::CUstream;
        self.stream = stream;
        let rb = self.row_bytes();
        let Some(host) = self.cur.map(|i| self.hosts[i]) else {
            bail!(Compatibility, "slot {slot} captured before the device step was reset");
        };
        if let Some(prev) = self.last {
            let ev = self.copies_done[prev];
            // The arena (and the row index) still hold the previous step until its copies ran: the
            // caller's stream waits for them on the device, the host does not wait.
            // SAFETY: the event was created in `new` and recorded by `end_step` on the copy stream.
            guarded("cuStreamWaitEvent", || unsafe {
                drv("cuStreamWaitEvent", cu::stream::wait_event(s, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT))
            })
            .map_err(kerr)?;
        }
        if !self.src_uploaded && self.rows > 0 {
            // Pageable host→device async copy: staged by the driver before the call returns, so the
            // vector may change afterwards; no device synchronisation.
            // SAFETY: `d_src` holds `capacity` i32 and rows <= capacity.
            guarded("cuMemcpyHtoDAsync", || unsafe { drv("cuMemcpyHtoDAsync", cu::memcpy_htod_async(self.d_src, &self.src_rows, s)) })
                .map_err(kerr)?;
            self.src_uploaded = true;
        }
        let base = slot * self.capacity;
        let args = LaunchArgs {
            hidden: hidden.ptr as u64,
            residual: residual.map_or(0, |r| r.ptr as u64),
            h_stride,
            r_stride,
            in_dtype: hidden.dtype,
            src_rows: self.d_src,
            n_rows: self.rows as i32,
            width: self.width as i32,
            out: self.d_data + (base * rb) as u64,
            out_dtype: self.dtype,
            row_sums: self.d_sums + (base * 8) as u64,
            nonfinite: self.d_bad + (base * 4) as u64,
        };
        // SAFETY: the arena pointers are this device's allocations sized for `capacity` rows per
        // slot; the tensors' memory is the caller's contract (alive until the stream has run the kernel).
        unsafe { self.kernel.launch(&args, stream) }.map_err(kerr)?;
        if self.rows == 0 {
            return Ok(());
        }
        let ev = self.slot_done[slot];
        let (cs, n, quantize) = (self.copy_stream, self.rows, self.quantize);
        guarded("enqueueing the copy to host", || {
            // SAFETY: the pinned buffer (taken from the free list by `reset`) has the arena's layout;
            // the copy stream waits for the kernel through `ev`; nobody reads it before `wait`.
            unsafe {
                drv("cuEventRecord", cu::event::record(ev, s))?;
                drv("cuStreamWaitEvent", cu::stream::wait_event(cs, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT))?;
                if !quantize {
                    let hd = std::slice::from_raw_parts_mut(host.data.add(base * rb), n * rb);
                    drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hd, self.d_data + (base * rb) as u64, cs))?;
                }
                let hs = std::slice::from_raw_parts_mut(host.sums.add(base), n);
                drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hs, self.d_sums + (base * 8) as u64, cs))?;
                let hb = std::slice::from_raw_parts_mut(host.bad.add(base), n);
                drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hb, self.d_bad + (base * 4) as u64, cs))?;
            }
            Ok(())
        })
        .map_err(kerr)
    }

    fn end_step(&mut self) -> CoreResult<()> {
        let Some(i) = self.cur else {
            bail!(Compatibility, "a device step ended before it was reset");
        };
        self.kernel.bind().map_err(kerr)?;
        if self.quantize && self.rows > 0 {
            self.quantize_step(self.hosts[i])?;
        }
        let (ev, cs) = (self.copies_done[i], self.copy_stream);
        // SAFETY: both handles were created in `new` and are alive.
        guarded("cuEventRecord", || unsafe { drv("cuEventRecord", cu::event::record(ev, cs)) }).map_err(kerr)?;
        self.cur = None;
        self.flight.push_back(i);
        self.last = Some(i);
        Ok(())
    }

    fn wait(&mut self) -> CoreResult<Box<dyn PinnedStep>> {
        // The step leaves the queue whatever happens next, as the session's pending step did: the two
        // queues stay paired, and on failure the buffer goes back to the free list unread (so the ring
        // never loses a buffer).
        let Some(i) = self.flight.pop_front() else {
            bail!(Compatibility, "no device step to collect: `end_step` was not called");
        };
        let ev = self.copies_done[i];
        let synced = self.kernel.bind().and_then(|()| {
            // SAFETY: the event was recorded by `end_step` on the copy stream.
            guarded("cuEventSynchronize", || unsafe { drv("cuEventSynchronize", cu::event::synchronize(ev)) })
        });
        if let Err(e) = synced {
            self.free.push(i);
            return Err(kerr(e));
        }
        Ok(Box::new(CudaPinnedStep { ring_slot: i, buf: self.hosts[i], capacity: self.capacity, row_bytes: self.host_row_bytes() }))
    }

    fn recycle(&mut self, buf: Box<dyn PinnedStep>) -> CoreResult<()> {
        let i = buf.ring_slot();
        ensure!(
            i < self.hosts.len() && !self.free.contains(&i) && self.cur != Some(i) && !self.flight.contains(&i),
            Compatibility,
            "host buffer {i} given back twice or unknown (ring of {})",
            self.hosts.len()
        );
        self.free.push(i);
        Ok(())
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.kernel.bind();
        let _ = guarded("freeing the capture arena", || {
            // SAFETY: each handle and allocation was made in `new` and is released exactly once here,
            // after the copy stream has finished with them.
            unsafe {
                if !self.copy_stream.is_null() {
                    let _ = cu::stream::synchronize(self.copy_stream);
                }
                for &e in &self.slot_done {
                    let _ = cu::event::destroy(e);
                }
                for &e in &self.copies_done {
                    let _ = cu::event::destroy(e);
                }
                if !self.copy_stream.is_null() {
                    let _ = cu::stream::destroy(self.copy_stream);
                }
                for d in [self.d_data, self.d_sums, self.d_bad, self.d_src, self.d_codes, self.d_scales] {
                    if d != 0 {
                        let _ = cu::free_sync(d);
                    }
                }
                for h in &self.hosts {
                    for p in [h.data as *mut c_void, h.sums as *mut c_void, h.bad as *mut c_void, h.scales as *mut c_void] {
                        if !p.is_null() {
                            let _ = cu::free_host(p);
                        }
                    }
                }
            }
            Ok(())
        });
    }
}
