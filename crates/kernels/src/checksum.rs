//! Checksums of captured rows.
//!
//! Defined so that a GPU computes them with a parallel reduction in any order: a row's checksum is a
//! wrapping sum of independently mixed elements, and a step's checksum a wrapping sum of mixed rows.
//! Two ranks that stored the same bytes in the same rows get the same value; a single flipped bit
//! anywhere changes it (with probability 1 - 2^-64 per change).

/// The splitmix64 finaliser: a bijective 64-bit mixer.
#[inline(always)]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Contribution of element `j` (stored bit pattern `bits`, zero-extended) to its row's checksum.
#[inline(always)]
pub const fn element_term(bits: u64, j: usize) -> u64 {
    mix64(bits ^ ((j as u64) << 32))
}

/// Checksum of one stored row, given the bit patterns of its elements in order.
pub fn row_checksum(bits: impl IntoIterator<Item = u64>) -> u64 {
    bits.into_iter().enumerate().fold(0u64, |acc, (j, b)| acc.wrapping_add(element_term(b, j)))
}

/// Contribution of a row checksum to a step checksum, keyed by the row's layer slot and its row
/// index within the step's captured rows.
#[inline(always)]
pub const fn combine_row(row_sum: u64, slot: usize, row: usize) -> u64 {
    mix64(row_sum.wrapping_add(mix64(((slot as u64) << 48) ^ row as u64)))
}

#[cfg(test)]
#[path = "tests/checksum.rs"]
mod tests;
