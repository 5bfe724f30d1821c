//! One row of the CPU capture, compiled once per (hidden, residual, stored) dtype triple: the same arithmetic as
//! [`crate::dtype::DType::load`] and [`crate::dtype::DType::store`] (one f32 addition, round to nearest even), without
//! a dtype match and a bounds check per element. The host path (vLLM for CPU, pipeline stages on the GPU, a GPU with
//! the device path off) copies every captured row through it; the per-element dispatch ran at ~14 ns an element.
//! `tests/cpu_rows.rs` holds it to the dtype-generic definition, bit for bit, for every triple.

use half::{bf16, f16};

use crate::checksum::element_term;
use crate::dtype::DType;

/// An element type read as f32 (exact for each of them).
trait Load {
    const SIZE: usize;
    fn load(b: &[u8]) -> f32;
}

/// An element type stored from f32; returns the stored bit pattern, zero-extended, and whether it is finite.
trait Store {
    const SIZE: usize;
    fn store(v: f32, out: &mut [u8]) -> (u64, bool);
}

struct F32;
struct Bf16;
struct F16;

impl Load for F32 {
    const SIZE: usize = 4;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Load for Bf16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
}

impl Load for F16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn load(b: &[u8]) -> f32 {
        f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
}

impl Store for F32 {
    const SIZE: usize = 4;
    #[inline(always)]
    fn store(v: f32, out: &mut [u8]) -> (u64, bool) {
        out.copy_from_slice(&v.to_le_bytes());
        (u64::from(v.to_bits()), v.is_finite())
    }
}

impl Store for Bf16 {
    const SIZE: usize = 2;
    /// `bf16::from_f32` without its branch on the rounding bits, which random activations mispredict half the time
    /// (most of this loop's cost): round to nearest even is a carry into bit 16 (`x + 0x7fff + lsb`); a NaN keeps
    /// its sign and top mantissa bits and is made quiet, as `half` does.
    #[inline(always)]
    fn store(v: f32, out: &mut [u8]) -> (u64, bool) {
        let x = v.to_bits();
        let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
        let nan = ((x >> 16) | 0x0040) as u16;
        let bits = if x & 0x7fff_ffff > 0x7f80_0000 { nan } else { rounded };
        out.copy_from_slice(&bits.to_le_bytes());
        (u64::from(bits), bits & 0x7f80 != 0x7f80)
    }
}

impl Store for F16 {
    const SIZE: usize = 2;
    #[inline(always)]
    fn store(v: f32, out: &mut [u8]) -> (u64, bool) {
        let h = f16::from_f32(v);
        out.copy_from_slice(&h.to_bits().to_le_bytes());
        (u64::from(h.to_bits()), h.is_finite())
    }
}

#[inline(always)]
fn row<H: Load, R: Load, O: Store>(h: &[u8], r: Option<&[u8]>, dst: &mut [u8]) -> (u64, u32) {
    let (mut sum, mut bad) = (0u64, 0u32);
    let mut put = |j: usize, v: f32, d: &mut [u8]| {
        let (bits, finite) = O::store(v, d);
        sum = sum.wrapping_add(element_term(bits, j));
        bad += u32::from(!finite);
    };
    let out = dst.chunks_exact_mut(O::SIZE);
    match r {
        Some(r) => {
            for (j, ((hc, rc), d)) in h.chunks_exact(H::SIZE).zip(r.chunks_exact(R::SIZE)).zip(out).enumerate() {
                put(j, H::load(hc) + R::load(rc), d);
            }
        }
        None => {
            for (j, (hc, d)) in h.chunks_exact(H::SIZE).zip(out).enumerate() {
                put(j, H::load(hc), d);
            }
        }
    }
    (sum, bad)
}

fn with_store<H: Load, R: Load>(out: DType, h: &[u8], r: Option<&[u8]>, dst: &mut [u8]) -> (u64, u32) {
    match out {
        DType::F32 => row::<H, R, F32>(h, r, dst),
        DType::BF16 => row::<H, R, Bf16>(h, r, dst),
        DType::F16 => row::<H, R, F16>(h, r, dst),
    }
}

fn with_residual<H: Load>(r_dtype: DType, out: DType, h: &[u8], r: Option<&[u8]>, dst: &mut [u8]) -> (u64, u32) {
    match r_dtype {
        DType::F32 => with_store::<H, F32>(out, h, r, dst),
        DType::BF16 => with_store::<H, Bf16>(out, h, r, dst),
        DType::F16 => with_store::<H, F16>(out, h, r, dst),
    }
}

/// One stored row: `h` (the hidden states' `width` elements of `h_dtype`), plus `r` (the residual's, of `r_dtype`,
/// if any), stored into `dst` (`width` elements of `out`). Returns the row's checksum and its count of non-finite
/// values. The three slices hold exactly `width` elements each (the caller sliced them).
pub(crate) fn capture_row_typed((h, h_dtype): (&[u8], DType), r: Option<(&[u8], DType)>, dst: &mut [u8], out: DType) -> (u64, u32) {
    let (r, r_dtype) = match r {
        Some((r, d)) => (Some(r), d),
        None => (None, h_dtype),
    };
    match h_dtype {
        DType::F32 => with_residual::<F32>(r_dtype, out, h, r, dst),
        DType::BF16 => with_residual::<Bf16>(r_dtype, out, h, r, dst),
        DType::F16 => with_residual::<F16>(r_dtype, out, h, r, dst),
    }
}

#[cfg(test)]
#[path = "tests/cpu_rows.rs"]
mod tests;
