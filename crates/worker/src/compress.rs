//! Optional lossless compression of stored hidden states: byte-plane split, then zstd.
//!
//! Activations in bf16/fp16/fp32 compress poorly as they are: the sign/exponent bytes repeat a lot,
//! the low mantissa bytes are close to noise, and interleaved they hide each other's structure.
//! Splitting each element's bytes into planes (all first bytes, then all second bytes, …) lets zstd
//! find the redundancy in the high planes. Lossless: decoding gives the exact bytes back.

use crate::{core_err, ensure, error::CoreResult};

/// The name stored in a file's metadata (`hscapture.compression`).
pub const CODEC: &str = "byteplane-zstd/1";

/// Splits `data` (elements of `elem` bytes) into byte planes and compresses them with zstd `level`.
pub fn encode(data: &[u8], elem: usize, level: i32) -> CoreResult<Vec<u8>> {
    ensure!(elem > 0 && data.len() % elem == 0, ShapeContract, "{} bytes are not whole {elem}-byte elements", data.len());
    let n = data.len() / elem;
    let mut planes = vec![0u8; data.len()];
    // One sequential pass per plane: streaming writes, no index arithmetic in the inner loop.
    for (b, plane) in planes.chunks_exact_mut(n.max(1)).enumerate().take(elem) {
        for (dst, e) in plane.iter_mut().zip(data.chunks_exact(elem)) {
            *dst = e[b];
        }
    }
    zstd::bulk::compress(&planes, level).map_err(|e| core_err!(Output, "zstd compression failed: {e}"))
}

/// Inverts [`encode`]: `len` is the decoded size in bytes.
pub fn decode(compressed: &[u8], elem: usize, len: usize, what: &str) -> CoreResult<Vec<u8>> {
    ensure!(elem > 0 && len % elem == 0, Output, "{what}: {len} bytes are not whole {elem}-byte elements");
    let planes = zstd::bulk::decompress(compressed, len)
        .map_err(|e| core_err!(Output, "{what}: the compressed states do not decode ({e}); the file is damaged: delete it and re-run"))?;
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
mod tests {
    use super::*;

    /// bf16 values of a smooth activation-like signal: high bytes repeat, low bytes vary.
    fn activations(n: usize) -> Vec<u8> {
        (0..n).flat_map(|i| half::bf16::from_f32(((i as f32) * 0.37).sin() * 2.5).to_le_bytes()).collect()
    }

    #[test]
    fn round_trips_every_element_size() {
        for elem in [1, 2, 4] {
            let data: Vec<u8> = (0..4096 * elem).map(|i| (i * 31 % 251) as u8).collect();
            let c = encode(&data, elem, 3).unwrap();
            assert_eq!(decode(&c, elem, data.len(), "t").unwrap(), data);
        }
        assert_eq!(decode(&encode(&[], 2, 3).unwrap(), 2, 0, "t").unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn the_plane_split_helps_on_activation_like_data() {
        let data = activations(1 << 16);
        let split = encode(&data, 2, 3).unwrap().len();
        let plain = zstd::bulk::compress(&data, 3).unwrap().len();
        assert!(split < plain, "byte planes {split} bytes, plain zstd {plain} bytes");
    }

    #[test]
    fn damage_and_misuse_are_errors() {
        let data = activations(1000);
        let mut c = encode(&data, 2, 3).unwrap();
        assert!(decode(&c, 2, data.len() + 2, "t").is_err());
        let mid = c.len() / 2;
        c[mid] ^= 0xff;
        c.truncate(c.len() - 4);
        assert!(decode(&c, 2, data.len(), "t").is_err());
        assert!(encode(&data[..3], 2, 3).is_err());
    }
}
