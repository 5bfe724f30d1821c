//! Where and how a worker's samples are stored, and the identity a capture so stored goes by.

use crate::capture::session::SessionConfig;
use crate::output::formats::Format;
use crate::output::ledger::record::Identity;

pub use crate::output::destination::{Destination, Files, STORE_FORMAT};

/// Where and how a worker's samples are stored.
#[derive(Clone, Debug)]
pub struct OutputSettings {
    /// Where the samples go, with that destination's own settings.
    pub destination: Destination,
    /// The model as the capture's identity names it.
    pub model: String,
    /// The layer-output rule as the capture's identity names it (`Identity::layer_output`).
    pub layer_output: String,
    /// Writer threads, and the samples that may wait for them before the capture blocks.
    pub threads: usize,
    pub queue: usize,
    /// A sample that grows with its generated tokens (`include_output_tokens`) may take at most this many bytes: a
    /// request whose prompt and `max_tokens` could exceed it is refused at admission (nothing captured, no file).
    pub max_growing_sample: u64,
    /// Why no sample may grow with its generated tokens here, or None: the engine's configuration leaves their
    /// positions unknown where hscapture attributes them (`adapters/requested.py::outputs_refused`). Such a request
    /// is refused at admission, as one that could outgrow the bound.
    pub outputs_refused: Option<String>,
}

impl OutputSettings {
    /// Completed samples kept in memory (`take_samples`): nothing is written.
    pub fn in_memory() -> OutputSettings {
        OutputSettings {
            destination: Destination::Memory,
            model: String::new(),
            layer_output: Identity::summed(),
            threads: 1,
            queue: 1,
            max_growing_sample: u64::MAX,
            outputs_refused: None,
        }
    }

    /// The bound on a growing sample of `slots` × `width` values in `dtype` per row, as this destination stores
    /// them (its format's row): the workers' rule, and the scheduler-side connector's (`py/output.rs`).
    pub fn growing_bound(&self, slots: usize, width: usize, dtype: hscapture_kernels::DType) -> crate::error::CoreResult<GrowingBound> {
        let row_bytes = self.destination.format()?.stored_row_bytes(slots, width, dtype);
        Ok(GrowingBound { refused: self.outputs_refused.clone(), ..GrowingBound::new(self.max_growing_sample, row_bytes) })
    }
}

/// The defaults of what a worker's output is told (the Python package reads them from here: `_native.DEFAULTS`).
pub mod defaults {
    /// The sample format a capture writes unless told otherwise.
    pub const FORMAT: &str = crate::output::formats::safetensors::NAME;
    /// Samples waiting for the writer before the capture blocks.
    pub const WRITER_QUEUE: usize = 8;
    /// Per-request files: MiB of complete samples that may wait for their files at a release.
    pub const STAGING_BACKLOG_MIB: u64 = 2048;
    /// Per-request files: seconds a client has to collect its file.
    pub const STAGING_COLLECT_S: u64 = crate::output::sinks::janitor::COLLECT_WITHIN.as_secs();
    /// MiB a sample that grows with its generated tokens may take.
    pub const MAX_GROWING_SAMPLE_MIB: u64 = 4096;
}

/// The identity of a capture of `cfg` stored in `format` as `out` says.
pub fn identity(cfg: &SessionConfig, out: &OutputSettings, format: &dyn Format) -> Identity {
    Identity {
        format: format.name().into(),
        model: out.model.clone(),
        layer_ids: cfg.layers.ids.clone(),
        convention: cfg.layers.convention.name().into(),
        dtype: format.stored_dtype(cfg.out_dtype).into(),
        hidden_size: cfg.hidden_size,
        num_hidden_layers: cfg.layers.num_hidden_layers,
        layer_output: out.layer_output.clone(),
    }
}

/// The bound on a sample that grows with its generated tokens (`include_output_tokens`), checked at admission: the
/// workers drop such a request's rows, and the scheduler-side connector answers it with an error and no path, by
/// this one rule.
#[derive(Clone, Debug)]
pub struct GrowingBound {
    /// The most rows such a sample may reach.
    pub max_rows: usize,
    pub row_bytes: usize,
    /// Why every such sample is refused here (`OutputSettings::outputs_refused`).
    pub refused: Option<String>,
}

impl GrowingBound {
    pub fn new(max_bytes: u64, row_bytes: usize) -> GrowingBound {
        let max_rows = usize::try_from(max_bytes / row_bytes.max(1) as u64).unwrap_or(usize::MAX);
        GrowingBound { max_rows, row_bytes, refused: None }
    }

    /// Why a request with this prompt and `max_tokens` (None: unbounded, as vLLM leaves it to the model's length) is
    /// refused (generated tokens refused here, or its sample could outgrow the bound: every token but the last goes
    /// through a forward), or None when it is admitted.
    pub fn refusal(&self, req_id: &str, prompt_len: usize, max_tokens: Option<usize>) -> Option<String> {
        if let Some(why) = &self.refused {
            return Some(format!("request {req_id:.80?} refused at admission: {why}"));
        }
        let max_tokens = max_tokens?;
        let rows = prompt_len.saturating_add(max_tokens.saturating_sub(1));
        if rows <= self.max_rows {
            return None;
        }
        let mib = (rows as u128 * self.row_bytes as u128) >> 20;
        Some(format!(
            "request {req_id:.80?} refused at admission: its prompt ({prompt_len} tokens) and max_tokens ({max_tokens}) \
             could grow its sample with generated tokens to {rows} rows ({mib} MiB), over the bound of {} rows \
             (HSCAPTURE_MAX_GROWING_SAMPLE_MIB); nothing of it is captured. Ask for fewer max_tokens, or raise the bound",
            self.max_rows
        ))
    }
}
