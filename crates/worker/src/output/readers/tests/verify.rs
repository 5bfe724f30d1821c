use super::*;
use crate::output::atomic::Durability;
use crate::output::ledger::manifest::FORMAT;
use crate::output::ledger::record::Identity;
use crate::output::sinks::sink::{FileSink, Sink};
use crate::sample::Sample;
use crate::sample::SampleKey;

fn identity() -> Identity {
    Identity {
        format: "hscapture".into(),
        model: "m".into(),
        layer_ids: vec![3],
        convention: "after".into(),
        dtype: "float32".into(),
        hidden_size: 2,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

fn write(root: &Path, i: u64, vals: &[f32]) -> SampleRecord {
    let s = Sample {
        key: SampleKey::Index(i),
        req_id: format!("r{i}"),
        token_ids: vec![1, 2],
        data: vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        rows: 2,
        slots: 1,
        width: 2,
        dtype: DType::F32,
        loss_mask: None,
        scales: None,
    };
    let sink = FileSink::open(root, by_name("hscapture", None).unwrap(), identity(), Durability::Rename).unwrap();
    sink.put(&s).unwrap()
}

fn manifest(root: &Path, samples: Vec<SampleRecord>) {
    let id = identity();
    let mut m = Manifest {
        format: FORMAT.into(),
        sample_format: id.format,
        model: id.model,
        layer_ids: id.layer_ids,
        convention: id.convention,
        dtype: id.dtype,
        model_dtype: None,
        hidden_size: id.hidden_size,
        num_hidden_layers: id.num_hidden_layers,
        layer_output: id.layer_output,
        tensor_parallel_size: 1,
        created_by: Default::default(),
        samples,
        skipped: Vec::new(),
    };
    m.write(&root.join("manifest.json")).unwrap();
}

#[test]
fn a_good_directory_verifies_and_damage_is_named() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let a = write(root, 0, &[1.0, 2.0, 3.0, 4.0]);
    let b = write(root, 1, &[1.0, f32::NAN, 3.0, 4.0]);
    manifest(root, vec![a.clone(), b]);
    let rep = verify_dir(root).unwrap();
    assert_eq!(rep.samples, 2);
    assert_eq!(rep.problems, vec!["sample 1: 1 NaN/Inf values".to_string()]);
    // Truncate sample 0, add an orphan and a partial file.
    let p = root.join(&a.file);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 4]).unwrap();
    std::fs::write(root.join("hidden_states/hs_9.safetensors"), b"x").unwrap();
    std::fs::write(root.join("hidden_states/.hs_3.safetensors.partial-1-0"), b"x").unwrap();
    let rep = verify_dir(root).unwrap();
    let all = rep.problems.join("\n");
    assert!(all.contains("sample 0") && all.contains("truncated"), "{all}");
    assert!(all.contains("hs_9.safetensors is not in the manifest"), "{all}");
    assert!(all.contains("leftover partial file"), "{all}");
}

#[test]
fn every_byte_of_a_file_is_covered_by_its_checksum() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let a = write(root, 0, &[1.0, 2.0, 3.0, 4.0]);
    manifest(root, vec![a.clone()]);
    let p = root.join(&a.file);
    let good = std::fs::read(&p).unwrap();
    // A token id's byte (just before the states) and a state's exponent bit: both found.
    for at in [good.len() - 16 - 1, good.len() - 2] {
        let mut b = good.clone();
        b[at] ^= 0x40;
        std::fs::write(&p, &b).unwrap();
        let rep = verify_dir(root).unwrap();
        assert!(rep.problems.iter().any(|x| x.contains("the file changed after it was written")), "byte {at}: {:?}", rep.problems);
    }
}

#[test]
fn a_layer_of_zeros_or_of_one_row_is_named() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let good = write(root, 0, &[1.0, 2.0, 3.0, 4.0]);
    let zeros = write(root, 1, &[0.0; 4]);
    let one_row = write(root, 2, &[1.0, 2.0, 1.0, 2.0]);
    manifest(root, vec![good, zeros, one_row]);
    let rep = verify_dir(root).unwrap();
    assert_eq!(rep.problems.len(), 2, "{:?}", rep.problems);
    assert!(rep.problems[0].starts_with("sample 1: layer id 3 is all zeros over its 2 rows"), "{:?}", rep.problems);
    assert!(rep.problems[1].starts_with("sample 2: layer id 3 is the same row for all 2 tokens"), "{:?}", rep.problems);
}
