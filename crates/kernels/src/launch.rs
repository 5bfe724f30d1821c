//! The capture kernels on a CUDA device (`capture.cu`, and `fp8.cu` appended to it): compiled with NVRTC when a worker starts
//! (never inside a forward or a CUDA-graph capture), loaded into the device's primary context (the one
//! PyTorch uses), and launched on a raw stream handle — PyTorch's current stream, which `cudarc`'s
//! safe API cannot adopt, so this module uses its `result` layer and says so.
//!
//! Invariants: `CaptureKernel` holds one reference on the primary context (released on drop); the
//! module stays loaded while the kernel exists; every entry point makes the primary context current
//! on the calling thread first.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result as cu, sys};

use crate::cpu::KernelError;
use crate::dtype::DType;

/// The kernels' source, also shipped for inspection (`fp8.cu` uses `capture.cu`'s helpers).
pub const SOURCE: &str = concat!(include_str!("capture.cu"), "\n", include_str!("fp8.cu"));
const NAME: &str = "hscapture_capture_rows";
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

/// Raw device pointers and sizes of one launch (see `capture.cu`).
#[derive(Clone, Copy, Debug)]
pub struct LaunchArgs {
    pub hidden: u64,
    /// 0 when there is no residual.
    pub residual: u64,
    /// Row strides of hidden and residual, in elements.
    pub h_stride: i64,
    pub r_stride: i64,
    pub in_dtype: DType,
    /// Device array of `n_rows` i32 source-row indices.
    pub src_rows: u64,
    pub n_rows: i32,
    pub width: i32,
    pub out: u64,
    pub out_dtype: DType,
    pub row_sums: u64,
    pub nonfinite: u64,
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

pub struct CaptureKernel {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    module: sys::CUmodule,
    func: sys::CUfunction,
    fp8: sys::CUfunction,
    pub arch: String,
}

// SAFETY: the handles are plain driver handles, valid on any thread once the context is made current,
// which every method does first; the owner serialises use (one session per worker thread).
unsafe impl Send for CaptureKernel {}
// SAFETY: `&self` methods only make the context current and enqueue work; the driver API is thread-safe.
unsafe impl Sync for CaptureKernel {}

impl CaptureKernel {
    /// Compiles and loads the kernel for device `ordinal`.
    pub fn load(ordinal: i32) -> Result<CaptureKernel, KernelError> {
        guarded("loading the capture kernel", || {
            cu::init().map_err(|e| err("cuInit", e))?;
            let dev = cu::device::get(ordinal).map_err(|e| err("cuDeviceGet", e))?;
            // SAFETY: `dev` comes from `device::get`.
            let (major, minor) = unsafe {
                (
                    cu::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                        .map_err(|e| err("compute capability", e))?,
                    cu::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                        .map_err(|e| err("compute capability", e))?,
                )
            };
            // SAFETY: `dev` comes from `device::get`; the reference is released in Drop.
            let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| err("cuDevicePrimaryCtxRetain", e))?;
            // SAFETY: `ctx` is the retained primary context.
            unsafe { cu::ctx::set_current(ctx) }.map_err(|e| err("cuCtxSetCurrent", e))?;
            let arch = format!("compute_{major}{minor}");
            let image = CString::new(ptx_for(&arch)?).map_err(|e| err("PTX", e))?;
            // SAFETY: `image` is a NUL-terminated PTX string that outlives the call.
            let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| err("cuModuleLoadData", e))?;
            let name = CString::new(NAME).map_err(|e| err("kernel name", e))?;
            // SAFETY: `module` was just loaded.
            let func = unsafe { cu::module::get_function(module, name) }.map_err(|e| err("cuModuleGetFunction", e))?;
            let name = CString::new(NAME_FP8).map_err(|e| err("kernel name", e))?;
            // SAFETY: as above.
            let fp8 = unsafe { cu::module::get_function(module, name) }.map_err(|e| err("cuModuleGetFunction", e))?;
            Ok(CaptureKernel { dev, ctx, module, func, fp8, arch })
        })
    }

    /// Makes the kernel's context current on this thread.
    pub fn bind(&self) -> Result<(), KernelError> {
        // SAFETY: `self.ctx` is the retained primary context, alive while `self` is.
        guarded("cuCtxSetCurrent", || unsafe { cu::ctx::set_current(self.ctx) }.map_err(|e| err("cuCtxSetCurrent", e)))
    }

    /// Enqueues one capture on `stream`.
    ///
    /// # Safety
    /// Every pointer in `a` must be device memory of this context, large enough for the launch
    /// (`n_rows` source rows addressed through `src_rows`, `n_rows * width` outputs, `n_rows` sums and
    /// counts), and stay allocated until the launch has run on `stream`.
    pub unsafe fn launch(&self, a: &LaunchArgs, stream: u64) -> Result<(), KernelError> {
        if a.n_rows <= 0 {
            return Ok(());
        }
        let (mut hidden, mut residual, mut hs, mut rs) = (a.hidden, a.residual, a.h_stride, a.r_stride);
        let (mut in_dt, mut src, mut n, mut w) = (dtype_code(a.in_dtype), a.src_rows, a.n_rows, a.width);
        let (mut out, mut out_dt, mut sums, mut bad) = (a.out, dtype_code(a.out_dtype), a.row_sums, a.nonfinite);
        let mut params: [*mut c_void; 12] = [
            &mut hidden as *mut u64 as *mut c_void,
            &mut residual as *mut u64 as *mut c_void,
            &mut hs as *mut i64 as *mut c_void,
            &mut rs as *mut i64 as *mut c_void,
            &mut in_dt as *mut i32 as *mut c_void,
            &mut src as *mut u64 as *mut c_void,
            &mut n as *mut i32 as *mut c_void,
            &mut w as *mut i32 as *mut c_void,
            &mut out as *mut u64 as *mut c_void,
            &mut out_dt as *mut i32 as *mut c_void,
            &mut sums as *mut u64 as *mut c_void,
            &mut bad as *mut u64 as *mut c_void,
        ];
        guarded("launching the capture kernel", || {
            // SAFETY: the parameters match the kernel's signature one for one and outlive the call
            // (the driver copies them at launch); the memory contract is the caller's.
            unsafe { cu::launch_kernel(self.func, (a.n_rows as u32, 1, 1), (BLOCK, 1, 1), 0, stream as sys::CUstream, &mut params) }
                .map_err(|e| err("cuLaunchKernel", e))
        })
    }

    /// Enqueues one fp8 quantization on `stream`.
    ///
    /// # Safety
    /// Every pointer in `a` must be device memory of this context holding the extents `Fp8Args` describes, and
    /// stay allocated until the launch has run on `stream`.
    pub unsafe fn launch_fp8(&self, a: &Fp8Args, stream: u64) -> Result<(), KernelError> {
        if a.n_rows <= 0 {
            return Ok(());
        }
        let (mut arena, mut dt, mut stride, mut slots) = (a.arena, dtype_code(a.dtype), a.slot_stride, a.slots);
        let (mut n, mut w, mut codes, mut scales) = (a.n_rows, a.width, a.codes, a.scales);
        let mut params: [*mut c_void; 8] = [
            &mut arena as *mut u64 as *mut c_void,
            &mut dt as *mut i32 as *mut c_void,
            &mut stride as *mut i64 as *mut c_void,
            &mut slots as *mut i32 as *mut c_void,
            &mut n as *mut i32 as *mut c_void,
            &mut w as *mut i32 as *mut c_void,
            &mut codes as *mut u64 as *mut c_void,
            &mut scales as *mut u64 as *mut c_void,
        ];
        guarded("launching the fp8 kernel", || {
            // SAFETY: the parameters match the kernel's signature one for one and outlive the call (the driver
            // copies them at launch); the memory contract is the caller's.
            unsafe { cu::launch_kernel(self.fp8, (a.n_rows as u32, 1, 1), (BLOCK, 1, 1), 0, stream as sys::CUstream, &mut params) }
                .map_err(|e| err("cuLaunchKernel", e))
        })
    }

    pub fn device(&self) -> sys::CUdevice {
        self.dev
    }
}

impl Drop for CaptureKernel {
    fn drop(&mut self) {
        let _ = guarded("unloading the capture kernel", || {
            // SAFETY: the module was loaded by `load` and is unloaded once; the context reference
            // taken there is released once.
            unsafe {
                let _ = cu::ctx::set_current(self.ctx);
                let _ = cu::module::unload(self.module);
                let _ = cu::primary_ctx::release(self.dev);
            }
            Ok(())
        });
    }
}
