//! Token attribution: which rows of a step's flattened batch belong to which request, and which of
//! them are prompt tokens to capture.
//!
//! A step schedules `n_r` consecutive tokens for each request `r`, starting at the request's
//! position `num_computed_tokens`; the model runner lays the requests out one after another in an
//! order of its own. Rows at positions below the prompt length are prompt tokens; the rest are
//! decode tokens and are not captured.
//!
//! Invariants kept by [`Tracker`]:
//! - a request's captured rows are always the contiguous prefix `0..captured` of its prompt;
//! - chunked prefill continues a request where the previous step stopped;
//! - a request scheduled again from an earlier position (preemption, recompute) starts over from that
//!   position: rows from there on are replaced, never duplicated;
//! - a request whose prompt was complete is never captured again (recomputation after emission is
//!   ignored), so no sample is emitted twice;
//! - a request that would skip prompt tokens (prefix caching) is refused with an explained error,
//!   since the skipped tokens' states are never computed.
//!
//! A request that asks for its generated tokens too (`include_output_tokens`, the KV connector's) is captured at
//! every position that goes through a forward — prompt and decode rows alike, under the same prefix and recompute
//! rules — and completes when it finishes, with the token ids the scheduler reports for it (`StepInput::outputs`:
//! all of its tokens but the last, which no forward computed). Rows computed beyond those (a step scheduled
//! before the finish was known) are not part of the sample.

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};
use std::collections::hash_map::Entry;

use crate::sample::SampleKey;
use crate::{bail, core_err, ensure, error::CoreResult};
use hscapture_kernels::RowRun;

/// A request the scheduler sends for the first time (or again, in some vLLM versions, after
/// preemption).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRequest {
    pub req_id: String,
    pub prompt_token_ids: Vec<i64>,
    pub num_computed_tokens: usize,
    /// The sample index the driver attached to the request, if any.
    pub sample: Option<u64>,
    /// The prompt's training mask (0/1 per token), when the driver attached one.
    pub loss_mask: Option<Vec<u8>>,
    /// The most tokens the request may generate (its sampling parameters' `max_tokens`), when known: what a sample
    /// that grows with them is bounded by at admission.
    pub max_tokens: Option<usize>,
}

/// A request the model runner already knows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedRequest {
    pub req_id: String,
    pub num_computed_tokens: usize,
    pub resumed: bool,
}

/// What hscapture needs of one step's scheduler output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepInput {
    pub new_requests: Vec<NewRequest>,
    pub cached_requests: Vec<CachedRequest>,
    /// `(req_id, tokens scheduled this step)`.
    pub num_scheduled: Vec<(String, usize)>,
    pub total_tokens: usize,
    pub finished: Vec<String>,
    pub preempted: Vec<String>,
    /// New requests of this step that capture their generated tokens too.
    pub with_outputs: Vec<String>,
    /// `(req_id, token ids)` of finished requests that capture their generated tokens: every token that went
    /// through a forward (prompt and output, all but the last).
    pub outputs: Vec<(String, Vec<i64>)>,
    /// New requests of this step refused at admission (their sample could outgrow the bound): nothing of them is
    /// captured, no file is promised, their client finds none.
    pub refused: Vec<String>,
}

/// Rows `src_row..src_row+len` of the step are prompt positions `dst_pos..dst_pos+len` of
/// `req_id` (a prompt of `prompt_len` tokens, stored as `sample`); the step's captured rows are
/// stored at `arena_row..arena_row+len`. Self-contained, so that a step's data can be assembled
/// after the request has left the tracker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub req_id: String,
    pub sample: SampleKey,
    pub prompt_len: usize,
    pub src_row: usize,
    pub arena_row: usize,
    pub dst_pos: usize,
    pub len: usize,
    /// The request captures generated tokens too: its sample grows past `prompt_len` until it finishes.
    pub grows: bool,
}

/// The attribution of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub step: u64,
    pub total_tokens: usize,
    pub arena_rows: usize,
    pub segments: Vec<Segment>,
}

impl StepPlan {
    /// The row copies the capture kernel performs for this step.
    pub fn runs(&self) -> Vec<RowRun> {
        self.segments.iter().map(|s| RowRun { src_row: s.src_row, dst_row: s.arena_row, len: s.len }).collect()
    }
}

/// What happened to a request when a step was committed or announced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// All prompt rows are captured (or, for a request that captures its generated tokens, it finished): the
    /// sample of `token_ids.len()` rows can be assembled.
    Completed { req_id: String, sample: SampleKey, token_ids: Vec<i64>, loss_mask: Option<Vec<u8>> },
    /// A request that captures its generated tokens was registered: its sample completes only after it
    /// finishes, so whatever must exist before its response (a file's lock) is taken now.
    Opened { req_id: String },
    /// The request finished or was aborted before its prompt was complete; its rows are dropped.
    Aborted { req_id: String, sample: SampleKey, captured: usize, prompt_len: usize },
}

/// Rows of the sample of a request that captures its generated tokens and finished with `all_tokens` tokens (prompt
/// and generated): every token that went through a forward, all but the last (sampled, never an input); None when
/// it ended before its first output (aborted), which leaves no sample. The KV connector's scheduler and the
/// workers both decide by this.
pub fn output_sample_rows(prompt_len: usize, all_tokens: usize) -> Option<usize> {
    all_tokens.checked_sub(1).filter(|&rows| rows >= prompt_len)
}

#[derive(Debug)]
struct Track {
    sample: SampleKey,
    token_ids: Vec<i64>,
    loss_mask: Option<Vec<u8>>,
    prompt_len: usize,
    captured: usize,
    done: bool,
    /// Captures generated tokens too (see the module's doc).
    with_outputs: bool,
}

#[derive(Debug)]
struct Pending {
    /// req_id -> (start position, tokens scheduled, prompt rows to capture)
    sched: HashMap<String, (usize, usize, usize)>,
    total_tokens: usize,
    plan: Option<StepPlan>,
}

/// Per-request capture progress across steps.
#[derive(Debug, Default)]
pub struct Tracker {
    reqs: HashMap<String, Track>,
    pending: Option<Pending>,
    step: u64,
    /// Requests with generated tokens that finished at this step's start, reported at its end.
    finished: Vec<Event>,
}

impl Tracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of steps begun so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Requests known and not finished.
    pub fn live_requests(&self) -> usize {
        self.reqs.len()
    }

    /// Prompt rows captured so far for `req_id` (None if unknown).
    pub fn captured(&self, req_id: &str) -> Option<usize> {
        self.reqs.get(req_id).map(|t| t.captured)
    }

    /// Applies a step's scheduler output: retires finished requests, registers new ones and decides
    /// which prompt rows each scheduled request contributes. Returns the requests aborted before
    /// their prompt was complete.
    pub fn begin_step(&mut self, input: StepInput) -> CoreResult<Vec<Event>> {
        ensure!(
            self.pending.is_none(),
            Attribution,
            "step {} began before step {} was ended; every begun step must be ended (the previous forward \
             probably failed)",
            self.step + 1,
            self.step
        );
        self.step += 1;
        let mut events = self.retire(&input.finished, &input.outputs)?;
        let mut starts = self.register(&input.new_requests, &input.with_outputs, &input.refused, &mut events)?;
        for r in &input.cached_requests {
            starts.insert(&r.req_id, r.num_computed_tokens);
        }
        let sched = self.schedule(input.num_scheduled, &starts, input.total_tokens)?;
        self.pending = Some(Pending { sched, total_tokens: input.total_tokens, plan: None });
        Ok(events)
    }

    /// Forgets the requests that finished: one that captures its generated tokens completes (at this step's
    /// end, with the token ids the scheduler reports); one whose prompt was not complete is aborted.
    fn retire(&mut self, finished: &[String], outputs: &[(String, Vec<i64>)]) -> CoreResult<Vec<Event>> {
        let step = self.step;
        let mut events = Vec::new();
        let mut outputs: HashMap<&str, &Vec<i64>> = outputs.iter().map(|(r, t)| (r.as_str(), t)).collect();
        for id in finished {
            let Some(mut t) = self.reqs.remove(id) else { continue };
            match outputs.remove(id.as_str()) {
                // Ended with fewer rows than tokens (aborted while a preemption's recompute was catching up): this
                // request has no sample; the capture goes on.
                Some(tokens) if t.with_outputs && t.captured < tokens.len() => {
                    events.push(Event::Aborted { req_id: id.clone(), sample: t.sample, captured: t.captured, prompt_len: tokens.len() })
                }
                Some(tokens)
                    if t.with_outputs && t.captured >= t.prompt_len && output_sample_rows(t.prompt_len, tokens.len() + 1).is_some() =>
                {
                    let prompt_first = tokens.len() >= t.prompt_len && tokens[..t.prompt_len] == t.token_ids[..];
                    ensure!(
                        prompt_first,
                        Attribution,
                        "step {step}: {} ({id:?}) finished with {} tokens through a forward that do not start with its \
                         {}-token prompt; expected the prompt first (the scheduler's tokens and the request's prompt \
                         disagree: a bug, please report it)",
                        t.sample,
                        tokens.len(),
                        t.prompt_len
                    );
                    self.finished.push(Event::Completed {
                        req_id: id.clone(),
                        sample: t.sample,
                        token_ids: tokens.clone(),
                        loss_mask: t.loss_mask.take(),
                    });
                }
                _ if !t.done => {
                    events.push(Event::Aborted { req_id: id.clone(), sample: t.sample, captured: t.captured, prompt_len: t.prompt_len })
                }
                _ => {}
            }
        }
        if let Some(id) = outputs.keys().next() {
            bail!(
                Attribution,
                "step {step}: output tokens arrived for request {id:?}, which did not finish in this step or does \
                 not capture its generated tokens"
            );
        }
        Ok(events)
    }

    /// Registers the step's new requests (a request announced again must keep its prompt); returns each one's
    /// start position.
    fn register<'a>(
        &mut self,
        new_requests: &'a [NewRequest],
        with_outputs: &[String],
        refused: &[String],
        events: &mut Vec<Event>,
    ) -> CoreResult<HashMap<&'a str, usize>> {
        let with_outputs: HashSet<&str> = with_outputs.iter().map(String::as_str).collect();
        let refused: HashSet<&str> = refused.iter().map(String::as_str).collect();
        let mut starts = HashMap::with_capacity(new_requests.len());
        for r in new_requests {
            ensure!(
                !r.prompt_token_ids.is_empty(),
                ShapeContract,
                "request {:?} has an empty prompt: there are no prompt tokens whose hidden states could be \
                 captured; drop empty prompts from the input",
                r.req_id
            );
            if let Some(t) = self.reqs.get(&r.req_id) {
                ensure!(
                    t.prompt_len == r.prompt_token_ids.len(),
                    Attribution,
                    "request {:?} was announced again with a {}-token prompt, it had {} tokens before; request \
                     ids must not be reused while a request is live",
                    r.req_id,
                    r.prompt_token_ids.len(),
                    t.prompt_len
                );
            } else {
                // A refused request is tracked as done from the start: its rows are never captured, it never
                // completes, and it ends without an event.
                let refuse = refused.contains(r.req_id.as_str());
                let captures_outputs = with_outputs.contains(r.req_id.as_str()) && !refuse;
                let sample = r.sample.map(SampleKey::Index).unwrap_or_else(|| SampleKey::Request(r.req_id.clone()));
                self.reqs.insert(
                    r.req_id.clone(),
                    Track {
                        sample,
                        token_ids: if refuse { Vec::new() } else { r.prompt_token_ids.clone() },
                        loss_mask: if refuse { None } else { r.loss_mask.clone() },
                        prompt_len: r.prompt_token_ids.len(),
                        captured: 0,
                        done: refuse,
                        with_outputs: captures_outputs,
                    },
                );
                if captures_outputs {
                    events.push(Event::Opened { req_id: r.req_id.clone() });
                }
            }
            starts.insert(r.req_id.as_str(), r.num_computed_tokens);
        }
        Ok(starts)
    }

    /// Each scheduled request's (start, tokens, rows to capture); the counts must add up to the step's total. The
    /// ids move into the step's map: no copy of each request's id every step.
    fn schedule(
        &mut self,
        num_scheduled: Vec<(String, usize)>,
        starts: &HashMap<&str, usize>,
        total_tokens: usize,
    ) -> CoreResult<HashMap<String, (usize, usize, usize)>> {
        let step = self.step;
        let mut sched = HashMap::with_capacity(num_scheduled.len());
        let mut sum = 0usize;
        for (id, n) in num_scheduled {
            sum = sum
                .checked_add(n)
                .ok_or_else(|| core_err!(Attribution, "step {step}: the scheduled token counts overflow (request {id:?}: {n})"))?;
            let Some(&start) = starts.get(id.as_str()) else {
                bail!(
                    Attribution,
                    "step {step}: request {id:?} has {n} scheduled tokens but is neither a new nor a cached request \
                     of the step, so its position is unknown"
                );
            };
            let Some(t) = self.reqs.get_mut(&id) else {
                bail!(
                    Attribution,
                    "step {step}: request {id:?} is scheduled but its prompt was never announced to hscapture (was the \
                     capture set up after the request started?)"
                );
            };
            let cap = rows_to_capture(step, &id, t, start, n)?;
            match sched.entry(id) {
                Entry::Occupied(e) => bail!(Attribution, "step {step}: request {:?} is scheduled twice", e.key()),
                Entry::Vacant(v) => v.insert((start, n, cap)),
            };
        }
        ensure!(
            sum == total_tokens,
            Attribution,
            "step {step}: scheduled tokens per request add up to {sum}, the step reports {total_tokens} in total"
        );
        Ok(sched)
    }

    /// Lays out the step in the order the model runner used (`order` = request ids, each owning
    /// its scheduled tokens consecutively) and returns the plan.
    pub fn plan(&mut self, order: &[String]) -> CoreResult<&StepPlan> {
        let step = self.step;
        let Some(p) = self.pending.as_mut() else {
            bail!(Attribution, "no step is in progress: the step plan is asked for outside a step");
        };
        ensure!(
            order.len() == p.sched.len(),
            Attribution,
            "step {step}: the model runner ordered {} requests, the scheduler scheduled {}",
            order.len(),
            p.sched.len()
        );
        let mut seen = HashSet::with_capacity(order.len());
        let mut segments = Vec::new();
        let (mut src, mut arena) = (0usize, 0usize);
        for id in order {
            ensure!(seen.insert(id.as_str()), Attribution, "step {step}: request {id:?} appears twice in the runner's order");
            let Some(&(start, n, cap)) = p.sched.get(id) else {
                bail!(Attribution, "step {step}: the runner's order names request {id:?}, which the scheduler did not schedule");
            };
            if cap > 0 {
                let Some(t) = self.reqs.get(id) else {
                    bail!(Attribution, "step {step}: request {id:?} vanished while the step was planned");
                };
                segments.push(Segment {
                    req_id: id.clone(),
                    sample: t.sample.clone(),
                    prompt_len: t.prompt_len,
                    src_row: src,
                    arena_row: arena,
                    dst_pos: start,
                    len: cap,
                    grows: t.with_outputs,
                });
                arena += cap;
            }
            src += n;
        }
        p.plan = Some(StepPlan { step, total_tokens: p.total_tokens, arena_rows: arena, segments });
        match &p.plan {
            Some(plan) => Ok(plan),
            None => bail!(Attribution, "step {step}: plan missing"),
        }
    }

    /// The plan of the step in progress, if [`Tracker::plan`] was called.
    pub fn current_plan(&self) -> Option<&StepPlan> {
        self.pending.as_ref().and_then(|p| p.plan.as_ref())
    }

    /// Whether a step is in progress.
    pub fn in_step(&self) -> bool {
        self.pending.is_some()
    }

    /// Ends the step: advances every request by the rows captured and reports those whose prompt is
    /// now complete. A step whose plan was never made (no forward ran) must capture nothing.
    pub fn commit(&mut self) -> CoreResult<Vec<Event>> {
        let step = self.step;
        let Some(p) = self.pending.take() else {
            bail!(Attribution, "no step is in progress: a step was ended twice");
        };
        let Some(plan) = p.plan else {
            let rows: usize = p.sched.values().map(|&(_, _, c)| c).sum();
            ensure!(
                rows == 0,
                Attribution,
                "step {step}: {rows} prompt tokens were scheduled but no decoder layer ran (no capture hook fired); \
                 the model's forward did not pass through the hooked layers"
            );
            return Ok(std::mem::take(&mut self.finished));
        };
        let mut events = std::mem::take(&mut self.finished);
        for s in &plan.segments {
            let Some(t) = self.reqs.get_mut(&s.req_id) else {
                bail!(Attribution, "step {step}: request {:?} vanished during the step", s.req_id);
            };
            t.captured = s.dst_pos + s.len;
            if t.captured == t.prompt_len && !t.with_outputs {
                t.done = true;
                events.push(Event::Completed {
                    req_id: s.req_id.clone(),
                    sample: t.sample.clone(),
                    token_ids: std::mem::take(&mut t.token_ids),
                    loss_mask: t.loss_mask.take(),
                });
            }
        }
        Ok(events)
    }

    /// Abandons the step in progress (its forward failed); captured progress is unchanged.
    pub fn abandon(&mut self) {
        self.pending = None;
    }
}

/// The rows of `n` tokens scheduled from `start` that `t` captures: none once its sample is done (or a
/// prompt-only request is past its prompt); else from `start` on, which must not skip uncaptured positions.
fn rows_to_capture(step: u64, id: &str, t: &mut Track, start: usize, n: usize) -> CoreResult<usize> {
    if t.done || (start >= t.prompt_len && !t.with_outputs) {
        return Ok(0);
    }
    ensure!(
        start <= t.captured,
        Attribution,
        "step {step}: {} ({id:?}) resumes at prompt position {start} but only positions 0..{} were computed and \
         captured: the scheduler skipped prompt tokens (prefix caching or a KV-cache transfer), whose hidden states \
         are never computed; disable prefix caching (`enable_prefix_caching=False`, `--no-enable-prefix-caching`)",
        t.sample,
        t.captured
    );
    // Recompute from an earlier position: rows from `start` on are captured again.
    t.captured = start;
    Ok(if t.with_outputs { n } else { n.min(t.prompt_len - start) })
}

#[cfg(test)]
#[path = "tests/plan.rs"]
mod tests;
