//! `CaptureSession`: one worker's capture state, driven by the Python worker once per step.

use std::collections::HashMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};

use super::errors::guard;
use super::tensor::{describe, parse_dtype};
use crate::attribution::layers::{CapturePoint, Convention, LayerPlan};
use crate::attribution::plan::{CachedRequest, NewRequest, SampleKey, StepInput};
use crate::ranks::checksums::verify_replicated;
use crate::output::sample::Sample;
use crate::capture::cuda::CudaDevice;
use crate::capture::session::{Session, SessionConfig, StepOutcome};
use crate::output::writer::{SampleRecord, Writer, WriterConfig};

type NewReqTuple = (String, Vec<i64>, usize, Option<u64>);
type CachedReqTuple = (String, usize, bool);

#[pyclass(module = "hscapture._native")]
pub struct CaptureSession {
    inner: Session,
    writer: Option<Writer>,
    samples: Vec<Sample>,
    aborted: Vec<(String, String, usize, usize)>,
}

fn record_dict<'py>(py: Python<'py>, r: &SampleRecord) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("index", r.index)?;
    d.set_item("request_id", r.request_id.clone())?;
    d.set_item("file", &r.file)?;
    d.set_item("length", r.length)?;
    d.set_item("checksum", &r.checksum)?;
    d.set_item("bytes", r.bytes)?;
    Ok(d)
}

fn key_str(k: &SampleKey) -> String {
    match k {
        SampleKey::Index(i) => i.to_string(),
        SampleKey::Request(r) => r.clone(),
    }
}

type OutcomeTuple = (u64, i64, usize, usize);

impl CaptureSession {
    /// Hands an assembled step's samples to the writer (or keeps them) and reports it.
    /// Also collects what the assembler thread completed meanwhile (all of it, waiting, with `fence`).
    fn take_outcome(&mut self, py: Python<'_>, outs: Vec<StepOutcome>, fence: bool) -> PyResult<Vec<OutcomeTuple>> {
        let inner = &mut self.inner;
        let mut ready = py.detach(|| inner.take_ready(fence))?;
        let mut tuples = Vec::with_capacity(outs.len());
        for mut out in outs {
            let completed = out.completed.len();
            ready.append(&mut out.completed);
            for a in &out.aborted {
                self.aborted.push((a.req_id.clone(), key_str(&a.sample), a.captured, a.prompt_len));
            }
            tuples.push((out.step, out.checksum as i64, out.rows, completed));
        }
        if let Some(w) = self.writer.as_mut() {
            // Blocks while the writer's queue is full (backpressure), without holding the GIL.
            py.detach(|| ready.into_iter().try_for_each(|s| w.submit(s)))?;
        } else {
            self.samples.extend(ready);
        }
        Ok(tuples)
    }
}

#[pymethods]
impl CaptureSession {
    /// `out_dir=None` keeps completed samples in memory for `take_samples()`; otherwise they are
    /// written to `out_dir/hidden_states/` by `writer_threads` threads.
    #[new]
    #[pyo3(signature = (layer_ids, convention, num_hidden_layers, hidden_size, model_dtype, out_dtype, assemble, out_dir=None, writer_threads=4, writer_queue=8, durable=true, metadata=HashMap::new(), compress=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        layer_ids: Vec<i64>,
        convention: &str,
        num_hidden_layers: usize,
        hidden_size: usize,
        model_dtype: &str,
        out_dtype: &str,
        assemble: bool,
        out_dir: Option<PathBuf>,
        writer_threads: usize,
        writer_queue: usize,
        durable: bool,
        metadata: HashMap<String, String>,
        compress: Option<i32>,
    ) -> PyResult<Self> {
        guard("CaptureSession()", || {
            let layers = LayerPlan::new(&layer_ids, Convention::parse(convention)?, num_hidden_layers)?;
            let cfg = SessionConfig {
                layers,
                hidden_size,
                model_dtype: parse_dtype(model_dtype, "model dtype")?,
                out_dtype: parse_dtype(out_dtype, "output dtype")?,
                assemble,
            };
            let inner = Session::new(cfg)?;
            if compress.is_some_and(|l| !(1..=22).contains(&l)) {
                return Err(crate::core_err!(
                    Config,
                    "compression level {compress:?}: zstd takes 1..=22 (3 is a good default); leave it unset for none"
                )
                .into());
            }
            let writer = match (assemble, out_dir) {
                (true, Some(root)) => Some(Writer::start(WriterConfig {
                    root,
                    threads: writer_threads,
                    queue: writer_queue,
                    durable,
                    metadata,
                    pool: Some(inner.pool()),
                    compress,
                })?),
                _ => None,
            };
            Ok(CaptureSession { inner, writer, samples: Vec::new(), aborted: Vec::new() })
        })
    }

    /// Capture points in slot order: `("embeddings", 0)` or `("layer_output", k)`.
    fn capture_points(&self) -> Vec<(&'static str, usize)> {
        self.inner
            .config()
            .layers
            .points()
            .into_iter()
            .map(|p| match p {
                CapturePoint::Embeddings => ("embeddings", 0),
                CapturePoint::LayerOutput(k) => ("layer_output", k),
            })
            .collect()
    }

    #[getter]
    fn layer_ids(&self) -> Vec<usize> {
        self.inner.config().layers.ids.clone()
    }

    #[getter]
    fn in_step(&self) -> bool {
        self.inner.in_step()
    }

    #[getter]
    fn planned(&self) -> bool {
        self.inner.planned()
    }

    /// Registers a step's scheduler output.
    #[pyo3(signature = (new_requests, cached_requests, scheduled, total_tokens, finished, preempted))]
    #[allow(clippy::too_many_arguments)]
    fn begin_step(
        &mut self,
        py: Python<'_>,
        new_requests: Vec<NewReqTuple>,
        cached_requests: Vec<CachedReqTuple>,
        scheduled: Vec<(String, usize)>,
        total_tokens: usize,
        finished: Vec<String>,
        preempted: Vec<String>,
    ) -> PyResult<Vec<OutcomeTuple>> {
        guard("begin_step", || {
            let input = StepInput {
                new_requests: new_requests
                    .into_iter()
                    .map(|(req_id, prompt_token_ids, num_computed_tokens, sample)| NewRequest { req_id, prompt_token_ids, num_computed_tokens, sample })
                    .collect(),
                cached_requests: cached_requests
                    .into_iter()
                    .map(|(req_id, num_computed_tokens, resumed)| CachedRequest { req_id, num_computed_tokens, resumed })
                    .collect(),
                num_scheduled: scheduled,
                total_tokens,
                finished,
                preempted,
            };
            // May wait for a device step's copies (and for the ring): without the GIL.
            let inner = &mut self.inner;
            let out = py.detach(|| inner.begin_step(input))?;
            self.take_outcome(py, out, false)
        })
    }

    /// Fixes the step's layout from the runner's request order; returns the number of prompt rows.
    /// May wait for a host buffer to come back from the assembler thread: without the GIL.
    fn plan(&mut self, py: Python<'_>, order: Vec<String>) -> PyResult<usize> {
        guard("plan", || {
            let inner = &mut self.inner;
            Ok(py.detach(|| inner.plan(&order).map(|p| p.arena_rows))?)
        })
    }

    /// Captures slot `slot` from a layer's hidden states (+ residual): torch tensors, read in place
    /// (host) or by the capture kernel enqueued on `stream`, a raw CUDA stream handle (device).
    #[pyo3(signature = (slot, hidden, residual=None, stream=0))]
    fn capture(&mut self, py: Python<'_>, slot: usize, hidden: &Bound<'_, PyAny>, residual: Option<&Bound<'_, PyAny>>, stream: u64) -> PyResult<()> {
        guard("capture", || {
            let h = describe(hidden, "hidden states")?;
            let r = residual.map(|r| describe(r, "residual")).transpose()?;
            let inner = &mut self.inner;
            // SAFETY: `hidden` and `residual` are borrowed for this whole call, so their memory stays
            // allocated; vLLM's forward is paused inside the hook that called us, so nothing writes to
            // it while the GIL is released; device work is enqueued on the stream PyTorch's forward uses,
            // so it runs before the caching allocator can hand the memory to anything later.
            py.detach(|| unsafe { inner.capture(slot, &h, r.as_ref(), stream) })?;
            Ok(())
        })
    }

    /// Ends the step. Returns `[(step, checksum_as_i64, rows, completed)]` for the steps assembled now,
    /// oldest first: a host step (after any device step still in flight); none for a device step
    /// (assembled by a later `begin_step`, or at `flush`). `begin_step` returns the same for the
    /// device steps it assembles.
    fn end_step(&mut self, py: Python<'_>) -> PyResult<Vec<OutcomeTuple>> {
        guard("end_step", || {
            let inner = &mut self.inner;
            let out = py.detach(|| inner.end_step())?;
            self.take_outcome(py, out, false)
        })
    }

    /// Assembles every device step still in flight and waits for the assembler thread to finish every
    /// step handed to it; same result as `end_step` (empty if no device step was in flight).
    fn flush(&mut self, py: Python<'_>) -> PyResult<Vec<OutcomeTuple>> {
        guard("flush", || {
            let inner = &mut self.inner;
            let out = py.detach(|| inner.flush())?;
            self.take_outcome(py, out, true)
        })
    }

    /// Copies rows into per-request buffers on a thread of its own (a ring of `ring` step buffers), so
    /// the next forward does not wait for it. Only before the first step.
    #[pyo3(signature = (ring=2))]
    fn set_background(&mut self, ring: usize) -> PyResult<()> {
        guard("set_background", || {
            self.inner.set_background(ring)?;
            // Samples go from the assembler thread to the writer: nothing of them on this thread.
            let sink = self.writer.as_ref().and_then(|w| w.submitter());
            Ok(self.inner.set_sink(sink)?)
        })
    }

    #[getter]
    fn background(&self) -> bool {
        self.inner.background()
    }

    /// Captures CUDA tensors on device `ordinal` from now on: compiles the capture kernel (NVRTC) and
    /// allocates the fixed device arena of `capacity_rows` rows per layer and `host_ring` pinned host
    /// buffers. With `overlap`, a step begins while the previous one's forward and copies are in flight
    /// (needs `host_ring` ≥ 2). Returns the architecture the kernel was built for.
    #[pyo3(signature = (ordinal, capacity_rows, host_ring=2, overlap=true))]
    fn enable_device(&mut self, py: Python<'_>, ordinal: i32, capacity_rows: usize, host_ring: usize, overlap: bool) -> PyResult<String> {
        guard("enable_device", || {
            let cfg = self.inner.config().clone();
            let dev = py.detach(|| CudaDevice::new(ordinal, cfg.layers.num_slots(), cfg.hidden_size, cfg.out_dtype, capacity_rows, host_ring))?;
            let arch = dev.arch().to_string();
            self.inner.set_device(Box::new(dev), overlap)?;
            Ok(arch)
        })
    }

    #[getter]
    fn device_bytes(&self) -> usize {
        self.inner.device_bytes()
    }

    /// Prompt rows per request in the planned step, in the runner's order: `[(request_id, rows)]`.
    fn step_rows(&self) -> Vec<(String, usize)> {
        self.inner.step_rows()
    }

    /// Pipeline parallelism: the slots this rank neither captures nor receives.
    fn set_absent_slots(&mut self, slots: Vec<usize>) -> PyResult<()> {
        guard("set_absent_slots", || Ok(self.inner.set_absent_slots(&slots)?))
    }

    /// This step's rows of `slots` as one message for the assembling pipeline stage (a bytearray: torch
    /// can send it without another copy).
    fn export_slots<'py>(&self, py: Python<'py>, slots: Vec<usize>) -> PyResult<Bound<'py, PyByteArray>> {
        guard("export_slots", || {
            let b = self.inner.export_slots(&slots)?;
            Ok(PyByteArray::new(py, &b))
        })
    }

    /// Writes another stage's message (from `export_slots`) into this step; returns the slots filled.
    fn import_slots(&mut self, py: Python<'_>, message: &[u8], sender: &str) -> PyResult<Vec<usize>> {
        guard("import_slots", || {
            let inner = &mut self.inner;
            Ok(py.detach(|| inner.import_slots(message, sender))?)
        })
    }

    /// Opt-in: skip samples with NaN/Inf values (reported by `take_skipped`) instead of failing.
    fn set_skip_nonfinite(&mut self, skip: bool) {
        self.inner.set_skip_nonfinite(skip);
    }

    /// Samples skipped for non-finite values since the last call: `(sample, request_id, why)`;
    /// `sample` is the sample index as a string, or the request id for requests without one.
    fn take_skipped(&mut self) -> Vec<(String, String, String)> {
        self.inner.take_skipped().into_iter().map(|(k, r, why)| (key_str(&k), r, why)).collect()
    }

    /// Drops the step in progress (its forward failed).
    fn abandon_step(&mut self) {
        self.inner.abandon_step();
    }

    /// Compares the step checksums gathered from every rank of a group (index = group rank).
    #[staticmethod]
    fn verify_ranks(step: u64, what: &str, checksums: Vec<i64>) -> PyResult<()> {
        let c: Vec<u64> = checksums.into_iter().map(|x| x as u64).collect();
        Ok(verify_replicated(step, what, &c)?)
    }

    /// Completed samples kept in memory (sessions without an output directory), removed from the
    /// session: dicts with `sample`, `request_id`, `token_ids`, `shape`, `dtype`, `data` (bytes).
    fn take_samples<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard("take_samples", || self.take_outcome(py, Vec::new(), true).map(|_| ()))?;
        let out = PyList::empty(py);
        for s in self.samples.drain(..) {
            let d = PyDict::new(py);
            match &s.key {
                SampleKey::Index(i) => d.set_item("sample", *i)?,
                SampleKey::Request(_) => d.set_item("sample", py.None())?,
            }
            d.set_item("request_id", &s.req_id)?;
            d.set_item("token_ids", &s.token_ids)?;
            d.set_item("shape", s.shape().to_vec())?;
            d.set_item("dtype", s.dtype.torch_name())?;
            d.set_item("data", PyBytes::new(py, &s.data))?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Requests that ended before their prompt was complete: `(request_id, sample, captured, prompt_len)`.
    fn take_aborted(&mut self) -> Vec<(String, String, usize, usize)> {
        std::mem::take(&mut self.aborted)
    }

    /// Records of files written so far (removed from the session).
    fn take_records<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        if let Some(w) = &self.writer {
            w.poll()?;
            for r in w.take_records() {
                out.append(record_dict(py, &r)?)?;
            }
        }
        Ok(out)
    }

    /// Waits until every completed sample is written (the writer keeps running); returns the records
    /// not yet taken.
    fn drain<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard("drain", || self.take_outcome(py, Vec::new(), true).map(|_| ()))?;
        if let Some(w) = self.writer.as_ref() {
            py.detach(|| w.drain())?;
        }
        self.take_records(py)
    }

    /// Waits for the writer to finish every queued sample; returns the records not yet taken.
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        // Even after an error, the writer is finished (its queue written, its threads joined); the first
        // error is reported after that.
        let first = guard("finish", || {
            let r = self.take_outcome(py, Vec::new(), true).map(|_| ());
            // The writer's threads stop only once the assembler's submitter is gone.
            let inner = &mut self.inner;
            let unset = py.detach(|| inner.set_sink(None)).map_err(PyErr::from);
            r.and(unset)?;
            self.take_outcome(py, Vec::new(), true).map(|_| ())
        })
        .err();
        let finished = match self.writer.as_mut() {
            Some(w) => py.detach(|| w.finish()).map_err(PyErr::from),
            None => Ok(Vec::new()),
        };
        if let Some(e) = first {
            return Err(e);
        }
        let recs = finished?;
        let out = PyList::empty(py);
        for r in &recs {
            out.append(record_dict(py, r)?)?;
        }
        Ok(out)
    }

    /// Running totals: steps, rows, samples, aborted, live_requests, held_bytes.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("rows", s.rows)?;
        d.set_item("samples", s.samples)?;
        d.set_item("aborted", s.aborted)?;
        d.set_item("skipped", s.skipped)?;
        d.set_item("live_requests", self.inner.tracker().live_requests())?;
        d.set_item("held_bytes", self.inner.held_bytes())?;
        Ok(d)
    }
}
