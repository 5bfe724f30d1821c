//! Tensors from Python. `capture` receives the tensor objects themselves (anything with torch's
//! `data_ptr()`, `shape`, `stride()`, `dtype` and `device`), so they are certainly alive for the
//! whole call; the descriptor is read here and validated by the core.

use pyo3::intern;
use pyo3::prelude::*;

use crate::capture::tensor::{Device, TensorDesc};
use crate::{core_err, CoreResult};
use hscapture_kernels::DType;

pub fn parse_dtype(name: &str, what: &str) -> CoreResult<DType> {
    DType::parse(name)
        .ok_or_else(|| core_err!(ShapeContract, "{what}: dtype {name} is not supported; expected float32, bfloat16 or float16"))
}

/// Reads the descriptor of a torch tensor. Called for every captured tensor of every eager step: the attribute names
/// are interned, and a CUDA tensor's device is read as `is_cuda` and `get_device()` (two calls, no `torch.device`).
pub fn describe(t: &Bound<'_, PyAny>, what: &str) -> PyResult<TensorDesc> {
    let py = t.py();
    let ptr: usize = t.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let shape: Vec<usize> = t.getattr(intern!(py, "shape"))?.extract()?;
    let strides: Vec<i64> = t.call_method0(intern!(py, "stride"))?.extract()?;
    let dtype: String = t.getattr(intern!(py, "dtype"))?.str()?.extract()?;
    let cuda = t.getattr(intern!(py, "is_cuda")).and_then(|b| b.extract::<bool>()).unwrap_or(false);
    let (kind, index): (String, Option<i64>) = if cuda {
        ("cuda".into(), Some(t.call_method0(intern!(py, "get_device"))?.extract()?))
    } else {
        let dev = t.getattr(intern!(py, "device"))?;
        (dev.getattr(intern!(py, "type"))?.extract()?, dev.getattr(intern!(py, "index"))?.extract()?)
    };
    let device = Device::parse(&kind, index)
        .ok_or_else(|| core_err!(Compatibility, "{what}: tensors on {kind} are not supported; expected cpu or cuda"))?;
    Ok(TensorDesc::new(ptr, shape, strides, parse_dtype(&dtype, what)?, device, what)?)
}
