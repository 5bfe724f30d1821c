use super::*;

fn rec(i: u64) -> SampleRecord {
    SampleRecord {
        index: Some(i),
        request_id: None,
        file: format!("hidden_states/hs_{i}.safetensors"),
        length: 3,
        checksum: "xxh3:0".into(),
        bytes: 9,
    }
}

#[test]
fn round_trip_sorted() {
    let d = tempfile::tempdir().unwrap();
    let mut m = Manifest {
        format: FORMAT.into(),
        sample_format: "hscapture".into(),
        model: "m".into(),
        layer_ids: vec![1, 3],
        convention: "after".into(),
        dtype: "float32".into(),
        model_dtype: None,
        hidden_size: 4,
        num_hidden_layers: 4,
        tensor_parallel_size: 2,
        created_by: BTreeMap::new(),
        samples: vec![rec(10), rec(2)],
        skipped: vec![Skipped { index: 5, why: "2 NaN/Inf values".into() }],
    };
    let p = d.path().join("manifest.json");
    m.write(&p).unwrap();
    let back = Manifest::read(&p).unwrap();
    assert_eq!(back.samples.iter().map(|s| s.index).collect::<Vec<_>>(), vec![Some(2), Some(10)]);
    assert_eq!(back.skipped, m.skipped, "skipped samples survive a round trip");
    m.skipped.push(Skipped { index: 10, why: "x".into() });
    assert!(m.write(&p).unwrap_err().message.contains("both as written and as skipped"));
    m.skipped.pop();
    std::fs::write(&p, "{ not json").unwrap();
    assert!(Manifest::read(&p).unwrap_err().message.contains("corrupted"));
    m.samples.push(rec(2));
    assert!(m.write(&p).unwrap_err().message.contains("twice"));
}
