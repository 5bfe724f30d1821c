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
        unsafe { s.capture(slot, &desc(&h, total), Some(&desc(&r, total)), 0)? };
    }
    Ok(s.end_step()?.unwrap_or_default())
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
    assert_eq!(s.assembly.held_bytes(), 0, "no per-request buffer outlives its sample");
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
    unsafe { s.capture(0, &desc(&h, 2), None, 0).unwrap() };
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
    let e = unsafe { s.capture(0, &wide, None, 0) }.unwrap_err();
    assert!(e.message.contains("expected hidden size 4") && e.message.contains("[3, 8]"), "{e}");
    let short = desc(&h, 2);
    // SAFETY: as above.
    let e = unsafe { s.capture(0, &short, None, 0) }.unwrap_err();
    assert!(e.message.contains("scheduled 3 tokens") && e.message.contains("2 rows"), "{e}");
    let bf = TensorDesc { dtype: DType::BF16, ..desc(&h, 3) };
    // SAFETY: as above.
    let e = unsafe { s.capture(0, &bf, None, 0) }.unwrap_err();
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
    unsafe { s.capture(0, &desc(&h, 3), None, 0).unwrap() };
    let e = s.end_step().unwrap_err();
    assert_eq!(e.kind, ErrorKind::NonFinite);
    assert!(e.message.contains("sample 42") && e.message.contains("layer id 6") && e.message.contains("2 NaN/Inf"), "{e}");
}

#[test]
fn opt_in_skips_only_the_sample_with_non_finite_values_across_chunks() {
    let mut s = session(&[6], true);
    s.set_skip_nonfinite(true);
    // Step 1: a (2 tokens, finite) whole; b's first 2 of 4 tokens, one NaN in b's second token.
    s.begin_step(input(vec![req("a", 2, 0), req("b", 4, 1)], vec![], &[("a", 2), ("b", 2)])).unwrap();
    s.plan(&["a".to_string(), "b".to_string()]).unwrap();
    let mut h = layer_output(6, 4, 0.0);
    h[3 * H] = f32::NAN;
    // SAFETY: `h` is live for the call.
    unsafe { s.capture(0, &desc(&h, 4), None, 0).unwrap() };
    let out = s.end_step().unwrap().unwrap();
    assert_eq!(out.completed.iter().map(|x| x.key.clone()).collect::<Vec<_>>(), vec![SampleKey::Index(0)]);
    assert!(s.take_skipped().is_empty(), "b is not complete yet");
    // Step 2: b's last 2 tokens, finite: b is still skipped, reported once, with what was found.
    let cached = vec![CachedRequest { req_id: "b".into(), num_computed_tokens: 2, resumed: false }];
    let out = run_step(&mut s, input(vec![], cached, &[("b", 2)]), &["b"], &[6]).unwrap();
    assert!(out.completed.is_empty());
    let skipped = s.take_skipped();
    assert_eq!(skipped.len(), 1);
    assert_eq!((skipped[0].0.clone(), skipped[0].1.as_str()), (SampleKey::Index(1), "b"));
    assert!(skipped[0].2.contains("1 NaN/Inf values in prompt positions 0..2 (first at position 1)"), "{}", skipped[0].2);
    assert_eq!((s.stats().samples, s.stats().skipped), (1, 1));
}

#[test]
fn padded_steps_read_only_scheduled_rows() {
    let mut s = session(&[0], true);
    s.begin_step(input(vec![req("a", 3, 0)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h = layer_output(0, 8, 0.0); // padded to 8 rows (CUDA-graph padding)
    // SAFETY: `h` is live for the call.
    unsafe { s.capture(0, &desc(&h, 8), None, 0).unwrap() };
    let out = s.end_step().unwrap().unwrap();
    assert_eq!(out.completed[0].rows, 3);
}


/// A device stand-in in host memory: "device" tensors are host memory tagged cuda, the kernel is the
/// CPU twin, and the copy to the host buffer happens at `end_step` (so data is only visible after
/// `wait`, as with a real device).
struct HostDevice {
    slots: usize,
    cap: usize,
    runs: Vec<hscapture_kernels::RowRun>,
    rows: usize,
    dev: Arena,
    host: Arena,
    waits: usize,
}

impl crate::device::DeviceBackend for HostDevice {
    fn capacity(&self) -> usize {
        self.cap
    }
    fn allocated(&self) -> (usize, usize) {
        (self.dev.allocated_bytes(), self.host.allocated_bytes())
    }
    fn reset(&mut self, rows: usize, runs: &[hscapture_kernels::RowRun]) -> CoreResult<()> {
        self.rows = rows;
        self.runs = runs.to_vec();
        self.dev.reset(rows);
        Ok(())
    }
    unsafe fn capture(&mut self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>, _stream: u64) -> CoreResult<()> {
        let as_cpu = |d: &TensorDesc| TensorDesc { device: Device::Cpu, ..d.clone() };
        let rows = hidden.rows();
        // SAFETY: the test's "device" tensors are live host memory.
        let h = unsafe { as_cpu(hidden).cpu_rows("h", rows)? };
        // SAFETY: as above.
        let r = match residual {
            Some(r) => Some(unsafe { as_cpu(r).cpu_rows("r", rows)? }),
            None => None,
        };
        let mut t = self.dev.target(slot, "x")?;
        capture_rows(&h, r.as_ref(), &self.runs, &mut t).map_err(|e| crate::core_err!(ShapeContract, "{e}"))
    }
    fn end_step(&mut self) -> CoreResult<()> {
        self.host.reset(self.rows);
        for s in 0..self.slots {
            let src = self.dev.target(s, "x")?;
            let (d, sums, bad) = (src.data.to_vec(), src.row_sums.to_vec(), src.nonfinite.to_vec());
            let dst = self.host.target(s, "x")?;
            dst.data.copy_from_slice(&d);
            dst.row_sums.copy_from_slice(&sums);
            dst.nonfinite.copy_from_slice(&bad);
        }
        Ok(())
    }
    fn wait(&mut self) -> CoreResult<&(dyn crate::rows::StepRows + Sync)> {
        self.waits += 1;
        Ok(&self.host)
    }
}

#[test]
fn device_steps_are_assembled_when_the_next_step_begins() {
    let layers = [1usize, 5];
    let mut host = session(&[5, 1], true);
    let mut dev = session(&[5, 1], true);
    dev.set_device(Box::new(HostDevice {
        slots: 2,
        cap: 64,
        runs: vec![],
        rows: 0,
        dev: Arena::new(2, H, DType::F32),
        host: Arena::new(2, H, DType::F32),
        waits: 0,
    }));
    let steps = || {
        vec![
            (input(vec![req("a", 2, 0), req("b", 5, 1)], vec![], &[("a", 2), ("b", 3)]), vec!["b", "a"]),
            (
                input(
                    vec![],
                    vec![
                        CachedRequest { req_id: "a".into(), num_computed_tokens: 2, resumed: false },
                        CachedRequest { req_id: "b".into(), num_computed_tokens: 3, resumed: false },
                    ],
                    &[("a", 1), ("b", 2)],
                ),
                vec!["a", "b"],
            ),
        ]
    };
    let mut host_out = Vec::new();
    for (inp, order) in steps() {
        host_out.push(run_step(&mut host, inp, &order, &layers).unwrap());
    }
    let mut dev_out = Vec::new();
    for (inp, order) in steps() {
        let total = inp.total_tokens;
        if let Some(o) = dev.begin_step(inp).unwrap() {
            dev_out.push(o);
        }
        dev.plan(&order.iter().map(|x| x.to_string()).collect::<Vec<_>>()).unwrap();
        for (slot, &layer) in layers.iter().enumerate() {
            let h = layer_output(layer, total, 0.0);
            let r = layer_output(layer, total, 0.5);
            let tag = |d: TensorDesc| TensorDesc { device: Device::Cuda(0), ..d };
            // SAFETY: `h` and `r` are live for the call; the stand-in device copies them at once.
            unsafe { dev.capture(slot, &tag(desc(&h, total)), Some(&tag(desc(&r, total))), 0).unwrap() };
        }
        assert!(dev.end_step().unwrap().is_none(), "device steps are not assembled at end_step");
    }
    dev_out.push(dev.flush().unwrap().expect("the last step is assembled at flush"));
    assert!(dev.flush().unwrap().is_none());
    assert_eq!(dev_out.len(), 2);
    for (a, b) in host_out.iter().zip(&dev_out) {
        assert_eq!((a.step, a.checksum, a.rows), (b.step, b.checksum, b.rows));
        assert_eq!(a.completed, b.completed, "same samples, byte for byte");
    }
}

#[test]
fn large_steps_scatter_in_parallel_to_the_same_result() {
    // 4 requests x 700 rows x 2 slots x 1024 f32 = 22 MiB: above the parallel threshold.
    let w = 1024usize;
    let mut s = Session::new(SessionConfig {
        layers: LayerPlan::new(&[1, 2], Convention::After, 8).unwrap(),
        hidden_size: w,
        model_dtype: DType::F32,
        out_dtype: DType::F32,
        assemble: true,
    })
    .unwrap();
    let reqs: Vec<NewRequest> = (0..4).map(|i| req(&format!("r{i}"), 700, i)).collect();
    let sched: Vec<(String, usize)> = (0..4).map(|i| (format!("r{i}"), 700)).collect();
    let total = 2800;
    s.begin_step(StepInput {
        new_requests: reqs,
        num_scheduled: sched,
        total_tokens: total,
        ..Default::default()
    })
    .unwrap();
    s.plan(&["r2".to_string(), "r0".into(), "r3".into(), "r1".into()]).unwrap();
    for slot in 0..2 {
        let h: Vec<f32> = (0..total * w).map(|i| (slot * 1_000_000 + i / w) as f32).collect();
        let d = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![total, w], strides: vec![w as i64, 1], dtype: DType::F32, device: Device::Cpu };
        // SAFETY: `h` is live for the call.
        unsafe { s.capture(slot, &d, None, 0).unwrap() };
    }
    let out = s.end_step().unwrap().unwrap();
    assert_eq!(out.completed.len(), 4);
    for smp in &out.completed {
        let SampleKey::Index(i) = smp.key else { panic!("indexed") };
        let first_row = [1usize, 3, 0, 2][i as usize] * 700; // r0 is second in the runner's order, ...
        for (pos, slot) in [(0usize, 0usize), (699, 1), (350, 0)] {
            let v = f32::from_le_bytes(smp.cell(pos, slot)[..4].try_into().unwrap());
            assert_eq!(v, (slot * 1_000_000 + first_row + pos) as f32, "sample {i} pos {pos} slot {slot}");
        }
    }
}

#[test]
fn a_slot_captured_twice_in_one_step_is_refused() {
    let mut s = session(&[1], true);
    s.begin_step(input(vec![req("a", 2, 0)], vec![], &[("a", 2)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h = layer_output(1, 2, 0.0);
    // SAFETY: `h` is live for the calls.
    unsafe { s.capture(0, &desc(&h, 2), None, 0).unwrap() };
    // SAFETY: as above.
    let e = unsafe { s.capture(0, &desc(&h, 2), None, 0) }.unwrap_err();
    assert!(e.message.contains("captured twice in one step"), "{e}");
}

#[test]
fn two_prompts_with_the_same_sample_index_are_refused() {
    let mut s = session(&[1], true);
    let e = run_step(&mut s, input(vec![req("a", 2, 5), req("b", 3, 5)], vec![], &[("a", 2), ("b", 3)]), &["a", "b"], &[1]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Output);
    assert!(e.message.contains("sample 5 was completed twice"), "{e}");
}
