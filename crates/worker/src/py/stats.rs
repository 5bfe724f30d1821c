//! A worker's running totals as the dict `CaptureSession.stats()` returns (soaks, dashboards, benchmarks).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::worker::WorkerSession;

/// steps, rows, samples, aborted, skipped, refused, failed_requests (samples a server could not store, each failing its
/// request alone), live_requests, held_bytes; and the nanoseconds the worker's thread spent
/// in each call of the step protocol (`ns_*`, summed over the run), waits included.
pub fn stats<'py>(py: Python<'py>, w: &WorkerSession) -> PyResult<Bound<'py, PyDict>> {
    let (st, live_requests, held_bytes) = w.totals();
    let d = PyDict::new(py);
    d.set_item("steps", st.steps)?;
    d.set_item("rows", st.rows)?;
    d.set_item("samples", st.samples)?;
    d.set_item("aborted", st.aborted)?;
    d.set_item("skipped", st.skipped)?;
    d.set_item("refused", st.refused)?;
    d.set_item("failed_requests", w.failed_requests())?;
    d.set_item("live_requests", live_requests)?;
    d.set_item("held_bytes", held_bytes)?;
    let t = w.times;
    for (k, v) in [
        ("ns_begin_step", t.begin_step),
        ("ns_plan", t.plan),
        ("ns_capture", t.capture),
        ("ns_end_step", t.end_step),
        ("ns_release", t.release),
        ("ns_wait_backlog", t.backlog),
        ("ns_wait_ring", st.wait_ring_ns),
        ("ns_wait_copies", st.wait_copies_ns),
        ("ns_device_end", st.device_end_ns),
        ("ns_account", st.account_ns),
        ("ns_scatter", st.scatter_ns),
        ("ns_route", t.route),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}
