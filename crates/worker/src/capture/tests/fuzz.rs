//! Property test of attribution and assembly: random schedules (chunked prefill, decode tokens, random
//! runner order, preemption with recompute from an earlier position, aborts mid-prefill) against a
//! simple model of the truth. Each captured row carries (request, prompt position) in its values, so a
//! misattributed, duplicated or missing row is visible in the assembled samples. Half the cases copy
//! rows on the assembler thread (background assembly, a ring of 2 arenas), half inline. Some requests capture
//! their generated tokens too (`include_output_tokens`): their decode rows are captured under the same rules,
//! and a finish reports every token through a forward — or, as when the finish came after one more step was
//! scheduled, all but the last row computed.
//!
//! CI runs 3,000 cases; `PROPTEST_CASES=20000 cargo test -p hscapture-worker fuzz` runs
//! longer (scripts/nightly.sh).

use proptest::prelude::*;

use crate::attribution::layers::{Convention, LayerPlan};
use crate::attribution::plan::{CachedRequest, NewRequest, StepInput};
use crate::capture::session::{Session, SessionConfig};
use crate::capture::tensor::{Device, TensorDesc};
use crate::sample::SampleKey;
use hscapture_kernels::DType;

const W: usize = 2;

#[derive(Clone, Debug)]
struct Op {
    pick: Vec<(usize, usize)>, // (request slot, chunk size 1..)
    preempt: Option<(usize, usize)>,
    abort: Option<usize>,
    order_seed: u64,
}

fn ops() -> impl Strategy<Value = (Vec<usize>, Vec<Op>)> {
    let lens = prop::collection::vec(1usize..40, 1..8);
    lens.prop_flat_map(|lens| {
        let n = lens.len();
        let op = (
            prop::collection::vec((0..n, 1usize..24), 1..5),
            prop::option::weighted(0.15, (0..n, 0usize..40)),
            prop::option::weighted(0.08, 0..n),
            any::<u64>(),
        )
            .prop_map(|(pick, preempt, abort, order_seed)| Op { pick, preempt, abort, order_seed });
        (Just(lens), prop::collection::vec(op, 1..60))
    })
}

struct Req {
    len: usize,
    computed: usize, // the scheduler's position
    announced: bool,
    finished: bool,
    complete_emitted: bool,
    with_outputs: bool,
    /// The tokens a finish reported (with outputs, finished after its prompt).
    tokens: Option<usize>,
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(3000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn attribution_matches_the_truth((lens, ops) in ops(), background in any::<bool>(), outs in any::<u8>(), lags in any::<u8>()) {
        let mut s = Session::new(SessionConfig {
            layers: LayerPlan::new(&[0], Convention::After, 2).unwrap(),
            hidden_size: W,
            model_dtype: DType::F32,
            out_dtype: DType::F32,
            assemble: true,
        }).unwrap();
        if background {
            s.set_background(2).unwrap();
        }
        let mut collected = Vec::new();
        let mut reqs: Vec<Req> = lens.iter().enumerate().map(|(r, &len)| Req { len, computed: 0, announced: false, finished: false, complete_emitted: false, with_outputs: outs >> r & 1 == 1, tokens: None }).collect();
        let mut emitted: Vec<u64> = Vec::new();
        let mut pending_finished: Vec<String> = Vec::new();
        for op in ops {
            let mut outputs = Vec::new();
            if let Some(r) = op.abort {
                if reqs[r].announced && !reqs[r].finished {
                    reqs[r].finished = true;
                    pending_finished.push(format!("r{r}"));
                    let q = &mut reqs[r];
                    if q.with_outputs && q.computed >= q.len {
                        let lag = lags >> r & 1 == 1 && q.computed > q.len; // one more row ran than the finish reports
                        let n = q.computed - usize::from(lag);
                        q.tokens = Some(n);
                        outputs.push((format!("r{r}"), (0..n as i64).collect::<Vec<i64>>()));
                    }
                }
            }
            if let Some((r, back)) = op.preempt {
                if reqs[r].announced && !reqs[r].finished {
                    reqs[r].computed = reqs[r].computed.saturating_sub(back); // recompute from earlier
                }
            }
            let mut new_requests = Vec::new();
            let mut with_outputs = Vec::new();
            let mut cached = Vec::new();
            let mut sched: Vec<(String, usize)> = Vec::new();
            let mut seen = std::collections::HashSet::new();
            for &(r, k) in &op.pick {
                if reqs[r].finished || !seen.insert(r) {
                    continue;
                }
                let id = format!("r{r}");
                let start = reqs[r].computed;
                if reqs[r].announced {
                    cached.push(CachedRequest { req_id: id.clone(), num_computed_tokens: start, resumed: false });
                } else {
                    new_requests.push(NewRequest { req_id: id.clone(), prompt_token_ids: (0..reqs[r].len as i64).collect(), num_computed_tokens: 0, sample: Some(r as u64), loss_mask: None, max_tokens: None });
                    reqs[r].announced = true;
                    if reqs[r].with_outputs {
                        with_outputs.push(id.clone());
                    }
                }
                let n = if start >= reqs[r].len { 1 } else { k.min(reqs[r].len - start) };
                sched.push((id, n));
                reqs[r].computed = start + n;
            }
            let total: usize = sched.iter().map(|x| x.1).sum();
            // the runner's order: a seeded permutation
            let mut order: Vec<String> = sched.iter().map(|x| x.0.clone()).collect();
            let mut seed = op.order_seed;
            for i in (1..order.len()).rev() {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (seed >> 33) as usize % (i + 1));
            }
            let input = StepInput { new_requests, cached_requests: cached, num_scheduled: sched.clone(), total_tokens: total, finished: std::mem::take(&mut pending_finished), preempted: vec![], with_outputs, outputs, refused: vec![] };
            s.begin_step(input).unwrap();
            if total > 0 {
                s.plan(&order).unwrap();
                // step rows: each request's tokens consecutively in the runner's order, value = req*1000 + position
                let mut h = Vec::with_capacity(total * W);
                for id in &order {
                    let r: usize = id[1..].parse().unwrap();
                    let n = sched.iter().find(|x| &x.0 == id).unwrap().1;
                    let start = reqs[r].computed - n;
                    for k in 0..n {
                        for _ in 0..W { h.push((r * 1000 + start + k) as f32); }
                    }
                }
                let d = TensorDesc { ptr: h.as_ptr() as usize, shape: vec![total, W], strides: vec![W as i64, 1], dtype: DType::F32, device: Device::Cpu };
                // SAFETY: `h` is live for the call.
                unsafe { s.capture(0, None, &d, None, 0).unwrap() };
            }
            let out = s.end_step().unwrap().remove(0);
            collected.extend(out.completed);
            collected.extend(s.take_ready(false).unwrap());
        }
        collected.extend(s.take_ready(true).unwrap());
        prop_assert!(s.take_ready(true).unwrap().is_empty());
        {
            for smp in collected {
                let SampleKey::Index(r) = smp.key else { panic!("indexed samples") };
                let r = r as usize;
                prop_assert!(!reqs[r].complete_emitted, "request {} emitted twice", r);
                reqs[r].complete_emitted = true;
                emitted.push(r as u64);
                prop_assert_eq!(smp.rows, reqs[r].tokens.unwrap_or(reqs[r].len));
                prop_assert_eq!(smp.token_ids.len(), smp.rows);
                for pos in 0..smp.rows {
                    let v = f32::from_le_bytes(smp.cell(pos, 0)[..4].try_into().unwrap());
                    prop_assert_eq!(v, (r * 1000 + pos) as f32, "request {} position {}", r, pos);
                }
            }
        }
        // every request whose prompt was fully computed without being aborted first was emitted exactly once
        for (r, q) in reqs.iter().enumerate() {
            if q.complete_emitted {
                prop_assert!(q.announced);
            }
            if q.with_outputs {
                prop_assert_eq!(q.complete_emitted, q.tokens.is_some(), "request {} with outputs: emitted iff it finished after its prompt", r);
            } else if !q.finished && q.announced && q.computed >= q.len {
                prop_assert!(q.complete_emitted, "request {} computed its prompt but was not emitted", r);
            }
        }
    }
}
