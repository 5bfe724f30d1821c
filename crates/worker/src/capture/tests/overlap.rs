//! Overlapped device steps: step N+1 begins while step N is in flight (the stand-in device of
//! `tests/session.rs`); the data, the checksums and the order of accounting stay those of the host path.

use super::tests::{chunked_run, desc, input, layer_output, req, session, HostDevice};
use super::*;
use crate::attribution::plan::CachedRequest;
use crate::error::ErrorKind;

fn on_device(d: TensorDesc) -> TensorDesc {
    TensorDesc { device: Device::Cuda(0), ..d }
}

/// Begins, plans and captures a step (slots of `layers`) as device or host tensors; returns what
/// `begin_step` and `end_step` accounted.
fn step(s: &mut Session, inp: StepInput, order: &[&str], layers: &[usize], device: bool) -> (Vec<StepOutcome>, Vec<StepOutcome>) {
    let total = inp.total_tokens;
    let begun = s.begin_step(inp).unwrap();
    s.plan(&order.iter().map(|x| x.to_string()).collect::<Vec<_>>()).unwrap();
    for (slot, &layer) in layers.iter().enumerate() {
        let (h, r) = (layer_output(layer, total, 0.0), layer_output(layer, total, 0.5));
        let (h, r) = (desc(&h, total), desc(&r, total));
        let (h, r) = if device { (on_device(h), on_device(r)) } else { (h, r) };
        // SAFETY: the vectors behind `h` and `r` live until the call returns; the stand-in device
        // copies them at once.
        unsafe { s.capture(slot, None, &h, Some(&r), 0).unwrap() };
    }
    (begun, s.end_step().unwrap())
}

fn cached(id: &str, computed: usize) -> CachedRequest {
    CachedRequest { req_id: id.into(), num_computed_tokens: computed, resumed: false }
}

#[test]
fn overlapped_steps_give_the_host_paths_samples_and_checksums() {
    let (want, want_sums) = chunked_run(&mut session(&[5, 1], true), 12, false);
    // Inline: 2 buffers (one in flight, one filling). Background: the assembler's ring plus the one
    // in flight, and the tightest ring (2), where the worker waits for the assembler every step.
    // Two steps in flight: a ring of 3 inline, the assembler's 2 plus 2 in the background.
    // With small buffers (8 rows) besides: steps of up to 8 rows take those, the larger ones the full ones.
    let cases = [
        (2usize, false, 1usize, 0usize),
        (3, true, 1, 0),
        (2, true, 1, 0),
        (3, false, 2, 0),
        (4, true, 2, 0),
        (4, true, 2, 8),
        (2, false, 1, 8),
    ];
    for (ring, background, in_flight, small) in cases {
        let mut s = session(&[5, 1], true);
        s.set_device(Box::new(HostDevice::with_small(2, 64, ring, small)), in_flight).unwrap();
        if background {
            s.set_background(2).unwrap();
        }
        let (got, sums) = chunked_run(&mut s, 12, true);
        let case = format!("ring {ring}, background {background}, {in_flight} in flight, small buffers of {small} rows");
        assert_eq!(got, want, "{case}: same samples byte for byte");
        assert_eq!(sums, want_sums, "{case}: same checksums, in step order");
    }
}

#[test]
fn a_device_step_is_accounted_when_the_next_one_ends() {
    let mut s = session(&[1], true);
    s.set_device(Box::new(HostDevice::new(1, 64, 2)), 1).unwrap();
    let (b0, e0) = step(&mut s, input(vec![req("a", 9, 0)], vec![], &[("a", 3)]), &["a"], &[1], true);
    assert!(b0.is_empty() && e0.is_empty());
    let (b1, e1) = step(&mut s, input(vec![], vec![cached("a", 3)], &[("a", 3)]), &["a"], &[1], true);
    assert!(b1.is_empty(), "the first step is still in flight while the second begins");
    assert_eq!(e1.iter().map(|o| (o.step, o.rows)).collect::<Vec<_>>(), vec![(1, 3)], "and is accounted when it ends");
    assert_eq!(s.steps_in_flight(), 1);
    let (b2, e2) = step(&mut s, input(vec![], vec![cached("a", 6)], &[("a", 3)]), &["a"], &[1], true);
    assert!(b2.is_empty());
    assert_eq!(e2.iter().map(|o| o.step).collect::<Vec<_>>(), vec![2]);
    let rest = s.flush().unwrap();
    assert_eq!(rest.iter().map(|o| (o.step, o.rows)).collect::<Vec<_>>(), vec![(3, 3)], "only the last step is left");
    assert_eq!(rest[0].completed.len(), 1, "the prompt completes with its last step");
    assert!(s.flush().unwrap().is_empty());

    // Without overlap: each step is accounted when the next begins.
    let mut serial = session(&[1], true);
    serial.set_device(Box::new(HostDevice::new(1, 64, 1)), 0).unwrap();
    step(&mut serial, input(vec![req("a", 9, 0)], vec![], &[("a", 3)]), &["a"], &[1], true);
    let (b1, e1) = step(&mut serial, input(vec![], vec![cached("a", 3)], &[("a", 3)]), &["a"], &[1], true);
    assert_eq!((b1.len(), e1.len()), (1, 0));
}

#[test]
fn a_request_ending_while_its_rows_are_in_flight_is_dropped_after_them() {
    for background in [false, true] {
        let mut s = session(&[1], true);
        s.set_device(Box::new(HostDevice::new(1, 64, 3)), 1).unwrap();
        if background {
            s.set_background(2).unwrap();
        }
        step(&mut s, input(vec![req("a", 8, 0)], vec![], &[("a", 3)]), &["a"], &[1], true);
        let mut inp = input(vec![req("b", 2, 1)], vec![], &[("b", 2)]);
        inp.finished = vec!["a".into()];
        // a ends while the first step, holding its first 3 rows, is in flight.
        step(&mut s, inp, &["b"], &[1], true);
        let outs = s.flush().unwrap();
        let done: Vec<Sample> = outs.into_iter().flat_map(|o| o.completed).chain(s.take_ready(true).unwrap()).collect();
        assert_eq!(done.iter().map(|x| x.key.to_string()).collect::<Vec<_>>(), vec!["sample 1"]);
        assert_eq!(s.request_bytes(), 0, "background {background}: a's rows were assembled, then dropped");
        assert_eq!(s.stats().aborted, 1);
    }
}

#[test]
fn a_step_without_device_captures_waits_for_the_steps_in_flight() {
    let layers = [1usize, 5];
    let mut host = session(&[5, 1], true);
    let mut s = session(&[5, 1], true);
    s.set_device(Box::new(HostDevice::new(2, 64, 2)), 1).unwrap();
    let first = || input(vec![req("a", 5, 0)], vec![], &[("a", 3)]);
    let second = || input(vec![], vec![cached("a", 3)], &[("a", 2)]);
    step(&mut host, first(), &["a"], &layers, false);
    let (_, want) = step(&mut host, second(), &["a"], &layers, false);
    step(&mut s, first(), &["a"], &layers, true);
    let (_, got) = step(&mut s, second(), &["a"], &layers, false);
    assert_eq!(got.iter().map(|o| o.step).collect::<Vec<_>>(), vec![1, 2], "the device step first, then the host step");
    assert_eq!(got[1].completed, want[0].completed, "a's rows in order, byte for byte");
}

#[test]
fn overlap_needs_a_ring_of_two() {
    let mut s = session(&[1], true);
    let e = s.set_device(Box::new(HostDevice::new(1, 64, 1)), 1).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Config);
    assert!(e.message.contains("at least 2 host buffers"), "{e}");
}

#[test]
fn after_a_step_fails_to_be_collected_the_session_captures_nothing_more() {
    let mut s = session(&[1], true);
    s.set_device(Box::new(HostDevice::new(1, 64, 2)), 1).unwrap();
    s.begin_step(input(vec![req("a", 9, 0)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let mut h = layer_output(1, 3, 0.0);
    h[5] = f32::NAN;
    // SAFETY: `h` lives until the call returns; the stand-in device copies it at once.
    unsafe { s.capture(0, None, &on_device(desc(&h, 3)), None, 0).unwrap() };
    assert!(s.end_step().unwrap().is_empty());
    // The next step ends: the first is collected now, and its NaN is the error.
    s.begin_step(input(vec![], vec![cached("a", 3)], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    let h = layer_output(1, 3, 0.0);
    // SAFETY: as above.
    unsafe { s.capture(0, None, &on_device(desc(&h, 3)), None, 0).unwrap() };
    assert_eq!(s.end_step().unwrap_err().kind, ErrorKind::NonFinite);
    let e = s.begin_step(input(vec![], vec![cached("a", 6)], &[("a", 3)])).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NonFinite);
    assert!(e.message.contains("an earlier device step could not be collected"), "{e}");
    assert!(s.flush().is_err(), "flush reports it too");
}

#[test]
fn with_two_steps_in_flight_a_step_is_accounted_two_steps_later() {
    let mut s = session(&[1], true);
    s.set_device(Box::new(HostDevice::new(1, 64, 3)), 2).unwrap();
    let mut ended = vec![];
    for k in 0..4usize {
        let inp =
            if k == 0 { input(vec![req("a", 12, 0)], vec![], &[("a", 3)]) } else { input(vec![], vec![cached("a", 3 * k)], &[("a", 3)]) };
        let (b, e) = step(&mut s, inp, &["a"], &[1], true);
        assert!(b.is_empty());
        ended.push(e.iter().map(|o| o.step).collect::<Vec<_>>());
    }
    assert_eq!(ended, vec![vec![], vec![], vec![1], vec![2]], "step N is accounted when step N + 2 ends");
    assert_eq!(s.steps_in_flight(), 2);
    let rest = s.flush().unwrap();
    assert_eq!(rest.iter().map(|o| o.step).collect::<Vec<_>>(), vec![3, 4]);
    assert_eq!(rest[1].completed.len(), 1, "the prompt completes with its last step");
    let e = session(&[1], true).set_device(Box::new(HostDevice::new(1, 64, 2)), 2).unwrap_err();
    assert!(e.message.contains("at least 3 host buffers"), "{e}");
}

#[test]
fn a_small_step_takes_a_small_buffer_while_the_assembler_holds_the_large_ones() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let mut s = session(&[1], true);
    // As the worker sets it up: the assembler's 2 + 1 in flight large buffers, as many of 4 rows.
    s.set_device(Box::new(HostDevice::with_small(1, 64, 3, 4)), 1).unwrap();
    s.set_background(2).unwrap();
    let hold = s.hold_assembler_for_test();
    // Three prompt steps of 9 rows: two go to the held assembler, one is in flight; no large buffer is free.
    for (k, id) in ["a", "b", "c"].into_iter().enumerate() {
        step(&mut s, input(vec![req(id, 9, k as u64)], vec![], &[(id, 9)]), &[id], &[1], true);
    }
    let released = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&released);
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(3));
        flag.store(true, Ordering::SeqCst);
        drop(hold);
    });
    // A step of 3 rows (a decode step's size) takes a small buffer: it does not wait for the assembler.
    step(&mut s, input(vec![req("d", 3, 3)], vec![], &[("d", 3)]), &["d"], &[1], true);
    assert!(!released.load(Ordering::SeqCst), "the small step waited for the assembler to give back a large buffer");
    release.join().unwrap();
    let mut done: Vec<Sample> = s.flush().unwrap().into_iter().flat_map(|o| o.completed).collect();
    done.extend(s.take_ready(true).unwrap());
    done.sort_by_key(|x| x.key.to_string());
    let got: Vec<(String, usize)> = done.iter().map(|x| (x.key.to_string(), x.rows)).collect();
    let want = [("sample 0", 9), ("sample 1", 9), ("sample 2", 9), ("sample 3", 3)];
    assert_eq!(got, want.map(|(k, n)| (k.to_string(), n)));
}
