//! `Output`: where a capture session's samples go, built once and handed to `CaptureSession`.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::guard;
use super::store::PyStore;
use crate::output::atomic::Durability;
use crate::output::ledger::record::Identity;
use crate::output::sinks::staging::SlowDisk;
use crate::worker::{defaults, Destination, Files, OutputSettings};

/// Where a session's samples go, built once: `Output(destination)` with `destination` a description of one kind
/// (`adapters/requested.py` builds it; each kind takes only its own keys, anything else is a `ConfigError`):
/// - `{"kind": "memory"}` (or None): completed samples kept for `take_samples()`;
/// - `{"kind": "directory", "root", "format", "compress", "durable"}`: a capture directory;
/// - `{"kind": "staging", "root", "format", "compress", "durable", "backlog_mib", "collect_s"}`: per-request files a
///   client collects (`output/sinks/staging.rs`);
/// - `{"kind": "store", "client"}`: packed objects in an object store through its client (`py/store.rs`).
///
/// `durable`: true (each file and its directory fsync'd; the default), false (renamed into place only) or
/// "writeback" (each file's data written back by its writer thread right after it is in place; `output/atomic.rs`).
/// `writer_threads` threads write, with at most `writer_queue` samples waiting; `max_growing_sample_mib` bounds a
/// sample that grows with its generated tokens.
#[pyclass(module = "hscapture._native", frozen)]
pub struct Output {
    settings: OutputSettings,
}

impl Output {
    pub fn settings(&self) -> &OutputSettings {
        &self.settings
    }
}

/// `durable` as given: a bool (default true) or the writeback level's name.
fn durability(durable: Option<Bound<'_, PyAny>>) -> PyResult<Durability> {
    let Some(d) = durable else { return Ok(Durability::Fsync) };
    if let Ok(flag) = d.extract::<bool>() {
        return Ok(Durability::from_flag(flag));
    }
    match d.extract::<String>() {
        Ok(t) if t == Durability::WRITEBACK => Ok(Durability::Writeback),
        _ => Err(crate::core_err!(Config, "durable is {d}; expected true, false or \"{}\"", Durability::WRITEBACK).into()),
    }
}

fn mib(v: u64, what: &str) -> PyResult<u64> {
    v.checked_mul(1 << 20).ok_or_else(|| crate::core_err!(Config, "{what} of {v} MiB: expected at most {} MiB", u64::MAX >> 20).into())
}

/// The keys each kind of destination takes.
const KINDS: [(&str, &[&str]); 4] = [
    ("memory", &["kind"]),
    ("directory", &["kind", "root", "format", "compress", "durable"]),
    ("staging", &["kind", "root", "format", "compress", "durable", "backlog_mib", "collect_s"]),
    ("store", &["kind", "client"]),
];

/// A store described where it is not opened (the scheduler-side connector sizes rows by its description; the
/// workers open the store and write).
struct NotOpened;

impl crate::output::sinks::store::ObjectStore for NotOpened {
    fn put(&self, key: &str, _bytes: &[u8]) -> crate::error::CoreResult<()> {
        Err(crate::core_err!(Config, "{key}: this store is only described here (Output.described), not opened; the workers store samples"))
    }
}

/// A destination from its description (see [`Output`]); `opened` false: a store's client may be left out.
fn destination(d: &Bound<'_, PyDict>, opened: bool) -> PyResult<Destination> {
    // A key given as None is a key not given.
    let get = |k: &str| d.get_item(k).map(|v| v.filter(|v| !v.is_none()));
    let kind: String = get("kind")?
        .ok_or_else(|| crate::core_err!(Config, "a destination without a kind: expected one of {:?}", KINDS.map(|k| k.0)))?
        .extract()?;
    let Some((_, keys)) = KINDS.iter().find(|(k, _)| *k == kind) else {
        return Err(crate::core_err!(Config, "destination kind {kind:?}: expected one of {:?}", KINDS.map(|k| k.0)).into());
    };
    for k in d.keys() {
        let k: String = k.extract()?;
        if !keys.contains(&k.as_str()) {
            return Err(crate::core_err!(Config, "a {kind} destination takes {keys:?}; found {k:?}").into());
        }
    }
    let files = || -> PyResult<Files> {
        let root: PathBuf = get("root")?.ok_or_else(|| crate::core_err!(Config, "a {kind} destination needs a root"))?.extract()?;
        let format: String = match get("format")? {
            Some(f) => f.extract()?,
            None => defaults::FORMAT.to_string(),
        };
        let compress: Option<i32> = get("compress")?.map(|c| c.extract()).transpose()?;
        Ok(Files { root, format, compress, durability: durability(get("durable")?)? })
    };
    Ok(match kind.as_str() {
        "directory" => Destination::Directory(files()?),
        "staging" => {
            let backlog_mib: u64 = get("backlog_mib")?.map(|v| v.extract()).transpose()?.unwrap_or(defaults::STAGING_BACKLOG_MIB);
            let collect_s: u64 = get("collect_s")?.map(|v| v.extract()).transpose()?.unwrap_or(defaults::STAGING_COLLECT_S);
            Destination::Staging {
                files: files()?,
                backlog: mib(backlog_mib, "a staging backlog")?,
                collect_within: std::time::Duration::from_secs(collect_s),
                slow_disk: SlowDisk::default(),
            }
        }
        "store" => match get("client")? {
            Some(client) => Destination::Store(Arc::new(PyStore::new(client.unbind()))),
            None if !opened => Destination::Store(Arc::new(NotOpened)),
            None => return Err(crate::core_err!(Config, "a store destination needs its client").into()),
        },
        _ => Destination::Memory,
    })
}

#[pymethods]
impl Output {
    #[new]
    #[pyo3(signature = (destination=None, *, writer_threads=4, writer_queue=defaults::WRITER_QUEUE, model=String::new(), max_growing_sample_mib=defaults::MAX_GROWING_SAMPLE_MIB, layer_output=Identity::summed(), outputs_refused=None))]
    fn new(
        destination: Option<&Bound<'_, PyDict>>,
        writer_threads: usize,
        writer_queue: usize,
        model: String,
        max_growing_sample_mib: u64,
        layer_output: String,
        outputs_refused: Option<String>,
    ) -> PyResult<Self> {
        guard("Output()", || {
            let destination = match destination {
                Some(d) => self::destination(d, true)?,
                None => Destination::Memory,
            };
            let max_growing_sample = mib(max_growing_sample_mib, "a growing sample bound")?;
            let settings = OutputSettings {
                destination,
                model,
                layer_output,
                threads: writer_threads,
                queue: writer_queue,
                max_growing_sample,
                outputs_refused,
            };
            Ok(Output { settings })
        })
    }

    /// The same output as the workers would open it, described only (a store needs no client): what the
    /// scheduler-side connector decides by (`growing_refusal`).
    #[staticmethod]
    #[pyo3(signature = (destination, *, max_growing_sample_mib=defaults::MAX_GROWING_SAMPLE_MIB, outputs_refused=None))]
    fn described(destination: &Bound<'_, PyDict>, max_growing_sample_mib: u64, outputs_refused: Option<String>) -> PyResult<Output> {
        guard("Output.described()", || {
            let destination = self::destination(destination, false)?;
            let max_growing_sample = mib(max_growing_sample_mib, "a growing sample bound")?;
            let settings = OutputSettings { destination, max_growing_sample, outputs_refused, ..OutputSettings::in_memory() };
            Ok(Output { settings })
        })
    }

    /// Why a request whose sample grows with its generated tokens is refused at admission (its prompt and
    /// `max_tokens` could outgrow the bound, rows of `slots` × `width` values in `dtype` as this output stores them),
    /// or None: the workers' own rule (`worker::GrowingBound`).
    fn growing_refusal(
        &self,
        slots: usize,
        width: usize,
        dtype: &str,
        req_id: &str,
        prompt_len: usize,
        max_tokens: Option<usize>,
    ) -> PyResult<Option<String>> {
        guard("Output.growing_refusal()", || {
            let bound = self.settings.growing_bound(slots, width, super::tensor::parse_dtype(dtype, "dtype")?)?;
            Ok(bound.refusal(req_id, prompt_len, max_tokens))
        })
    }

    /// Tests only: the same per-request files on a slow disk — each written `delay_ms` late, and first for as long
    /// as the file `hold` exists (`output/sinks/staging.rs`).
    #[pyo3(signature = (delay_ms=0, hold=None))]
    fn on_slow_disk(&self, delay_ms: u64, hold: Option<PathBuf>) -> PyResult<Output> {
        let mut settings = self.settings.clone();
        let Destination::Staging { slow_disk, .. } = &mut settings.destination else {
            return Err(crate::core_err!(Config, "a slow disk applies to per-request files (a staging destination) only").into());
        };
        *slow_disk = SlowDisk { delay: std::time::Duration::from_millis(delay_ms), hold_while: hold };
        Ok(Output { settings })
    }
}
