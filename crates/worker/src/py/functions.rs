//! Module-level functions: layer ids, manifests, sample files, verify and resume, the dtype table,
//! atomic files, the CUDA probe. Each is guarded: a panic (a bug) reaches Python as `HscaptureError`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use super::errors::guard;
use crate::attribution::layers::{default_ids, CapturePoint, Convention, LayerPlan};
use crate::core_err;
use crate::output::atomic::write_atomic;
use crate::output::formats::read_sample_file;
use crate::output::ledger::manifest::{Manifest, Skipped};
use crate::output::ledger::record::{file_checksum, Identity, SampleRecord};

/// Capture points in slot order: `("embeddings", 0)` or `("layer_output", k)`.
pub fn points(plan: &LayerPlan) -> Vec<(&'static str, usize)> {
    plan.points()
        .into_iter()
        .map(|p| match p {
            CapturePoint::Embeddings => ("embeddings", 0),
            CapturePoint::LayerOutput(k) => ("layer_output", k),
        })
        .collect()
}

/// Validates layer ids for a convention and model depth; returns them sorted ascending.
#[pyfunction]
fn validate_layers(ids: Vec<i64>, convention: &str, num_hidden_layers: usize) -> PyResult<Vec<usize>> {
    guard("validate_layers", || Ok(LayerPlan::new(&ids, Convention::parse(convention)?, num_hidden_layers)?.ids))
}

/// The ecosystem's default ids for a convention and model depth.
#[pyfunction]
fn default_layers(convention: &str, num_hidden_layers: usize) -> PyResult<Vec<usize>> {
    guard("default_layers", || Ok(default_ids(Convention::parse(convention)?, num_hidden_layers)?))
}

/// Where each (validated, sorted) id is captured: `("embeddings", 0)` or `("layer_output", k)`.
#[pyfunction]
fn capture_points(ids: Vec<i64>, convention: &str, num_hidden_layers: usize) -> PyResult<Vec<(&'static str, usize)>> {
    guard("capture_points", || Ok(points(&LayerPlan::new(&ids, Convention::parse(convention)?, num_hidden_layers)?)))
}

/// speculators' fp8 quantization of `tokens` tokens of `per_token` values each (`data` little-endian in `dtype`):
/// the e4m3fn codes and one f32 scale per token — what the `fp8` format stores.
#[pyfunction]
fn fp8_quantize<'py>(
    py: Python<'py>,
    data: &[u8],
    dtype: &str,
    tokens: usize,
    per_token: usize,
) -> PyResult<(Bound<'py, PyBytes>, Vec<f32>)> {
    guard("fp8_quantize", || {
        let d = super::tensor::parse_dtype(dtype, "dtype")?;
        let values = tokens.checked_mul(per_token).filter(|n| n.checked_mul(d.size()) == Some(data.len()));
        let values = values.ok_or_else(|| {
            core_err!(ShapeContract, "fp8_quantize: {} bytes are not {tokens} tokens of {per_token} {d} values", data.len())
        })?;
        let (mut codes, mut scales) = (vec![0u8; values], vec![0f32; tokens]);
        py.detach(|| hscapture_kernels::fp8::quantize(data, d, tokens, per_token, &mut codes, &mut scales));
        Ok((PyBytes::new(py, &codes), scales))
    })
}

/// The bytes of the file `format` stores a sample in: `data` `shape` `[L, n_layers, H]` little-endian in `dtype`, with
/// `token_ids` and the capture's `identity_json` (an identity as manifests record it).
#[pyfunction]
fn encode_sample<'py>(
    py: Python<'py>,
    format: &str,
    identity_json: &str,
    token_ids: Vec<i64>,
    data: &[u8],
    shape: [usize; 3],
    dtype: &str,
) -> PyResult<Bound<'py, PyBytes>> {
    guard("encode_sample", || {
        let identity: Identity = serde_json::from_str(identity_json)
            .map_err(|e| core_err!(Config, "encode_sample: the identity is not valid ({e})").caused_by(&e))?;
        let sample = crate::sample::Sample {
            key: crate::sample::SampleKey::Index(0),
            req_id: String::new(),
            token_ids,
            data: data.to_vec(),
            rows: shape[0],
            slots: shape[1],
            width: shape[2],
            dtype: super::tensor::parse_dtype(dtype, "dtype")?,
            loss_mask: None,
            scales: None,
        };
        let f = crate::output::formats::by_name(format, None)?;
        let bytes = py.detach(|| f.encode(&sample, &identity).map(|parts| parts.concat()))?;
        Ok(PyBytes::new(py, &bytes))
    })
}

/// Checks a manifest given as JSON and writes it atomically and durably (samples sorted).
#[pyfunction]
fn write_manifest(py: Python<'_>, path: PathBuf, manifest_json: &str) -> PyResult<()> {
    guard("write_manifest", || {
        let mut m = Manifest::from_json(manifest_json)?;
        Ok(py.detach(|| m.write(&path))?)
    })
}

/// The manifest of a finished capture as JSON (the schema is the core's, `Manifest::of`): `identity_json` the
/// capture's identity as the core gives it (extra keys ignored), `records_json` its records, `skipped` the samples
/// it skipped as `(index, why)`.
#[pyfunction]
#[pyo3(signature = (identity_json, model, model_dtype, tensor_parallel_size, created_by, records_json, skipped))]
#[allow(clippy::too_many_arguments)]
fn new_manifest(
    identity_json: &str,
    model: String,
    model_dtype: Option<String>,
    tensor_parallel_size: usize,
    created_by: BTreeMap<String, String>,
    records_json: &str,
    skipped: Vec<(u64, String)>,
) -> PyResult<String> {
    guard("new_manifest", || {
        let identity: Identity =
            serde_json::from_str(identity_json).map_err(|e| core_err!(Output, "the capture's identity is not valid: {e}").caused_by(&e))?;
        let samples: Vec<SampleRecord> =
            serde_json::from_str(records_json).map_err(|e| core_err!(Output, "the capture's records are not valid: {e}").caused_by(&e))?;
        let skipped = skipped.into_iter().map(|(index, why)| Skipped { index, why }).collect();
        let m = Manifest::of(&identity, model, model_dtype, tensor_parallel_size, created_by, samples, skipped)?;
        Ok(serde_json::to_string(&m).map_err(|e| core_err!(Output, "cannot encode the manifest: {e}").caused_by(&e))?)
    })
}

/// Reads and checks a manifest; returns it as JSON.
#[pyfunction]
fn read_manifest(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    guard("read_manifest", || {
        let m = py.detach(|| Manifest::read(&path))?;
        Ok(serde_json::to_string(&m).map_err(|e| core_err!(Output, "cannot encode the manifest: {e}").caused_by(&e))?)
    })
}

/// Reads a sample file of any format: dict with `token_ids`, `shape`, `dtype`, `data` (bytes),
/// `checksum` (of the whole file), `metadata`, `loss_mask` (None unless the format stores one).
#[pyfunction]
fn read_sample<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyDict>> {
    guard("read_sample", || {
        let s = py.detach(|| read_sample_file(&path))?;
        let d = PyDict::new(py);
        d.set_item("token_ids", s.token_ids)?;
        d.set_item("shape", s.shape.to_vec())?;
        d.set_item("dtype", s.dtype.torch_name())?;
        d.set_item("stored", s.stored)?;
        d.set_item("data", PyBytes::new(py, &s.data))?;
        d.set_item("checksum", s.checksum)?;
        d.set_item("metadata", s.metadata)?;
        d.set_item("loss_mask", s.loss_mask)?;
        Ok(d)
    })
}

/// The checksum records carry, of a byte string (`xxh3:<hex>`).
#[pyfunction]
fn checksum(data: &[u8]) -> PyResult<String> {
    guard("checksum", || Ok(file_checksum(data)))
}

/// Checks a capture directory; returns `(samples, tokens, bytes, problems)`.
#[pyfunction]
fn verify_dir(py: Python<'_>, root: PathBuf) -> PyResult<(usize, u64, u64, Vec<String>)> {
    guard("verify_dir", || {
        let r = py.detach(|| crate::output::readers::verify::verify_dir(&root))?;
        Ok((r.samples, r.tokens, r.bytes, r.problems))
    })
}

/// What a run of `identity` (JSON of the capture's settings) resuming the capture in `root` keeps:
/// `({index: (record dict, token_ids)}, [why each other file is captured again], the ledger's identity as
/// JSON or None)`.
#[pyfunction]
fn resume_plan<'py>(py: Python<'py>, root: PathBuf, identity: &str) -> PyResult<(Bound<'py, PyDict>, Vec<String>, Option<String>)> {
    guard("resume_plan", || {
        let id: Identity =
            serde_json::from_str(identity).map_err(|e| core_err!(Config, "the capture identity is not valid: {e}").caused_by(&e))?;
        let plan = py.detach(|| crate::output::readers::resume::plan(&root, &id))?;
        let d = PyDict::new(py);
        for (i, k) in plan.kept {
            d.set_item(i, (record_dict(py, &k.record)?, k.token_ids))?;
        }
        let found = plan
            .identity
            .map(|i| serde_json::to_string(&i))
            .transpose()
            .map_err(|e| core_err!(Output, "cannot encode an identity: {e}").caused_by(&e))?;
        Ok((d, plan.recapture, found))
    })
}

/// Writes `data` to `path` atomically (durably: file and directory flushed); returns the size.
#[pyfunction]
#[pyo3(signature = (path, data, durable=true))]
fn write_file(py: Python<'_>, path: PathBuf, data: &[u8], durable: bool) -> PyResult<u64> {
    guard("write_file", || Ok(py.detach(|| write_atomic(&path, durable, |w| w.write_all(data)))?.bytes))
}

/// The file name a staging directory gives request `req_id`'s sample (`<id>.safetensors`, id made safe).
#[pyfunction]
fn staged_file_name(req_id: &str) -> PyResult<String> {
    guard("staged_file_name", || Ok(crate::output::sinks::staging::file_name(req_id)))
}

/// The transfer manifest (JSON text) of request `req_id`'s packed Mooncake object of `rows` tokens, `slots` layers
/// of `width` values in `dtype` (`output/sinks/packed.rs`): what the connector answers before the object exists.
#[pyfunction]
#[pyo3(signature = (req_id, rows, slots, width, dtype, mode="prompt_only"))]
fn packed_manifest(req_id: &str, rows: usize, slots: usize, width: usize, dtype: &str, mode: &str) -> PyResult<String> {
    guard("packed_manifest", || {
        use crate::output::sinks::packed::{key_of, PackedLayout};
        let dtype = super::tensor::parse_dtype(dtype, "dtype")?;
        Ok(PackedLayout::of(rows, slots, width, dtype)?.manifest(&key_of(req_id), mode).to_string())
    })
}

/// Flushes a directory's entries (renames into it) to disk.
#[pyfunction]
fn sync_dir(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    guard("sync_dir", || Ok(py.detach(|| crate::output::atomic::sync_dir(&path))?))
}

/// The dtypes stored states may have: `[(torch name, bytes per element)]` (the one dtype table).
#[pyfunction]
fn dtypes() -> PyResult<Vec<(&'static str, usize)>> {
    guard("dtypes", || Ok(hscapture_kernels::DType::ALL.iter().map(|d| (d.torch_name(), d.size())).collect()))
}

/// How a layer's rows on this rank relate to the step's tokens: None (replicated) or the rows per
/// rank of vLLM's sequence-parallel sharding (gather, then read the first rows). See `row_layout.rs`.
#[pyfunction]
fn row_layout(
    rows: usize,
    forward_tokens: usize,
    step_tokens: usize,
    tp_size: usize,
    tp_rank: usize,
    what: &str,
) -> PyResult<Option<usize>> {
    use crate::ranks::row_layout::{row_layout, RowLayout};
    guard("row_layout", || {
        Ok(match row_layout(rows, forward_tokens, step_tokens, tp_size, tp_rank, what)? {
            RowLayout::Replicated => None,
            RowLayout::Sharded { chunk } => Some(chunk),
        })
    })
}

/// Panics inside `guard` on purpose: proves that a Rust panic reaches Python as `HscaptureError`
/// (not as `BaseException`). For tests only.
#[pyfunction]
fn _panic_for_test(msg: &str) -> PyResult<()> {
    guard("_panic_for_test", || -> PyResult<()> { std::panic::panic_any(msg.to_string()) })
}

pub fn record_dict<'py>(py: Python<'py>, r: &SampleRecord) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("index", r.index)?;
    d.set_item("request_id", r.request_id.clone())?;
    d.set_item("file", &r.file)?;
    d.set_item("length", r.length)?;
    d.set_item("checksum", &r.checksum)?;
    d.set_item("bytes", r.bytes)?;
    Ok(d)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("MANIFEST_FORMAT", crate::output::ledger::manifest::FORMAT)?;
    m.add("MANIFEST", crate::output::ledger::manifest::FILE)?;
    m.add("JOURNAL", crate::output::ledger::journal::FILE)?;
    m.add_function(wrap_pyfunction!(validate_layers, m)?)?;
    m.add_function(wrap_pyfunction!(row_layout, m)?)?;
    m.add_function(wrap_pyfunction!(default_layers, m)?)?;
    m.add_function(wrap_pyfunction!(capture_points, m)?)?;
    m.add_function(wrap_pyfunction!(write_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(new_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(read_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(read_sample, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(verify_dir, m)?)?;
    m.add_function(wrap_pyfunction!(resume_plan, m)?)?;
    m.add_function(wrap_pyfunction!(write_file, m)?)?;
    m.add_function(wrap_pyfunction!(dtypes, m)?)?;
    m.add_function(wrap_pyfunction!(sync_dir, m)?)?;
    m.add_function(wrap_pyfunction!(staged_file_name, m)?)?;
    m.add_function(wrap_pyfunction!(fp8_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(packed_manifest, m)?)?;
    m.add_function(wrap_pyfunction!(encode_sample, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_test, m)?)?;
    Ok(())
}
