use super::*;
use crate::cpu::{capture_row, capture_row_reference, RowSource};

/// A deterministic row of `width` elements of `dtype` covering ordinary values, signed zeros, subnormals, values that
/// round to infinity in a narrower dtype, infinities and NaN.
fn source(dtype: DType, width: usize, seed: u64) -> Vec<u8> {
    let specials = [0.0f32, -0.0, 1e-40, -3.4e38, 7.0e4, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65519.0, 1.5e-7];
    let mut x = seed;
    let mut out = Vec::with_capacity(width * dtype.size());
    for j in 0..width {
        x = crate::checksum::mix64(x.wrapping_add(j as u64));
        let v = if x.is_multiple_of(7) {
            specials[(x >> 8) as usize % specials.len()]
        } else {
            ((x >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 8.0
        };
        let mut b = vec![0u8; dtype.size()];
        dtype.store(&mut b, 0, v);
        out.extend_from_slice(&b);
    }
    out
}

#[test]
fn every_dtype_triple_equals_the_definition_bit_for_bit() {
    let width = 1031; // not a multiple of any vector width
    for h_dtype in DType::ALL {
        let h = source(h_dtype, width * 2, 1);
        for r_dtype in [None, Some(DType::F32), Some(DType::BF16), Some(DType::F16)] {
            let r = r_dtype.map(|d| source(d, width * 2, 2));
            for out in DType::ALL {
                let hs = RowSource { data: &h, dtype: h_dtype, rows: 2, width, row_stride: width };
                let rs = r.as_ref().zip(r_dtype).map(|(data, dtype)| RowSource { data, dtype, rows: 2, width, row_stride: width });
                for s in 0..2 {
                    let (mut fast, mut slow) = (vec![0u8; width * out.size()], vec![0u8; width * out.size()]);
                    let a = capture_row(&hs, rs.as_ref(), s, &mut fast, out);
                    let b = capture_row_reference(&hs, rs.as_ref(), s, &mut slow, out);
                    assert_eq!((a, &fast), (b, &slow), "{h_dtype} + {r_dtype:?} -> {out}, row {s}");
                    assert!(b.1 > 0, "the sample must hold non-finite values to test their count");
                }
            }
        }
    }
}

#[test]
fn a_strided_source_row_is_read_at_its_stride() {
    let (width, stride) = (5, 9);
    let h = source(DType::BF16, stride * 3, 3);
    let hs = RowSource { data: &h, dtype: DType::BF16, rows: 3, width, row_stride: stride };
    let (mut fast, mut slow) = (vec![0u8; width * 4], vec![0u8; width * 4]);
    assert_eq!(capture_row(&hs, None, 2, &mut fast, DType::F32), capture_row_reference(&hs, None, 2, &mut slow, DType::F32));
    assert_eq!(fast, slow);
}
