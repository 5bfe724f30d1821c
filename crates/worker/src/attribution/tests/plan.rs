use super::*;

fn new(id: &str, len: usize, computed: usize, sample: Option<u64>) -> NewRequest {
    NewRequest {
        req_id: id.into(),
        prompt_token_ids: (0..len as i64).map(|x| 100 + x).collect(),
        num_computed_tokens: computed,
        sample,
        loss_mask: None,
        max_tokens: None,
    }
}

fn cached(id: &str, computed: usize) -> CachedRequest {
    CachedRequest { req_id: id.into(), num_computed_tokens: computed, resumed: false }
}

fn step(new_reqs: Vec<NewRequest>, cached_reqs: Vec<CachedRequest>, sched: &[(&str, usize)]) -> StepInput {
    StepInput {
        new_requests: new_reqs,
        cached_requests: cached_reqs,
        num_scheduled: sched.iter().map(|(i, n)| (i.to_string(), *n)).collect(),
        total_tokens: sched.iter().map(|(_, n)| n).sum(),
        finished: vec![],
        preempted: vec![],
        ..Default::default()
    }
}

fn seg(id: &str, sample: SampleKey, prompt_len: usize, src_row: usize, arena_row: usize, dst_pos: usize, len: usize) -> Segment {
    Segment { req_id: id.into(), sample, prompt_len, src_row, arena_row, dst_pos, len, grows: false }
}

fn ids(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn completed(ev: &[Event]) -> Vec<(String, SampleKey, usize)> {
    ev.iter()
        .filter_map(|e| match e {
            Event::Completed { req_id, sample, token_ids, .. } => Some((req_id.clone(), sample.clone(), token_ids.len())),
            _ => None,
        })
        .collect()
}

#[test]
fn whole_prompts_in_one_step_follow_the_runner_order() {
    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 3, 0, Some(0)), new("b", 2, 0, Some(1))], vec![], &[("a", 3), ("b", 2)])).unwrap();
    // The runner put b first.
    let plan = t.plan(&ids(&["b", "a"])).unwrap().clone();
    assert_eq!(plan.segments, vec![seg("b", SampleKey::Index(1), 2, 0, 0, 0, 2), seg("a", SampleKey::Index(0), 3, 2, 2, 0, 3),]);
    let ev = t.commit().unwrap();
    assert_eq!(completed(&ev), vec![("b".into(), SampleKey::Index(1), 2), ("a".into(), SampleKey::Index(0), 3)]);
}

#[test]
fn chunked_prefill_continues_across_steps_next_to_decodes() {
    let mut t = Tracker::new();
    // Step 1: a (len 2) whole, b (len 7) first chunk of 3.
    t.begin_step(step(vec![new("a", 2, 0, None), new("b", 7, 0, None)], vec![], &[("a", 2), ("b", 3)])).unwrap();
    t.plan(&ids(&["a", "b"])).unwrap();
    assert_eq!(completed(&t.commit().unwrap()).len(), 1);
    // Step 2: a decodes one token (position 2 >= prompt 2: not captured), b continues at 3 for 3.
    t.begin_step(step(vec![], vec![cached("a", 2), cached("b", 3)], &[("a", 1), ("b", 3)])).unwrap();
    let plan = t.plan(&ids(&["a", "b"])).unwrap().clone();
    assert_eq!(plan.segments, vec![seg("b", SampleKey::Request("b".into()), 7, 1, 0, 3, 3)]);
    assert!(t.commit().unwrap().is_empty());
    assert_eq!(t.captured("b"), Some(6));
    // Step 3: the last prompt token of b plus... the scheduler gives 2 tokens; only 1 is prompt.
    t.begin_step(step(vec![], vec![cached("b", 6)], &[("b", 1)])).unwrap();
    let plan = t.plan(&ids(&["b"])).unwrap().clone();
    assert_eq!(plan.arena_rows, 1);
    let ev = t.commit().unwrap();
    assert_eq!(completed(&ev), vec![("b".into(), SampleKey::Request("b".into()), 7)]);
}

#[test]
fn preempted_mid_prefill_starts_over_without_duplicates() {
    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 8, 0, Some(4))], vec![], &[("a", 4)])).unwrap();
    t.plan(&ids(&["a"])).unwrap();
    t.commit().unwrap();
    assert_eq!(t.captured("a"), Some(4));
    // Preempted; comes back from position 0 and recomputes everything.
    let mut s = step(vec![], vec![CachedRequest { req_id: "a".into(), num_computed_tokens: 0, resumed: true }], &[("a", 8)]);
    s.preempted = vec![];
    t.begin_step(s).unwrap();
    let plan = t.plan(&ids(&["a"])).unwrap().clone();
    assert_eq!(plan.segments, vec![seg("a", SampleKey::Index(4), 8, 0, 0, 0, 8)]);
    let ev = t.commit().unwrap();
    assert_eq!(completed(&ev), vec![("a".into(), SampleKey::Index(4), 8)]);
}

#[test]
fn recompute_after_completion_is_ignored() {
    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 3, 0, None)], vec![], &[("a", 3)])).unwrap();
    t.plan(&ids(&["a"])).unwrap();
    assert_eq!(completed(&t.commit().unwrap()).len(), 1);
    // Preempted during decode and recomputed: prompt + 2 output tokens.
    t.begin_step(step(vec![], vec![CachedRequest { req_id: "a".into(), num_computed_tokens: 0, resumed: true }], &[("a", 5)])).unwrap();
    assert_eq!(t.plan(&ids(&["a"])).unwrap().arena_rows, 0);
    assert!(t.commit().unwrap().is_empty(), "a completed sample must not be emitted twice");
}

#[test]
fn skipped_prompt_tokens_are_refused() {
    let mut t = Tracker::new();
    let e = t.begin_step(step(vec![new("a", 10, 4, Some(2))], vec![], &[("a", 6)])).unwrap_err();
    assert_eq!(e.kind, crate::error::ErrorKind::Attribution);
    assert!(e.message.contains("prefix caching") && e.message.contains("sample 2"), "{e}");
}

#[test]
fn a_request_scheduled_twice_is_refused_by_name() {
    let mut t = Tracker::new();
    let e = t.begin_step(step(vec![new("a", 4, 0, Some(0))], vec![], &[("a", 2), ("a", 2)])).unwrap_err();
    assert_eq!(e.kind, crate::error::ErrorKind::Attribution);
    assert!(e.message.contains("request \"a\" is scheduled twice"), "{e}");
}

#[test]
fn abort_mid_prefill_drops_the_request() {
    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 10, 0, Some(7))], vec![], &[("a", 4)])).unwrap();
    t.plan(&ids(&["a"])).unwrap();
    t.commit().unwrap();
    let mut s = step(vec![], vec![], &[]);
    s.finished = vec!["a".into()];
    let ev = t.begin_step(s).unwrap();
    assert_eq!(ev, vec![Event::Aborted { req_id: "a".into(), sample: SampleKey::Index(7), captured: 4, prompt_len: 10 }]);
    t.commit().unwrap();
    assert_eq!(t.live_requests(), 0);
}

#[test]
fn inconsistent_steps_are_refused() {
    let mut t = Tracker::new();
    let e = t.begin_step(step(vec![], vec![], &[("ghost", 3)])).unwrap_err();
    assert!(e.message.contains("neither a new nor a cached"), "{e}");

    let mut t = Tracker::new();
    let e = t.begin_step(step(vec![], vec![cached("ghost", 0)], &[("ghost", 3)])).unwrap_err();
    assert!(e.message.contains("never announced"), "{e}");

    let mut t = Tracker::new();
    let mut s = step(vec![new("a", 3, 0, None)], vec![], &[("a", 3)]);
    s.total_tokens = 4;
    assert!(t.begin_step(s).unwrap_err().message.contains("add up to 3"));

    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 3, 0, None), new("b", 3, 0, None)], vec![], &[("a", 3), ("b", 3)])).unwrap();
    assert!(t.plan(&ids(&["a"])).is_err());
    assert!(t.plan(&ids(&["a", "a"])).is_err());
    assert!(t.plan(&ids(&["a", "c"])).is_err());
    assert!(t.plan(&ids(&["b", "a"])).is_ok());

    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 3, 0, None)], vec![], &[("a", 3)])).unwrap();
    let e = t.commit().unwrap_err();
    assert!(e.message.contains("no decoder layer ran"), "{e}");

    let mut t = Tracker::new();
    assert!(t.begin_step(step(vec![new("e", 0, 0, None)], vec![], &[])).unwrap_err().message.contains("empty prompt"));
}

#[test]
fn a_step_must_end_before_the_next_begins() {
    let mut t = Tracker::new();
    t.begin_step(step(vec![new("a", 3, 0, None)], vec![], &[("a", 3)])).unwrap();
    assert!(t.begin_step(step(vec![], vec![], &[])).is_err());
    t.abandon();
    assert!(t.begin_step(step(vec![], vec![cached("a", 0)], &[("a", 3)])).is_ok());
}

fn finish(reqs: &[&str], outputs: Vec<(&str, Vec<i64>)>) -> StepInput {
    StepInput { finished: ids(reqs), outputs: outputs.into_iter().map(|(r, t)| (r.to_string(), t)).collect(), ..Default::default() }
}

#[test]
fn a_request_with_outputs_captures_its_decode_rows_and_completes_when_it_finishes() {
    let mut t = Tracker::new();
    let mut first = step(vec![new("a", 3, 0, None), new("b", 2, 0, None)], vec![], &[("a", 3), ("b", 2)]);
    first.with_outputs = ids(&["a"]);
    let ev = t.begin_step(first).unwrap();
    assert_eq!(ev, vec![Event::Opened { req_id: "a".into() }], "opened at once: its sample completes after its answer");
    t.plan(&ids(&["a", "b"])).unwrap();
    assert_eq!(completed(&t.commit().unwrap()), vec![("b".into(), SampleKey::Request("b".into()), 2)]);
    // Two decode steps: a's rows at positions 3 and 4 are captured (and b's are not).
    for pos in [3, 4] {
        t.begin_step(step(vec![], vec![cached("a", pos), cached("b", pos - 1)], &[("a", 1), ("b", 1)])).unwrap();
        let plan = t.plan(&ids(&["b", "a"])).unwrap().clone();
        let mut want = seg("a", SampleKey::Request("a".into()), 3, 1, 0, pos, 1);
        want.grows = true;
        assert_eq!(plan.segments, vec![want]);
        assert!(t.commit().unwrap().is_empty());
    }
    // a finished: its tokens are the 5 that went through a forward (prompt 100, 101, 102 and outputs 7, 8).
    t.begin_step(finish(&["a", "b"], vec![("a", vec![100, 101, 102, 7, 8])])).unwrap();
    let ev = t.commit().unwrap();
    assert!(matches!(&ev[..], [Event::Completed { req_id, token_ids, .. }] if req_id == "a" && token_ids == &vec![100, 101, 102, 7, 8]));
}

#[test]
fn a_finish_that_disagrees_with_the_rows_or_comes_without_tokens_is_not_a_sample() {
    let mut t = Tracker::new();
    let mut first = step(vec![new("a", 2, 0, None), new("b", 2, 0, None), new("c", 4, 0, None)], vec![], &[("a", 2), ("b", 2), ("c", 2)]);
    first.with_outputs = ids(&["a", "b", "c"]);
    t.begin_step(first).unwrap();
    t.plan(&ids(&["a", "b", "c"])).unwrap();
    t.commit().unwrap();
    // b finished without its tokens (aborted): dropped; c finished mid-prompt: dropped.
    let ev = t.begin_step(finish(&["b", "c"], vec![])).unwrap();
    assert_eq!(ev.iter().filter(|e| matches!(e, Event::Aborted { .. })).count(), 2);
    t.commit().unwrap();
    // a reports 4 tokens through a forward but only 2 rows were captured: a has no sample, the capture goes on.
    let ev = t.begin_step(finish(&["a"], vec![("a", vec![100, 101, 5, 6])])).unwrap();
    assert!(matches!(&ev[..], [Event::Aborted { captured: 2, prompt_len: 4, .. }]), "{ev:?}");
    t.commit().unwrap();
    // d ended before its first output (aborted in its last prefill step): fewer tokens than its prompt, no sample.
    let mut t = Tracker::new();
    let mut first = step(vec![new("d", 3, 0, None)], vec![], &[("d", 3)]);
    first.with_outputs = ids(&["d"]);
    t.begin_step(first).unwrap();
    t.plan(&ids(&["d"])).unwrap();
    t.commit().unwrap();
    let ev = t.begin_step(finish(&["d"], vec![("d", vec![100, 101])])).unwrap();
    assert!(matches!(&ev[..], [Event::Aborted { .. }]), "{ev:?}");
    assert!(t.commit().unwrap().is_empty());
    let mut t = Tracker::new();
    let e = t.begin_step(finish(&[], vec![("z", vec![1])])).unwrap_err();
    assert!(e.message.contains("did not finish in this step"), "{e}");
}

#[test]
fn scheduled_counts_that_overflow_are_refused() {
    let mut t = Tracker::new();
    let input = StepInput {
        new_requests: vec![new("a", 4, 0, Some(0)), new("b", 4, 0, Some(1))],
        num_scheduled: vec![("a".into(), usize::MAX), ("b".into(), 2)],
        total_tokens: 6,
        ..Default::default()
    };
    let e = t.begin_step(input).unwrap_err();
    assert!(e.message.contains("overflow") || e.message.contains("scheduled"), "{}", e.message);
}

#[test]
fn a_request_with_outputs_aborted_while_its_preemption_is_recomputed_fails_alone() {
    // a (prompt 3) decodes 2 tokens, is preempted, recomputed from 0 (prompt + outputs as its new prompt), and aborted
    // when the recompute has covered 4 of its 5 tokens: the scheduler reports all 5. Before, an AttributionError
    // stopped the whole capture; now a alone has no sample, and b, beside it, completes.
    let mut t = Tracker::new();
    let mut first = step(vec![new("a", 3, 0, None), new("b", 4, 0, None)], vec![], &[("a", 3), ("b", 2)]);
    first.with_outputs = ids(&["a"]);
    t.begin_step(first).unwrap();
    t.plan(&ids(&["a", "b"])).unwrap();
    t.commit().unwrap();
    for pos in [3, 4] {
        t.begin_step(step(vec![], vec![cached("a", pos), cached("b", 2)], &[("a", 1)])).unwrap();
        t.plan(&ids(&["a"])).unwrap();
        t.commit().unwrap();
    }
    assert_eq!(t.captured("a"), Some(5));
    let mut pre = step(vec![], vec![], &[("b", 1)]);
    pre.preempted = ids(&["a"]);
    pre.cached_requests = vec![cached("b", 2)];
    t.begin_step(pre).unwrap();
    t.plan(&ids(&["b"])).unwrap();
    t.commit().unwrap();
    // The recompute: a from position 0, 4 tokens of its 5 (prompt and outputs), b finishes its prompt.
    let mut re = step(
        vec![],
        vec![CachedRequest { req_id: "a".into(), num_computed_tokens: 0, resumed: true }, cached("b", 3)],
        &[("a", 4), ("b", 1)],
    );
    re.cached_requests[1] = cached("b", 3);
    t.begin_step(re).unwrap();
    t.plan(&ids(&["a", "b"])).unwrap();
    assert_eq!(completed(&t.commit().unwrap()), vec![("b".into(), SampleKey::Request("b".into()), 4)]);
    let ev = t.begin_step(finish(&["a", "b"], vec![("a", vec![100, 101, 102, 7, 8])])).unwrap();
    assert!(matches!(&ev[..], [Event::Aborted { req_id, captured: 4, prompt_len: 5, .. }] if req_id == "a"), "{ev:?}");
    assert!(t.commit().unwrap().is_empty(), "no sample for a");
    assert_eq!(t.live_requests(), 0);
}

#[test]
fn a_refused_request_is_never_captured_and_ends_without_an_event() {
    let mut t = Tracker::new();
    let mut first = step(vec![new("r", 5, 0, None), new("b", 2, 0, None)], vec![], &[("r", 3), ("b", 2)]);
    first.with_outputs = ids(&["r"]);
    first.refused = ids(&["r"]);
    assert!(t.begin_step(first).unwrap().is_empty(), "no Opened: nothing is promised for it");
    let plan = t.plan(&ids(&["r", "b"])).unwrap().clone();
    assert_eq!(plan.segments.iter().map(|s| s.req_id.as_str()).collect::<Vec<_>>(), ["b"]);
    assert_eq!(plan.segments[0].src_row, 3, "its scheduled tokens still occupy their rows of the step");
    assert_eq!(completed(&t.commit().unwrap()).len(), 1);
    // The rest of its prompt (chunked), a preemption back to 0, decode: never a row.
    for (pos, n) in [(3, 2), (0, 5), (5, 1)] {
        t.begin_step(step(vec![], vec![cached("r", pos)], &[("r", n)])).unwrap();
        assert!(t.plan(&ids(&["r"])).unwrap().segments.is_empty());
        assert!(t.commit().unwrap().is_empty());
    }
    // It finishes; the scheduler may still send its tokens (it answers by its own rule): no event, no error.
    let ev = t.begin_step(finish(&["r"], vec![("r", (100..106).collect())])).unwrap();
    assert!(ev.is_empty(), "{ev:?}");
    assert_eq!(t.live_requests(), 1, "only b's track is left... until b is retired");
}
