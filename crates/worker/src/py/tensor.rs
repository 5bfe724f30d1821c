//! Tensors from Python. `capture` receives the tensor objects themselves (anything with torch's
//! `data_ptr()`, `shape`, `stride()`, `dtype` and `device`), so they are certainly alive for the
//! whole call; the descriptor is read here and validated by the core.

use pyo3::prelude::*;

use crate::capture::tensor::{Device, TensorDesc};
use crate::{core_err, CoreResult};
use hscapture_kernels::DType;

pub fn parse_dtype(name: &str, what: &str) -> CoreResult<DType> {
    DType::parse(name)
        .ok_or_else(|| core_err!(ShapeContract, "{what}: dtype {name} is not supported; expected float32, bfloat16 or float16"))
}

/// Reads the descriptor of a torch tensor.
pub fn describe(t: &Bound<'_, PyAny>, what: &str) -> PyResult<TensorDesc> {
    let ptr: usize = t.call_method0("data_ptr")?.extract()?;
    let shape: Vec<usize> = t.getattr("shape")?.extract()?;
    let strides: Vec<i64> = t.call_method0("stride")?.extract()?;
    let dtype: String = t.getattr("dtype")?.str()?.extract()?;
    let dev = t.getattr("device")?;
    let kind: String = dev.getattr("type")?.extract()?;
    let index: Option<i64> = dev.getattr("index")?.extract()?;
    let device = Device::parse(&kind, index)
        .ok_or_else(|| core_err!(Compatibility, "{what}: tensors on {kind} are not supported; expected cpu or cuda"))?;
    Ok(TensorDesc::new(ptr, shape, strides, parse_dtype(&dtype, what)?, device, what)?)
}
