//! Module-level functions: layer validation, manifests, sample files, the CUDA probe.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::errors::guard;
use crate::attribution::layers::{default_ids, CapturePoint, Convention, LayerPlan};
use crate::output::manifest::Manifest;
use crate::output::safetensors::read_sample_file;
use crate::output::sample::content_checksum;

/// Validates layer ids for a convention and model depth; returns them sorted ascending.
#[pyfunction]
fn validate_layers(ids: Vec<i64>, convention: &str, num_hidden_layers: usize) -> PyResult<Vec<usize>> {
    guard("validate_layers", || Ok(LayerPlan::new(&ids, Convention::parse(convention)?, num_hidden_layers)?.ids))
}

/// The ecosystem's default ids for a convention and model depth.
#[pyfunction]
fn default_layers(convention: &str, num_hidden_layers: usize) -> PyResult<Vec<usize>> {
    Ok(default_ids(Convention::parse(convention)?, num_hidden_layers))
}

/// Where each (validated, sorted) id is captured: `("embeddings", 0)` or `("layer_output", k)`.
#[pyfunction]
fn capture_points(ids: Vec<i64>, convention: &str, num_hidden_layers: usize) -> PyResult<Vec<(&'static str, usize)>> {
    let plan = LayerPlan::new(&ids, Convention::parse(convention)?, num_hidden_layers)?;
    Ok(plan
        .points()
        .into_iter()
        .map(|p| match p {
            CapturePoint::Embeddings => ("embeddings", 0),
            CapturePoint::LayerOutput(k) => ("layer_output", k),
        })
        .collect())
}

/// Checks a manifest given as JSON and writes it atomically (samples sorted).
#[pyfunction]
fn write_manifest(py: Python<'_>, path: PathBuf, manifest_json: &str) -> PyResult<()> {
    let mut m = Manifest::from_json(manifest_json)?;
    py.detach(|| m.write(&path))?;
    Ok(())
}

/// Reads and checks a manifest; returns it as JSON.
#[pyfunction]
fn read_manifest(path: PathBuf) -> PyResult<String> {
    let m = Manifest::read(&path)?;
    serde_json::to_string(&m).map_err(|e| crate::core_err!(Output, "cannot encode the manifest: {e}").into())
}

/// Reads a sample file: dict with `token_ids`, `shape`, `dtype`, `data` (bytes), `checksum`, `metadata`.
#[pyfunction]
fn read_sample<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    let s = py.detach(|| read_sample_file(&path))?;
    let d = PyDict::new(py);
    d.set_item("token_ids", s.token_ids)?;
    d.set_item("shape", s.shape)?;
    d.set_item("dtype", s.dtype.torch_name())?;
    d.set_item("data", PyBytes::new(py, &s.data))?;
    d.set_item("checksum", s.checksum)?;
    d.set_item("metadata", s.metadata)?;
    Ok(d)
}

/// The manifest's checksum of a byte string (`xxh3:<hex>`).
#[pyfunction]
fn checksum(data: &[u8]) -> String {
    content_checksum(data)
}

/// Checks a capture directory; returns `(samples, tokens, bytes, problems)`.
#[pyfunction]
fn verify_dir(py: Python<'_>, root: PathBuf) -> PyResult<(usize, u64, u64, Vec<String>)> {
    let r = py.detach(|| crate::output::verify::verify_dir(&root))?;
    Ok((r.samples, r.tokens, r.bytes, r.problems))
}

/// Finished indexed sample files under `root/hidden_states`, read from the files:
/// `({index: (record dict, token_ids)}, skipped)`.
#[pyfunction]
fn scan_finished<'py>(py: Python<'py>, root: PathBuf) -> PyResult<(Bound<'py, PyDict>, Vec<String>)> {
    let (found, skipped) = py.detach(|| crate::output::verify::scan_finished(&root))?;
    let d = PyDict::new(py);
    for (i, (r, toks)) in found {
        let rec = PyDict::new(py);
        rec.set_item("index", r.index)?;
        rec.set_item("request_id", r.request_id)?;
        rec.set_item("file", r.file)?;
        rec.set_item("length", r.length)?;
        rec.set_item("checksum", r.checksum)?;
        rec.set_item("bytes", r.bytes)?;
        d.set_item(i, (rec, toks))?;
    }
    Ok((d, skipped))
}

/// Panics inside `guard` on purpose: proves that a Rust panic reaches Python as `HscaptureError`
/// (not as `BaseException`). For tests only.
/// How a layer's rows on this rank relate to the step's tokens: None (replicated) or the rows per
/// rank of vLLM's sequence-parallel sharding (gather, then read the first rows). See `layout.rs`.
#[pyfunction]
fn row_layout(rows: usize, forward_tokens: usize, step_tokens: usize, tp_size: usize, tp_rank: usize, what: &str) -> PyResult<Option<usize>> {
    guard("row_layout", || {
        Ok(match crate::ranks::row_layout::row_layout(rows, forward_tokens, step_tokens, tp_size, tp_rank, what)? {
            crate::ranks::row_layout::RowLayout::Replicated => None,
            crate::ranks::row_layout::RowLayout::Sharded { chunk } => Some(chunk),
        })
    })
}

#[pyfunction]
fn _panic_for_test(msg: &str) -> PyResult<()> {
    guard("_panic_for_test", || -> PyResult<()> { std::panic::panic_any(msg.to_string()) })
}

/// Whether CUDA kernels can run here.
#[pyfunction]
fn cuda_available() -> bool {
    hscapture_kernels::cuda::is_available()
}

/// What the CUDA probe found, in words.
#[pyfunction]
fn cuda_probe() -> PyResult<String> {
    guard("cuda_probe", || {
        Ok(match hscapture_kernels::cuda::probe() {
            hscapture_kernels::cuda::Availability::Devices(n) => format!("{n} CUDA device(s)"),
            hscapture_kernels::cuda::Availability::Unavailable(why) => format!("CUDA not available here: {why}"),
        })
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(validate_layers, m)?)?;
    m.add_function(wrap_pyfunction!(row_layout, m)?)?;
    m.add_function(wrap_pyfunction!(default_layers, m)?)?;
    m.add_function(wrap_pyfunction!(capture_points, m)?)?;
    m.add_function(wrap_pyfunction!(write_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(read_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(read_sample, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(verify_dir, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    m.add_function(wrap_pyfunction!(scan_finished, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_probe, m)?)?;
    Ok(())
}
