//! Tensors crossing from Python as validated descriptors.
//!
//! A [`TensorDesc`] names memory owned by a Python tensor: address, shape, strides (in elements),
//! dtype and device. The Python caller keeps the tensor alive for the duration of the call that
//! receives the descriptor; nothing here retains the address after that call returns.

use crate::{ensure, error::CoreResult};
use hscapture_kernels::{DType, RowSource};

/// Where a tensor's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(u32),
}

impl Device {
    pub fn parse(kind: &str, index: Option<i64>) -> Option<Device> {
        match kind {
            "cpu" => Some(Device::Cpu),
            "cuda" => Some(Device::Cuda(index.unwrap_or(0).max(0) as u32)),
            _ => None,
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A tensor as described by its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    pub ptr: usize,
    pub shape: Vec<usize>,
    /// Strides in elements.
    pub strides: Vec<i64>,
    pub dtype: DType,
    pub device: Device,
}

impl TensorDesc {
    /// A descriptor read from a caller, checked: its element count and byte extent fit the address space (every
    /// size computed from it later is then in range).
    pub fn new(ptr: usize, shape: Vec<usize>, strides: Vec<i64>, dtype: DType, device: Device, what: &str) -> CoreResult<TensorDesc> {
        let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        let fits = elems.and_then(|n| n.checked_mul(dtype.size())).is_some_and(|b| b <= isize::MAX as usize);
        ensure!(fits, ShapeContract, "{what}: shape {shape:?} of {dtype} describes more bytes than memory can hold");
        let strided = strides.iter().all(|s| s.checked_abs().is_some_and(|a| (a as u64) <= isize::MAX as u64));
        ensure!(strided, ShapeContract, "{what}: strides {strides:?} are out of range");
        Ok(TensorDesc { ptr, shape, strides, dtype, device })
    }

    /// Number of rows once leading dimensions are flattened into tokens: `[T, H]` → `T`,
    /// `[1, T, H]` → `T` (saturating: a descriptor from [`TensorDesc::new`] never reaches the bound).
    pub fn rows(&self) -> usize {
        self.shape.iter().rev().skip(1).fold(1usize, |a, &d| a.saturating_mul(d))
    }

    pub fn width(&self) -> usize {
        self.shape.last().copied().unwrap_or(0)
    }

    /// Checks that the tensor is a matrix of rows the kernels can read: last dimension contiguous,
    /// leading dimensions collapsible into one row dimension with a non-negative stride.
    /// Returns the row stride in elements.
    pub fn row_layout(&self, what: &str) -> CoreResult<usize> {
        ensure!(
            self.shape.len() >= 2 && self.shape.len() == self.strides.len(),
            ShapeContract,
            "{what}: expected a [tokens, hidden] tensor, found shape {:?} with strides {:?}",
            self.shape,
            self.strides
        );
        let w = self.width();
        ensure!(
            w <= 1 || self.strides[self.strides.len() - 1] == 1,
            ShapeContract,
            "{what}: the hidden dimension must be contiguous (stride 1), found strides {:?} for shape {:?}; \
             call `.contiguous()` on the tensor",
            self.strides,
            self.shape
        );
        let n = self.shape.len();
        let row_stride = self.strides[n - 2];
        ensure!(row_stride >= 0, ShapeContract, "{what}: negative row stride {row_stride} is not supported");
        // Leading dims must collapse: stride[d] == stride[d+1] * shape[d+1] for d < n-2.
        for d in 0..n.saturating_sub(2) {
            ensure!(
                self.shape[d] <= 1
                    || i64::try_from(self.shape[d + 1]).ok().and_then(|n| self.strides[d + 1].checked_mul(n)) == Some(self.strides[d]),
                ShapeContract,
                "{what}: leading dimensions of shape {:?} (strides {:?}) cannot be flattened into tokens; \
                 call `.contiguous()`",
                self.shape,
                self.strides
            );
        }
        let rs = row_stride as usize;
        ensure!(self.rows() <= 1 || rs >= w, ShapeContract, "{what}: row stride {rs} is smaller than the hidden size {w}");
        Ok(rs.max(w))
    }

    /// A read-only view of the first `rows` rows of a CPU tensor.
    ///
    /// # Safety
    /// The memory described must be a live allocation of at least the described extent, not written
    /// to by anyone else while the returned view is in use, and it must outlive `'a`.
    pub unsafe fn cpu_rows<'a>(&self, what: &str, rows: usize) -> CoreResult<RowSource<'a>> {
        ensure!(self.device == Device::Cpu, Compatibility, "{what}: tensor is on {}, this path reads CPU tensors", self.device);
        let stride = self.row_layout(what)?;
        ensure!(rows <= self.rows(), ShapeContract, "{what}: asked for {rows} rows of a tensor with {}", self.rows());
        let width = self.width();
        let extent = match rows {
            0 => Some(0),
            _ => (rows - 1).checked_mul(stride).and_then(|e| e.checked_add(width)).and_then(|e| e.checked_mul(self.dtype.size())),
        };
        let Some(bytes) = extent.filter(|b| *b <= isize::MAX as usize) else {
            crate::bail!(ShapeContract, "{what}: {rows} rows of stride {stride} and width {width} exceed the address space");
        };
        ensure!(self.ptr != 0 || bytes == 0, ShapeContract, "{what}: null data pointer");
        let data: &'a [u8] = if bytes == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees the allocation covers `bytes` bytes from `ptr` (checked against
            // shape and strides above, without overflow) and stays alive and unmodified for 'a.
            unsafe { std::slice::from_raw_parts(self.ptr as *const u8, bytes) }
        };
        Ok(RowSource { data, dtype: self.dtype, rows, width, row_stride: stride })
    }
}

#[cfg(test)]
#[path = "tests/tensor.rs"]
mod tests;
