use super::*;
use crate::attribution::layers::{Convention, LayerPlan};
use crate::attribution::plan::{CachedRequest, NewRequest};
use crate::error::ErrorKind;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

pub(super) const H: usize = 4;

pub(crate) use super::host_device::HostDevice;

pub(super) fn session(ids: &[i64], assemble: bool) -> Session {
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
pub(super) fn layer_output(layer: usize, rows: usize, base: f32) -> Vec<f32> {
    (0..rows * H).map(|i| base + (layer * 1000 + (i / H) * 10 + i % H) as f32).collect()
}

pub(super) fn desc(v: &[f32], rows: usize) -> TensorDesc {
    TensorDesc { ptr: v.as_ptr() as usize, shape: vec![rows, H], strides: vec![H as i64, 1], dtype: DType::F32, device: Device::Cpu }
}

pub(super) fn run_step(s: &mut Session, input: StepInput, order: &[&str], layers: &[usize]) -> CoreResult<StepOutcome> {
    let total = input.total_tokens;
    s.begin_step(input)?;
    s.plan(&order.iter().map(|x| x.to_string()).collect::<Vec<_>>())?;
    for (slot, &layer) in layers.iter().enumerate() {
        let h = layer_output(layer, total, 0.0);
        let r = layer_output(layer, total, 0.5);
        // SAFETY: `h` and `r` are live for the call and not written meanwhile.
        unsafe { s.capture(slot, None, &desc(&h, total), Some(&desc(&r, total)), 0)? };
    }
    Ok(s.end_step()?.pop().unwrap_or_default())
}

pub(super) fn req(id: &str, len: usize, sample: u64) -> NewRequest {
    NewRequest {
        req_id: id.into(),
        prompt_token_ids: (0..len as i64).collect(),
        num_computed_tokens: 0,
        sample: Some(sample),
        loss_mask: None,
        max_tokens: None,
    }
}

pub(super) fn input(new: Vec<NewRequest>, cached: Vec<CachedRequest>, sched: &[(&str, usize)]) -> StepInput {
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
    assert_eq!(s.request_bytes(), 0, "no per-request buffer outlives its sample");
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
    unsafe { s.capture(0, None, &desc(&h, 2), None, 0).unwrap() };
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
    let e = unsafe { s.capture(0, None, &wide, None, 0) }.unwrap_err();
    assert!(e.message.contains("expected hidden size 4") && e.message.contains("[3, 8]"), "{e}");
    let short = desc(&h, 2);
    // SAFETY: as above.
    let e = unsafe { s.capture(0, None, &short, None, 0) }.unwrap_err();
    assert!(e.message.contains("scheduled 3 tokens") && e.message.contains("2 rows"), "{e}");
    let bf = TensorDesc { dtype: DType::BF16, ..desc(&h, 3) };
    // SAFETY: as above.
    let e = unsafe { s.capture(0, None, &bf, None, 0) }.unwrap_err();
    assert!(e.message.contains("expected dtype float32, found bfloat16"), "{e}");
}

#[test]
fn a_layer_that_stacks_streams_per_token_is_refused_and_a_batch_of_one_is_read() {
    let mut s = session(&[1], true);
    s.begin_step(input(vec![req("a", 3, 0)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h: Vec<f32> = (0..2 * 3 * H).map(|i| i as f32).collect();
    // Gemma 3n's AltUp: [streams, tokens, hidden]; read as rows it would pass the row count with stream 0 alone.
    let stacked = TensorDesc {
        ptr: h.as_ptr() as usize,
        shape: vec![2, 3, H],
        strides: vec![(3 * H) as i64, H as i64, 1],
        dtype: DType::F32,
        device: Device::Cpu,
    };
    // SAFETY: `h` is live for the calls below.
    let e = unsafe { s.capture(0, None, &stacked, None, 0) }.unwrap_err();
    assert_eq!(e.kind, ErrorKind::ShapeContract);
    assert!(e.message.contains("[2, 3, 4]") && e.message.contains("several hidden states per token"), "{e}");
    let batch_of_one = TensorDesc { shape: vec![1, 3, H], ..stacked };
    // SAFETY: as above.
    unsafe { s.capture(0, None, &batch_of_one, None, 0) }.unwrap();
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
    unsafe { s.capture(0, None, &desc(&h, 3), None, 0).unwrap() };
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
    unsafe { s.capture(0, None, &desc(&h, 4), None, 0).unwrap() };
    let out = s.end_step().unwrap().remove(0);
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
    unsafe { s.capture(0, None, &desc(&h, 8), None, 0).unwrap() };
    let out = s.end_step().unwrap().remove(0);
    assert_eq!(out.completed[0].rows, 3);
}

#[test]
fn device_steps_are_assembled_when_the_next_step_begins() {
    let layers = [1usize, 5];
    let mut host = session(&[5, 1], true);
    let mut dev = session(&[5, 1], true);
    dev.set_device(Box::new(HostDevice::new(2, 64, 1)), 0).unwrap();
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
        dev_out.extend(dev.begin_step(inp).unwrap());
        dev.plan(&order.iter().map(|x| x.to_string()).collect::<Vec<_>>()).unwrap();
        for (slot, &layer) in layers.iter().enumerate() {
            let h = layer_output(layer, total, 0.0);
            let r = layer_output(layer, total, 0.5);
            let tag = |d: TensorDesc| TensorDesc { device: Device::Cuda(0), ..d };
            // SAFETY: `h` and `r` are live for the call; the stand-in device copies them at once.
            unsafe { dev.capture(slot, None, &tag(desc(&h, total)), Some(&tag(desc(&r, total))), 0).unwrap() };
        }
        assert!(dev.end_step().unwrap().is_empty(), "device steps are not assembled at end_step");
    }
    dev_out.extend(dev.flush().unwrap());
    assert!(dev.flush().unwrap().is_empty());
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
    s.begin_step(StepInput { new_requests: reqs, num_scheduled: sched, total_tokens: total, ..Default::default() }).unwrap();
    s.plan(&["r2".to_string(), "r0".into(), "r3".into(), "r1".into()]).unwrap();
    for slot in 0..2 {
        let h: Vec<f32> = (0..total * w).map(|i| (slot * 1_000_000 + i / w) as f32).collect();
        let d = TensorDesc {
            ptr: h.as_ptr() as usize,
            shape: vec![total, w],
            strides: vec![w as i64, 1],
            dtype: DType::F32,
            device: Device::Cpu,
        };
        // SAFETY: `h` is live for the call.
        unsafe { s.capture(slot, None, &d, None, 0).unwrap() };
    }
    let out = s.end_step().unwrap().remove(0);
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
    unsafe { s.capture(0, None, &desc(&h, 2), None, 0).unwrap() };
    // SAFETY: as above.
    let e = unsafe { s.capture(0, None, &desc(&h, 2), None, 0) }.unwrap_err();
    assert!(e.message.contains("captured twice in one step"), "{e}");
}

#[test]
fn two_prompts_with_the_same_sample_index_are_refused() {
    let mut s = session(&[1], true);
    let e = run_step(&mut s, input(vec![req("a", 2, 5), req("b", 3, 5)], vec![], &[("a", 2), ("b", 3)]), &["a", "b"], &[1]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Output);
    assert!(e.message.contains("sample 5 was completed twice"), "{e}");
}

/// Runs a chunked schedule of `steps` steps (requests of 3..=9 tokens, at most 4 tokens per request
/// per step, new requests every step) on `s`, as host or stand-in device tensors; returns every
/// sample (from outcomes and from the assembler thread), sorted by key, and the outcomes' checksums.
pub(super) fn chunked_run(s: &mut Session, steps: usize, on_device: bool) -> (Vec<Sample>, Vec<u64>) {
    let layers = [1usize, 5];
    let mut left: Vec<(String, usize, usize)> = Vec::new(); // (id, computed, len)
    let (mut samples, mut sums) = (Vec::new(), Vec::new());
    let keep = |outs: Vec<StepOutcome>, s: &mut Session, samples: &mut Vec<Sample>, sums: &mut Vec<u64>| {
        for o in outs {
            sums.push(o.checksum);
            samples.extend(o.completed);
        }
        samples.extend(s.take_ready(false).unwrap());
    };
    for step in 0..steps {
        let id = format!("q{step}");
        let news = vec![req(&id, 3 + step % 7, step as u64)];
        left.push((id, 0, 3 + step % 7));
        let cached: Vec<CachedRequest> = left
            .iter()
            .filter(|(_, c, _)| *c > 0)
            .map(|(r, c, _)| CachedRequest { req_id: r.clone(), num_computed_tokens: *c, resumed: false })
            .collect();
        let sched: Vec<(String, usize)> = left.iter().map(|(r, c, n)| (r.clone(), (n - c).min(4))).collect();
        let refs: Vec<(&str, usize)> = sched.iter().map(|(r, n)| (r.as_str(), *n)).collect();
        let inp = input(news, cached, &refs);
        let total = inp.total_tokens;
        let mut order: Vec<String> = sched.iter().map(|x| x.0.clone()).collect();
        let k = step % order.len().max(1);
        order.rotate_left(k);
        let prev = s.begin_step(inp).unwrap();
        keep(prev, s, &mut samples, &mut sums);
        s.plan(&order).unwrap();
        for (slot, &layer) in layers.iter().enumerate() {
            let h = layer_output(layer, total, step as f32);
            let r = layer_output(layer, total, 0.5);
            let tag = |d: TensorDesc| if on_device { TensorDesc { device: Device::Cuda(0), ..d } } else { d };
            // SAFETY: `h` and `r` are live for the call and read during it (the stand-in device runs the
            // CPU twin into its own arena at once).
            unsafe { s.capture(slot, None, &tag(desc(&h, total)), Some(&tag(desc(&r, total))), 0).unwrap() };
        }
        let out = s.end_step().unwrap();
        keep(out, s, &mut samples, &mut sums);
        for (_, c, n) in left.iter_mut() {
            *c += (*n - *c).min(4);
        }
        left.retain(|(_, c, n)| c < n);
    }
    let last = s.flush().unwrap();
    keep(last, s, &mut samples, &mut sums);
    samples.extend(s.take_ready(true).unwrap());
    samples.sort_by_key(|x| x.key.to_string());
    (samples, sums)
}

#[test]
fn background_assembly_equals_inline_on_host_and_device_paths() {
    let (want, want_sums) = chunked_run(&mut session(&[5, 1], true), 12, false);
    assert_eq!(want.len(), 11, "the requests completed within 12 steps");
    let mut bg = session(&[5, 1], true);
    bg.set_background(2).unwrap();
    let (got, sums) = chunked_run(&mut bg, 12, false);
    assert_eq!((&got, &sums), (&want, &want_sums), "host path: same samples byte for byte, same checksums");
    assert!(bg.buffers.arenas() <= 2, "the CPU ring holds at most 2 arenas, found {}", bg.buffers.arenas());
    assert_eq!(bg.request_bytes(), bg.held_bytes() - bg.buffers.arena_bytes());

    let mut dev = session(&[5, 1], true);
    dev.set_device(Box::new(HostDevice::new(2, 64, 2)), 0).unwrap();
    assert!(dev.set_device(Box::new(HostDevice::new(2, 64, 2)), 0).is_err(), "the device path is enabled once");
    dev.set_background(2).unwrap();
    let (got, sums) = chunked_run(&mut dev, 12, true);
    assert_eq!(got, want, "device path on the assembler thread: same samples byte for byte");
    assert_eq!(sums, want_sums, "and the same step checksums");

    // One pinned buffer and the assembler thread: every step waits for the buffer to come back.
    let mut one = session(&[5, 1], true);
    one.set_device(Box::new(HostDevice::new(2, 64, 1)), 0).unwrap();
    one.set_background(2).unwrap();
    let (got, sums) = chunked_run(&mut one, 12, true);
    assert_eq!((got, sums), (want, want_sums), "a ring of one device buffer: slower, the same data");
}

#[test]
fn background_assembly_is_chosen_before_the_first_step_with_a_ring_of_two() {
    let mut s = session(&[1], true);
    assert_eq!(s.set_background(1).unwrap_err().kind, ErrorKind::Config);
    run_step(&mut s, input(vec![req("a", 2, 0)], vec![], &[("a", 2)]), &["a"], &[1]).unwrap();
    let e = s.set_background(2).unwrap_err();
    assert!(e.message.contains("before the first step"), "{e}");
}

#[test]
fn aborted_requests_free_their_buffers_on_the_assembler_thread() {
    let mut s = session(&[1], true);
    s.set_background(2).unwrap();
    run_step(&mut s, input(vec![req("a", 8, 0)], vec![], &[("a", 3)]), &["a"], &[1]).unwrap();
    s.take_ready(true).unwrap();
    assert_eq!(s.request_bytes(), 8 * H * 4, "a's partial sample is held");
    let mut inp = input(vec![], vec![], &[]);
    inp.finished = vec!["a".into()];
    s.begin_step(inp).unwrap();
    s.end_step().unwrap();
    assert!(s.take_ready(true).unwrap().is_empty());
    assert_eq!(s.request_bytes(), 0, "the drop ran after a's earlier rows, on the thread");
    assert_eq!(s.stats().aborted, 1);
}

#[test]
fn a_busy_ring_makes_the_worker_wait_and_loses_nothing() {
    let layers = [1usize, 5];
    let mut s = session(&[5, 1], true);
    s.set_background(2).unwrap();
    let hold = s.buffers.hold().expect("set_background");
    // Step 1's arena goes to the held thread, a second arena is made for step 2.
    run_step(&mut s, input(vec![req("a", 2, 0)], vec![], &[("a", 2)]), &["a"], &layers).unwrap();
    assert_eq!(s.buffers.arenas(), 2);
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(hold);
    });
    // Step 2's arena must go too: both are with the thread, so end_step waits for one to come back.
    let t = std::time::Instant::now();
    run_step(&mut s, input(vec![req("b", 3, 1)], vec![], &[("b", 3)]), &["b"], &layers).unwrap();
    let waited = t.elapsed();
    release.join().unwrap();
    assert!(waited >= std::time::Duration::from_millis(250), "the worker waited for a buffer ({waited:?})");
    assert_eq!(s.buffers.arenas(), 2, "no third arena: host memory stays at the ring");
    let got = s.take_ready(true).unwrap();
    let mut keys: Vec<String> = got.iter().map(|x| x.key.to_string()).collect();
    keys.sort();
    assert_eq!(keys, vec!["sample 0", "sample 1"]);
}
