use super::*;
use crate::checksum::row_checksum;

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn adds_residual_selects_rows_and_sums() {
    // 4 source rows of width 3, stride 4 (one padding element per row).
    let h: Vec<f32> = (0..16).map(|x| x as f32).collect();
    let r: Vec<f32> = (0..16).map(|x| 100.0 * x as f32).collect();
    let (hb, rb) = (f32_bytes(&h), f32_bytes(&r));
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 4, width: 3, row_stride: 4 };
    let rs = RowSource { data: &rb, ..hs };
    let mut data = vec![0u8; 2 * 3 * 4];
    let (mut sums, mut bad) = (vec![0u64; 2], vec![0u32; 2]);
    let mut out = CaptureTarget { data: &mut data, dtype: DType::F32, rows: 2, width: 3, row_sums: &mut sums, nonfinite: &mut bad };
    let runs = [RowRun { src_row: 3, dst_row: 0, len: 1 }, RowRun { src_row: 1, dst_row: 1, len: 1 }];
    capture_rows(&hs, Some(&rs), &runs, &mut out).unwrap();
    let got: Vec<f32> = data.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(got, vec![1212.0, 1313.0, 1414.0, 404.0, 505.0, 606.0]);
    assert_eq!(sums[0], row_checksum([1212.0f32, 1313.0, 1414.0].map(|x| u64::from(x.to_bits()))));
    assert_eq!(bad, vec![0, 0]);
}

#[test]
fn counts_nonfinite_after_rounding() {
    let hb = f32_bytes(&[f32::MAX, 1.0, f32::NAN, 2.0]);
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 1, width: 4, row_stride: 4 };
    let mut data = vec![0u8; 8];
    let (mut sums, mut bad) = (vec![0u64; 1], vec![0u32; 1]);
    let mut out = CaptureTarget { data: &mut data, dtype: DType::BF16, rows: 1, width: 4, row_sums: &mut sums, nonfinite: &mut bad };
    capture_rows(&hs, None, &[RowRun { src_row: 0, dst_row: 0, len: 1 }], &mut out).unwrap();
    assert_eq!(bad[0], 2, "f32::MAX overflows bf16 and NaN stays NaN");
}

#[test]
fn refuses_runs_out_of_bounds() {
    let hb = f32_bytes(&[0.0; 8]);
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 2, width: 4, row_stride: 4 };
    let mut data = vec![0u8; 16];
    let (mut sums, mut bad) = (vec![0u64; 1], vec![0u32; 1]);
    let mut out = CaptureTarget { data: &mut data, dtype: DType::F32, rows: 1, width: 4, row_sums: &mut sums, nonfinite: &mut bad };
    let e = capture_rows(&hs, None, &[RowRun { src_row: 1, dst_row: 0, len: 2 }], &mut out).unwrap_err();
    assert!(e.0.contains("reads past"), "{e}");
    let short = RowSource { data: &hb[..20], ..hs };
    assert!(capture_rows(&short, None, &[], &mut out).is_err());
}
