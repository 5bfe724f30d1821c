//! Optional lossless compression of stored hidden states: byte-plane split, then zstd.
//!
//! Activations in bf16/fp16/fp32 compress poorly as they are: the sign/exponent bytes repeat a lot,
//! the low mantissa bytes are close to noise, and interleaved they hide each other's structure.
//! Splitting each element's bytes into planes (all first bytes, then all second bytes, …) lets zstd
//! find the redundancy in the high planes. Lossless: decoding gives the exact bytes back.

use crate::{core_err, ensure, error::CoreResult};

/// The zstd levels a capture may compress with (0 or unset: none).
pub const LEVELS: std::ops::RangeInclusive<i32> = 1..=22;

/// The name stored in a file's metadata (`hscapture.compression`).
pub const CODEC: &str = "byteplane-zstd/1";

/// Splits `data` (elements of `elem` bytes) into byte planes and compresses them with zstd `level`.
pub fn encode(data: &[u8], elem: usize, level: i32) -> CoreResult<Vec<u8>> {
    ensure!(elem > 0 && data.len().is_multiple_of(elem), ShapeContract, "{} bytes are not whole {elem}-byte elements", data.len());
    let n = data.len() / elem;
    let mut planes = vec![0u8; data.len()];
    // One sequential pass per plane: streaming writes, no index arithmetic in the inner loop.
    for (b, plane) in planes.chunks_exact_mut(n.max(1)).enumerate().take(elem) {
        for (dst, e) in plane.iter_mut().zip(data.chunks_exact(elem)) {
            *dst = e[b];
        }
    }
    zstd::bulk::compress(&planes, level).map_err(|e| core_err!(Output, "zstd compression failed: {e}").caused_by(&e))
}

/// Inverts [`encode`]: `len` is the decoded size in bytes. Memory grows with what actually decodes
/// (never sized from `len` up front: `len` comes from the file).
pub fn decode(compressed: &[u8], elem: usize, len: usize, what: &str) -> CoreResult<Vec<u8>> {
    use std::io::Read;
    ensure!(elem > 0 && len.is_multiple_of(elem), Output, "{what}: {len} bytes are not whole {elem}-byte elements");
    let damaged = |e: std::io::Error| {
        core_err!(Output, "{what}: the compressed states do not decode ({e}); the file is damaged: delete it and re-run")
    };
    let mut planes = Vec::new();
    zstd::stream::read::Decoder::new(compressed).map_err(damaged)?.take(len as u64 + 1).read_to_end(&mut planes).map_err(damaged)?;
    ensure!(planes.len() == len, Output, "{what}: decoded {} bytes, expected {len}; the file is damaged", planes.len());
    let n = len / elem;
    let mut data = vec![0u8; len];
    for (b, plane) in planes.chunks_exact(n.max(1)).enumerate().take(elem) {
        for (e, &src) in data.chunks_exact_mut(elem).zip(plane) {
            e[b] = src;
        }
    }
    Ok(data)
}

#[cfg(test)]
#[path = "tests/compress.rs"]
mod tests;
