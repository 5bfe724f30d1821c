//! The facts about the output that the Python package needs and must not restate: each format's descriptor
//! (names, aliases, folder, file pattern, stored dtype, compression, per-request files), the compression levels,
//! the writer lock's and partial files' names, the capture's identity, the final layer's id and the ids of another
//! convention, and which finished request has a sample. Each comes from the one place in the core that decides it.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use super::errors::guard;
use super::tensor::parse_dtype;
use crate::attribution::layers::Convention;
use crate::output::formats::{all, by_name, canonical, Descriptor};
use crate::output::ledger::record::Identity;
use crate::worker::defaults;

/// Every format's descriptor, in the order they are listed to users.
#[pyfunction]
fn formats(py: Python<'_>) -> PyResult<Bound<'_, PyList>> {
    guard("formats", || {
        let list = PyList::empty(py);
        for f in all() {
            let d = Descriptor::of(f.as_ref());
            let e = PyDict::new(py);
            e.set_item("name", d.name)?;
            e.set_item("aliases", d.aliases.to_vec())?;
            e.set_item("folder", d.folder)?;
            e.set_item("file_pattern", d.file_pattern)?;
            e.set_item("stored_dtype", d.stored_dtype)?;
            e.set_item("value_bytes", d.value_bytes)?;
            e.set_item("compressible", d.compressible)?;
            e.set_item("per_request_files", d.per_request_files)?;
            list.append(e)?;
        }
        Ok(list)
    })
}

/// The format a name or alias stands for (`ConfigError` naming the formats otherwise).
#[pyfunction]
fn canonical_format(name: &str) -> PyResult<&'static str> {
    guard("canonical_format", || Ok(canonical(name)?))
}

/// The sample index of a file name in the format's folder (None: not one of its sample files).
#[pyfunction]
fn sample_index(format: &str, file_name: &str) -> PyResult<Option<u64>> {
    guard("sample_index", || Ok(by_name(format, None)?.index_of(file_name)))
}

/// Whether a file name is a temporary an interrupted write left.
#[pyfunction]
fn is_partial(file_name: &str) -> bool {
    crate::output::atomic::is_partial(file_name)
}

/// The temporary name a file is written under before it is renamed into place.
#[pyfunction]
fn partial_path(path: PathBuf) -> PathBuf {
    crate::output::atomic::partial_path(&path)
}

/// The id of the last decoder layer's output (before the final norm) in a convention.
#[pyfunction]
fn final_layer_id(convention: &str, num_hidden_layers: usize) -> PyResult<Option<usize>> {
    guard("final_layer_id", || Ok(Convention::parse(convention)?.max_id(num_hidden_layers)))
}

/// `ids` of one convention in another (None where an id has none: `before` 0, the embeddings, in `after`).
#[pyfunction]
fn layer_ids_in(ids: Vec<usize>, convention: &str, to: &str) -> PyResult<Vec<Option<usize>>> {
    guard("layer_ids_in", || {
        let (from, to) = (Convention::parse(convention)?, Convention::parse(to)?);
        Ok(ids.into_iter().map(|id| from.id_in(id, to)).collect())
    })
}

/// A capture's identity (what its journal, manifest and every file record), its stored dtype the format's for
/// states of `dtype` (`auto`: vLLM's choice, known at start-up, unless the format fixes it); `layer_output` the
/// rule the hooks follow (`auto` for a driver: known once the workers have the model).
#[pyfunction]
#[pyo3(signature = (format, model, layer_ids, convention, dtype, hidden_size, num_hidden_layers, layer_output="auto"))]
#[allow(clippy::too_many_arguments)]
fn capture_identity<'py>(
    py: Python<'py>,
    format: &str,
    model: String,
    layer_ids: Vec<usize>,
    convention: &str,
    dtype: &str,
    hidden_size: usize,
    num_hidden_layers: usize,
    layer_output: &str,
) -> PyResult<Bound<'py, PyDict>> {
    guard("capture_identity", || {
        let f = by_name(format, None)?;
        let d = Descriptor::of(f.as_ref());
        let stored = match (d.stored_dtype, dtype) {
            (Some(fixed), _) => fixed.to_string(),
            (None, "auto") => "auto".to_string(),
            (None, name) => f.stored_dtype(parse_dtype(name, "dtype")?).to_string(),
        };
        let convention = Convention::parse(convention)?.name().to_string();
        let layer_output = layer_output.to_string();
        let id =
            Identity { format: f.name().into(), model, layer_ids, convention, dtype: stored, hidden_size, num_hidden_layers, layer_output };
        identity_dict(py, &id)
    })
}

/// An identity as the dict its JSON is.
pub(super) fn identity_dict<'py>(py: Python<'py>, id: &Identity) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let json = serde_json::to_value(id).map_err(|e| crate::core_err!(Output, "the identity: {e}").caused_by(&e))?;
    for (k, v) in json.as_object().into_iter().flatten() {
        out.set_item(k, pythonize(py, v)?)?;
    }
    Ok(out)
}

fn pythonize<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use pyo3::IntoPyObjectExt;
    Ok(match v {
        serde_json::Value::String(s) => s.into_bound_py_any(py)?,
        serde_json::Value::Number(n) => n.as_u64().into_bound_py_any(py)?,
        serde_json::Value::Array(a) => PyList::new(py, a.iter().map(|x| pythonize(py, x)).collect::<PyResult<Vec<_>>>()?)?.into_any(),
        _ => py.None().into_bound(py),
    })
}

/// Rows of the sample of a request that captures its generated tokens and finished with `all_tokens` tokens
/// (prompt and generated): every token that went through a forward, all but the last; None when it ended before
/// its first output (aborted), which leaves no sample.
#[pyfunction]
fn output_sample_rows(prompt_len: usize, all_tokens: usize) -> Option<usize> {
    crate::attribution::plan::output_sample_rows(prompt_len, all_tokens)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let levels = crate::output::formats::compress::LEVELS;
    m.add("COMPRESS_LEVELS", (*levels.start(), *levels.end()))?;
    m.add("WRITER_LOCK", crate::output::sinks::dirlock::FILE)?;
    m.add("STORE_FORMAT", crate::worker::STORE_FORMAT)?;
    let d = PyDict::new(m.py());
    d.set_item("format", defaults::FORMAT)?;
    d.set_item("writer_queue", defaults::WRITER_QUEUE)?;
    d.set_item("staging_backlog_mib", defaults::STAGING_BACKLOG_MIB)?;
    d.set_item("staging_collect_s", defaults::STAGING_COLLECT_S)?;
    d.set_item("max_growing_sample_mib", defaults::MAX_GROWING_SAMPLE_MIB)?;
    m.add("DEFAULTS", d)?;
    m.add("DURABLE_WRITEBACK", crate::output::atomic::Durability::WRITEBACK)?;
    m.add_function(wrap_pyfunction!(formats, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_format, m)?)?;
    m.add_function(wrap_pyfunction!(sample_index, m)?)?;
    m.add_function(wrap_pyfunction!(is_partial, m)?)?;
    m.add_function(wrap_pyfunction!(partial_path, m)?)?;
    m.add_function(wrap_pyfunction!(final_layer_id, m)?)?;
    m.add_function(wrap_pyfunction!(layer_ids_in, m)?)?;
    m.add_function(wrap_pyfunction!(capture_identity, m)?)?;
    m.add_function(wrap_pyfunction!(output_sample_rows, m)?)?;
    Ok(())
}
