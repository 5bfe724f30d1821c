//! The CUDA device path: a fixed device arena ([`arena`]), the armed capture kernel on PyTorch's stream, and copies
//! on a side stream to a ring of pinned host buffers ([`ring`]); all memory, streams and events are `cudarc`'s owned
//! types.
//!
//! Invariants:
//! - a capture launch is one kernel launch whose arguments never change between steps, so that a CUDA graph records
//!   it once (vLLM captures its graphs with the hooks' launches in them) and every replay captures the step that was
//!   armed before it: the step lives in device memory (control block, source rows) written on the forward's stream
//!   before the forward (`arm`) and disarmed after it (`end_step`), so that a forward outside a step (warm-up, a
//!   dummy batch, a graph being captured) writes nothing;
//! - the arena has halves (two with overlap): step N+1 is armed into the other half while step N's copies run; a
//!   half is armed again only once the copies of the step that last used it ran (the forward's stream waits for
//!   them on the device, the host never waits);
//! - after the forward, on the forward's stream: fp8 quantization (per-token scales over every slot, `fp8.cu`) into
//!   the half's codes, the disarm, an event; the copy stream waits for that event and copies the step's rows (or
//!   codes and scales), checksums, counts and stamps to the step's pinned buffer, then records the buffer's
//!   `copies_done` and the half's `half_free`; in a large step each slot's rows are copied as soon as its kernel
//!   ran instead (`early_copies.rs`);
//! - a host buffer is written only by the copies of the step that took it, and read only once they are done and
//!   until it is given back (`ring.rs`);
//! - on drop the forward's last work is disarmed and the copy stream synchronised: it waited for every kernel that
//!   used the arena, so the arena (freed on that stream) and the pinned buffers go only once no work uses them. The
//!   control block outlives the session when a launch ran outside a step: a CUDA graph may have recorded it, and a
//!   replay after the session is gone must still read "disarmed" there (and the kernel's module stays loaded for
//!   the process: `hscapture_kernels::launch`).

mod arena;
mod early_copies;
mod pinned;
mod ring;
mod step_copies;

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaEvent, CudaStream, DevicePtr, DriverError};

use crate::capture::device::{DeviceBackend, PinnedStep};
use crate::capture::tensor::{Device, TensorDesc};
use crate::{bail, core_err, ensure, error::CoreResult};
use arena::{address, part, DeviceArena};
use early_copies::EarlyCopies;
use hscapture_kernels::armed::{ArmedLayout, Control, CONTROL_WORDS, STAMP_WORDS};
use hscapture_kernels::launch::{guarded, ArmedArgs, CaptureKernel, Fp8Args};
use hscapture_kernels::{DType, KernelError, RowRun};
use ring::HostRing;

fn kerr(e: KernelError) -> crate::CoreError {
    core_err!(Compatibility, "CUDA: {e}")
}

fn drv<T>(what: &str, r: Result<T, DriverError>) -> Result<T, KernelError> {
    r.map_err(|e| KernelError(format!("{what}: {e:?}")))
}

/// The step armed on the device: its half, rows and the forward's stream.
struct Armed {
    half: usize,
    rows: usize,
    stream: Arc<CudaStream>,
}

pub struct CudaDevice {
    kernel: CaptureKernel,
    arena: DeviceArena,
    ring: HostRing,
    copy: Arc<CudaStream>,
    /// Recorded on the forward's stream after a step's forward (and fp8 kernel and disarm).
    forward_done: CudaEvent,
    /// Per half: recorded on the copy stream after the copies of the step that last used it (`half_used`).
    half_free: Vec<CudaEvent>,
    half_used: Vec<bool>,
    next_half: usize,
    armed: Option<Armed>,
    /// The last stream a launch or an arm borrowed (PyTorch's current stream, wrapped once per stream).
    stream: Option<Arc<CudaStream>>,
    /// A launch ran outside an armed step: a CUDA graph may have recorded it (see the module's invariants).
    recorded: bool,
    quantize: bool,
    early: EarlyCopies,
    src_rows: Vec<i32>,
    /// The largest pitch a strided copy takes on this device (`CU_DEVICE_ATTRIBUTE_MAX_PITCH`; 0: copy run by run).
    max_pitch: usize,
}

impl CudaDevice {
    /// Loads the kernel on `ordinal`, allocates the arena for `capacity` rows per slot in `halves` halves (2 when steps
    /// overlap) and `ring` pinned host buffers of `capacity` rows, and as many of `small_rows` rows when that is
    /// between 0 and `capacity` (decode steps take those: `host_pool.rs`); with `quantize`, the fp8 codes and
    /// scales, and host buffers that hold those. Steps of at least `early_bytes` bytes of rows per slot copy each
    /// slot's rows as soon as its kernel ran (`early_copies.rs`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ordinal: i32,
        slots: usize,
        width: usize,
        dtype: DType,
        capacity: usize,
        halves: usize,
        ring: usize,
        small_rows: usize,
        quantize: bool,
        early_bytes: usize,
    ) -> CoreResult<CudaDevice> {
        ensure!(
            capacity > 0 && slots > 0 && width > 0,
            Config,
            "device arena of {capacity} rows × {slots} slots × {width}: nothing to allocate"
        );
        ensure!(ring > 0, Config, "a ring of {ring} host buffers: at least one is needed");
        ensure!((1..=2).contains(&halves), Config, "a device arena of {halves} halves: expected 1 or 2");
        // Sizes from the caller (capacity from max_num_batched_tokens): checked before anything is allocated. The
        // kernel's row indices are u32/i32.
        let sized = |what: &str, parts: &[usize]| {
            parts
                .iter()
                .try_fold(1usize, |a, &p| a.checked_mul(p))
                .filter(|n| *n <= isize::MAX as usize)
                .ok_or_else(|| core_err!(Config, "device arena of {capacity} rows × {slots} slots × {width}: its {what} overflow"))
        };
        let row_bytes = sized("row bytes", &[width, dtype.size()])?;
        sized("bytes", &[halves, slots, capacity, row_bytes])?;
        let n_rows = sized("rows", &[halves, slots, capacity])?;
        ensure!(
            n_rows <= i32::MAX as usize && width <= i32::MAX as usize,
            Config,
            "device arena of {halves} × {capacity} rows × {slots} slots × {width}: more rows than the kernel indexes"
        );
        sized("checksums", &[n_rows, 8])?;
        sized("fp8 codes", &[n_rows, width])?;
        let layout = ArmedLayout { slots, capacity, width, halves };
        let kernel = CaptureKernel::load(ordinal).map_err(kerr)?;
        let ctx = Arc::clone(kernel.context());
        let max_pitch = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH).map_or(0, |p| p.max(0) as usize);
        let (copy, arena, forward_done, half_free, early) = guarded("allocating the capture arena", || {
            let copy = drv("cuStreamCreate", ctx.new_stream())?;
            let arena = drv("cuMemAlloc", DeviceArena::new(&copy, layout, dtype, quantize))?;
            let forward_done = drv("cuEventCreate", ctx.new_event(None))?;
            let half_free = (0..halves).map(|_| drv("cuEventCreate", ctx.new_event(None))).collect::<Result<Vec<_>, _>>()?;
            let early = EarlyCopies::new(&ctx, slots, early_bytes)?;
            // Other streams use the arena only once its allocation (stream-ordered) and zeroing are done.
            drv("cuStreamSynchronize", copy.synchronize())?;
            Ok((copy, arena, forward_done, half_free, early))
        })
        .map_err(kerr)?;
        let host_row_bytes = if quantize { width } else { row_bytes };
        let small = if small_rows < capacity { ring } else { 0 };
        let ring = HostRing::new(&ctx, &[(ring, capacity), (small, small_rows)], slots, host_row_bytes, quantize)?;
        Ok(CudaDevice {
            kernel,
            arena,
            ring,
            copy,
            forward_done,
            half_free,
            half_used: vec![false; halves],
            next_half: 0,
            armed: None,
            stream: None,
            recorded: false,
            quantize,
            early,
            src_rows: Vec::with_capacity(capacity),
            max_pitch,
        })
    }

    pub fn arch(&self) -> &str {
        &self.kernel.arch
    }

    /// The caller's stream, borrowed once per stream rather than once per call (no allocation per launch).
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context (the caller's current stream), kept alive by
    /// its owner while work enqueued on it runs.
    unsafe fn borrow(&mut self, stream: u64) -> Arc<CudaStream> {
        match &self.stream {
            Some(s) if s.cu_stream() as u64 == stream => Arc::clone(s),
            _ => {
                // SAFETY: the caller's contract, above.
                let s = unsafe { self.kernel.borrow_stream(stream) };
                self.stream = Some(Arc::clone(&s));
                s
            }
        }
    }

    /// Disarms on `s` (stream-ordered after the step's forward): the control block zeroed, as `Control::DISARMED`
    /// reads, by a memset that needs no host staging (a pageable copy does).
    fn write_disarmed(&mut self, s: &Arc<CudaStream>) -> CoreResult<()> {
        debug_assert_eq!(Control::DISARMED.words(), [0; CONTROL_WORDS]);
        let block = self.arena.ctl()?;
        let (ptr, _record) = block.device_ptr(s);
        guarded("cuMemsetD8Async", || {
            // SAFETY: the control block is this device's allocation of CONTROL_WORDS u32 words, alive while any
            // launch may read it (the module's invariants); zero is a valid pattern for it (disarmed).
            drv("cuMemsetD8Async", unsafe { result::memset_d8_async(ptr, 0, CONTROL_WORDS * 4, s.cu_stream()) })
        })
        .map_err(kerr)
    }

    /// Writes the control block on `s` (stream-ordered after the forward before it, before the one after).
    fn write_control(&mut self, ctl: Control, s: &Arc<CudaStream>) -> CoreResult<()> {
        let words = ctl.words();
        let Some(block) = self.arena.ctl.as_mut() else {
            bail!(Compatibility, "the device's control block is gone");
        };
        let mut dst = block.try_slice_mut(0..CONTROL_WORDS).ok_or_else(|| core_err!(Compatibility, "the control block"))?;
        // Pageable host→device async copy: staged by the driver before the call returns (no device synchronisation).
        guarded("cuMemcpyHtoDAsync", || drv("cuMemcpyHtoDAsync", s.memcpy_htod(&words[..], &mut dst))).map_err(kerr)
    }
}

impl DeviceBackend for CudaDevice {
    fn capacity(&self) -> usize {
        self.arena.layout.capacity
    }

    fn allocated(&self) -> (usize, usize) {
        let ArmedLayout { slots, width, .. } = self.arena.layout;
        let host_row = if self.quantize { width } else { self.arena.row_bytes() };
        let buf = |cap: usize| slots * cap * (host_row + 12) + if self.quantize { cap * 4 } else { 0 } + slots * STAMP_WORDS * 4;
        (self.arena.bytes(), self.ring.capacities().map(buf).sum())
    }

    fn quantizes(&self) -> bool {
        self.quantize
    }

    fn free_host(&self, rows: usize) -> usize {
        self.ring.available(rows)
    }

    fn ring(&self) -> usize {
        self.ring.capacities().filter(|&c| c >= self.arena.layout.capacity).count()
    }

    fn arm(&mut self, arm: u32, rows: usize, runs: &[RowRun], stream: u64) -> CoreResult<()> {
        let cap = self.arena.layout.capacity;
        ensure!(self.armed.is_none(), Compatibility, "a device step was armed twice");
        ensure!(arm != 0, Compatibility, "arm number 0 means disarmed");
        ensure!(rows <= cap, ShapeContract, "{rows} rows exceed the device arena's {cap} rows");
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
        self.ring.take(rows)?;
        self.kernel.bind().map_err(kerr)?;
        // SAFETY: `stream` is the caller's current stream on this device (the trait's contract).
        let s = unsafe { self.borrow(stream) };
        let half = self.next_half;
        if self.half_used[half] {
            // The half still holds a step until its copies ran: the forward's stream waits for them on the device.
            guarded("cuStreamWaitEvent", || drv("cuStreamWaitEvent", s.wait(&self.half_free[half]))).map_err(kerr)?;
        }
        if rows > 0 {
            let mut dst =
                self.arena.src.try_slice_mut(0..rows).ok_or_else(|| core_err!(Compatibility, "{rows} source rows exceed the arena"))?;
            // Pageable host→device async copy: staged by the driver before the call returns.
            guarded("cuMemcpyHtoDAsync", || drv("cuMemcpyHtoDAsync", s.memcpy_htod(&self.src_rows[..], &mut dst))).map_err(kerr)?;
        }
        let data_base = self.arena.data_base(half) as u32;
        self.write_control(Control { arm, rows: rows as u32, data_base, half: half as u32 }, &s)?;
        self.next_half = (half + 1) % self.half_free.len();
        self.early.policy.arm(rows.saturating_mul(self.arena.row_bytes()), self.quantize);
        self.armed = Some(Armed { half, rows, stream: s });
        Ok(())
    }

    fn disarm(&mut self) -> CoreResult<()> {
        let Some(a) = self.armed.take() else {
            return Ok(());
        };
        self.early.policy.off();
        self.kernel.bind().map_err(kerr)?;
        self.write_disarmed(&a.stream)
    }

    unsafe fn launch(
        &mut self,
        slot: usize,
        point: i32,
        hidden: &TensorDesc,
        residual: Option<&TensorDesc>,
        stream: u64,
    ) -> CoreResult<()> {
        let layout = self.arena.layout;
        ensure!(slot < layout.slots, ShapeContract, "slot {slot} does not exist ({} slots)", layout.slots);
        let Device::Cuda(_) = hidden.device else {
            bail!(Compatibility, "the device path got a tensor on {}", hidden.device);
        };
        let h_stride = hidden.row_layout("hidden states")? as i64;
        let r_stride = match residual {
            Some(r) => r.row_layout("residual")? as i64,
            None => 0,
        };
        let grid = i32::try_from(hidden.rows()).map_err(|_| core_err!(ShapeContract, "{} rows exceed a kernel launch", hidden.rows()))?;
        self.kernel.bind().map_err(kerr)?;
        // SAFETY: `stream` is the caller's current stream on this device (the trait's contract).
        let s = unsafe { self.borrow(stream) };
        self.recorded |= self.armed.is_none();
        let early = self.before_launch(slot, &s).map_err(kerr)?;
        let a = &self.arena;
        let (sums, bad) = (address(&a.sums, &s), address(&a.bad, &s));
        let args = ArmedArgs {
            hidden: hidden.ptr as u64,
            residual: residual.map_or(0, |r| r.ptr as u64),
            h_stride,
            r_stride,
            in_dtype: hidden.dtype,
            ctl: address(a.ctl()?, &s),
            src_rows: address(&a.src, &s),
            grid,
            slot: slot as i32,
            slots: layout.slots as i32,
            capacity: layout.capacity as i32,
            point,
            width: layout.width as i32,
            out: address(&a.data, &s),
            out_dtype: a.dtype,
            row_sums: sums,
            nonfinite: bad,
            stamps: address(&a.stamps, &s),
        };
        // SAFETY: the arena's buffers are this device's allocations for every half and stay allocated while a graph
        // may replay the launch (the control block beyond the session: see the module's invariants); the tensors'
        // memory is the caller's contract.
        unsafe { self.kernel.launch_armed(&args, &s) }.map_err(kerr)?;
        if early {
            self.after_launch(slot, &s)?;
        }
        Ok(())
    }

    fn end_step(&mut self) -> CoreResult<()> {
        let Some(a) = self.armed.take() else {
            bail!(Compatibility, "a device step ended without being armed");
        };
        self.kernel.bind().map_err(kerr)?;
        if self.quantize && a.rows > 0 {
            self.quantize_step(&a)?;
        }
        self.write_disarmed(&a.stream)?;
        guarded("cuEventRecord", || drv("cuEventRecord", self.forward_done.record(&a.stream))).map_err(kerr)?;
        self.copy_step(&a)?;
        self.early.policy.off();
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
        let _ = self.kernel.bind();
        let _ = self.disarm();
        if let (true, Some(mut ctl)) = (self.recorded, self.arena.ctl.take()) {
            // A CUDA graph may replay a recorded launch after this session is gone: its control block stays allocated,
            // written "disarmed" (and waited for), so the replayed kernel returns at its first read. 32 bytes of
            // device memory per such session, for the process's life.
            let words = Control::DISARMED.words();
            let _ = guarded("disarming for good", || {
                let mut dst = ctl.try_slice_mut(0..CONTROL_WORDS).ok_or_else(|| KernelError("the control block".into()))?;
                drv("cuMemcpyHtoDAsync", self.copy.memcpy_htod(&words[..], &mut dst))?;
                crate::blocking::section(|| drv("cuStreamSynchronize", self.copy.synchronize()))
            });
            std::mem::forget(ctl);
        }
        // The copy stream waited for every kernel that used the arena: once it is done, nothing uses the memory
        // the fields free after this.
        let _ =
            crate::blocking::section(|| guarded("synchronising the copy stream", || drv("cuStreamSynchronize", self.copy.synchronize())));
    }
}
