use super::*;
use crate::error::ErrorKind;
use crate::layers::{Convention, LayerPlan};
use crate::plan::{CachedRequest, NewRequest};

const H: usize = 4;

fn session(ids: &[i64], assemble: bool) -> Session {
    Session::new(SessionConfig {
        layers: LayerPlan::new(ids, Convention::After, 8).unwrap(),
        hidden_size: H,
        model_dtype: DType::F32,
        out_dtype: DType::F32,
        assemble,
    })
    .unwrap()
}

/// Values encode (layer, step row, column) so every misplaced row is visible.
fn layer_output(layer: usize, rows: usize, base: f32) -> Vec<f32> {
    (0..rows * H).map(|i| base + (layer * 1000 + (i / H) * 10 + i % H) as f32).collect()
}

fn desc(v: &[f32], rows: usize) -> TensorDesc {
    TensorDesc { ptr: v.as_ptr() as usize, shape: vec![rows, H], strides: vec![H as i64, 1], dtype: DType::F32, device: Device::Cpu }
}

fn run_step(s: &mut Session, input: StepInput, order: &[&str], layers: &[usize]) -> CoreResult<StepOutcome> {
    let total = input.total_tokens;
    s.begin_step(input)?;
    s.plan(&order.iter().map(|x| x.to_string()).collect::<Vec<_>>())?;
    for (slot, &layer) in layers.iter().enumerate() {
        let h = layer_output(layer, total, 0.0);
        let r = layer_output(layer, total, 0.5);
        // SAFETY: `h` and `r` are live for the call and not written meanwhile.
        unsafe { s.capture(slot, &desc(&h, total), Some(&desc(&r, total)))? };
    }
    s.end_step()
}

fn req(id: &str, len: usize, sample: u64) -> NewRequest {
    NewRequest { req_id: id.into(), prompt_token_ids: (0..len as i64).collect(), num_computed_tokens: 0, sample: Some(sample) }
}

fn input(new: Vec<NewRequest>, cached: Vec<CachedRequest>, sched: &[(&str, usize)]) -> StepInput {
    StepInput {
        new_requests: new,
        cached_requests: cached,
        num_scheduled: sched.iter().map(|(a, b)| (a.to_string(), *b)).collect(),
        total_tokens: sched.iter().map(|x| x.1).sum(),
        ..Default::default()
    }
}

fn value(sample: &Sample, pos: usize, slot: usize, col: usize) -> f32 {
    let c = sample.cell(pos, slot);
    f32::from_le_bytes([c[col * 4], c[col * 4 + 1], c[col * 4 + 2], c[col * 4 + 3]])
}

#[test]
fn chunked_requests_assemble_in_prompt_order() {
    let mut s = session(&[5, 1], true);
    // slots: id 1 -> layer 1, id 5 -> layer 5 (ascending).
    let layers = [1usize, 5];
    // Step 1: runner order b, a. a: 2 tokens (whole), b: 3 of 5.
    let out = run_step(&mut s, input(vec![req("a", 2, 0), req("b", 5, 1)], vec![], &[("a", 2), ("b", 3)]), &["b", "a"], &layers).unwrap();
    assert_eq!(out.rows, 5);
    assert_eq!(out.completed.len(), 1);
    let a = &out.completed[0];
    assert_eq!((a.key.clone(), a.shape()), (SampleKey::Index(0), [2, 2, H]));
    // a's rows were step rows 3 and 4 (after b's 3 rows): value = 2*(layer*1000 + row*10 + col) + 0.5.
    assert_eq!(value(a, 0, 0, 0), 2.0 * (1000.0 + 30.0) + 0.5);
    assert_eq!(value(a, 1, 1, 3), 2.0 * (5000.0 + 40.0 + 3.0) + 0.5);
    // Step 2: b continues at 3 with 2 tokens; a decodes (not captured).
    let cached = vec![
        CachedRequest { req_id: "a".into(), num_computed_tokens: 2, resumed: false },
        CachedRequest { req_id: "b".into(), num_computed_tokens: 3, resumed: false },
    ];
    let out = run_step(&mut s, input(vec![], cached, &[("a", 1), ("b", 2)]), &["a", "b"], &layers).unwrap();
    assert_eq!(out.rows, 2);
    let b = &out.completed[0];
    assert_eq!(b.token_ids, vec![0, 1, 2, 3, 4]);
    assert_eq!(value(b, 0, 0, 0), 2.0 * 1000.0 + 0.5, "b's first chunk came from step rows 0..3");
    assert_eq!(value(b, 3, 0, 0), 2.0 * (1000.0 + 10.0) + 0.5, "b's second chunk starts at step row 1");
    assert_eq!(s.stats().samples, 2);
    assert_eq!(s.held_bytes(), s.arena.allocated_bytes(), "no per-request buffer outlives its sample");
}

#[test]
fn ranks_that_only_verify_get_the_same_checksum() {
    let layers = [2usize];
    let mut w = session(&[2], true);
    let mut v = session(&[2], false);
    let a = run_step(&mut w, input(vec![req("a", 3, 0)], vec![], &[("a", 3)]), &["a"], &layers).unwrap();
    let b = run_step(&mut v, input(vec![req("a", 3, 0)], vec![], &[("a", 3)]), &["a"], &layers).unwrap();
    assert_eq!(a.checksum, b.checksum);
    assert!(b.completed.is_empty() && a.completed.len() == 1);
}

#[test]
fn a_missing_layer_is_named() {
    let mut s = session(&[1, 3], true);
    s.begin_step(input(vec![req("a", 2, 0)], vec![], &[("a", 2)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h = layer_output(1, 2, 0.0);
    // SAFETY: `h` is live for the call.
    unsafe { s.capture(0, &desc(&h, 2), None).unwrap() };
    let e = s.end_step().unwrap_err();
    assert_eq!(e.kind, ErrorKind::ShapeContract);
    assert!(e.message.contains("layer id 3"), "{e}");
    assert!(!s.in_step(), "a failed step is abandoned");
}

#[test]
fn shape_and_dtype_are_enforced() {
    let mut s = session(&[1], true);
    s.begin_step(input(vec![req("a", 3, 0)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h = vec![0f32; 3 * 8];
    let wide = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![3, 8], strides: vec![8, 1], dtype: DType::F32, device: Device::Cpu };
    // SAFETY: `h` is live for the calls below.
    let e = unsafe { s.capture(0, &wide, None) }.unwrap_err();
    assert!(e.message.contains("expected hidden size 4") && e.message.contains("[3, 8]"), "{e}");
    let short = desc(&h, 2);
    // SAFETY: as above.
    let e = unsafe { s.capture(0, &short, None) }.unwrap_err();
    assert!(e.message.contains("scheduled 3 tokens") && e.message.contains("2 rows"), "{e}");
    let bf = TensorDesc { dtype: DType::BF16, ..desc(&h, 3) };
    // SAFETY: as above.
    let e = unsafe { s.capture(0, &bf, None) }.unwrap_err();
    assert!(e.message.contains("expected dtype float32, found bfloat16"), "{e}");
}

#[test]
fn non_finite_values_name_sample_layer_and_count() {
    let mut s = session(&[6], true);
    s.begin_step(input(vec![req("a", 3, 42)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let mut h = layer_output(6, 3, 0.0);
    h[5] = f32::NAN;
    h[6] = f32::INFINITY;
    // SAFETY: `h` is live for the call.
    unsafe { s.capture(0, &desc(&h, 3), None).unwrap() };
    let e = s.end_step().unwrap_err();
    assert_eq!(e.kind, ErrorKind::NonFinite);
    assert!(e.message.contains("sample 42") && e.message.contains("layer id 6") && e.message.contains("2 NaN/Inf"), "{e}");
}

#[test]
fn padded_steps_read_only_scheduled_rows() {
    let mut s = session(&[0], true);
    s.begin_step(input(vec![req("a", 3, 0)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h = layer_output(0, 8, 0.0); // padded to 8 rows (CUDA-graph padding)
    // SAFETY: `h` is live for the call.
    unsafe { s.capture(0, &desc(&h, 8), None).unwrap() };
    let out = s.end_step().unwrap();
    assert_eq!(out.completed[0].rows, 3);
}
