//! `CaptureSession`: the binding of one worker's capture ([`WorkerSession`]), driven by the Python
//! worker once per step. Conversions only: every decision is the core's.

use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};

use super::errors::guard;
use super::functions::record_dict;
use super::interpreter::holding;
use super::output::Output;
use super::step::Step;
use super::tensor::{describe, parse_dtype};
use crate::attribution::layers::{Convention, LayerPlan};
use crate::capture::cuda::CudaDevice;
use crate::capture::session::SessionConfig;
use crate::capture::tensor::Device;
use crate::output::ledger::record::SampleRecord;
use crate::sample::SampleKey;
use crate::worker::{OutputSettings, StepReport, WorkerSession};

/// `(step, checksum as i64, rows, samples completed)`.
type ReportTuple = (u64, i64, usize, usize);

#[pyclass(module = "hscapture._native")]
pub struct CaptureSession {
    inner: WorkerSession,
}

fn records<'py>(py: Python<'py>, rs: &[SampleRecord]) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for r in rs {
        out.append(record_dict(py, r)?)?;
    }
    Ok(out)
}

fn key_str(k: &SampleKey) -> String {
    match k {
        SampleKey::Index(i) => i.to_string(),
        SampleKey::Request(r) => r.clone(),
    }
}

fn tuples(rs: Vec<StepReport>) -> Vec<ReportTuple> {
    // The checksum travels as i64: what a torch int64 all-gather carries.
    rs.into_iter().map(|r| (r.step, r.checksum as i64, r.rows, r.completed)).collect()
}

#[pymethods]
impl CaptureSession {
    /// One worker's capture of `layer_ids` (in `convention`) from a model of `num_hidden_layers` layers of
    /// `hidden_size` in `model_dtype`, stored as `out_dtype`; `assemble`: this rank assembles samples (else it only
    /// verifies); `output`: where they go (`Output`; None keeps them in memory).
    #[new]
    #[pyo3(signature = (layer_ids, convention, num_hidden_layers, hidden_size, model_dtype, out_dtype, assemble, output=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        layer_ids: Vec<i64>,
        convention: &str,
        num_hidden_layers: usize,
        hidden_size: usize,
        model_dtype: &str,
        out_dtype: &str,
        assemble: bool,
        output: Option<Py<Output>>,
    ) -> PyResult<Self> {
        guard("CaptureSession()", || {
            let cfg = SessionConfig {
                layers: LayerPlan::new(&layer_ids, Convention::parse(convention)?, num_hidden_layers)?,
                hidden_size,
                model_dtype: parse_dtype(model_dtype, "model dtype")?,
                out_dtype: parse_dtype(out_dtype, "output dtype")?,
                assemble,
            };
            let out = match output {
                Some(o) => o.get().settings().clone(),
                None => OutputSettings::in_memory(),
            };
            Ok(CaptureSession { inner: py.detach(|| WorkerSession::new(cfg, out))? })
        })
    }

    /// Capture points in slot order: `("embeddings", 0)` or `("layer_output", k)`.
    fn capture_points(&self) -> PyResult<Vec<(&'static str, usize)>> {
        guard("capture_points", || Ok(super::functions::points(self.inner.layers())))
    }

    /// Checks that `point` (a compiled graph's tap's) is slot `slot`'s capture point; a `CompatibilityError` if not.
    fn check_point(&self, slot: usize, point: i32) -> PyResult<()> {
        guard("check_point", || Ok(self.inner.check_point(slot, point)?))
    }

    /// Checks what slot `slot`'s tensors must be whatever the step (width, dtype, rows as the second-to-last
    /// dimension); a `ShapeContractError` if not. For the forwards vLLM runs before any request.
    #[pyo3(signature = (slot, hidden, residual=None))]
    fn check_shape(&self, slot: usize, hidden: &Bound<'_, PyAny>, residual: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        guard("check_shape", || {
            let h = describe(hidden, "hidden states")?;
            let r = residual.map(|r| describe(r, "residual")).transpose()?;
            Ok(self.inner.check_shape(slot, &h, r.as_ref())?)
        })
    }

    /// Each slot's capture point as the number a compiled graph's tap carries (`k`: the output of decoder layer `k`;
    /// -1: the embeddings).
    fn point_codes(&self) -> PyResult<Vec<i32>> {
        guard("point_codes", || Ok(self.inner.layers().points().into_iter().map(|p| p.code()).collect()))
    }

    #[getter]
    fn layer_ids(&self) -> PyResult<Vec<usize>> {
        guard("layer_ids", || Ok(self.inner.layers().ids.clone()))
    }

    #[getter]
    fn in_step(&self) -> PyResult<bool> {
        guard("in_step", || Ok(self.inner.in_step()))
    }

    #[getter]
    fn planned(&self) -> PyResult<bool> {
        guard("planned", || Ok(self.inner.planned()))
    }

    /// Registers a step's scheduler output (a `Step`, taken: each step builds its own); returns the reports of
    /// the device steps it accounted.
    fn begin_step(&mut self, step: &Bound<'_, Step>) -> PyResult<Vec<ReportTuple>> {
        guard("begin_step", || {
            let input = step.borrow_mut().take()?;
            // The GIL is kept: the core lets go of it only where it waits (a device step's copies, the ring, the
            // writer), `crate::blocking`. Let go of for the whole call, winning it back from the engine's other
            // Python threads would cost every step.
            Ok(tuples(holding(|| self.inner.begin_step(input))?))
        })
    }

    /// Fixes the step's layout from the runner's request order; with `stream` (the forward's, a raw CUDA stream
    /// handle) also arms the device capture for it, before the forward. Returns the number of prompt rows.
    #[pyo3(signature = (order, stream=None))]
    fn plan(&mut self, order: Vec<String>, stream: Option<u64>) -> PyResult<usize> {
        guard("plan", || Ok(holding(|| self.inner.plan(&order, stream))?))
    }

    /// Captures slot `slot` from a layer's hidden states (+ residual): torch tensors, read in place
    /// (host) or by the capture kernel enqueued on `stream`, a raw CUDA stream handle (device; outside a step the
    /// launch writes nothing: what a CUDA graph being captured records). `point`: the capture point a compiled
    /// graph's tap carries, checked against the slot's.
    #[pyo3(signature = (slot, hidden, residual=None, stream=0, point=None))]
    fn capture(
        &mut self,
        py: Python<'_>,
        slot: usize,
        hidden: &Bound<'_, PyAny>,
        residual: Option<&Bound<'_, PyAny>>,
        stream: u64,
        point: Option<i32>,
    ) -> PyResult<()> {
        guard("capture", || {
            let h = describe(hidden, "hidden states")?;
            let r = residual.map(|r| describe(r, "residual")).transpose()?;
            let inner = &mut self.inner;
            // SAFETY: `hidden` and `residual` are borrowed for this whole call, so their memory stays
            // allocated; vLLM's forward is paused inside the hook that called us, so nothing writes to
            // it while the GIL is released; device work is enqueued on the stream PyTorch's forward uses,
            // so it runs before the caching allocator can hand the memory to anything later (a CUDA graph that
            // records the launch owns the memory it recorded).
            let capture = || unsafe { inner.capture(slot, point, &h, r.as_ref(), stream) };
            // A large host tensor's rows are copied here, at length: without the GIL. A device launch is enqueued in
            // microseconds, and a few host rows copied in less than winning the GIL back would take (a wait, if
            // any, lets go of it in the core).
            let bytes = h.rows().saturating_mul(h.width()).saturating_mul(h.dtype.size());
            match h.device {
                Device::Cpu if bytes >= crate::blocking::LONG_COPY => py.detach(capture)?,
                _ => holding(capture)?,
            }
            Ok(())
        })
    }

    /// Ends the step. Returns `[(step, checksum_as_i64, rows, completed)]` for the steps accounted now,
    /// oldest first (see `Session::end_step`).
    fn end_step(&mut self) -> PyResult<Vec<ReportTuple>> {
        guard("end_step", || Ok(tuples(holding(|| self.inner.end_step())?)))
    }

    /// Accounts every device step still in flight and waits for the assembler thread.
    fn flush(&mut self, py: Python<'_>) -> PyResult<Vec<ReportTuple>> {
        guard("flush", || {
            let inner = &mut self.inner;
            Ok(tuples(py.detach(|| inner.flush())?))
        })
    }

    /// Every step accounted so far is agreed on by the ranks (their meeting passed): its samples are stored.
    /// Samples of steps never released are never written.
    fn release(&mut self) -> PyResult<()> {
        // A wait for the writer or the backlog lets go of the GIL in the core (`crate::blocking`).
        guard("release", || Ok(holding(|| self.inner.release())?))
    }

    /// What happened since the last call that the worker should log: a stalled writer (per-request files past the
    /// backlog's deadline), what a sweep of the staging directory removed.
    fn take_notes(&mut self) -> PyResult<Vec<String>> {
        guard("take_notes", || Ok(self.inner.take_notes()))
    }

    /// Copies rows into per-request buffers on a thread of its own (a ring of `ring` step buffers).
    #[pyo3(signature = (ring=2))]
    fn set_background(&mut self, ring: usize) -> PyResult<()> {
        guard("set_background", || Ok(self.inner.set_background(ring)?))
    }

    #[getter]
    fn background(&self) -> PyResult<bool> {
        guard("background", || Ok(self.inner.background()))
    }

    /// Captures CUDA tensors on device `ordinal` from now on: compiles the capture kernel (NVRTC) and
    /// allocates the fixed device arena of `capacity_rows` rows per layer and `host_ring` pinned host
    /// buffers of that size, and as many of `small_rows` rows when it is below `capacity_rows` (0: none): a step
    /// takes the smallest free one that holds its rows, so that decode steps do not wait for the large ones the
    /// assembler thread still reads. `overlap`: ended steps kept in flight (0, 1 or 2; a bool is 0 or 1), their
    /// copies running while the next forwards do (needs `host_ring` > `overlap`; the arena then has two halves).
    /// With `fp8`, each step is quantized on the device (the fp8 format's codes and scales cross PCIe). Returns the
    /// architecture the kernel was built for. Steps of at least `early_copy_bytes` bytes of rows per layer (a prefill)
    /// copy each layer's rows as soon as its kernel ran, while the forward goes on (None: every copy after it).
    #[pyo3(signature = (ordinal, capacity_rows, host_ring=2, overlap=1, fp8=false, small_rows=0, early_copy_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn enable_device(
        &mut self,
        py: Python<'_>,
        ordinal: i32,
        capacity_rows: usize,
        host_ring: usize,
        overlap: usize,
        fp8: bool,
        small_rows: usize,
        early_copy_bytes: Option<usize>,
    ) -> PyResult<String> {
        guard("enable_device", || {
            let (slots, width, dtype) = self.inner.geometry();
            let halves = if overlap == 0 { 1 } else { 2 };
            let dev = py.detach(|| {
                CudaDevice::new(
                    ordinal,
                    slots,
                    width,
                    dtype,
                    capacity_rows,
                    halves,
                    host_ring,
                    small_rows,
                    fp8,
                    early_copy_bytes.unwrap_or(usize::MAX),
                )
            })?;
            let arch = dev.arch().to_string();
            self.inner.set_device(Box::new(dev), overlap)?;
            Ok(arch)
        })
    }

    #[getter]
    fn device_bytes(&self) -> PyResult<usize> {
        guard("device_bytes", || Ok(self.inner.device_bytes()))
    }

    /// Prompt rows per request in the planned step, in the runner's order: `[(request_id, rows)]`.
    fn step_rows(&self) -> PyResult<Vec<(String, usize)>> {
        guard("step_rows", || Ok(self.inner.step_rows()))
    }

    /// Pipeline parallelism: the slots this rank neither captures nor receives.
    fn set_absent_slots(&mut self, slots: Vec<usize>) -> PyResult<()> {
        guard("set_absent_slots", || Ok(self.inner.set_absent_slots(&slots)?))
    }

    /// This step's rows of `slots` as one message for the assembling pipeline stage (a bytearray: torch
    /// can send it without another copy).
    fn export_slots<'py>(&self, py: Python<'py>, slots: Vec<usize>) -> PyResult<Bound<'py, PyByteArray>> {
        guard("export_slots", || Ok(PyByteArray::new(py, &self.inner.export_slots(&slots)?)))
    }

    /// Writes another stage's message (from `export_slots`) into this step; returns the slots filled.
    fn import_slots(&mut self, py: Python<'_>, message: &[u8], sender: &str) -> PyResult<Vec<usize>> {
        guard("import_slots", || {
            let inner = &mut self.inner;
            Ok(py.detach(|| inner.import_slots(message, sender))?)
        })
    }

    /// Opt-in: skip samples with NaN/Inf values (reported by `take_skipped`) instead of failing.
    fn set_skip_nonfinite(&mut self, skip: bool) -> PyResult<()> {
        guard("set_skip_nonfinite", || {
            self.inner.set_skip_nonfinite(skip);
            Ok(())
        })
    }

    /// Samples skipped for non-finite values since the last call: `(sample, request_id, why)`;
    /// `sample` is the sample index as a string, or the request id for requests without one.
    fn take_skipped(&mut self) -> PyResult<Vec<(String, String, String)>> {
        guard("take_skipped", || Ok(self.inner.take_skipped().into_iter().map(|(k, r, why)| (key_str(&k), r, why)).collect()))
    }

    /// Drops the step in progress (its forward failed); a device capture armed for it is disarmed.
    fn abandon_step(&mut self) -> PyResult<()> {
        guard("abandon_step", || Ok(self.inner.abandon_step()?))
    }

    /// Completed samples kept in memory (sessions without an output directory), removed from the
    /// session: dicts with `sample`, `request_id`, `token_ids`, `shape`, `dtype`, `data` (bytes).
    fn take_samples<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard("take_samples", || {
            let inner = &mut self.inner;
            let samples = py.detach(|| inner.take_samples())?;
            let out = PyList::empty(py);
            for s in samples {
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
        })
    }

    /// Requests that ended before their prompt was complete: `(request_id, sample, captured, prompt_len)`.
    fn take_aborted(&mut self) -> PyResult<Vec<(String, String, usize, usize)>> {
        guard("take_aborted", || {
            Ok(self.inner.take_aborted().into_iter().map(|a| (a.req_id, key_str(&a.sample), a.captured, a.prompt_len)).collect())
        })
    }

    /// Records of files written so far (removed from the session).
    fn take_records<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard("take_records", || records(py, &self.inner.take_records()?))
    }

    /// Waits until every completed sample is written (the writer keeps running); returns the records
    /// not yet taken.
    fn drain<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard("drain", || {
            let inner = &mut self.inner;
            let rs = py.detach(|| inner.drain())?;
            records(py, &rs)
        })
    }

    /// Finishes the writer (every queued sample written, its threads joined, even after an error,
    /// which is raised after that); returns the records not yet taken.
    fn finish<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        guard("finish", || {
            let inner = &mut self.inner;
            let rs = py.detach(|| inner.finish())?;
            records(py, &rs)
        })
    }

    /// What this capture is (format, model, layer_ids, convention, dtype as stored, hidden_size,
    /// num_hidden_layers): the one the journal and the files record.
    fn identity<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard("identity", || super::facts::identity_dict(py, self.inner.identity()))
    }

    /// Running totals: steps, rows, samples, aborted, skipped, live_requests, held_bytes, and the nanoseconds the
    /// worker's thread spent in each call (`ns_*`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guard("stats", || super::stats::stats(py, &self.inner))
    }
}

impl Drop for CaptureSession {
    /// Finishes the output without the GIL: a writer thread that puts into an object store calls back into Python
    /// (`py/store.rs`), so joining it while holding the GIL could wait forever.
    fn drop(&mut self) {
        let inner = &mut self.inner;
        Python::attach(|py| py.detach(|| drop(inner.finish())));
    }
}
