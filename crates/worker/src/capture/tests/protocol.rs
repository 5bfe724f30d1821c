use std::sync::Mutex;

use super::*;
use crate::attribution::layers::{Convention, LayerPlan};
use crate::attribution::plan::NewRequest;
use crate::capture::tensor::Device;
use crate::error::ErrorKind;
use hscapture_kernels::DType;

const H: usize = 4;

fn protocol(assemble: bool) -> StepProtocol {
    StepProtocol::new(SessionConfig {
        layers: LayerPlan::new(&[1, 5], Convention::After, 8).unwrap(),
        hidden_size: H,
        model_dtype: DType::F32,
        out_dtype: DType::F32,
        assemble,
    })
}

fn step(reqs: &[(&str, usize, usize)], with_outputs: &[&str]) -> StepInput {
    StepInput {
        new_requests: reqs
            .iter()
            .enumerate()
            .map(|(i, &(id, len, _))| NewRequest {
                req_id: id.into(),
                prompt_token_ids: (0..len as i64).collect(),
                num_computed_tokens: 0,
                sample: Some(i as u64),
                loss_mask: None,
                max_tokens: None,
            })
            .collect(),
        num_scheduled: reqs.iter().map(|&(id, _, n)| (id.to_string(), n)).collect(),
        total_tokens: reqs.iter().map(|r| r.2).sum(),
        with_outputs: with_outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn tensor(v: &[f32], rows: usize, width: usize) -> TensorDesc {
    TensorDesc {
        ptr: v.as_ptr() as usize,
        shape: vec![rows, width],
        strides: vec![width as i64, 1],
        dtype: DType::F32,
        device: Device::Cpu,
    }
}

#[test]
fn a_capture_is_admitted_once_per_slot_and_only_inside_a_planned_step() {
    let mut p = protocol(true);
    let v = vec![0f32; 3 * H];
    let outside = p.admit(0, &tensor(&v, 3, H), None).err().unwrap();
    assert_eq!(outside.kind, ErrorKind::Attribution, "{outside}");
    p.begin(step(&[("a", 3, 3)], &[])).unwrap();
    p.plan(&["a".into()]).unwrap();
    let a = p.admit(1, &tensor(&v, 3, H), None).unwrap();
    assert_eq!((a.name.as_str(), a.rows, a.runs.len()), ("layer id 5 (after convention, slot 1)", 3, 1));
    let twice = p.admit(1, &tensor(&v, 3, H), None).err().unwrap();
    assert!(twice.message.contains("captured twice"), "{twice}");
    let narrow = p.admit(0, &tensor(&v, 3, H - 1), None).err().unwrap();
    assert_eq!(narrow.kind, ErrorKind::ShapeContract, "{narrow}");
    assert!(!p.slots().is_filled(0), "a refused capture holds no slot");
}

#[test]
fn a_step_whose_forward_skipped_a_slot_names_it_and_commits_nothing() {
    let mut p = protocol(true);
    let v = vec![0f32; 2 * H];
    p.begin(step(&[("a", 2, 2)], &[])).unwrap();
    p.plan(&["a".into()]).unwrap();
    p.admit(0, &tensor(&v, 2, H), None).unwrap();
    let e = p.end(true).err().unwrap();
    assert!(e.message.contains("layer id 5") && e.message.contains("found 1"), "{e}");
    p.abandon();
    assert!(!p.in_step());
    assert_eq!(p.tracker().captured("a"), Some(0), "the abandoned step's rows are not attributed");
}

#[test]
fn the_hook_hears_each_opened_sample_at_begin_and_each_completed_prompt_at_end() {
    let heard = Arc::new(Mutex::new(Vec::new()));
    let mut p = protocol(true);
    let h = Arc::clone(&heard);
    p.set_completion_hook(Arc::new(move |r: &str, rows: Option<usize>| {
        h.lock().unwrap().push((r.to_string(), rows));
        Ok(())
    }));
    let v = vec![0f32; 5 * H];
    p.begin(step(&[("gen", 2, 2), ("a", 3, 3)], &["gen"])).unwrap();
    assert_eq!(*heard.lock().unwrap(), vec![("gen".to_string(), None)], "a sample with outputs is heard when it opens");
    p.plan(&["gen".into(), "a".into()]).unwrap();
    for slot in 0..2 {
        p.admit(slot, &tensor(&v, 5, H), None).unwrap();
    }
    let (plan, _) = p.end(true).unwrap();
    assert_eq!(plan.total_tokens, 5);
    assert_eq!(*heard.lock().unwrap(), vec![("gen".to_string(), None), ("a".to_string(), Some(3))], "and a prompt's rows");
}

#[test]
fn a_failing_hook_fails_the_step() {
    let mut p = protocol(true);
    p.set_completion_hook(Arc::new(|r: &str, _| Err(crate::core_err!(Output, "no lock for {r}"))));
    let v = vec![0f32; 2 * H];
    p.begin(step(&[("a", 2, 2)], &[])).unwrap();
    p.plan(&["a".into()]).unwrap();
    for slot in 0..2 {
        p.admit(slot, &tensor(&v, 2, H), None).unwrap();
    }
    let e = p.end(true).err().unwrap();
    assert!(e.message.contains("no lock for a"), "{e}");
}

#[test]
fn only_a_rank_that_does_not_assemble_may_lack_slots() {
    assert!(protocol(true).set_absent(&[1]).is_err());
    let mut p = protocol(false);
    p.set_absent(&[1]).unwrap();
    assert_eq!((p.slots().expected(), p.slots().missing()), (1, vec![0]));
}
