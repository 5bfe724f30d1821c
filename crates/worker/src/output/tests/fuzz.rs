//! The readers against damaged files: bit flips anywhere (header, token ids, states), truncation and swapped
//! files. What must hold: no panic; `verify` never reports a damaged file as good, and a resume never keeps
//! one; a file whose bytes are unchanged is always good.

use proptest::prelude::*;

use crate::output::atomic::Durability;
use crate::output::formats::{by_name, decode_file};
use crate::output::ledger::manifest::{Manifest, FORMAT};
use crate::output::ledger::record::{Identity, SampleRecord};
use crate::output::readers::resume::plan;
use crate::output::readers::verify::verify_dir;
use crate::output::sinks::sink::{FileSink, Sink};
use crate::sample::Sample;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

fn identity(format: &str) -> Identity {
    Identity {
        format: format.into(),
        model: "m".into(),
        layer_ids: vec![1, 2],
        convention: "after".into(),
        dtype: "bfloat16".into(),
        hidden_size: 8,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

fn sample(i: u64, rows: usize) -> Sample {
    let data = (0..rows * 2 * 8).flat_map(|k| half::bf16::from_f32(((k as f32) * 0.37 + i as f32).sin()).to_le_bytes()).collect();
    Sample {
        key: SampleKey::Index(i),
        req_id: format!("r{i}"),
        token_ids: (0..rows as i64).map(|t| t * 31 + i as i64).collect(),
        data,
        rows,
        slots: 2,
        width: 8,
        dtype: DType::BF16,
        loss_mask: None,
        scales: None,
    }
}

/// A finished capture of two samples in `format`: its root and the two records.
fn capture(format: &str, compress: Option<i32>) -> (tempfile::TempDir, Vec<SampleRecord>) {
    let d = tempfile::tempdir().unwrap();
    let sink = FileSink::open(d.path(), by_name(format, compress).unwrap(), identity(format), Durability::Rename).unwrap();
    let recs = vec![sink.put(&sample(0, 5)).unwrap(), sink.put(&sample(1, 3)).unwrap()];
    drop(sink);
    let id = identity(format);
    let mut m = Manifest {
        format: FORMAT.into(),
        sample_format: id.format.clone(),
        model: id.model.clone(),
        layer_ids: id.layer_ids.clone(),
        convention: id.convention.clone(),
        dtype: id.dtype.clone(),
        model_dtype: None,
        hidden_size: id.hidden_size,
        num_hidden_layers: id.num_hidden_layers,
        layer_output: id.layer_output.clone(),
        tensor_parallel_size: 1,
        created_by: Default::default(),
        samples: recs.clone(),
        skipped: vec![],
    };
    m.write(&d.path().join("manifest.json")).unwrap();
    (d, recs)
}

#[derive(Clone, Debug)]
enum Damage {
    Flip { at: usize, bit: u8 },
    Truncate { keep: usize },
    Swap,
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Damage::Flip { at, bit }),
        any::<usize>().prop_map(|keep| Damage::Truncate { keep }),
        Just(Damage::Swap),
    ]
}

fn apply(root: &std::path::Path, recs: &[SampleRecord], d: &Damage) {
    let p = root.join(&recs[0].file);
    let mut b = std::fs::read(&p).unwrap();
    match *d {
        Damage::Flip { at, bit } => {
            let n = b.len();
            b[at % n] ^= 1 << bit;
            std::fs::write(&p, b).unwrap();
        }
        Damage::Truncate { keep } => {
            let n = b.len();
            b.truncate(keep % n);
            std::fs::write(&p, b).unwrap();
        }
        Damage::Swap => {
            let q = root.join(&recs[1].file);
            let other = std::fs::read(&q).unwrap();
            std::fs::write(&q, &b).unwrap();
            std::fs::write(&p, other).unwrap();
        }
    }
}

fn cases() -> u32 {
    std::env::var("HSCAPTURE_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn damaged_files_are_never_good(format in prop_oneof![Just("hscapture"), Just("legacy")], compressed in any::<bool>(), d in damage()) {
        let compress = if compressed && format == "hscapture" { Some(1) } else { None };
        let (dir, recs) = capture(format, compress);
        let root = dir.path();
        let before = std::fs::read(root.join(&recs[0].file)).unwrap();
        apply(root, &recs, &d);
        let after = std::fs::read(root.join(&recs[0].file)).unwrap();
        let changed = before != after;
        // The reader: an error or a decoded sample, never a panic.
        let _ = decode_file(&root.join(&recs[0].file), &after);
        let rep = verify_dir(root).unwrap();
        let names_sample_0 = rep.problems.iter().any(|p| p.starts_with("sample 0"));
        prop_assert_eq!(names_sample_0, changed, "verify: {:?} for {:?}", rep.problems, d);
        let kept = plan(root, &identity(format)).unwrap();
        prop_assert_eq!(kept.kept.contains_key(&0), !changed, "resume kept a damaged file: {:?}", d);
    }
}
