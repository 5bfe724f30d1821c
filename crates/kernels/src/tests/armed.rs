use super::*;
use crate::cpu::{capture_rows, CaptureTarget, RowRun};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

const L: ArmedLayout = ArmedLayout { slots: 2, capacity: 4, width: 3, halves: 2 };

struct Arena {
    data: Vec<u8>,
    sums: Vec<u64>,
    bad: Vec<u32>,
    stamps: Vec<u32>,
}

impl Arena {
    fn new() -> Arena {
        let rows = L.stat_row(L.halves, 0, 0);
        Arena { data: vec![0xAB; rows * L.width * 4], sums: vec![7; rows], bad: vec![9; rows], stamps: vec![5; L.stamp_at(2, 0)] }
    }
    fn target(&mut self) -> ArmedTarget<'_> {
        ArmedTarget {
            data: &mut self.data,
            dtype: DType::F32,
            row_sums: &mut self.sums,
            nonfinite: &mut self.bad,
            stamps: &mut self.stamps,
        }
    }
}

#[test]
fn a_disarmed_launch_writes_nothing() {
    let hb = f32_bytes(&[1.0; 12]);
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 4, width: 3, row_stride: 3 };
    let mut a = Arena::new();
    let before = (a.data.clone(), a.sums.clone(), a.stamps.clone());
    capture_armed(&Control::DISARMED, &[0, 1, 2, 3], &hs, None, 1, 7, &L, &mut a.target()).unwrap();
    assert_eq!((a.data, a.sums, a.stamps), before);
}

#[test]
fn an_armed_launch_equals_capture_rows_in_its_half_and_stamps_its_slot() {
    let h: Vec<f32> = (0..15).map(|x| x as f32 * 1.5).collect();
    let r: Vec<f32> = (0..15).map(|x| 100.0 - x as f32).collect();
    let (hb, rb) = (f32_bytes(&h), f32_bytes(&r));
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 5, width: 3, row_stride: 3 };
    let rs = RowSource { data: &rb, ..hs };
    let src = [4, 0, 2, 0];
    let ctl = Control { arm: 11, rows: 3, data_base: L.stat_row(1, 0, 0) as u32, half: 1 };
    let mut a = Arena::new();
    capture_armed(&ctl, &src, &hs, Some(&rs), 1, -1, &L, &mut a.target()).unwrap();
    // The reference: the same rows through capture_rows.
    let runs: Vec<RowRun> = src[..3].iter().enumerate().map(|(d, &s)| RowRun { src_row: s as usize, dst_row: d, len: 1 }).collect();
    let (mut data, mut sums, mut bad) = (vec![0u8; 3 * 3 * 4], vec![0u64; 3], vec![0u32; 3]);
    let mut t = CaptureTarget { data: &mut data, dtype: DType::F32, rows: 3, width: 3, row_sums: &mut sums, nonfinite: &mut bad };
    capture_rows(&hs, Some(&rs), &runs, &mut t).unwrap();
    let first = L.stat_row(1, 1, 0);
    assert_eq!(&a.data[first * 12..(first + 3) * 12], &data[..]);
    assert_eq!(&a.sums[first..first + 3], &sums[..]);
    assert_eq!(&a.bad[first..first + 3], &bad[..]);
    assert_eq!(a.sums[first + 3], 7, "rows past the step's are untouched");
    assert_eq!(Stamp::from_words(&a.stamps[L.stamp_at(1, 1)..]), Stamp { arm: 11, point: -1, grid: 5 });
    assert_eq!(&a.stamps[L.stamp_at(1, 0)..L.stamp_at(1, 0) + 4], &[5, 5, 5, 5], "another slot's stamp is untouched");
    assert!(a.sums[..L.stat_row(1, 0, 0)].iter().all(|&s| s == 7), "the other half is untouched");
}

#[test]
fn source_rows_past_the_tensor_are_never_read_and_the_stamp_says_how_many_there_were() {
    let hb = f32_bytes(&[2.0; 6]);
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 2, width: 3, row_stride: 3 };
    let ctl = Control { arm: 3, rows: 3, data_base: 0, half: 0 };
    let mut a = Arena::new();
    capture_armed(&ctl, &[0, 5, 1, 0], &hs, None, 0, 4, &L, &mut a.target()).unwrap();
    assert_eq!(a.sums[1], 7, "row 1 (source row 5 of 2) is skipped");
    assert_ne!(a.sums[2], 7);
    assert_eq!(Stamp::from_words(&a.stamps[0..4]).grid, 2);
}

#[test]
fn a_launch_that_does_not_fit_the_arena_is_refused() {
    let hb = f32_bytes(&[0.0; 12]);
    let hs = RowSource { data: &hb, dtype: DType::F32, rows: 4, width: 3, row_stride: 3 };
    let mut a = Arena::new();
    for ctl in [
        Control { arm: 1, rows: 5, data_base: 0, half: 0 },
        Control { arm: 1, rows: 1, data_base: 0, half: 2 },
        Control { arm: 1, rows: 1, data_base: L.stat_row(2, 0, 0) as u32, half: 0 },
    ] {
        assert!(capture_armed(&ctl, &[0; 8], &hs, None, 0, 0, &L, &mut a.target()).is_err(), "{ctl:?}");
    }
    assert!(capture_armed(&Control { arm: 1, rows: 1, data_base: 0, half: 0 }, &[0], &hs, None, 2, 0, &L, &mut a.target()).is_err());
}
