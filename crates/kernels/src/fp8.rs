//! fp8 (e4m3fn) storage of hidden states, bit for bit as speculators' `FP8Transfer` reads it
//! (`hs_connectors.fp8_utils.quantize_tensor_to_fp8`): one scale per token over all of its layers and hidden
//! dims. This is the specification (the CPU reference); a CUDA kernel must match it bit for bit.
//!
//! For token `t` with values `x` (every layer, every hidden dim, read as f32):
//! - `amax = max |x|` (a NaN propagates);
//! - `scale = max(amax / 448, 1e-12)` in f32 (IEEE division; a NaN stays NaN, as `torch.clamp` keeps it);
//! - `code = e4m3fn(x / scale)`: IEEE division (not a multiplication by the reciprocal), then torch's
//!   conversion — round to nearest even, not saturating (`|v| >= 464` becomes NaN, `0x7f`).
//!
//! Dequantized as speculators does: `bf16(f32(code) * f32(bf16(scale)))`.

use half::bf16;

use crate::dtype::DType;

/// The largest finite e4m3fn value.
pub const FP8_MAX: f32 = 448.0;
/// The smallest scale (a token of zeros).
pub const MIN_SCALE: f32 = 1e-12;

/// torch's `fp8e4m3fn_from_fp32_value`: round to nearest even, NaN for anything from 464 up (and NaN, inf).
#[inline(always)]
pub fn e4m3_from_f32(f: f32) -> u8 {
    const FP8_MAX_BITS: u32 = 1087 << 20; // 480.0: from here on the result is NaN
    const DENORM_MASK: u32 = 141 << 23;
    let mut bits = f.to_bits();
    let sign = bits & 0x8000_0000;
    bits ^= sign;
    let result = if bits >= FP8_MAX_BITS {
        0x7f
    } else if bits < (121 << 23) {
        // Below 2^-6: e4m3's denormals, rounded by one f32 addition (round to nearest even).
        let sum = (f32::from_bits(bits) + f32::from_bits(DENORM_MASK)).to_bits();
        sum.wrapping_sub(DENORM_MASK) as u8
    } else {
        let mant_odd = (bits >> 20) & 1;
        bits = bits.wrapping_add(((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7FFFF));
        bits = bits.wrapping_add(mant_odd);
        (bits >> 20) as u8
    };
    result | (sign >> 24) as u8
}

/// An e4m3fn code as f32 (exact).
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = (code >> 3) & 0x0f;
    let mant = f32::from(code & 0x07);
    if exp == 0x0f && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        return sign * mant * (2.0f32).powi(-9);
    }
    sign * (1.0 + mant / 8.0) * (2.0f32).powi(i32::from(exp) - 7)
}

/// The scale of one token whose values (as f32) are `values`.
pub fn token_scale(values: impl Iterator<Item = f32>) -> f32 {
    let mut amax = 0.0f32;
    for v in values {
        let a = v.abs();
        if a.is_nan() || amax.is_nan() {
            amax = f32::NAN;
        } else if a > amax {
            amax = a;
        }
    }
    let s = amax / FP8_MAX;
    if s < MIN_SCALE {
        MIN_SCALE
    } else {
        s
    }
}

/// Quantizes `tokens` tokens of `per_token` values each, stored contiguously in `src` as `dtype`
/// (little-endian): fills `codes` (one byte per value) and `scales` (one per token).
pub fn quantize(src: &[u8], dtype: DType, tokens: usize, per_token: usize, codes: &mut [u8], scales: &mut [f32]) {
    for (t, (scale, out)) in scales[..tokens].iter_mut().zip(codes.chunks_exact_mut(per_token.max(1))).enumerate() {
        let base = t * per_token;
        let s = token_scale((0..per_token).map(|i| dtype.load(src, base + i)));
        *scale = s;
        for (i, c) in out.iter_mut().enumerate().take(per_token) {
            *c = e4m3_from_f32(dtype.load(src, base + i) / s);
        }
    }
}

/// speculators' dequantization of one value: `bf16(f32(code) * f32(bf16(scale)))`.
#[inline(always)]
pub fn dequantize_bf16(code: u8, scale: f32) -> bf16 {
    bf16::from_f32(e4m3_to_f32(code) * bf16::from_f32(scale).to_f32())
}

#[cfg(test)]
#[path = "tests/fp8.rs"]
mod tests;
