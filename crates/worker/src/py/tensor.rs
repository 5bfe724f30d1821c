//! Tensor descriptors from Python: `(data_ptr, shape, strides, dtype, device_type, device_index)`.

use crate::tensor::{Device, TensorDesc};
use crate::{core_err, CoreResult};
use hscapture_kernels::DType;

pub type PyTensorDesc = (usize, Vec<usize>, Vec<i64>, String, String, Option<i64>);

pub fn parse_dtype(name: &str, what: &str) -> CoreResult<DType> {
    DType::parse(name).ok_or_else(|| core_err!(ShapeContract, "{what}: dtype {name} is not supported; expected float32, bfloat16 or float16"))
}

pub fn to_desc(d: PyTensorDesc, what: &str) -> CoreResult<TensorDesc> {
    let (ptr, shape, strides, dtype, dev, idx) = d;
    let device = Device::parse(&dev, idx).ok_or_else(|| core_err!(Compatibility, "{what}: tensors on {dev} are not supported; expected cpu or cuda"))?;
    Ok(TensorDesc { ptr, shape, strides, dtype: parse_dtype(&dtype, what)?, device })
}
