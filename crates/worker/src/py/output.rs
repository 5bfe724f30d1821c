//! `Output`: where a capture session's samples go, built once and handed to `CaptureSession`.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use super::errors::guard;
use super::store::PyStore;
use crate::output::atomic::Durability;
use crate::output::sinks::staging::SlowDisk;
use crate::worker::{defaults, OutputSettings, StoreHandle};

/// Where a session's samples go, built once: `Output(out_dir)` writes a capture directory in `format` with
/// `writer_threads` threads; with `staging`, per-request files a client collects (`output/sinks/staging.rs`; at most
/// `staging_backlog_mib` of complete samples waiting for their files after a release); with `store` (an object
/// store's client, `py/store.rs`) and format `mooncake`, packed objects in that store instead (`output/sinks/store.rs`).
/// `durable`: true (each file and its directory fsync'd), false (renamed into place only) or "writeback" (each file's
/// data written back by its writer thread right after it is in place; `output/atomic.rs`).
/// A session without one keeps completed samples in memory for `take_samples()`.
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
fn durability(durable: Option<&Bound<'_, PyAny>>) -> PyResult<Durability> {
    let Some(d) = durable else { return Ok(Durability::Fsync) };
    if let Ok(flag) = d.extract::<bool>() {
        return Ok(Durability::from_flag(flag));
    }
    match d.extract::<String>() {
        Ok(t) if t == Durability::WRITEBACK => Ok(Durability::Writeback),
        _ => Err(crate::core_err!(Config, "durable is {d}; expected true, false or \"{}\"", Durability::WRITEBACK).into()),
    }
}

#[pymethods]
impl Output {
    #[new]
    #[pyo3(signature = (out_dir=None, *, format=defaults::FORMAT.to_string(), writer_threads=4, writer_queue=defaults::WRITER_QUEUE, durable=None, compress=None, model=String::new(), staging=false, staging_backlog_mib=defaults::STAGING_BACKLOG_MIB, staging_collect_s=defaults::STAGING_COLLECT_S, max_growing_sample_mib=defaults::MAX_GROWING_SAMPLE_MIB, store=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        out_dir: Option<PathBuf>,
        format: String,
        writer_threads: usize,
        writer_queue: usize,
        durable: Option<&Bound<'_, PyAny>>,
        compress: Option<i32>,
        model: String,
        staging: bool,
        staging_backlog_mib: u64,
        staging_collect_s: u64,
        max_growing_sample_mib: u64,
        store: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        guard("Output()", || {
            let durability = durability(durable)?;
            let staging_backlog = staging_backlog_mib.checked_mul(1 << 20).ok_or_else(|| {
                crate::core_err!(Config, "staging backlog of {staging_backlog_mib} MiB: expected at most {} MiB", u64::MAX >> 20)
            })?;
            let max_growing_sample = max_growing_sample_mib.checked_mul(1 << 20).ok_or_else(|| {
                crate::core_err!(Config, "a growing sample bound of {max_growing_sample_mib} MiB: expected at most {} MiB", u64::MAX >> 20)
            })?;
            let settings = OutputSettings {
                root: out_dir,
                format,
                compress,
                model,
                threads: writer_threads,
                queue: writer_queue,
                durability,
                staging,
                staging_backlog,
                staging_collect: std::time::Duration::from_secs(staging_collect_s),
                max_growing_sample,
                slow_disk: SlowDisk::default(),
                store: store.map(|client| StoreHandle(Arc::new(PyStore::new(client)))),
            };
            Ok(Output { settings })
        })
    }

    /// Tests only: the same output on a slow disk — each per-request file written `delay_ms` late, and first for
    /// as long as the file `hold` exists (`output/sinks/staging.rs`).
    #[pyo3(signature = (delay_ms=0, hold=None))]
    fn on_slow_disk(&self, delay_ms: u64, hold: Option<PathBuf>) -> Output {
        let slow_disk = SlowDisk { delay: std::time::Duration::from_millis(delay_ms), hold_while: hold };
        Output { settings: OutputSettings { slow_disk, ..self.settings.clone() } }
    }
}
