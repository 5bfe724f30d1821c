//! fp8 on the device: a quantizing device path (the stand-in runs the CPU twin where the CUDA path runs
//! `fp8.cu`) assembles the same samples as the host path quantized at encode time — the same files.

use super::tests::{chunked_run, input, req, session, HostDevice};
use crate::output::formats::by_name;
use crate::output::ledger::record::Identity;

fn identity() -> Identity {
    Identity {
        format: "fp8".into(),
        model: "m".into(),
        layer_ids: vec![1, 5],
        convention: "after".into(),
        dtype: "float8_e4m3fn".into(),
        hidden_size: 4,
        num_hidden_layers: 8,
        layer_output: "sum".into(),
    }
}

#[test]
fn device_quantized_samples_make_the_same_fp8_files_as_the_host_path() {
    let (want, want_sums) = chunked_run(&mut session(&[5, 1], true), 12, false);
    let fp8 = by_name("fp8", None).unwrap();
    let other = by_name("hscapture", None).unwrap();
    for background in [false, true] {
        let mut dev = session(&[5, 1], true);
        if background {
            dev.set_background(2).unwrap();
        }
        dev.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), 1).unwrap();
        let (got, sums) = chunked_run(&mut dev, 12, true);
        assert_eq!((got.len(), &sums), (want.len(), &want_sums), "the same samples and step checksums (of the rows)");
        for (h, d) in want.iter().zip(&got) {
            assert_eq!((&h.key, h.shape(), &h.token_ids), (&d.key, d.shape(), &d.token_ids));
            assert!(h.scales.is_none() && d.scales.as_ref().is_some_and(|s| s.len() == d.rows), "codes and a scale per row");
            assert_eq!(d.data.len(), d.rows * 2 * 4, "one byte per value");
            let twin = crate::output::formats::fp8::quantize(h).unwrap();
            assert_eq!((&twin.codes, &twin.scales), (&d.data, d.scales.as_ref().unwrap()), "{}", h.key);
            assert_eq!(fp8.encode(h, &identity()).unwrap().concat(), fp8.encode(d, &identity()).unwrap().concat());
            assert!(other.encode(d, &identity()).err().is_some_and(|e| e.message.contains("fp8 codes")), "codes are not states");
        }
    }
}

#[test]
fn a_quantizing_device_needs_every_slot_on_the_assembling_rank() {
    let mut verifier = session(&[5, 1], false);
    let e = verifier.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), 1).unwrap_err();
    assert!(e.message.contains("assembling rank"), "{}", e.message);
    let mut s = session(&[5, 1], true);
    s.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), 1).unwrap();
    assert!(s.set_absent_slots(&[1]).unwrap_err().message.contains("quantizes to fp8"));
    // A host tensor cannot join a step the device quantizes.
    let v = vec![0f32; 2 * 4];
    s.begin_step(input(vec![req("a", 2, 0)], vec![], &[("a", 2)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    // SAFETY: `v` is live for the call and not written meanwhile.
    let e = unsafe { s.capture(0, None, &super::tests::desc(&v, 2), None, 0) }.unwrap_err();
    assert!(e.message.contains("host tensor"), "{}", e.message);
}

/// Keeps the request ids of the samples it is given, as the writer's sink.
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<(String, bool)>>);

impl crate::output::sinks::sink::Sink for Seen {
    fn put(&self, s: &crate::sample::Sample) -> Result<crate::output::ledger::record::SampleRecord, crate::output::sinks::sink::NotStored> {
        self.0.lock().unwrap().push((s.req_id.clone(), s.scales.is_some()));
        let rec = crate::output::ledger::record::SampleRecord {
            index: None,
            request_id: Some(s.req_id.clone()),
            file: String::new(),
            length: s.rows,
            checksum: String::new(),
            bytes: 0,
        };
        Ok(rec)
    }
}

#[test]
fn a_quantizing_device_keeps_the_writer_the_assembler_hands_samples_to() {
    // The wiring order: background assembly with the writer as its sink, then the device. A KV-connector server's
    // last step before idling is collected by the empty step that reports its requests finished; nothing calls the
    // session after that, so the assembler thread itself must hand the samples to the writer (their clients wait
    // for the files' locks).
    use crate::output::sinks::writer::{Writer, WriterConfig};
    use std::sync::Arc;
    let mut s = session(&[5, 1], true);
    s.set_background(2).unwrap();
    let seen = Arc::new(Seen::default());
    let wcfg = WriterConfig { threads: 1, queue: 4, pool: Some(s.pool()), keep_records: false };
    let mut writer = Writer::start(seen.clone(), wcfg, s.failure().clone()).unwrap();
    // A gate whose steps are all agreed on (one rank): samples pass as the assembler thread hands them over.
    let gate = Arc::new(crate::output::gate::Gate::new(crate::output::gate::Onward::Writer(writer.submitter().unwrap())));
    gate.release(u64::MAX).unwrap();
    s.set_sink(Some(Arc::clone(&gate) as Arc<dyn crate::sample::Handoff>)).unwrap();
    s.set_device(Box::new(HostDevice::quantizing(2, 64, 3)), 1).unwrap();
    let total = 3;
    s.begin_step(input(vec![req("a", 3, 0)], vec![], &[("a", 3)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    for (slot, layer) in [1usize, 5].into_iter().enumerate() {
        let (h, r) = (super::tests::layer_output(layer, total, 0.0), super::tests::layer_output(layer, total, 0.5));
        let cuda = |d: crate::capture::tensor::TensorDesc| crate::capture::tensor::TensorDesc {
            device: crate::capture::tensor::Device::Cuda(0),
            ..d
        };
        // SAFETY: `h` and `r` are live for the call; the stand-in device copies them at once.
        unsafe { s.capture(slot, None, &cuda(super::tests::desc(&h, total)), Some(&cuda(super::tests::desc(&r, total))), 0).unwrap() };
    }
    assert!(s.end_step().unwrap().is_empty(), "overlap: the step stays in flight");
    s.begin_step(crate::attribution::plan::StepInput { finished: vec!["a".into()], ..Default::default() }).unwrap();
    s.end_step().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while seen.0.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(*seen.0.lock().unwrap(), [("a".to_string(), true)], "the fp8 sample reached the writer with no later call");
    s.set_sink(None).unwrap();
    gate.close();
    writer.finish().unwrap();
}

/// One request capturing its generated tokens (prompt 3, two decode steps, then finished), on `s`; returns its sample.
fn grown(s: &mut crate::capture::session::Session, device: bool) -> crate::sample::Sample {
    use crate::attribution::plan::{CachedRequest, StepInput};
    use crate::capture::tensor::{Device, TensorDesc};
    let on = |d: TensorDesc| if device { TensorDesc { device: Device::Cuda(0), ..d } } else { d };
    let run = |s: &mut crate::capture::session::Session, inp: StepInput, base: f32| {
        let total = inp.total_tokens;
        let mut outs = s.begin_step(inp).unwrap();
        s.plan(&["a".to_string()]).unwrap();
        for (slot, layer) in [1usize, 5].into_iter().enumerate() {
            let (h, r) = (super::tests::layer_output(layer, total, base), super::tests::layer_output(layer, total, base + 0.5));
            // SAFETY: `h` and `r` are live for the call; the stand-in device copies them at once.
            unsafe { s.capture(slot, None, &on(super::tests::desc(&h, total)), Some(&on(super::tests::desc(&r, total))), 0).unwrap() };
        }
        outs.extend(s.end_step().unwrap());
        outs
    };
    let mut first = input(vec![req("a", 3, 0)], vec![], &[("a", 3)]);
    first.with_outputs = vec!["a".into()];
    let mut outs = run(s, first, 0.0);
    for pos in [3usize, 4] {
        let cached = CachedRequest { req_id: "a".into(), num_computed_tokens: pos, resumed: false };
        outs.extend(run(s, input(vec![], vec![cached], &[("a", 1)]), pos as f32 * 7.0));
    }
    let fin = StepInput { finished: vec!["a".into()], outputs: vec![("a".into(), vec![0, 1, 2, 70, 71])], ..Default::default() };
    outs.extend(s.begin_step(fin).unwrap());
    outs.extend(s.end_step().unwrap());
    outs.extend(s.flush().unwrap());
    let mut done: Vec<_> = outs.into_iter().flat_map(|o| o.completed).collect();
    assert_eq!(done.len(), 1, "one sample");
    done.pop().unwrap()
}

#[test]
fn a_growing_sample_is_quantized_token_by_token_on_the_device() {
    // Before, a request capturing its generated tokens on an fp8 server quantizing on the GPU stopped the capture
    // (a Config error at begin_step): its scales sat after the prompt's rows. Each token's scale now sits beside its
    // codes, so decode rows grow the sample by whole tokens.
    let host = grown(&mut session(&[5, 1], true), false);
    let mut s = session(&[5, 1], true);
    s.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), 1).unwrap();
    let dev = grown(&mut s, true);
    assert_eq!((host.rows, dev.rows, &dev.token_ids), (5, 5, &vec![0, 1, 2, 70, 71]));
    let twin = crate::output::formats::fp8::quantize(&host).unwrap();
    assert_eq!(dev.scales.as_ref(), Some(&twin.scales), "a scale per token, as the writer's quantization gives");
    assert_eq!(dev.data, twin.codes, "the codes of every token, prompt and decode rows alike");
    let fp8 = by_name("fp8", None).unwrap();
    assert_eq!(fp8.encode(&host, &identity()).unwrap().concat(), fp8.encode(&dev, &identity()).unwrap().concat());
}
