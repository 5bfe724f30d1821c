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
    /// Number of rows once leading dimensions are flattened into tokens: `[T, H]` → `T`,
    /// `[1, T, H]` → `T`.
    pub fn rows(&self) -> usize {
        self.shape.iter().rev().skip(1).product()
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
                self.shape[d] <= 1 || self.strides[d] == self.strides[d + 1] * self.shape[d + 1] as i64,
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
        let elems = if rows == 0 { 0 } else { (rows - 1) * stride + width };
        ensure!(self.ptr != 0 || elems == 0, ShapeContract, "{what}: null data pointer");
        let data: &'a [u8] = if elems == 0 {
            &[]
        } else {
            // SAFETY: the caller guarantees the allocation covers `elems` elements from `ptr`
            // (checked against shape and strides above) and stays alive and unmodified for 'a.
            unsafe { std::slice::from_raw_parts(self.ptr as *const u8, elems * self.dtype.size()) }
        };
        Ok(RowSource { data, dtype: self.dtype, rows, width, row_stride: stride })
    }
}

#[cfg(test)]
#[path = "tests/tensor.rs"]
mod tests;
