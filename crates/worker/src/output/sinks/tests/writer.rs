use super::*;
use crate::output::atomic::Durability;
use crate::output::formats::by_name;
use crate::output::ledger::journal;
use crate::output::ledger::record::Identity;
use crate::output::sinks::sink::FileSink;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

fn sample(i: u64) -> Sample {
    Sample {
        key: SampleKey::Index(i),
        req_id: format!("r{i}"),
        token_ids: vec![1, 2, 3],
        data: vec![i as u8; 3 * 2 * 4 * 4],
        rows: 3,
        slots: 2,
        width: 4,
        dtype: DType::F32,
        loss_mask: None,
        scales: None,
    }
}

/// A small capture's identity (also the staging tests').
pub(crate) fn identity() -> Identity {
    Identity {
        format: "hscapture".into(),
        model: "m".into(),
        layer_ids: vec![1, 2],
        convention: "after".into(),
        dtype: "float32".into(),
        hidden_size: 4,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

fn writer(root: &std::path::Path, threads: usize, queue: usize) -> Writer {
    let sink = Arc::new(FileSink::open(root, by_name("hscapture", None).unwrap(), identity(), Durability::Rename).unwrap());
    Writer::start(sink, WriterConfig { threads, queue, pool: None, keep_records: true }, Failure::new()).unwrap()
}

#[test]
fn writes_every_sample_once() {
    let d = tempfile::tempdir().unwrap();
    let mut w = writer(d.path(), 3, 2);
    for i in 0..10 {
        w.submit(sample(i)).unwrap();
    }
    w.drain().unwrap();
    let mut recs = w.take_records();
    assert_eq!(recs.len(), 10, "drain waits for every submitted sample");
    for i in 10..20 {
        w.submit(sample(i)).unwrap();
    }
    recs.extend(w.finish().unwrap());
    recs.sort_by_key(|r| r.index);
    assert_eq!(recs.len(), 20);
    assert_eq!(recs[7].file, "hidden_states/hs_7.safetensors");
    let names = std::fs::read_dir(d.path().join("hidden_states")).unwrap().count();
    assert_eq!(names, 20, "exactly the finished files, no partial ones");
    // The journal holds the capture's identity, then one whole line per finished file, equal to its record.
    let mut j = journal::read(d.path()).unwrap();
    assert_eq!(j.identity, Some(identity()));
    assert!(j.damaged.is_empty());
    j.records.sort_by_key(|r| r.index);
    assert_eq!(j.records, recs);
}

#[test]
fn a_failed_write_is_reported() {
    let d = tempfile::tempdir().unwrap();
    let mut w = writer(d.path(), 1, 1);
    let mut bad = sample(1);
    bad.rows = 5; // does not match its data
    w.submit(bad).unwrap();
    let e = w.finish().unwrap_err();
    assert_eq!(e.kind, crate::ErrorKind::ShapeContract);
    assert!(journal::read(d.path()).unwrap().records.is_empty(), "a failed sample never reaches the journal");
}

#[test]
fn a_submitter_on_another_thread_counts_for_drain_and_finish() {
    let d = tempfile::tempdir().unwrap();
    let mut w = writer(d.path(), 2, 1);
    let sub = w.submitter().unwrap();
    let t = std::thread::spawn(move || {
        for i in 0..6 {
            sub.submit(sample(i)).unwrap(); // a queue of 1: blocks until the writer catches up
        }
        // `sub` is dropped here, which lets the writer's threads stop at finish.
    });
    t.join().unwrap();
    w.drain().unwrap();
    assert_eq!(w.take_records().len(), 6, "drain waits for what the submitter queued");
    w.submit(sample(6)).unwrap();
    assert_eq!(w.finish().unwrap().len(), 1);
    assert!(w.submitter().is_none(), "a finished writer hands out no submitter");
}

#[test]
fn try_submit_gives_a_sample_back_when_the_queue_is_full_and_loses_nothing() {
    let d = tempfile::tempdir().unwrap();
    let mut w = writer(d.path(), 1, 1);
    let sub = w.submitter().unwrap();
    let mut given_back = 0;
    for i in 0..200 {
        if let Some(back) = sub.try_submit(sample(i)).unwrap() {
            assert_eq!(back.key, SampleKey::Index(i), "the same sample comes back");
            given_back += 1;
            sub.submit(back).unwrap();
        }
    }
    drop(sub);
    w.drain().unwrap(); // returns only if every count of a given-back sample was taken back
    let mut recs = w.take_records();
    recs.sort_by_key(|r| r.index);
    assert_eq!(
        recs.iter().map(|r| r.index).collect::<Vec<_>>(),
        (0..200).map(Some).collect::<Vec<Option<u64>>>(),
        "each written once ({given_back} given back)"
    );
    w.finish().unwrap();
}

/// Stores nothing: records only.
struct Counting;

impl crate::output::sinks::sink::Sink for Counting {
    fn put(&self, s: &Sample) -> Result<SampleRecord, NotStored> {
        let SampleKey::Index(i) = s.key else { unreachable!() };
        Ok(SampleRecord { index: Some(i), request_id: None, file: String::new(), length: s.rows, checksum: String::new(), bytes: 0 })
    }
}

#[test]
fn records_nobody_takes_stay_bounded_and_the_drop_is_counted() {
    // A long-lived server with a capture directory: no driver ever takes the records (its journal has them all).
    let mut w =
        Writer::start(Arc::new(Counting), WriterConfig { threads: 1, queue: 64, pool: None, keep_records: true }, Failure::new()).unwrap(); // one thread: records in submission order
    let n = UNTAKEN_RECORDS as u64 + 10;
    for i in 0..n {
        w.submit(sample(i)).unwrap();
    }
    w.drain().unwrap();
    let dropped = w.take_dropped();
    let recs = w.take_records();
    assert_eq!(dropped, UNTAKEN_RECORDS / 2);
    assert_eq!(recs.len() + dropped, n as usize, "every record is either kept or counted as dropped");
    assert!(recs.len() <= UNTAKEN_RECORDS);
    assert_eq!(w.take_dropped(), 0, "counted once");
    assert_eq!(recs.iter().filter_map(|r| r.index).min(), Some((UNTAKEN_RECORDS / 2) as u64), "the oldest go");
    w.finish().unwrap();
}

/// Fails the odd samples for their requests alone (a server's per-request files on a full disk).
struct OddsFailAlone;

impl crate::output::sinks::sink::Sink for OddsFailAlone {
    fn put(&self, s: &Sample) -> Result<SampleRecord, NotStored> {
        let SampleKey::Index(i) = s.key else { unreachable!() };
        if i % 2 == 1 {
            return Err(NotStored::Request(crate::core_err!(Output, "no space left for r{i}")));
        }
        Ok(SampleRecord { index: Some(i), request_id: None, file: String::new(), length: s.rows, checksum: String::new(), bytes: 0 })
    }
}

#[test]
fn a_sample_that_fails_its_request_alone_leaves_the_writer_and_the_capture_running() {
    let failure = Failure::new();
    let mut w =
        Writer::start(Arc::new(OddsFailAlone), WriterConfig { threads: 2, queue: 2, pool: None, keep_records: true }, failure.clone())
            .unwrap();
    for i in 0..10 {
        w.submit(sample(i)).unwrap();
    }
    w.drain().unwrap();
    let mut written: Vec<Option<u64>> = w.take_records().iter().map(|r| r.index).collect();
    written.sort();
    assert_eq!(written, [0, 2, 4, 6, 8].map(Some), "every other sample is written");
    assert!(!failure.is_set(), "no capture-wide failure");
    assert_eq!(w.failed_requests(), 5);
    let note = w.take_failed_note(false).expect("the first failures are reported at once");
    assert!(note.contains("no space left for r") && note.contains("(5 in all)") && note.contains("4 more"), "{note}");
    assert_eq!(w.take_failed_note(true), None, "nothing new to report");
    w.submit(sample(11)).unwrap();
    w.submit(sample(12)).unwrap();
    w.drain().unwrap();
    assert_eq!(w.take_failed_note(false), None, "the next line waits for the interval");
    let last = w.take_failed_note(true).expect("the last word reports what is left");
    assert!(last.contains("\"r11\"") && last.contains("(6 in all)"), "{last}");
    assert_eq!(w.finish().unwrap().len(), 1, "sample 12's record");
}
