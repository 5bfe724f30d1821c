//! The CPU step arena: one step's captured prompt rows, layer-major (`[slot][row][hidden]`), in the
//! output dtype, with a checksum and a non-finite count per row. The device path keeps the same
//! layout in device memory and in its pinned host buffer.
//!
//! Invariants: capacity only grows; rows beyond the step's row count are never read.

use crate::capture::rows::StepRows;
use crate::{ensure, error::CoreResult};
use hscapture_kernels::{CaptureTarget, DType};

#[derive(Debug)]
pub struct Arena {
    slots: usize,
    width: usize,
    dtype: DType,
    capacity: usize,
    rows: usize,
    data: Vec<u8>,
    row_sums: Vec<u64>,
    nonfinite: Vec<u32>,
}

impl Arena {
    pub fn new(slots: usize, width: usize, dtype: DType) -> Self {
        Arena { slots, width, dtype, capacity: 0, rows: 0, data: Vec::new(), row_sums: Vec::new(), nonfinite: Vec::new() }
    }

    pub fn row_bytes(&self) -> usize {
        self.width * self.dtype.size()
    }

    /// Prepares the arena for a step of `rows` captured rows per slot.
    pub fn reset(&mut self, rows: usize) {
        if rows > self.capacity {
            let cap = rows.next_power_of_two();
            self.data = vec![0u8; self.slots * cap * self.row_bytes()];
            self.row_sums = vec![0u64; self.slots * cap];
            self.nonfinite = vec![0u32; self.slots * cap];
            self.capacity = cap;
        }
        self.rows = rows;
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (capacity, all slots).
    pub fn allocated_bytes(&self) -> usize {
        self.data.len() + self.row_sums.len() * 8 + self.nonfinite.len() * 4
    }

    /// The writable rows of `slot` for this step.
    pub fn target(&mut self, slot: usize, what: &str) -> CoreResult<CaptureTarget<'_>> {
        ensure!(slot < self.slots, ShapeContract, "{what}: slot {slot} does not exist ({} slots)", self.slots);
        let rb = self.row_bytes();
        let base = slot * self.capacity;
        let rows = self.rows;
        Ok(CaptureTarget {
            data: &mut self.data[base * rb..(base + rows) * rb],
            dtype: self.dtype,
            rows,
            width: self.width,
            row_sums: &mut self.row_sums[base..base + rows],
            nonfinite: &mut self.nonfinite[base..base + rows],
        })
    }

    /// Slot `slot`'s rows of this step: data, row sums, non-finite counts (for another pipeline stage).
    pub fn slot_rows(&self, slot: usize) -> (&[u8], &[u64], &[u32]) {
        let (rb, base, rows) = (self.row_bytes(), slot * self.capacity, self.rows);
        (&self.data[base * rb..(base + rows) * rb], &self.row_sums[base..base + rows], &self.nonfinite[base..base + rows])
    }

    /// Writes slot `slot`'s rows of this step as another stage captured them; sizes are checked.
    pub fn put_slot(&mut self, slot: usize, data: &[u8], row_sums: &[u64], nonfinite: &[u32], what: &str) -> CoreResult<()> {
        let rows = self.rows;
        let t = self.target(slot, what)?;
        ensure!(
            data.len() == t.data.len() && row_sums.len() == rows && nonfinite.len() == rows,
            RankMismatch,
            "{what}: received {} bytes and {} rows from another pipeline stage, expected {} bytes and {rows} rows",
            data.len(),
            row_sums.len(),
            t.data.len()
        );
        t.data.copy_from_slice(data);
        t.row_sums.copy_from_slice(row_sums);
        t.nonfinite.copy_from_slice(nonfinite);
        Ok(())
    }
}

impl StepRows for Arena {
    fn row(&self, slot: usize, row: usize) -> &[u8] {
        let rb = self.row_bytes();
        let o = (slot * self.capacity + row) * rb;
        &self.data[o..o + rb]
    }
    fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        self.nonfinite[slot * self.capacity + row]
    }
    fn row_sum(&self, slot: usize, row: usize) -> u64 {
        self.row_sums[slot * self.capacity + row]
    }
}
