use super::*;
use crate::output::manifest::FORMAT;
use crate::attribution::plan::SampleKey;
use crate::output::safetensors::write_sample_file;
use crate::output::sample::{content_checksum, Sample};
use std::collections::HashMap;

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
    };
    std::fs::create_dir_all(root.join("hidden_states")).unwrap();
    let file = format!("hidden_states/hs_{i}.safetensors");
    let bytes = write_sample_file(&root.join(&file), &s, &HashMap::new(), false).unwrap();
    SampleRecord { index: Some(i), request_id: None, file, length: 2, checksum: content_checksum(&s.data), bytes }
}

fn manifest(root: &Path, samples: Vec<SampleRecord>) {
    let mut m = Manifest {
        format: FORMAT.into(),
        model: "m".into(),
        layer_ids: vec![3],
        convention: "after".into(),
        dtype: "float32".into(),
        hidden_size: 2,
        num_hidden_layers: 4,
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
fn finished_files_are_found_without_a_manifest() {
    let d = tempfile::tempdir().unwrap();
    let a = write(d.path(), 4, &[1.0, 2.0, 3.0, 4.0]);
    std::fs::write(d.path().join("hidden_states/hs_5.safetensors"), b"garbage").unwrap();
    let (found, skipped) = scan_finished(d.path()).unwrap();
    assert_eq!(found.keys().copied().collect::<Vec<_>>(), vec![4]);
    assert_eq!(found[&4].0, a);
    assert_eq!(found[&4].1, vec![1, 2]);
    assert_eq!(skipped.len(), 1);
    assert_eq!(index_of("hs_12.safetensors"), Some(12));
    assert_eq!(index_of("hs_req-x.safetensors"), None);
}
