use super::*;
use crate::sample::SampleKey;

fn sample(rows: usize, slots: usize, width: usize, dtype: DType) -> Sample {
    Sample {
        key: SampleKey::Request("r".into()),
        req_id: "r".into(),
        token_ids: (0..rows as i64).map(|t| 1000 + t).collect(),
        data: (0..rows * slots * width * dtype.size()).map(|i| (i % 251) as u8).collect(),
        rows,
        slots,
        width,
        dtype,
        loss_mask: None,
        scales: None,
    }
}

#[test]
fn the_layout_is_speculators_example_and_every_offset_is_aligned() {
    // hs_connectors' packed_layout for T=5, L=4, H=16 in bf16: 640 bytes at 0, token ids at 640, 704 in all.
    let l = PackedLayout::of(5, 4, 16, DType::BF16).unwrap();
    assert_eq!((l.states_bytes, l.tokens_offset, l.tokens_bytes, l.total), (640, 640, 40, 704));
    let l = PackedLayout::of(3, 3, 5, DType::F32).unwrap(); // 180 bytes of states: token ids at 192
    assert_eq!((l.states_bytes, l.tokens_offset, l.tokens_bytes, l.total), (180, 192, 24, 256));
    let m = l.manifest("cmpl-1", "prompt_only");
    assert_eq!(m["version"], 1);
    assert_eq!(m["tensors"]["hidden_states"]["dtype"], "torch.float32");
    assert_eq!(m["tensors"]["hidden_states"]["shape"], json!([3, 3, 5]));
    assert_eq!(m["tensors"]["token_ids"]["offset"], 192);
    assert_eq!(m["metadata"]["total_aligned_bytes"], 256);
    assert_eq!(m["metadata"]["num_tokens"], 3);
}

#[test]
fn sizes_that_overflow_are_refused() {
    let e = PackedLayout::of(usize::MAX / 2, 4, 16, DType::BF16).unwrap_err();
    assert!(e.message.contains("overflows"), "{e}");
}

#[test]
fn an_object_holds_the_states_then_the_token_ids_at_their_offsets() {
    let s = sample(3, 3, 5, DType::F32);
    let o = encode(&s).unwrap();
    let l = PackedLayout::of(3, 3, 5, DType::F32).unwrap();
    assert_eq!(o.len(), l.total);
    assert_eq!(&o[..l.states_bytes], &s.data[..]);
    assert!(o[l.states_bytes..l.tokens_offset].iter().all(|b| *b == 0), "padding is zeros");
    let ids: Vec<i64> =
        o[l.tokens_offset..l.tokens_offset + l.tokens_bytes].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(ids, s.token_ids);
}

#[test]
fn a_sample_that_does_not_match_its_shape_or_arrived_quantized_is_refused() {
    let mut s = sample(3, 3, 5, DType::BF16);
    s.data.pop();
    assert!(encode(&s).is_err());
    let mut s = sample(3, 3, 5, DType::BF16);
    s.data.truncate(3 * 3 * 5);
    s.scales = Some(vec![1.0; 3]);
    assert!(encode(&s).unwrap_err().message.contains("fp8 codes"));
}

#[test]
fn keys_are_speculators_sanitized_request_ids() {
    assert_eq!(key_of("cmpl-abc-0-1f2e"), "cmpl-abc-0-1f2e");
    assert_eq!(key_of("a.b/c d"), "a_b_c_d");
    assert_eq!(key_of("7x"), "k7x");
    assert_eq!(key_of(""), "");
    assert_eq!(error_key("k7x"), "k7x:error");
}
