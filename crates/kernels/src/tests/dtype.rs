use super::*;

#[test]
fn parse_names() {
    assert_eq!(DType::parse("torch.bfloat16"), Some(DType::BF16));
    assert_eq!(DType::parse("F32"), Some(DType::F32));
    assert_eq!(DType::parse("fp16"), Some(DType::F16));
    assert_eq!(DType::parse("int8"), None);
}

#[test]
fn store_rounds_to_nearest_even() {
    let mut b = [0u8; 2];
    // 1 + 2^-8 lies exactly between two bf16 values; ties go to the even mantissa (1.0).
    DType::BF16.store(&mut b, 0, 1.0 + 1.0 / 256.0);
    assert_eq!(DType::BF16.load(&b, 0), 1.0);
    let (_, finite) = DType::BF16.store(&mut b, 0, f32::MAX);
    assert!(!finite, "f32::MAX overflows bf16 to infinity");
}
