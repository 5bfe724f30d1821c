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
        layer_output: "sum".into(),
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

#[test]
fn a_finished_capture_s_manifest_takes_its_facts_from_the_identity() {
    let id = Identity {
        format: "fp8".into(),
        model: "journal's name".into(),
        layer_ids: vec![2, 5],
        convention: "before".into(),
        dtype: "float8_e4m3fn".into(),
        hidden_size: 8,
        num_hidden_layers: 6,
        layer_output: "hidden".into(),
    };
    let by = BTreeMap::from([("hscapture".to_string(), "0.1.0".to_string())]);
    let m = Manifest::of(&id, "/models/x".into(), Some("bfloat16".into()), 2, by.clone(), vec![rec(1)], vec![]).unwrap();
    assert_eq!((m.format.as_str(), m.sample_format.as_str(), m.model.as_str()), (FORMAT, "fp8", "/models/x"));
    assert_eq!((m.layer_ids.clone(), m.convention.as_str(), m.dtype.as_str()), (vec![2, 5], "before", "float8_e4m3fn"));
    assert_eq!((m.hidden_size, m.num_hidden_layers, m.tensor_parallel_size), (8, 6, 2));
    assert_eq!(m.identity().layer_output, "hidden", "the layer-output rule included");
    let read = Manifest::from_json(&serde_json::to_string(&m).unwrap().replace(",\"layer_output\":\"hidden\"", "")).unwrap();
    assert_eq!(read.layer_output, "sum", "a manifest from before the rule was recorded: what was stored then");
    let twice = Manifest::of(&id, "m".into(), None, 1, by, vec![rec(1), rec(1)], vec![]);
    assert!(twice.unwrap_err().message.contains("twice"), "checked as a read manifest is");
}
