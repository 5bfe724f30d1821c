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
