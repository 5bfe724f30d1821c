//! The assembler thread's invariants: errors and panics are reported, and step buffers come back
//! after them, so the worker never waits forever for a buffer.

use super::*;
use crate::attribution::plan::Segment;
use crate::capture::scatter::{Completion, Geometry};
use crate::sample::pool::BufferPool;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

/// A step's rows, each different (a zero or constant sample is refused as degenerate).
fn arena(rows: usize) -> Arena {
    let mut a = Arena::new(1, 2, DType::F32);
    a.reset(rows);
    let t = a.target(0, "x").unwrap();
    t.data.iter_mut().enumerate().for_each(|(i, b)| *b = (i % 251) as u8 + 1);
    a
}

fn assembler() -> Assembler {
    let geo = Geometry { slots: 1, width: 2, dtype: DType::F32, quantized: false };
    Assembler::start(Scatter::new(geo, std::sync::Arc::new(BufferPool::new(4))), crate::failure::Failure::new()).unwrap()
}

fn seg(req: &str, arena_row: usize, len: usize, prompt_len: usize) -> Segment {
    Segment { req_id: req.into(), sample: SampleKey::Index(0), prompt_len, src_row: 0, arena_row, dst_pos: 0, len, grows: false }
}

#[test]
fn a_sample_completes_through_the_thread() {
    let a = assembler();
    let job = ScatterJob {
        step: 1,
        segments: vec![seg("r", 0, 3, 3)],
        completions: vec![Completion {
            req_id: "r".into(),
            sample: SampleKey::Index(0),
            token_ids: vec![1, 2, 3],
            loss_mask: None,
            grows: false,
        }],
        discard: vec![],
    };
    a.submit(job, StepBuffer::Arena(arena(3))).unwrap();
    a.fence().unwrap();
    let got = a.take_ready().unwrap();
    assert_eq!((got.len(), got[0].rows, got[0].data.len()), (1, 3, 3 * 2 * 4));
    assert!(matches!(a.returned(false), Some(StepBuffer::Arena(_))), "the arena came back");
    assert_eq!(a.held_bytes(), 0);
}

#[test]
fn an_error_on_the_thread_is_reported_and_the_buffer_still_comes_back() {
    let a = assembler();
    // A completion whose rows were never scattered: the prefix check fails on the thread.
    let job = ScatterJob {
        step: 4,
        completions: vec![Completion {
            req_id: "ghost".into(),
            sample: SampleKey::Index(9),
            token_ids: vec![1, 2],
            loss_mask: None,
            grows: false,
        }],
        ..Default::default()
    };
    a.submit(job, StepBuffer::Arena(arena(1))).unwrap();
    assert!(a.returned(true).is_some(), "the buffer comes back after the error");
    let e = a.fence().unwrap_err();
    assert!(e.message.contains("sample 9: completed with 0 of its 2 prompt rows copied"), "{e}");
    assert!(a.take_ready().is_err(), "the first error stays reported");
}

#[test]
fn a_panic_on_the_thread_is_an_error_not_a_hang() {
    let a = assembler();
    // Rows beyond the arena: the copy panics (index out of bounds) inside the thread.
    let job = ScatterJob { step: 2, segments: vec![seg("r", 50, 3, 3)], ..Default::default() };
    a.submit(job, StepBuffer::Arena(arena(2))).unwrap();
    assert!(a.returned(true).is_some(), "the buffer comes back after the panic");
    let e = a.fence().unwrap_err();
    assert!(e.message.contains("step 2: the assembler thread panicked"), "{e}");
    // The thread keeps serving: later buffers come back too.
    a.submit(ScatterJob { step: 3, ..Default::default() }, StepBuffer::Arena(arena(1))).unwrap();
    assert!(a.returned(true).is_some());
}
