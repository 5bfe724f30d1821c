//! The scatter's hand-over of completed samples: from the copying threads to `emit` (the writer), or
//! returned in the job's completion order; the same bytes either way, and an emit error reported.

use super::*;
use crate::capture::arena::Arena;

const W: usize = 1024;

/// A step of `n` requests × `len` rows × 2 slots of W f32; the even requests complete, the odd ones
/// (prompts of `2 * len`) are left in progress.
fn step(n: usize, len: usize) -> (Arena, ScatterJob) {
    let mut a = Arena::new(2, W, DType::F32);
    a.reset(n * len);
    for slot in 0..2 {
        let t = a.target(slot, "x").unwrap();
        for (i, v) in t.data.chunks_exact_mut(4).enumerate() {
            v.copy_from_slice(&((slot * 10_000_000 + i) as f32).to_le_bytes());
        }
    }
    let mut job = ScatterJob { step: 1, ..Default::default() };
    for r in 0..n {
        let prompt_len = if r % 2 == 0 { len } else { 2 * len };
        let id = format!("r{r}");
        job.segments.push(Segment {
            req_id: id.clone(),
            sample: SampleKey::Index(r as u64),
            prompt_len,
            src_row: r * len,
            arena_row: r * len,
            dst_pos: 0,
            len,
            grows: false,
        });
        if r % 2 == 0 {
            job.completions.push(Completion {
                req_id: id,
                sample: SampleKey::Index(r as u64),
                token_ids: vec![0; len],
                loss_mask: None,
                grows: false,
            });
        }
    }
    job.completions.reverse(); // an order the segments do not have
    (a, job)
}

fn scatter() -> Scatter {
    Scatter::new(Geometry { slots: 2, width: W, dtype: DType::F32, quantized: false }, Arc::new(BufferPool::new(8)))
}

#[test]
fn emitted_samples_equal_returned_ones_and_keep_nothing_else() {
    let (rows, job) = step(8, 256); // 8 × 256 rows × 2 slots × 4 KiB = 16 MiB: the parallel path
    let mut inline = scatter();
    let want = inline.run(job.clone(), &rows, None).unwrap();
    assert_eq!(
        want.iter().map(|s| s.key.clone()).collect::<Vec<_>>(),
        job.completions.iter().map(|c| c.sample.clone()).collect::<Vec<_>>()
    );
    let got = std::sync::Mutex::new(Vec::new());
    let emit = |s: Sample| {
        got.lock().unwrap().push(s);
        Ok(())
    };
    let mut threaded = scatter();
    assert!(threaded.run(job, &rows, Some(&emit)).unwrap().is_empty(), "every completed sample was emitted");
    let mut got = got.into_inner().unwrap();
    got.sort_by_key(|s| want.iter().position(|w| w.key == s.key));
    assert_eq!(got, want, "the same samples, byte for byte");
    assert_eq!(
        threaded.held_counter().load(Ordering::Relaxed),
        inline.held_counter().load(Ordering::Relaxed),
        "the incomplete requests stay held"
    );
    assert_eq!(threaded.bufs.len(), 4);
}

#[test]
fn an_emit_error_is_reported_and_the_incomplete_requests_are_kept() {
    let (rows, job) = step(8, 256);
    let mut s = scatter();
    let emit = |smp: Sample| match smp.key {
        SampleKey::Index(2) => Err(crate::core_err!(Output, "the writer has stopped")),
        _ => Ok(()),
    };
    let e = s.run(job, &rows, Some(&emit)).unwrap_err();
    assert!(e.message.contains("the writer has stopped"), "{e}");
    assert_eq!(s.bufs.len(), 4, "the requests still in progress are not lost");
}

#[test]
fn a_request_whose_earlier_rows_were_lost_is_refused_before_anything_is_copied() {
    // A 6-row prompt in three steps of 2 rows; the second step's job never reaches the scatter (lost).
    let rows = {
        let mut a = Arena::new(2, W, DType::F32);
        a.reset(2);
        a
    };
    let seg = |dst_pos| Segment {
        req_id: "a".into(),
        sample: SampleKey::Index(0),
        prompt_len: 6,
        src_row: 0,
        arena_row: 0,
        dst_pos,
        len: 2,
        grows: false,
    };
    let mut s = scatter();
    s.run(ScatterJob { step: 1, segments: vec![seg(0)], ..Default::default() }, &rows, None).unwrap();
    let last = ScatterJob {
        step: 3,
        segments: vec![seg(4)],
        completions: vec![Completion {
            req_id: "a".into(),
            sample: SampleKey::Index(0),
            token_ids: vec![0; 6],
            loss_mask: None,
            grows: false,
        }],
        ..Default::default()
    };
    let e = s.run(last.clone(), &rows, None).unwrap_err();
    assert!(e.message.contains("rows 4..6 of 6 arrived with 2 rows before them"), "{e}");
    assert_eq!(s.bufs.len(), 1, "nothing was taken out");
    // A request whose buffer is gone (dropped, or lost with a panicking step) starts again only at row 0.
    s.drop_request("a");
    let e = s.run(last, &rows, None).unwrap_err();
    assert!(e.message.contains("arrived with 0 rows before them"), "{e}");
    // A completion without all its rows is refused too.
    let short = ScatterJob {
        step: 4,
        segments: vec![seg(0)],
        completions: vec![Completion {
            req_id: "a".into(),
            sample: SampleKey::Index(0),
            token_ids: vec![0; 6],
            loss_mask: None,
            grows: false,
        }],
        ..Default::default()
    };
    assert!(s.run(short, &rows, None).unwrap_err().message.contains("completed with 2 of its 6 prompt rows"));
}
