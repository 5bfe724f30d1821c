//! The device side of the device path, allocated once on the copy stream when the worker loads the model (before
//! vLLM sizes its KV cache) and freed when dropped (on that stream, after the copies that read it):
//! - the rows: `data_halves × slots × capacity` rows in the output dtype (two halves with overlap, so that one
//!   step's kernels write one while the step before is copied from the other; one when only fp8 codes are copied
//!   out, since the codes are quantized from the rows on the capture stream before the next step can write them);
//! - per half: a checksum and a non-finite count per row, a stamp per slot; with fp8, the codes (a byte per value)
//!   and a scale per row;
//! - the step's control block and source-row index, which every capture launch reads (`armed.rs` in the kernels).

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DriverError};
use hscapture_kernels::armed::{ArmedLayout, CONTROL_WORDS, STAMP_WORDS};
use hscapture_kernels::DType;

use crate::{core_err, error::CoreResult};

pub struct DeviceArena {
    pub layout: ArmedLayout,
    pub dtype: DType,
    /// Halves of `data` (1 or `layout.halves`).
    pub data_halves: usize,
    pub data: CudaSlice<u8>,
    pub sums: CudaSlice<u64>,
    pub bad: CudaSlice<u32>,
    pub stamps: CudaSlice<u32>,
    pub src: CudaSlice<i32>,
    /// Taken out only when the device is dropped (it may outlive it: `CudaDevice`'s `Drop`).
    pub ctl: Option<CudaSlice<u32>>,
    /// fp8: the codes (`halves × slots × capacity × width` bytes) and a scale per row (`halves × capacity`).
    pub fp8: Option<(CudaSlice<u8>, CudaSlice<f32>)>,
}

impl DeviceArena {
    /// Sizes checked by the caller (`CudaDevice::new`); zeroed on `stream`, which the caller synchronises before any
    /// other stream uses the arena (so every launch finds the control block disarmed).
    pub fn new(stream: &Arc<CudaStream>, layout: ArmedLayout, dtype: DType, quantize: bool) -> Result<DeviceArena, DriverError> {
        let ArmedLayout { slots, capacity, width, halves } = layout;
        let data_halves = if quantize { 1 } else { halves };
        let per_half = slots * capacity;
        let fp8 = if quantize {
            Some((stream.alloc_zeros::<u8>(halves * per_half * width)?, stream.alloc_zeros::<f32>(halves * capacity)?))
        } else {
            None
        };
        Ok(DeviceArena {
            layout,
            dtype,
            data_halves,
            data: stream.alloc_zeros::<u8>(data_halves * per_half * width * dtype.size())?,
            sums: stream.alloc_zeros::<u64>(halves * per_half)?,
            bad: stream.alloc_zeros::<u32>(halves * per_half)?,
            stamps: stream.alloc_zeros::<u32>(halves * slots * STAMP_WORDS)?,
            src: stream.alloc_zeros::<i32>(capacity)?,
            ctl: Some(stream.alloc_zeros::<u32>(CONTROL_WORDS)?),
            fp8,
        })
    }

    /// The control block (present until the device is dropped).
    pub fn ctl(&self) -> CoreResult<&CudaSlice<u32>> {
        self.ctl.as_ref().ok_or_else(|| core_err!(Compatibility, "the device's control block is gone"))
    }

    pub fn row_bytes(&self) -> usize {
        self.layout.width * self.dtype.size()
    }

    /// The first row of `half`'s rows in `data`.
    pub fn data_base(&self, half: usize) -> usize {
        if self.data_halves == 1 {
            0
        } else {
            half * self.layout.slots * self.layout.capacity
        }
    }

    /// `slot`'s first `rows` rows in `half` (in the output dtype).
    pub fn slot_rows(&self, half: usize, slot: usize, rows: usize) -> CoreResult<CudaView<'_, u8>> {
        let rb = self.row_bytes();
        let at = (self.data_base(half) + slot * self.layout.capacity) * rb;
        part(&self.data, at..at + rows * rb, "rows")
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        let ArmedLayout { slots, capacity, width, halves } = self.layout;
        let per_half = slots * capacity;
        let fp8 = if self.fp8.is_some() { halves * (per_half * width + capacity * 4) } else { 0 };
        self.data_halves * per_half * self.row_bytes()
            + halves * (per_half * 12 + slots * STAMP_WORDS * 4)
            + capacity * 4
            + CONTROL_WORDS * 4
            + fp8
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
