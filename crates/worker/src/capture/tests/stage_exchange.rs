//! Pipeline parallelism: two stages each capture the slots of their own layers; the first sends its
//! rows to the second, which assembles. The result must equal one session capturing everything.
use super::*;
use crate::attribution::layers::{Convention, LayerPlan};
use crate::attribution::plan::NewRequest;
use crate::error::ErrorKind;
use hscapture_kernels::DType;

const H: usize = 4;

fn session(assemble: bool) -> Session {
    Session::new(SessionConfig {
        layers: LayerPlan::new(&[1, 2, 6], Convention::After, 8).unwrap(),
        hidden_size: H,
        model_dtype: DType::F32,
        out_dtype: DType::F32,
        assemble,
    })
    .unwrap()
}

fn values(layer: usize, rows: usize) -> Vec<f32> {
    (0..rows * H).map(|i| (layer * 1000 + (i / H) * 10 + i % H) as f32).collect()
}

fn desc(v: &[f32], rows: usize) -> TensorDesc {
    TensorDesc { ptr: v.as_ptr() as usize, shape: vec![rows, H], strides: vec![H as i64, 1], dtype: DType::F32, device: Device::Cpu }
}

fn step_input(step: usize) -> StepInput {
    let new = vec![NewRequest {
        req_id: format!("r{step}"),
        prompt_token_ids: vec![3; 5],
        num_computed_tokens: 0,
        sample: Some(step as u64),
        loss_mask: None,
        max_tokens: None,
    }];
    StepInput { new_requests: new, num_scheduled: vec![(format!("r{step}"), 5)], total_tokens: 5, ..Default::default() }
}

fn capture(s: &mut Session, slots: &[usize]) {
    let layers = [1usize, 2, 6];
    for &slot in slots {
        let v = values(layers[slot], 5);
        // SAFETY: `v` is live for the call and not written meanwhile.
        unsafe { s.capture(slot, None, &desc(&v, 5), None, 0).unwrap() };
    }
}

#[test]
fn two_stages_assemble_what_one_session_would() {
    let (mut first, mut last, mut whole) = (session(false), session(true), session(true));
    first.set_absent_slots(&[2]).unwrap();
    for step in 0..3 {
        let order = vec![format!("r{step}")];
        for s in [&mut first, &mut last, &mut whole] {
            s.begin_step(step_input(step)).unwrap();
            s.plan(&order).unwrap();
        }
        capture(&mut first, &[0, 1]);
        capture(&mut last, &[2]);
        capture(&mut whole, &[0, 1, 2]);
        let msg = first.export_slots(&[0, 1]).unwrap();
        assert_eq!(last.import_slots(&msg, "stage 0").unwrap(), vec![0, 1]);
        let a = first.end_step().unwrap().remove(0);
        let b = last.end_step().unwrap().remove(0);
        let c = whole.end_step().unwrap().remove(0);
        assert!(a.completed.is_empty());
        // The assembling rank's checksum covers what it captured itself (what its TP peers hold).
        let mut peer = session(false);
        peer.set_absent_slots(&[0, 1]).unwrap();
        peer.begin_step(step_input(step)).unwrap();
        peer.plan(&order).unwrap();
        capture(&mut peer, &[2]);
        assert_eq!(peer.end_step().unwrap().remove(0).checksum, b.checksum);
        assert_eq!(b.completed.len(), 1);
        assert_eq!(b.completed[0].data, c.completed[0].data);
    }
}

#[test]
fn a_stage_out_of_step_or_a_duplicate_slot_is_refused() {
    let (mut first, mut last) = (session(false), session(true));
    first.set_absent_slots(&[2]).unwrap();
    first.begin_step(step_input(0)).unwrap();
    first.plan(&["r0".to_string()]).unwrap();
    capture(&mut first, &[0, 1]);
    let msg = first.export_slots(&[0, 1]).unwrap();
    // The last stage has not planned: nothing to put the rows in.
    last.begin_step(step_input(0)).unwrap();
    assert_eq!(last.import_slots(&msg, "stage 0").unwrap_err().kind, ErrorKind::Attribution);
    last.plan(&["r0".to_string()]).unwrap();
    capture(&mut last, &[0]);
    let e = last.import_slots(&msg, "stage 0").unwrap_err();
    assert!(e.message.contains("captured twice"), "{e}");
    first.end_step().unwrap();
    // A message of step 0 offered at step 1.
    let mut other = session(true);
    other.begin_step(step_input(0)).unwrap();
    other.plan(&["r0".to_string()]).unwrap();
    other.abandon_step().unwrap();
    other.begin_step(step_input(1)).unwrap();
    other.plan(&["r1".to_string()]).unwrap();
    let e = other.import_slots(&msg, "stage 0").unwrap_err();
    assert_eq!(e.kind, ErrorKind::RankMismatch, "{e}");
    assert!(e.message.contains("disagree about the schedule"), "{e}");
    // The assembling rank may not leave slots absent; without the message its step fails.
    assert_eq!(session(true).set_absent_slots(&[0]).unwrap_err().kind, ErrorKind::Config);
    let mut lonely = session(true);
    lonely.begin_step(step_input(0)).unwrap();
    lonely.plan(&["r0".to_string()]).unwrap();
    capture(&mut lonely, &[2]);
    assert!(lonely.end_step().unwrap_err().message.contains("never reached its hook"));
}
