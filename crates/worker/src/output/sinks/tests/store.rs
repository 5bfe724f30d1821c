use super::*;
use crate::output::sinks::packed::PackedLayout;
use crate::sample::SampleKey;
use hscapture_kernels::DType;
use std::collections::HashMap;
use std::sync::Mutex;

/// An in-memory store that refuses the keys it is told to.
#[derive(Default)]
struct Memory {
    objects: Mutex<HashMap<String, Vec<u8>>>,
    refuse: Vec<String>,
}

impl ObjectStore for Memory {
    fn put(&self, key: &str, bytes: &[u8]) -> CoreResult<()> {
        if self.refuse.iter().any(|r| key.starts_with(r.as_str())) {
            return Err(core_err!(Output, "Mooncake put_from of {key} returned -200 (no space)"));
        }
        self.objects.lock().unwrap().insert(key.to_string(), bytes.to_vec());
        Ok(())
    }
}

fn sample(req: &str, rows: usize) -> Sample {
    Sample {
        key: SampleKey::Request(req.into()),
        req_id: req.into(),
        token_ids: (0..rows as i64).collect(),
        data: vec![7u8; rows * 2 * 4 * 2],
        rows,
        slots: 2,
        width: 4,
        dtype: DType::BF16,
        loss_mask: None,
        scales: None,
    }
}

#[test]
fn a_sample_is_one_object_under_its_request_s_key() {
    let mem = Arc::new(Memory::default());
    let sink = StoreSink::new(mem.clone());
    let rec = sink.put(&sample("1-a.b", 3)).unwrap();
    assert_eq!(rec.file, "k1-a_b");
    assert_eq!(rec.request_id.as_deref(), Some("1-a.b"));
    let objects = mem.objects.lock().unwrap();
    let object = &objects["k1-a_b"];
    assert_eq!(object.len(), PackedLayout::of(3, 2, 4, DType::BF16).unwrap().total);
    assert_eq!(rec.bytes, object.len() as u64);
}

#[test]
fn a_put_whose_marker_cannot_be_stored_either_fails_the_capture() {
    let mem = Arc::new(Memory { refuse: vec!["r-full".into()], ..Memory::default() });
    let sink = StoreSink::new(mem.clone());
    let NotStored::Capture(e) = sink.put(&sample("r-full", 2)).unwrap_err() else {
        panic!("a store that takes no marker either is unreachable: the capture stops")
    };
    assert!(e.message.contains("not stored") && e.message.contains("-200") && e.message.contains("r-full:error"), "{e}");
    // the marker could not be stored either (the same refusal): the error says why the capture stops
    let objects = mem.objects.lock().unwrap();
    assert!(objects.is_empty());
    assert!(e.message.contains("unreachable"), "{e}");
}

#[test]
fn the_marker_holds_the_reason_as_json() {
    struct DataRefused(Mutex<HashMap<String, Vec<u8>>>);
    impl ObjectStore for DataRefused {
        fn put(&self, key: &str, bytes: &[u8]) -> CoreResult<()> {
            if !key.ends_with(":error") {
                return Err(core_err!(Output, "master unreachable (-900)"));
            }
            self.0.lock().unwrap().insert(key.into(), bytes.to_vec());
            Ok(())
        }
    }
    let store = Arc::new(DataRefused(Mutex::default()));
    let sink = StoreSink::new(store.clone());
    let NotStored::Request(e) = sink.put(&sample("r", 2)).unwrap_err() else {
        panic!("the trainer learns of it from the marker: the request fails alone")
    };
    assert!(e.message.contains("the trainer finds this error under r:error"), "{e}");
    let marker: serde_json::Value = serde_json::from_slice(&store.0.lock().unwrap()["r:error"]).unwrap();
    assert!(marker["error"].as_str().unwrap().contains("-900"));
}
