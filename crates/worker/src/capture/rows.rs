//! A step's captured rows as the host reads them once they are in host memory (a step buffer): the
//! CPU arena, or the pinned buffer a device copied them into. Both use the same layout: `[slot][capacity][width]` rows
//! in the output dtype, plus a checksum and a non-finite count per row.

use hscapture_kernels::combine_row;

pub trait StepRows {
    /// Bytes of row `row` of slot `slot`.
    fn row(&self, slot: usize, row: usize) -> &[u8];
    fn nonfinite(&self, slot: usize, row: usize) -> u32;
    fn row_sum(&self, slot: usize, row: usize) -> u64;
    /// fp8 (a quantizing device): row `row`'s scale, its rows being e4m3fn codes (None: rows in the output dtype).
    fn scale(&self, _row: usize) -> Option<f32> {
        None
    }
}

impl<T: StepRows + ?Sized> StepRows for &T {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        (**self).row(slot, row)
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        (**self).nonfinite(slot, row)
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        (**self).row_sum(slot, row)
    }
    fn scale(&self, row: usize) -> Option<f32> {
        (**self).scale(row)
    }
}

/// A step's rows borrowed slot by slot (a device's pinned buffers): per slot its rows (`row_bytes` each), their
/// checksums and non-finite counts; with fp8 codes, a scale per row.
pub struct SlotRows<'a> {
    pub data: Vec<&'a [u8]>,
    pub sums: Vec<&'a [u64]>,
    pub bad: Vec<&'a [u32]>,
    pub scales: Option<&'a [f32]>,
    pub row_bytes: usize,
}

impl StepRows for SlotRows<'_> {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        &self.data[slot][row * self.row_bytes..(row + 1) * self.row_bytes]
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        self.bad[slot][row]
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        self.sums[slot][row]
    }
    fn scale(&self, row: usize) -> Option<f32> {
        self.scales.and_then(|s| s.get(row).copied())
    }
}

/// The step checksum over the slots marked present (those this rank holds) of `rows` rows (see
/// `hscapture_kernels::checksum`).
pub fn step_checksum(rows_view: &dyn StepRows, present: &[bool], rows: usize) -> u64 {
    let mut acc = 0u64;
    for s in (0..present.len()).filter(|&s| present[s]) {
        for r in 0..rows {
            acc = acc.wrapping_add(combine_row(rows_view.row_sum(s, r), s, r));
        }
    }
    acc
}
