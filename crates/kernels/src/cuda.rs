//! Whether CUDA can be used here.
//!
//! `cudarc` is built with dynamic loading: nothing links against CUDA, and this crate builds and
//! runs on machines without it. [`is_available`] probes for the driver library and a device without
//! ever panicking; every CUDA path answers "not available here" when it returns false.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Why CUDA cannot be used on this machine, or how many devices it has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Availability {
    /// The driver library loaded and reported this many devices (at least one).
    Devices(usize),
    /// No CUDA here; the text says what was missing.
    Unavailable(String),
}

/// Probes the CUDA driver: library present, `cuInit` succeeds, at least one device.
pub fn probe() -> Availability {
    // SAFETY: `is_culib_present` only tries to open the driver library with libloading.
    let present = catch_unwind(|| unsafe { cudarc::driver::sys::is_culib_present() }).unwrap_or(false);
    if !present {
        return Availability::Unavailable("the CUDA driver library (libcuda) was not found".into());
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        cudarc::driver::result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
        cudarc::driver::result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))
    }));
    match r {
        Ok(Ok(n)) if n > 0 => Availability::Devices(n as usize),
        Ok(Ok(_)) => Availability::Unavailable("the CUDA driver reports no device".into()),
        Ok(Err(e)) => Availability::Unavailable(e),
        Err(_) => Availability::Unavailable("the CUDA driver library lacks a required symbol".into()),
    }
}

/// True when CUDA kernels can be launched here.
pub fn is_available() -> bool {
    matches!(probe(), Availability::Devices(_))
}

#[cfg(test)]
#[path = "tests/cuda.rs"]
mod tests;
