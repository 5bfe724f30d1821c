use super::*;

/// The nearest e4m3fn value by search (ties to the even code), NaN from 464 up: what torch's cast computes.
fn slow(f: f32) -> u8 {
    if f.is_nan() {
        return if f.is_sign_negative() { 0xff } else { 0x7f };
    }
    let (sign, a) = (if f.is_sign_negative() { 0x80u8 } else { 0 }, f.abs() as f64);
    if a >= 464.0 {
        return 0x7f | sign;
    }
    let mut best = (f64::INFINITY, 0u8);
    for code in 0u8..0x7f {
        let v = e4m3_to_f32(code) as f64;
        let d = (v - a).abs();
        if d < best.0 || (d == best.0 && code % 2 == 0) {
            best = (d, code);
        }
    }
    best.1 | sign
}

#[test]
fn the_cast_is_torch_s_round_to_nearest_even_without_saturation() {
    assert_eq!(e4m3_from_f32(448.0), 0x7e);
    assert_eq!(e4m3_from_f32(449.0), 0x7e);
    assert_eq!(e4m3_from_f32(464.0), 0x7e, "464 rounds to 448 (ties to even)");
    assert_eq!(e4m3_from_f32(465.0), 0x7f, "not saturating: above 464 is NaN");
    assert_eq!(e4m3_from_f32(-1.0), 0xb8);
    assert_eq!(e4m3_from_f32(2f32.powi(-9)), 0x01, "the smallest denormal");
    assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7f);
    assert_eq!(e4m3_from_f32(0.0), 0x00);
    assert_eq!(e4m3_from_f32(-0.0), 0x80);
    let mut x = 0x1234_5678u64;
    for _ in 0..200_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let f = f32::from_bits(x as u32);
        let f = if f.abs() > 1e4 { f32::from_bits((x as u32 & 0x807f_ffff) | 0x3f00_0000) } else { f }; // keep some in range
        assert_eq!(e4m3_from_f32(f), slow(f), "{f:e} ({:#010x})", f.to_bits());
    }
    for code in 0u8..=255 {
        let v = e4m3_to_f32(code);
        if !v.is_nan() {
            assert_eq!(e4m3_from_f32(v), code, "every code round-trips");
        }
    }
}

#[test]
fn one_scale_per_token_over_all_of_its_values() {
    let vals: Vec<f32> = vec![1.0, -3.5, 0.25, 2.0, /* token 2: */ 0.0, 0.0, 0.0, 0.0];
    let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
    let (mut codes, mut scales) = (vec![0u8; 8], vec![0f32; 2]);
    quantize(&src, DType::F32, 2, 4, &mut codes, &mut scales);
    assert_eq!(scales[0], 3.5f32 / 448.0);
    assert_eq!(scales[1], MIN_SCALE, "a token of zeros gets the smallest scale");
    assert_eq!(codes[1], e4m3_from_f32(-3.5 / (3.5f32 / 448.0)));
    assert_eq!(e4m3_to_f32(codes[1]), -448.0, "the largest value maps to the top of the range");
    assert_eq!(&codes[4..], &[0, 0, 0, 0]);
    assert!(token_scale([1.0, f32::NAN].into_iter()).is_nan(), "a NaN propagates as torch's amax does");
    assert_eq!(dequantize_bf16(codes[1], scales[0]).to_f32(), -3.5);
}
