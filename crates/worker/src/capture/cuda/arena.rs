//! The device side of the device path: one arena of `slots × capacity` rows in the output dtype, a checksum and a
//! non-finite count per row, the step's source-row index and, with fp8, a code arena (a byte per value) and a scale
//! per row. Allocated once on the copy stream when the worker loads the model (before vLLM sizes its KV cache),
//! freed when dropped (on that stream, after the copies that read it).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DriverError};
use hscapture_kernels::DType;

use crate::{core_err, error::CoreResult};

pub struct DeviceArena {
    pub slots: usize,
    pub capacity: usize,
    pub width: usize,
    pub dtype: DType,
    pub data: CudaSlice<u8>,
    pub sums: CudaSlice<u64>,
    pub bad: CudaSlice<u32>,
    pub src: CudaSlice<i32>,
    /// fp8: the codes (`slots × capacity × width` bytes) and a scale per row.
    pub fp8: Option<(CudaSlice<u8>, CudaSlice<f32>)>,
}

impl DeviceArena {
    /// Sizes checked by the caller (`CudaDevice::new`); zeroed on `stream`, which the caller synchronises before any
    /// other stream uses the arena.
    pub fn new(
        stream: &Arc<CudaStream>,
        slots: usize,
        capacity: usize,
        width: usize,
        dtype: DType,
        quantize: bool,
    ) -> Result<DeviceArena, DriverError> {
        let n = slots * capacity;
        let fp8 = if quantize { Some((stream.alloc_zeros::<u8>(n * width)?, stream.alloc_zeros::<f32>(capacity)?)) } else { None };
        Ok(DeviceArena {
            slots,
            capacity,
            width,
            dtype,
            data: stream.alloc_zeros::<u8>(n * width * dtype.size())?,
            sums: stream.alloc_zeros::<u64>(n)?,
            bad: stream.alloc_zeros::<u32>(n)?,
            src: stream.alloc_zeros::<i32>(capacity)?,
            fp8,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.width * self.dtype.size()
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        let n = self.slots * self.capacity;
        let fp8 = if self.fp8.is_some() { n * self.width + self.capacity * 4 } else { 0 };
        n * (self.row_bytes() + 12) + self.capacity * 4 + fp8
    }
}

/// The device address of `s`, for a kernel's raw arguments. The context tracks no events (`launch.rs`), so naming
/// `stream` records nothing; the callers order the streams that use the memory themselves.
pub fn address<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    s.device_ptr(stream).0
}

/// `range` of `s`, or an error naming what overran (the plan's rows are within the arena: a bug if not).
pub fn part<'a, T>(s: &'a CudaSlice<T>, range: Range<usize>, what: &str) -> CoreResult<CudaView<'a, T>> {
    let (start, end, len) = (range.start, range.end, s.len());
    s.try_slice(range).ok_or_else(|| core_err!(Compatibility, "{what}: elements {start}..{end} of a device buffer of {len}"))
}
