//! CPU reference of the capture kernel. This is the specification the CUDA kernel must match bit
//! for bit.
//!
//! Semantics of [`capture_rows`], for every run `r` and every `k < r.len`, with
//! `s = r.src_row + k` and `d = r.dst_row + k`:
//! - `v[j] = f32(hidden[s][j]) + f32(residual[s][j])` (one f32 addition; without a residual,
//!   `v[j] = f32(hidden[s][j])`), for `j < width`;
//! - `out[d][j] = round_to_nearest_even(v[j], out.dtype)`;
//! - `row_sums[d] = row_checksum(bits(out[d][0..width]))` (see [`crate::checksum`]);
//! - `nonfinite[d] = #{ j : out[d][j] is NaN or infinite }`.
//!
//! Rows of `out` not named by a run are left untouched.

#[cfg(test)]
use crate::checksum::element_term;
use crate::dtype::DType;

/// A read-only matrix of rows: element `(i, j)` lives at element offset `i * row_stride + j`.
#[derive(Clone, Copy, Debug)]
pub struct RowSource<'a> {
    pub data: &'a [u8],
    pub dtype: DType,
    pub rows: usize,
    pub width: usize,
    /// Distance between consecutive rows, in elements.
    pub row_stride: usize,
}

/// Consecutive rows copied from `src_row..src_row+len` to `dst_row..dst_row+len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRun {
    pub src_row: usize,
    pub dst_row: usize,
    pub len: usize,
}

/// Destination of a capture: dense rows of `width` elements, plus per-row checksums and
/// non-finite counts.
#[derive(Debug)]
pub struct CaptureTarget<'a> {
    pub data: &'a mut [u8],
    pub dtype: DType,
    pub rows: usize,
    pub width: usize,
    pub row_sums: &'a mut [u64],
    pub nonfinite: &'a mut [u32],
}

/// A kernel was called with arguments that do not fit together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelError(pub String);

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for KernelError {}

fn check_source(name: &str, s: &RowSource<'_>, width: usize) -> Result<(), KernelError> {
    if s.width != width {
        return Err(KernelError(format!("{name}: width {} does not match the target's {width}", s.width)));
    }
    if s.rows > 0 {
        if s.row_stride < s.width {
            return Err(KernelError(format!("{name}: row stride {} is smaller than the width {}", s.row_stride, s.width)));
        }
        let need = ((s.rows - 1) * s.row_stride + s.width) * s.dtype.size();
        if s.data.len() < need {
            return Err(KernelError(format!("{name}: {} bytes hold fewer than the {need} bytes of {} rows", s.data.len(), s.rows)));
        }
    }
    Ok(())
}

/// Validates every argument of a capture; the CUDA launcher calls this too.
pub fn check_capture(
    hidden: &RowSource<'_>,
    residual: Option<&RowSource<'_>>,
    runs: &[RowRun],
    out_rows: usize,
    out_width: usize,
) -> Result<(), KernelError> {
    check_source("hidden", hidden, out_width)?;
    if let Some(r) = residual {
        check_source("residual", r, out_width)?;
        if r.rows != hidden.rows {
            return Err(KernelError(format!("residual has {} rows, hidden states {}", r.rows, hidden.rows)));
        }
    }
    for run in runs {
        if run.src_row + run.len > hidden.rows {
            return Err(KernelError(format!("run {run:?} reads past the {} source rows", hidden.rows)));
        }
        if run.dst_row + run.len > out_rows {
            return Err(KernelError(format!("run {run:?} writes past the {out_rows} target rows")));
        }
    }
    Ok(())
}

/// The capture kernel's CPU reference (see the module documentation for its exact semantics).
pub fn capture_rows(
    hidden: &RowSource<'_>,
    residual: Option<&RowSource<'_>>,
    runs: &[RowRun],
    out: &mut CaptureTarget<'_>,
) -> Result<(), KernelError> {
    let width = out.width;
    check_capture(hidden, residual, runs, out.rows, width)?;
    let row_bytes = width * out.dtype.size();
    if out.data.len() < out.rows * row_bytes || out.row_sums.len() < out.rows || out.nonfinite.len() < out.rows {
        return Err(KernelError(format!("target buffers are smaller than {} rows of {width} {} elements", out.rows, out.dtype)));
    }
    for run in runs {
        for k in 0..run.len {
            let (s, d) = (run.src_row + k, run.dst_row + k);
            let dst = &mut out.data[d * row_bytes..(d + 1) * row_bytes];
            (out.row_sums[d], out.nonfinite[d]) = capture_row(hidden, residual, s, dst, out.dtype);
        }
    }
    Ok(())
}

/// The part of `src` holding row `s`'s `width` elements (the caller has checked the bounds).
fn row_bytes<'a>(src: &RowSource<'a>, s: usize) -> &'a [u8] {
    let size = src.dtype.size();
    let start = s * src.row_stride * size;
    &src.data[start..start + src.width * size]
}

/// One row of the capture: source row `s` (plus the residual's) stored into `dst` as `dtype`; returns the stored
/// row's checksum and its count of non-finite values. The caller has checked the bounds. Computed by
/// [`crate::cpu_rows`], compiled per dtype triple; [`capture_row_reference`] is the definition it is held to.
pub(crate) fn capture_row(hidden: &RowSource<'_>, residual: Option<&RowSource<'_>>, s: usize, dst: &mut [u8], dtype: DType) -> (u64, u32) {
    let dst = &mut dst[..hidden.width * dtype.size()];
    crate::cpu_rows::capture_row_typed((row_bytes(hidden, s), hidden.dtype), residual.map(|r| (row_bytes(r, s), r.dtype)), dst, dtype)
}

/// [`capture_row`] element by element through [`DType::load`] and [`DType::store`]: its definition.
#[cfg(test)]
pub(crate) fn capture_row_reference(
    hidden: &RowSource<'_>,
    residual: Option<&RowSource<'_>>,
    s: usize,
    dst: &mut [u8],
    dtype: DType,
) -> (u64, u32) {
    let h_off = s * hidden.row_stride;
    let mut sum = 0u64;
    let mut bad = 0u32;
    for j in 0..hidden.width {
        let mut v = hidden.dtype.load(hidden.data, h_off + j);
        if let Some(r) = residual {
            v += r.dtype.load(r.data, s * r.row_stride + j);
        }
        let (bits, finite) = dtype.store(dst, j, v);
        sum = sum.wrapping_add(element_term(bits, j));
        bad += u32::from(!finite);
    }
    (sum, bad)
}

#[cfg(test)]
#[path = "tests/cpu.rs"]
mod tests;
