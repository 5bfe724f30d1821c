//! States no decoder layer produces: a layer slot whose rows are all zeros, or one and the same row, over a
//! sample of different tokens. That is what a hook on the wrong tensor records (a buffer never written or zeroed,
//! a constant, one row broadcast), the silent failure a training set would not show until the draft fails to
//! learn. A repeated token is exempt: its embeddings (and a layer that keeps them) are equal row for row.

/// What a degenerate slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Degenerate {
    Zeros,
    OneRow,
}

impl Degenerate {
    pub fn describe(self, rows: usize) -> String {
        match self {
            Degenerate::Zeros => format!("all zeros over its {rows} rows"),
            Degenerate::OneRow => format!("the same row for all {rows} tokens"),
        }
    }
}

/// The first slot of a `[rows, slots, row_bytes]` sample (its values, or fp8 codes with a scale per row) whose rows
/// are all zero or all equal, unless every token is the same one. Stops at the first row that differs, so a sound
/// sample costs a few rows per slot.
pub fn degenerate_slot(
    token_ids: &[i64],
    slots: usize,
    row_bytes: usize,
    data: &[u8],
    scales: Option<&[f32]>,
) -> Option<(usize, Degenerate)> {
    let rows = token_ids.len();
    if rows < 2 || token_ids.iter().all(|&t| t == token_ids[0]) || data.len() < rows * slots * row_bytes {
        return None;
    }
    let row = |r: usize, s: usize| &data[(r * slots + s) * row_bytes..(r * slots + s + 1) * row_bytes];
    let same_scale = |r: usize| scales.is_none_or(|sc| sc.get(r) == sc.first());
    (0..slots).find_map(|s| {
        let first = row(0, s);
        if !(1..rows).all(|r| row(r, s) == first && same_scale(r)) {
            return None;
        }
        Some((s, if first.iter().all(|&b| b == 0) { Degenerate::Zeros } else { Degenerate::OneRow }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeros_and_one_row_are_found_a_repeated_token_is_not() {
        let (slots, rb) = (2, 4);
        let mut data: Vec<u8> = (0..3 * slots * rb).map(|i| i as u8 + 1).collect();
        assert_eq!(degenerate_slot(&[1, 2, 3], slots, rb, &data, None), None, "sound");
        for r in 0..3 {
            data[(r * slots + 1) * rb..(r * slots + 2) * rb].fill(0);
        }
        assert_eq!(degenerate_slot(&[1, 2, 3], slots, rb, &data, None), Some((1, Degenerate::Zeros)));
        for r in 0..3 {
            data[(r * slots + 1) * rb..(r * slots + 2) * rb].copy_from_slice(&[7, 7, 0, 1]);
        }
        assert_eq!(degenerate_slot(&[1, 2, 3], slots, rb, &data, None), Some((1, Degenerate::OneRow)));
        assert_eq!(degenerate_slot(&[5, 5, 5], slots, rb, &data, None), None, "a repeated token's rows may be equal");
        assert_eq!(degenerate_slot(&[1, 2, 3], slots, rb, &data, Some(&[1.0, 2.0, 1.0])), None, "codes equal, scales not");
        assert_eq!(degenerate_slot(&[1], slots, rb, &data[..slots * rb], None), None, "one row says nothing");
    }
}
