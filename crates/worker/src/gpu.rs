//! The CUDA device path: a fixed device arena, the capture kernel on PyTorch's stream, and copies to
//! a pinned host buffer on a side stream.
//!
//! Invariants:
//! - device memory: one arena of `capacity` rows × `slots` × `width` in the output dtype, plus a
//!   checksum and a non-finite count per row and the step's source-row index, allocated once when the
//!   worker loads the model (before vLLM sizes its KV cache) and freed on drop;
//! - host memory: one pinned buffer with the same layout, written only by the side stream's copies
//!   and read only after `wait` has synchronised on the step's last copy;
//! - per slot: kernel on the caller's stream → event → side stream waits on it → copy of that slot's
//!   rows; so copies overlap the rest of the forward, and the compute stream never waits on the host;
//! - one step in flight: the session calls `wait` before the next step reuses the arena and buffer.

use std::ffi::c_void;

use cudarc::driver::{result as cu, sys};

use crate::device::DeviceBackend;
use crate::rows::StepRows;
use crate::tensor::{Device, TensorDesc};
use crate::{bail, core_err, ensure, error::CoreResult};
use hscapture_kernels::launch::{guarded, CaptureKernel, LaunchArgs};
use hscapture_kernels::{DType, KernelError, RowRun};

fn kerr(e: KernelError) -> crate::CoreError {
    core_err!(Compatibility, "CUDA: {e}")
}

fn drv<T>(what: &str, r: Result<T, cudarc::driver::DriverError>) -> Result<T, KernelError> {
    r.map_err(|e| KernelError(format!("{what}: {e:?}")))
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
    h_data: *mut u8,
    h_sums: *mut u64,
    h_bad: *mut u32,
    copy_stream: sys::CUstream,
    slot_done: Vec<sys::CUevent>,
    copies_done: sys::CUevent,
    src_rows: Vec<i32>,
    rows: usize,
    src_uploaded: bool,
    in_flight: bool,
}

// SAFETY: the raw pointers are this struct's own allocations (device and pinned host memory) and
// driver handles; the session that owns it is used by one thread at a time (Python's call into the
// pyclass), and every method binds the context first.
unsafe impl Send for CudaDevice {}
// SAFETY: shared references only read (the pinned buffer after `wait`, sizes); every mutation goes
// through `&mut self`, which the owning pyclass hands out to one caller at a time.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Loads the kernel on `ordinal` and allocates the arena for `capacity` rows per slot.
    pub fn new(ordinal: i32, slots: usize, width: usize, dtype: DType, capacity: usize) -> CoreResult<CudaDevice> {
        ensure!(capacity > 0 && slots > 0 && width > 0, Config, "device arena of {capacity} rows × {slots} slots × {width}: nothing to allocate");
        let kernel = CaptureKernel::load(ordinal).map_err(kerr)?;
        let row_bytes = width * dtype.size();
        let (n_data, n_rows) = (slots * capacity * row_bytes, slots * capacity);
        let mut dev = guarded("allocating the capture arena", || {
            // SAFETY: sizes are non-zero; every allocation is freed once in Drop (a partially built
            // device frees what it got because Drop runs on the struct built below).
            unsafe {
                let d_data = drv("cuMemAlloc arena", cu::malloc_sync(n_data))?;
                let d_sums = drv("cuMemAlloc sums", cu::malloc_sync(n_rows * 8))?;
                let d_bad = drv("cuMemAlloc counts", cu::malloc_sync(n_rows * 4))?;
                let d_src = drv("cuMemAlloc rows", cu::malloc_sync(capacity * 4))?;
                let h_data = drv("cuMemHostAlloc", cu::malloc_host(n_data, 0))? as *mut u8;
                let h_sums = drv("cuMemHostAlloc", cu::malloc_host(n_rows * 8, 0))? as *mut u64;
                let h_bad = drv("cuMemHostAlloc", cu::malloc_host(n_rows * 4, 0))? as *mut u32;
                let copy_stream = drv("cuStreamCreate", cu::stream::create(cu::stream::StreamKind::NonBlocking))?;
                let mut slot_done = Vec::with_capacity(slots);
                for _ in 0..slots {
                    slot_done.push(drv("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?);
                }
                let copies_done = drv("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
                Ok((d_data, d_sums, d_bad, d_src, h_data, h_sums, h_bad, copy_stream, slot_done, copies_done))
            }
        })
        .map_err(kerr)
        .map(|(d_data, d_sums, d_bad, d_src, h_data, h_sums, h_bad, copy_stream, slot_done, copies_done)| CudaDevice {
            kernel,
            slots,
            width,
            dtype,
            capacity,
            d_data,
            d_sums,
            d_bad,
            d_src,
            h_data,
            h_sums,
            h_bad,
            copy_stream,
            slot_done,
            copies_done,
            src_rows: Vec::with_capacity(capacity),
            rows: 0,
            src_uploaded: false,
            in_flight: false,
        })?;
        dev.rows = 0;
        Ok(dev)
    }

    fn row_bytes(&self) -> usize {
        self.width * self.dtype.size()
    }

    pub fn arch(&self) -> &str {
        &self.kernel.arch
    }
}

impl StepRows for CudaDevice {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        let rb = self.row_bytes();
        let o = (slot * self.capacity + row) * rb;
        // SAFETY: `h_data` holds slots*capacity*rb bytes (allocated in `new`); slot < slots and
        // row < capacity by the session's plan; the copies into it completed before `wait` returned.
        unsafe { std::slice::from_raw_parts(self.h_data.add(o), rb) }
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        // SAFETY: as in `row`, for the slots*capacity counts.
        unsafe { *self.h_bad.add(slot * self.capacity + row) }
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        // SAFETY: as in `row`, for the slots*capacity sums.
        unsafe { *self.h_sums.add(slot * self.capacity + row) }
    }
}

impl DeviceBackend for CudaDevice {
    fn capacity(&self) -> usize {
        self.capacity
    }

    fn allocated(&self) -> (usize, usize) {
        let n = self.slots * self.capacity;
        (n * (self.row_bytes() + 12) + self.capacity * 4, n * (self.row_bytes() + 12))
    }

    fn reset(&mut self, rows: usize, runs: &[RowRun]) -> CoreResult<()> {
        ensure!(!self.in_flight, Compatibility, "a device step began before the previous one was collected");
        ensure!(rows <= self.capacity, ShapeContract, "{rows} rows exceed the device arena's {} rows", self.capacity);
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
        let rb = self.row_bytes();
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
        let (cs, n) = (self.copy_stream, self.rows);
        guarded("enqueueing the copy to host", || {
            // SAFETY: the pinned buffers have the arena's layout; the copy stream waits for the
            // kernel through `ev`; the host reads them only after `wait`.
            unsafe {
                drv("cuEventRecord", cu::event::record(ev, s))?;
                drv("cuStreamWaitEvent", cu::stream::wait_event(cs, ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT))?;
                let hd = std::slice::from_raw_parts_mut(self.h_data.add(base * rb), n * rb);
                drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hd, self.d_data + (base * rb) as u64, cs))?;
                let hs = std::slice::from_raw_parts_mut(self.h_sums.add(base), n);
                drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hs, self.d_sums + (base * 8) as u64, cs))?;
                let hb = std::slice::from_raw_parts_mut(self.h_bad.add(base), n);
                drv("cuMemcpyDtoHAsync", cu::memcpy_dtoh_async(hb, self.d_bad + (base * 4) as u64, cs))?;
            }
            Ok(())
        })
        .map_err(kerr)
    }

    fn end_step(&mut self) -> CoreResult<()> {
        self.kernel.bind().map_err(kerr)?;
        let (ev, cs) = (self.copies_done, self.copy_stream);
        // SAFETY: both handles were created in `new` and are alive.
        guarded("cuEventRecord", || unsafe { drv("cuEventRecord", cu::event::record(ev, cs)) }).map_err(kerr)?;
        self.in_flight = true;
        Ok(())
    }

    fn wait(&mut self) -> CoreResult<&(dyn StepRows + Sync)> {
        if self.in_flight {
            self.kernel.bind().map_err(kerr)?;
            let ev = self.copies_done;
            // SAFETY: the event was recorded by `end_step` on the copy stream.
            guarded("cuEventSynchronize", || unsafe { drv("cuEventSynchronize", cu::event::synchronize(ev)) }).map_err(kerr)?;
            self.in_flight = false;
        }
        Ok(self)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.kernel.bind();
        let _ = guarded("freeing the capture arena", || {
            // SAFETY: each handle and allocation was made in `new` and is released exactly once here,
            // after the copy stream has finished with them.
            unsafe {
                let _ = cu::stream::synchronize(self.copy_stream);
                for &e in &self.slot_done {
                    let _ = cu::event::destroy(e);
                }
                let _ = cu::event::destroy(self.copies_done);
                let _ = cu::stream::destroy(self.copy_stream);
                let _ = cu::free_sync(self.d_data);
                let _ = cu::free_sync(self.d_sums);
                let _ = cu::free_sync(self.d_bad);
                let _ = cu::free_sync(self.d_src);
                let _ = cu::free_host(self.h_data as *mut c_void);
                let _ = cu::free_host(self.h_sums as *mut c_void);
                let _ = cu::free_host(self.h_bad as *mut c_void);
            }
            Ok(())
        });
    }
}
