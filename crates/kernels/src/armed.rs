//! The armed capture: the capture kernel as the device path launches it, the same on every forward, so that a
//! CUDA graph can record it once and replay it for every later step. This is the specification (the CPU
//! reference) of `hscapture_capture_armed` in `capture.cu`, which must match it bit for bit.
//!
//! A launch's own arguments never change between steps (tensor and buffer addresses, the slot, its capture point);
//! what changes lives in device memory the host fills before each forward:
//! - the [`Control`] block: armed or not, the step's rows, which half of the arena they go to;
//! - the source-row index: `src_rows[d]` is the row of the layer's tensor that becomes captured row `d`.
//!
//! Semantics of one launch for slot `slot` (capture point `point`) over a tensor of `grid` rows:
//! - disarmed (`arm == 0`): nothing is written;
//! - armed: the slot's [`Stamp`] of the armed half becomes `(arm, point, grid)`, so the host can tell that this
//!   step's forward ran this slot's capture, at this point, over enough rows;
//! - for every `d < rows` with `s = src_rows[d] < grid`: row `d` of the slot is [`crate::capture_rows`]'s row
//!   `s` (residual added, stored in the output dtype), its checksum and non-finite count beside it. A source row
//!   at or past `grid` (a layer that produced fewer rows than the step scheduled) is never read: the stamp's
//!   `grid` tells the host.
//!
//! Layout: checksums, counts and stamps have `halves` halves; a half holds `[slot][capacity]` rows. The rows
//! themselves are at `data_base + slot * capacity + d` (`data_base` from the control block: a half of its own, or
//! one shared half when the host only reads quantized codes of them).

use crate::cpu::{capture_row, KernelError, RowSource};
use crate::dtype::DType;

/// u32 words of the control block (the last three unused).
pub const CONTROL_WORDS: usize = 8;
/// u32 words of one stamp.
pub const STAMP_WORDS: usize = 4;

/// What a step arms: written by the host before the forward, read by every launch of the forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Control {
    /// The step's arm number (never 0); 0 = disarmed.
    pub arm: u32,
    /// Captured rows per slot.
    pub rows: u32,
    /// The first row of the half the rows are stored in.
    pub data_base: u32,
    /// The half of checksums, counts and stamps.
    pub half: u32,
}

impl Control {
    pub const DISARMED: Control = Control { arm: 0, rows: 0, data_base: 0, half: 0 };

    /// The block as the device reads it.
    pub fn words(&self) -> [u32; CONTROL_WORDS] {
        [self.arm, self.rows, self.data_base, self.half, 0, 0, 0, 0]
    }
}

/// A slot's stamp: which armed step last ran its capture, at which capture point, over how many tensor rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stamp {
    pub arm: u32,
    pub point: i32,
    pub grid: u32,
}

impl Stamp {
    pub fn from_words(w: &[u32]) -> Stamp {
        let get = |i: usize| w.get(i).copied().unwrap_or(0);
        Stamp { arm: get(0), point: get(1) as i32, grid: get(2) }
    }
}

/// The fixed geometry of an arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArmedLayout {
    pub slots: usize,
    pub capacity: usize,
    pub width: usize,
    pub halves: usize,
}

impl ArmedLayout {
    /// Index of row `d` of `slot` in `half`'s checksums and counts.
    pub fn stat_row(&self, half: usize, slot: usize, d: usize) -> usize {
        (half * self.slots + slot) * self.capacity + d
    }
    /// First u32 of `slot`'s stamp in `half`.
    pub fn stamp_at(&self, half: usize, slot: usize) -> usize {
        (half * self.slots + slot) * STAMP_WORDS
    }
}

/// Where an armed capture writes (every half).
pub struct ArmedTarget<'a> {
    pub data: &'a mut [u8],
    pub dtype: DType,
    pub row_sums: &'a mut [u64],
    pub nonfinite: &'a mut [u32],
    pub stamps: &'a mut [u32],
}

/// One launch of the armed capture (see the module documentation).
#[allow(clippy::too_many_arguments)]
pub fn capture_armed(
    ctl: &Control,
    src_rows: &[i32],
    hidden: &RowSource<'_>,
    residual: Option<&RowSource<'_>>,
    slot: usize,
    point: i32,
    layout: &ArmedLayout,
    out: &mut ArmedTarget<'_>,
) -> Result<(), KernelError> {
    if ctl.arm == 0 {
        return Ok(());
    }
    let (half, rows, base) = (ctl.half as usize, ctl.rows as usize, ctl.data_base as usize);
    let row_bytes = layout.width * out.dtype.size();
    let fits = slot < layout.slots
        && half < layout.halves
        && rows <= layout.capacity
        && rows <= src_rows.len()
        && hidden.width == layout.width
        && residual.is_none_or(|r| r.width == layout.width && r.rows == hidden.rows)
        && out.stamps.len() >= layout.stamp_at(layout.halves, 0)
        && out.row_sums.len() >= layout.stat_row(layout.halves, 0, 0)
        && out.nonfinite.len() >= layout.stat_row(layout.halves, 0, 0)
        && (base + (slot + 1) * layout.capacity) * row_bytes <= out.data.len();
    if !fits {
        return Err(KernelError(format!("armed capture of slot {slot} with {ctl:?} does not fit the arena {layout:?}")));
    }
    let grid = u32::try_from(hidden.rows).map_err(|_| KernelError(format!("{} rows exceed a launch", hidden.rows)))?;
    let at = layout.stamp_at(half, slot);
    out.stamps[at..at + STAMP_WORDS].copy_from_slice(&[ctl.arm, point as u32, grid, 0]);
    for (d, &s) in src_rows[..rows].iter().enumerate() {
        let Ok(s) = usize::try_from(s) else { continue };
        if s >= hidden.rows {
            continue;
        }
        let r = base + slot * layout.capacity + d;
        let dst = &mut out.data[r * row_bytes..(r + 1) * row_bytes];
        let stat = layout.stat_row(half, slot, d);
        (out.row_sums[stat], out.nonfinite[stat]) = capture_row(hidden, residual, s, dst, out.dtype);
    }
    Ok(())
}

#[cfg(test)]
#[path = "tests/armed.rs"]
mod tests;
