use super::*;
use crate::output::atomic::Durability;
use crate::output::ledger::record::Identity;
use crate::output::sinks::sink::{FileSink, Sink};
use crate::sample::Sample;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

fn identity(layers: Vec<usize>) -> Identity {
    Identity {
        format: "hscapture".into(),
        model: "m".into(),
        layer_ids: layers.clone(),
        convention: "after".into(),
        dtype: "float32".into(),
        hidden_size: 2,
        num_hidden_layers: 4,
        layer_output: "sum".into(),
    }
}

fn sample(i: u64, slots: usize) -> Sample {
    Sample {
        key: SampleKey::Index(i),
        req_id: format!("r{i}"),
        token_ids: vec![i as i64, 9],
        data: (0..2 * slots * 2).flat_map(|v| (v as f32 + i as f32).to_le_bytes()).collect(),
        rows: 2,
        slots,
        width: 2,
        dtype: DType::F32,
        loss_mask: None,
        scales: None,
    }
}

/// A capture of `id` in `root` holding `samples` (one slot each), its writer gone.
fn captured(root: &std::path::Path, id: &Identity, samples: &[u64]) {
    let sink = FileSink::open(root, by_name("hscapture", None).unwrap(), id.clone(), Durability::Rename).unwrap();
    for &i in samples {
        sink.put(&sample(i, 1)).unwrap();
    }
}

#[test]
fn a_resume_keeps_only_files_its_ledger_vouches_for() {
    let d = tempfile::tempdir().unwrap();
    let root = d.path();
    let id = identity(vec![3]);
    captured(root, &id, &[0, 1, 2, 3]);
    // Sample 1: one bit flipped in its states; sample 2: written but its journal line lost.
    let p1 = root.join("hidden_states/hs_1.safetensors");
    let mut b = std::fs::read(&p1).unwrap();
    let n = b.len();
    b[n - 3] ^= 0x40;
    std::fs::write(&p1, b).unwrap();
    let journal = std::fs::read_to_string(root.join(journal::FILE)).unwrap();
    let kept_lines: Vec<&str> = journal.lines().filter(|l| !l.contains("hs_2.")).collect();
    std::fs::write(root.join(journal::FILE), kept_lines.join("\n") + "\n").unwrap();
    let plan = plan(root, &id).unwrap();
    assert_eq!(plan.kept.keys().copied().collect::<Vec<_>>(), vec![0, 3]);
    assert_eq!(plan.kept[&3].token_ids, vec![3, 9]);
    let why = plan.recapture.join("\n");
    assert!(why.contains("sample 1") && why.contains("the file changed after it was written"), "{why}");
    assert!(why.contains("sample 2") && why.contains("no record of it was written"), "{why}");
}

#[test]
fn a_resume_with_other_settings_is_refused_naming_what_differs() {
    let d = tempfile::tempdir().unwrap();
    let id = identity(vec![3]);
    captured(d.path(), &id, &[0]);
    let e = plan(d.path(), &identity(vec![1, 3])).unwrap_err();
    assert_eq!(e.kind, crate::ErrorKind::Config);
    assert!(e.message.contains("layer ids: [3] vs [1, 3]"), "{e}");
    // A writer of other settings refuses the journal too, before writing anything.
    let other = FileSink::open(d.path(), by_name("hscapture", None).unwrap(), identity(vec![1, 3]), Durability::Rename);
    assert!(other.is_err());
    // The stored dtype may be left to vLLM: "auto" is checked by the workers instead.
    let auto = Identity { dtype: "auto".into(), ..id };
    assert_eq!(plan(d.path(), &auto).unwrap().kept.len(), 1);
}

#[test]
fn a_capture_from_before_the_rule_was_recorded_resumes_as_summed_and_only_so() {
    let d = tempfile::tempdir().unwrap();
    let id = identity(vec![3]);
    captured(d.path(), &id, &[0]);
    // The journal as an earlier hscapture wrote it: no layer_output in its identity line.
    let path = d.path().join(journal::FILE);
    let text = std::fs::read_to_string(&path).unwrap();
    let old = text.replacen(",\"layer_output\":\"sum\"", "", 1);
    assert_ne!(old, text, "the identity line carried the rule");
    std::fs::write(&path, old).unwrap();
    assert_eq!(plan(d.path(), &id).unwrap().kept.len(), 1, "read as sum, what every earlier capture stored");
    // A driver that has not seen the model leaves the rule to the workers, which refuse the journal if it differs.
    let driver = Identity { layer_output: "auto".into(), ..id.clone() };
    assert_eq!(plan(d.path(), &driver).unwrap().kept.len(), 1);
    let hidden = Identity { layer_output: "hidden".into(), ..id };
    let e = plan(d.path(), &hidden).unwrap_err();
    assert!(e.message.contains("layer output: sum vs hidden"), "{e}");
    let worker = FileSink::open(d.path(), by_name("hscapture", None).unwrap(), hidden, Durability::Rename);
    assert!(worker.err().unwrap().message.contains("layer output: sum vs hidden"));
}

#[test]
fn files_without_any_ledger_are_all_captured_again() {
    let d = tempfile::tempdir().unwrap();
    let id = identity(vec![3]);
    captured(d.path(), &id, &[5]);
    std::fs::remove_file(d.path().join(journal::FILE)).unwrap();
    let plan = plan(d.path(), &id).unwrap();
    assert!(plan.kept.is_empty());
    assert!(plan.recapture.join("\n").contains("sample 5"), "{:?}", plan.recapture);
}
