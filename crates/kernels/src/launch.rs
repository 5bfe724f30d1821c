//! The capture kernels on a CUDA device (`capture.cu`, and `fp8.cu` appended to it): compiled with NVRTC when a worker starts
//! (never inside a forward or a CUDA-graph capture), loaded into the device's primary context (the one
//! PyTorch uses) through `cudarc`'s owned types, and launched on PyTorch's current stream, which `cudarc` borrows
//! (`wrap_borrowed_stream`: never destroyed here).
//!
//! Invariants: the module is loaded once per device and process and never unloaded: a CUDA graph that recorded a
//! launch (vLLM captures its graphs with the capture kernel in them) may replay it after every session is gone, and
//! a replayed kernel node of an unloaded module is undefined (on the H200 it crashed the process once CUPTI had
//! been started by a profiler). `CaptureKernel` is a handle on that loaded module and the primary context (a
//! `CudaContext`, retained with it); every entry point makes the context current on the calling thread first. The
//! context does not track `CudaSlice` uses with events: its callers order their streams themselves (`capture/cuda/`).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::cpu::KernelError;
use crate::dtype::DType;

/// The kernels' source, also shipped for inspection (`fp8.cu` uses `capture.cu`'s helpers).
pub const SOURCE: &str = concat!(include_str!("capture.cu"), "\n", include_str!("fp8.cu"));
const NAME: &str = "hscapture_capture_armed";
const NAME_FP8: &str = "hscapture_fp8_quantize";
/// Threads per block (a multiple of 32: the reduction uses full-warp shuffles).
pub const BLOCK: u32 = 256;

fn err(what: &str, e: impl std::fmt::Debug) -> KernelError {
    KernelError(format!("{what}: {e:?}"))
}

/// Runs a CUDA call, turning a `cudarc` panic (a missing library or symbol) into an error.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, KernelError>) -> Result<T, KernelError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
        Err(KernelError(format!("{what}: {}", msg.unwrap_or_else(|| "CUDA library missing".into()))))
    })
}

/// The kernels' PTX for `arch` (`compute_90`), compiled once per process (at the first worker start-up).
pub fn ptx(arch: &str) -> Result<String, KernelError> {
    guarded("NVRTC", || ptx_for(arch))
}

fn ptx_for(arch: &str) -> Result<String, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    let mut g = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = g.get(arch) {
        return Ok(p.clone());
    }
    // NVRTC wants a 'static name; one small string per architecture, kept for the process.
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = cudarc::nvrtc::CompileOptions {
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        fmad: Some(false),
        arch: Some(arch_static),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).map_err(|e| err("NVRTC compiling capture.cu", e))?.to_src();
    g.insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}

pub fn dtype_code(d: DType) -> i32 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

/// Raw device pointers and sizes of one armed capture launch (see `capture.cu` and `armed.rs`). Nothing here
/// changes between steps: a CUDA graph may record the launch and replay it.
#[derive(Clone, Copy, Debug)]
pub struct ArmedArgs {
    pub hidden: u64,
    /// 0 when there is no residual.
    pub residual: u64,
    /// Row strides of hidden and residual, in elements.
    pub h_stride: i64,
    pub r_stride: i64,
    pub in_dtype: DType,
    /// The control block (`armed::CONTROL_WORDS` u32) and the source-row index (`capacity` i32).
    pub ctl: u64,
    pub src_rows: u64,
    /// Rows of the layer's tensor: one block each.
    pub grid: i32,
    pub slot: i32,
    pub slots: i32,
    pub capacity: i32,
    /// The slot's capture point, stamped.
    pub point: i32,
    pub width: i32,
    /// The arena's rows (every half), checksums, non-finite counts and stamps.
    pub out: u64,
    pub out_dtype: DType,
    pub row_sums: u64,
    pub nonfinite: u64,
    pub stamps: u64,
}

/// Raw device pointers and sizes of one fp8 quantization (see `fp8.cu`).
#[derive(Clone, Copy, Debug)]
pub struct Fp8Args {
    /// The arena: `slots` blocks of `slot_stride` elements in `dtype`, row `d` of a block at `d * width`.
    pub arena: u64,
    pub dtype: DType,
    pub slot_stride: i64,
    pub slots: i32,
    pub n_rows: i32,
    pub width: i32,
    /// One byte per arena element, same layout.
    pub codes: u64,
    /// `n_rows` f32.
    pub scales: u64,
}

#[derive(Clone)]
pub struct CaptureKernel {
    ctx: Arc<CudaContext>,
    func: CudaFunction,
    fp8: CudaFunction,
    pub arch: String,
}

impl CaptureKernel {
    /// The kernels on device `ordinal`: compiled and loaded at the first call for that device, then the same
    /// loaded module for the process's life (see the module's invariants).
    pub fn load(ordinal: i32) -> Result<CaptureKernel, KernelError> {
        static LOADED: OnceLock<Mutex<HashMap<i32, CaptureKernel>>> = OnceLock::new();
        let loaded = LOADED.get_or_init(|| Mutex::new(HashMap::new()));
        let mut g = loaded.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = g.get(&ordinal) {
            return Ok(k.clone());
        }
        let k = Self::load_new(ordinal)?;
        g.insert(ordinal, k.clone());
        Ok(k)
    }

    fn load_new(ordinal: i32) -> Result<CaptureKernel, KernelError> {
        guarded("loading the capture kernel", || {
            let ordinal = usize::try_from(ordinal).map_err(|e| err("device ordinal", e))?;
            let ctx = CudaContext::new(ordinal).map_err(|e| err("cuDevicePrimaryCtxRetain", e))?;
            // SAFETY: every CudaSlice of this context is ordered by its owner's events (capture/cuda/): freed only
            // after its copy stream synchronised, used by other streams only after allocation synchronised, and
            // written by one stream (the caller's) at a time.
            unsafe { ctx.disable_event_tracking() };
            let (major, minor) = ctx.compute_capability().map_err(|e| err("compute capability", e))?;
            let arch = format!("compute_{major}{minor}");
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx_for(&arch)?)).map_err(|e| err("cuModuleLoadData", e))?;
            let func = module.load_function(NAME).map_err(|e| err("cuModuleGetFunction", e))?;
            let fp8 = module.load_function(NAME_FP8).map_err(|e| err("cuModuleGetFunction", e))?;
            Ok(CaptureKernel { ctx, func, fp8, arch })
        })
    }

    /// The device's primary context, for the memory and streams that go with the kernel.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the kernel's context current on this thread.
    pub fn bind(&self) -> Result<(), KernelError> {
        guarded("cuCtxSetCurrent", || self.ctx.bind_to_thread().map_err(|e| err("cuCtxSetCurrent", e)))
    }

    /// The caller's stream (PyTorch's current stream), borrowed.
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context, kept alive by its owner while the
    /// returned handle is used.
    pub unsafe fn borrow_stream(&self, stream: u64) -> Arc<CudaStream> {
        // SAFETY: the caller's contract, above.
        unsafe { self.ctx.wrap_borrowed_stream(stream as sys::CUstream) }
    }

    fn config(n_rows: i32) -> LaunchConfig {
        LaunchConfig { grid_dim: (n_rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// Enqueues one armed capture on `stream`: one `cuLaunchKernel` and nothing else, so that it may be recorded
    /// into a CUDA graph being captured on `stream`.
    ///
    /// # Safety
    /// Every pointer in `a` must be device memory of this context large enough for the launch (`grid` rows of the
    /// tensors; the arena's rows, checksums, counts and stamps of every half; the control block and `capacity`
    /// source rows), and stay allocated as long as the launch, or a graph that recorded it, may run.
    pub unsafe fn launch_armed(&self, a: &ArmedArgs, stream: &CudaStream) -> Result<(), KernelError> {
        if a.grid <= 0 {
            return Ok(());
        }
        let (in_dt, out_dt) = (dtype_code(a.in_dtype), dtype_code(a.out_dtype));
        guarded("launching the capture kernel", || {
            let mut b = stream.launch_builder(&self.func);
            b.arg(&a.hidden).arg(&a.residual).arg(&a.h_stride).arg(&a.r_stride).arg(&in_dt);
            b.arg(&a.ctl).arg(&a.src_rows).arg(&a.grid).arg(&a.slot).arg(&a.slots).arg(&a.capacity).arg(&a.point).arg(&a.width);
            b.arg(&a.out).arg(&out_dt).arg(&a.row_sums).arg(&a.nonfinite).arg(&a.stamps);
            // SAFETY: the arguments match the kernel's signature one for one (capture.cu); the memory contract is
            // the caller's.
            unsafe { b.launch(Self::config(a.grid)) }.map(|_| ()).map_err(|e| err("cuLaunchKernel", e))
        })
    }

    /// Enqueues one fp8 quantization on `stream`.
    ///
    /// # Safety
    /// Every pointer in `a` must be device memory of this context holding the extents `Fp8Args` describes, and
    /// stay allocated until the launch has run on `stream`.
    pub unsafe fn launch_fp8(&self, a: &Fp8Args, stream: &CudaStream) -> Result<(), KernelError> {
        if a.n_rows <= 0 {
            return Ok(());
        }
        let dt = dtype_code(a.dtype);
        guarded("launching the fp8 kernel", || {
            let mut b = stream.launch_builder(&self.fp8);
            b.arg(&a.arena).arg(&dt).arg(&a.slot_stride).arg(&a.slots).arg(&a.n_rows).arg(&a.width);
            b.arg(&a.codes).arg(&a.scales);
            // SAFETY: the arguments match the kernel's signature one for one (fp8.cu); the memory contract is the
            // caller's.
            unsafe { b.launch(Self::config(a.n_rows)) }.map(|_| ()).map_err(|e| err("cuLaunchKernel", e))
        })
    }
}
