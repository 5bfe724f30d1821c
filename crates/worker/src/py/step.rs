//! `Step` and `NewRequest`: one step's scheduler output as the core needs it ([`StepInput`]), with named fields.
//! `vllm_compat.step_of` builds one from vLLM's objects; `CaptureSession.begin_step` takes it.

use foldhash::{HashSet, HashSetExt};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::guard;
use crate::attribution::plan::{CachedRequest, NewRequest, StepInput};
use crate::{bail, ensure, CoreResult};

/// `(request id, tokens)` pairs from the scheduler's dict, in its order.
fn scheduled_pairs(scheduled: Option<&Bound<'_, PyAny>>) -> CoreResult<Vec<(String, usize)>> {
    let Some(obj) = scheduled else {
        return Ok(Vec::new());
    };
    let Ok(d) = obj.cast::<PyDict>() else {
        let found = obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string());
        bail!(Compatibility, "the scheduler output's scheduled tokens are a {found}; expected a dict of request id -> count");
    };
    let bad = |e: PyErr| crate::core_err!(Compatibility, "the scheduler output's scheduled tokens: {e}; expected request id -> count");
    d.iter().map(|(k, v)| Ok((k.extract::<String>().map_err(bad)?, v.extract::<usize>().map_err(bad)?))).collect()
}

/// A request the step schedules for the first time.
#[pyclass(name = "NewRequest", module = "hscapture._native", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyNewRequest(NewRequest);

#[pymethods]
impl PyNewRequest {
    /// `sample`: the driver's sample index; `loss_mask`: the prompt's training mask (0/1 per token); `max_tokens`:
    /// the most tokens it may generate (what bounds a sample that grows with them).
    #[new]
    #[pyo3(signature = (req_id, prompt_token_ids, num_computed_tokens=0, *, sample=None, loss_mask=None, max_tokens=None))]
    fn new(
        req_id: String,
        prompt_token_ids: Vec<i64>,
        num_computed_tokens: usize,
        sample: Option<u64>,
        loss_mask: Option<Vec<u8>>,
        max_tokens: Option<usize>,
    ) -> Self {
        PyNewRequest(NewRequest { req_id, prompt_token_ids, num_computed_tokens, sample, loss_mask, max_tokens })
    }

    #[getter]
    fn req_id(&self) -> &str {
        &self.0.req_id
    }
    #[getter]
    fn prompt_token_ids(&self) -> Vec<i64> {
        self.0.prompt_token_ids.clone()
    }
    #[getter]
    fn num_computed_tokens(&self) -> usize {
        self.0.num_computed_tokens
    }
    #[getter]
    fn sample(&self) -> Option<u64> {
        self.0.sample
    }
    #[getter]
    fn loss_mask(&self) -> Option<Vec<u8>> {
        self.0.loss_mask.clone()
    }
    #[getter]
    fn max_tokens(&self) -> Option<usize> {
        self.0.max_tokens
    }

    fn __repr__(&self) -> String {
        let r = &self.0;
        format!(
            "NewRequest({:?}, {} prompt tokens, computed {}, sample {:?}, loss mask {}, max_tokens {:?})",
            r.req_id,
            r.prompt_token_ids.len(),
            r.num_computed_tokens,
            r.sample,
            if r.loss_mask.is_some() { "given" } else { "none" },
            r.max_tokens
        )
    }
}

/// One step's scheduler output, taken by one `begin_step` (a second one is refused: each step is built anew).
#[pyclass(name = "Step", module = "hscapture._native")]
pub struct Step {
    input: Option<StepInput>,
}

impl Step {
    /// The step's input for the core, once.
    pub fn take(&mut self) -> PyResult<StepInput> {
        self.input
            .take()
            .ok_or_else(|| crate::core_err!(Attribution, "this Step was begun already; expected a new Step for every step").into())
    }

    fn get(&self) -> PyResult<&StepInput> {
        self.input.as_ref().ok_or_else(|| crate::core_err!(Attribution, "this Step was begun already").into())
    }
}

#[pymethods]
impl Step {
    /// The cached requests as vLLM keeps them, columns passed as they are every step: `cached_ids`, `cached_computed`
    /// (their computed tokens) and `resumed` (the ids resumed after a preemption); `scheduled`: the scheduler's dict of
    /// tokens this step per request, in its order; `with_outputs`: new requests that capture their generated tokens
    /// too; `outputs`: `(request id, token ids)` of such requests finished now (every token that went through a
    /// forward).
    #[new]
    #[pyo3(signature = (*, new_requests=Vec::new(), cached_ids=Vec::new(), cached_computed=Vec::new(), resumed=HashSet::new(), scheduled=None, total_tokens=0, finished=Vec::new(), preempted=Vec::new(), with_outputs=Vec::new(), outputs=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        new_requests: Vec<PyRef<'_, PyNewRequest>>,
        cached_ids: Vec<String>,
        cached_computed: Vec<usize>,
        resumed: HashSet<String>,
        scheduled: Option<&Bound<'_, PyAny>>,
        total_tokens: usize,
        finished: Vec<String>,
        preempted: Vec<String>,
        with_outputs: Vec<String>,
        outputs: Vec<(String, Vec<i64>)>,
    ) -> PyResult<Self> {
        let build = || -> CoreResult<Step> {
            ensure!(
                cached_ids.len() == cached_computed.len(),
                Compatibility,
                "the scheduler output's cached requests: {} ids but {} computed-token counts; expected one count per id",
                cached_ids.len(),
                cached_computed.len()
            );
            let cached = cached_ids
                .into_iter()
                .zip(cached_computed)
                .map(|(req_id, num_computed_tokens)| {
                    let resumed = resumed.contains(&req_id);
                    CachedRequest { req_id, num_computed_tokens, resumed }
                })
                .collect();
            let input = StepInput {
                new_requests: new_requests.iter().map(|r| r.0.clone()).collect(),
                cached_requests: cached,
                num_scheduled: scheduled_pairs(scheduled)?,
                total_tokens,
                finished,
                preempted,
                with_outputs,
                outputs,
                refused: Vec::new(), // decided by the worker session (its bound on a growing sample)
            };
            Ok(Step { input: Some(input) })
        };
        guard("Step", || Ok(build()?))
    }

    #[getter]
    fn new_requests(&self) -> PyResult<Vec<PyNewRequest>> {
        guard("Step.new_requests", || Ok(self.get()?.new_requests.iter().cloned().map(PyNewRequest).collect()))
    }
    #[getter]
    fn cached_requests(&self) -> PyResult<Vec<(String, usize, bool)>> {
        guard("Step.cached_requests", || {
            Ok(self.get()?.cached_requests.iter().map(|c| (c.req_id.clone(), c.num_computed_tokens, c.resumed)).collect())
        })
    }
    #[getter]
    fn scheduled(&self) -> PyResult<Vec<(String, usize)>> {
        guard("Step.scheduled", || Ok(self.get()?.num_scheduled.clone()))
    }
    #[getter]
    fn total_tokens(&self) -> PyResult<usize> {
        guard("Step.total_tokens", || Ok(self.get()?.total_tokens))
    }
    #[getter]
    fn finished(&self) -> PyResult<Vec<String>> {
        guard("Step.finished", || Ok(self.get()?.finished.clone()))
    }
    #[getter]
    fn preempted(&self) -> PyResult<Vec<String>> {
        guard("Step.preempted", || Ok(self.get()?.preempted.clone()))
    }
    #[getter]
    fn with_outputs(&self) -> PyResult<Vec<String>> {
        guard("Step.with_outputs", || Ok(self.get()?.with_outputs.clone()))
    }
    #[getter]
    fn outputs(&self) -> PyResult<Vec<(String, Vec<i64>)>> {
        guard("Step.outputs", || Ok(self.get()?.outputs.clone()))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNewRequest>()?;
    m.add_class::<Step>()?;
    Ok(())
}
