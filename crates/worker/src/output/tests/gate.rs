//! The release gate: a sample passes only once its step is released, exactly once, whichever thread hands it over.

use std::sync::Arc;

use super::*;
use crate::failure::Failure;
use crate::output::atomic::Durability;
use crate::output::formats::by_name;
use crate::output::ledger::record::Identity;
use crate::output::sinks::sink::FileSink;
use crate::output::sinks::writer::{Writer, WriterConfig};
use crate::sample::SampleKey;
use hscapture_kernels::DType;

fn sample(i: u64) -> Sample {
    Sample {
        key: SampleKey::Index(i),
        req_id: format!("r{i}"),
        token_ids: vec![1, 2],
        data: vec![(i % 250) as u8 + 1; 2 * 4 * 4],
        rows: 2,
        slots: 1,
        width: 4,
        dtype: DType::F32,
        loss_mask: None,
        scales: None,
    }
}

fn keys(samples: &[Sample]) -> Vec<SampleKey> {
    samples.iter().map(|s| s.key.clone()).collect()
}

#[test]
fn a_sample_waits_for_its_steps_release_and_a_released_steps_sample_passes_at_once() {
    let g = Gate::new(Onward::Memory);
    g.submit(3, sample(30)).unwrap();
    g.submit(1, sample(10)).unwrap();
    assert_eq!((g.held(), g.take_kept().len()), (2, 0), "nothing passes before a release");
    g.release(2).unwrap();
    assert_eq!(keys(&g.take_kept()), vec![SampleKey::Index(10)], "only the steps released");
    assert_eq!(g.held(), 1);
    g.submit(2, sample(20)).unwrap();
    assert_eq!(keys(&g.take_kept()), vec![SampleKey::Index(20)], "a step already released passes at once");
    assert_eq!(g.try_submit(1, sample(11)).unwrap(), None, "taken, not given back");
    g.release(1).unwrap(); // an older release does not take back a newer one
    g.submit(2, sample(21)).unwrap();
    assert_eq!(keys(&g.take_kept()), vec![SampleKey::Index(11), SampleKey::Index(21)]);
    g.release(3).unwrap();
    assert_eq!(keys(&g.take_kept()), vec![SampleKey::Index(30)]);
    assert_eq!(g.held(), 0);
}

#[test]
fn closing_drops_what_was_never_agreed_on_and_refuses_a_released_sample_after() {
    let g = Gate::new(Onward::Memory);
    g.submit(5, sample(50)).unwrap();
    g.release(4).unwrap();
    g.close();
    assert_eq!(g.held(), 0, "a step never released is never stored");
    let e = g.submit(4, sample(40)).unwrap_err();
    assert!(e.message.contains("sample 40: released after the output was closed"), "{e}");
    assert!(g.take_kept().is_empty());
}

#[test]
fn a_discarding_gate_keeps_nothing() {
    let g = Gate::new(Onward::Discard);
    g.submit(1, sample(1)).unwrap();
    g.release(1).unwrap();
    g.submit(1, sample(2)).unwrap();
    assert_eq!((g.held(), g.take_kept().len()), (0, 0));
}

#[test]
fn samples_handed_over_while_steps_are_released_pass_exactly_once() {
    // The assembler thread hands samples over while the worker's thread releases steps: none lost, none twice.
    let g = Arc::new(Gate::new(Onward::Memory));
    let n = 2_000u64;
    let giver = {
        let g = Arc::clone(&g);
        std::thread::spawn(move || (0..n).for_each(|i| g.submit(i / 4, sample(i)).unwrap()))
    };
    for step in 0..n / 4 {
        g.release(step).unwrap();
    }
    giver.join().unwrap();
    g.release(n).unwrap();
    let mut got: Vec<u64> = g.take_kept().iter().map(|s| if let SampleKey::Index(i) = s.key { i } else { u64::MAX }).collect();
    got.sort_unstable();
    assert_eq!(got, (0..n).collect::<Vec<_>>());
}

#[test]
fn released_samples_reach_the_writer_and_it_finishes_once_the_gate_is_closed() {
    let d = tempfile::tempdir().unwrap();
    let identity = Identity {
        format: "hscapture".into(),
        model: "m".into(),
        layer_ids: vec![1],
        convention: "after".into(),
        dtype: "float32".into(),
        hidden_size: 4,
        num_hidden_layers: 2,
        layer_output: "sum".into(),
    };
    let sink = Arc::new(FileSink::open(d.path(), by_name("hscapture", None).unwrap(), identity, Durability::Rename).unwrap());
    let cfg = WriterConfig { threads: 2, queue: 1, pool: None, keep_records: true };
    let mut w = Writer::start(sink, cfg, Failure::new()).unwrap();
    let g = Gate::new(Onward::Writer(w.submitter().unwrap()));
    (0..6).for_each(|i| g.submit(i % 3, sample(i)).unwrap());
    g.release(1).unwrap(); // steps 0 and 1: four samples through a queue of one (the releasing thread waits)
    w.drain().unwrap();
    let mut written: Vec<u64> = w.take_records().iter().filter_map(|r| r.index).collect();
    written.sort_unstable();
    assert_eq!(written, vec![0, 1, 3, 4]);
    g.close(); // step 2 was never agreed on: its samples are not written, and the writer can finish
    assert!(w.finish().unwrap().is_empty());
    assert_eq!(std::fs::read_dir(d.path().join("hidden_states")).unwrap().count(), 4);
}
