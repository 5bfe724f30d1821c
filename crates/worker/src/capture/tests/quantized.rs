//! fp8 on the device: a quantizing device path (the stand-in runs the CPU twin where the CUDA path runs
//! `fp8.cu`) assembles the same samples as the host path quantized at encode time — the same files.

use super::tests::{chunked_run, input, req, session, HostDevice};
use crate::output::format::by_name;
use crate::output::record::Identity;

fn identity() -> Identity {
    Identity {
        format: "fp8".into(),
        model: "m".into(),
        layer_ids: vec![1, 5],
        convention: "after".into(),
        dtype: "float8_e4m3fn".into(),
        hidden_size: 4,
        num_hidden_layers: 8,
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
        dev.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), true).unwrap();
        let (got, sums) = chunked_run(&mut dev, 12, true);
        assert_eq!((got.len(), &sums), (want.len(), &want_sums), "the same samples and step checksums (of the rows)");
        for (h, d) in want.iter().zip(&got) {
            assert_eq!((&h.key, h.shape(), &h.token_ids), (&d.key, d.shape(), &d.token_ids));
            assert!(h.scales.is_none() && d.scales.as_ref().is_some_and(|s| s.len() == d.rows), "codes and a scale per row");
            assert_eq!(d.data.len(), d.rows * 2 * 4, "one byte per value");
            let twin = crate::output::fp8::quantize(h).unwrap();
            assert_eq!((&twin.codes, &twin.scales), (&d.data, d.scales.as_ref().unwrap()), "{}", h.key);
            assert_eq!(fp8.encode(h, &identity()).unwrap().concat(), fp8.encode(d, &identity()).unwrap().concat());
            assert!(other.encode(d, &identity()).err().is_some_and(|e| e.message.contains("fp8 codes")), "codes are not states");
        }
    }
}

#[test]
fn a_quantizing_device_needs_every_slot_on_the_assembling_rank() {
    let mut verifier = session(&[5, 1], false);
    let e = verifier.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), true).unwrap_err();
    assert!(e.message.contains("assembling rank"), "{}", e.message);
    let mut s = session(&[5, 1], true);
    s.set_device(Box::new(HostDevice::quantizing(2, 64, 2)), true).unwrap();
    assert!(s.set_absent_slots(&[1]).unwrap_err().message.contains("quantizes to fp8"));
    // A host tensor cannot join a step the device quantizes.
    let v = vec![0f32; 2 * 4];
    s.begin_step(input(vec![req("a", 2, 0)], vec![], &[("a", 2)])).unwrap();
    s.plan(&["a".to_string()]).unwrap();
    // SAFETY: `v` is live for the call and not written meanwhile.
    let e = unsafe { s.capture(0, &super::tests::desc(&v, 2), None, 0) }.unwrap_err();
    assert!(e.message.contains("host tensor"), "{}", e.message);
}
