//! The step arena: one step's captured prompt rows, layer-major (`[slot][row][hidden]`), in the
//! output dtype, with a checksum and a non-finite count per row.
//!
//! Invariants: capacity only grows; `reset` marks every slot empty; a slot is written at most once
//! per step; rows beyond the step's row count are never read.

use crate::{ensure, error::CoreResult};
use hscapture_kernels::{combine_row, CaptureTarget, DType};

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
    filled: Vec<bool>,
}

impl Arena {
    pub fn new(slots: usize, width: usize, dtype: DType) -> Self {
        Arena {
            slots,
            width,
            dtype,
            capacity: 0,
            rows: 0,
            data: Vec::new(),
            row_sums: Vec::new(),
            nonfinite: Vec::new(),
            filled: vec![false; slots],
        }
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
        self.filled.iter_mut().for_each(|f| *f = false);
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (capacity, all slots).
    pub fn allocated_bytes(&self) -> usize {
        self.data.len() + self.row_sums.len() * 8 + self.nonfinite.len() * 4
    }

    /// The writable rows of `slot` for this step; fails if the slot was already written.
    pub fn target(&mut self, slot: usize, what: &str) -> CoreResult<CaptureTarget<'_>> {
        ensure!(slot < self.slots, ShapeContract, "{what}: slot {slot} does not exist ({} slots)", self.slots);
        ensure!(
            !self.filled[slot],
            ShapeContract,
            "{what} was captured twice in one step: a decoder layer ran twice in one forward, or two hooks are \
             registered on it"
        );
        self.filled[slot] = true;
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

    /// Slots not written this step.
    pub fn missing_slots(&self) -> Vec<usize> {
        (0..self.slots).filter(|&s| !self.filled[s]).collect()
    }

    pub fn row(&self, slot: usize, row: usize) -> &[u8] {
        let rb = self.row_bytes();
        let o = (slot * self.capacity + row) * rb;
        &self.data[o..o + rb]
    }

    pub fn nonfinite(&self, slot: usize, row: usize) -> u32 {
        self.nonfinite[slot * self.capacity + row]
    }

    /// The step checksum over every slot and row (see `hscapture_kernels::checksum`).
    pub fn checksum(&self) -> u64 {
        let mut acc = 0u64;
        for s in 0..self.slots {
            for r in 0..self.rows {
                acc = acc.wrapping_add(combine_row(self.row_sums[s * self.capacity + r], s, r));
            }
        }
        acc
    }
}
