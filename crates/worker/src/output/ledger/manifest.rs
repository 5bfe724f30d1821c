//! `OUT/manifest.json`: what a directory of captured states holds and how to check it.
//!
//! Format `hscapture/2` (written now): each record's `checksum` is the xxh3-64 of its whole file, and
//! `sample_format` names the files' format. `hscapture/1` (read, for `verify`): the checksum covered
//! the `hidden_states` bytes only.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::output::atomic::write_atomic;
use crate::output::ledger::record::{Identity, SampleRecord};
use crate::{core_err, ensure, error::CoreResult};

pub const FORMAT: &str = "hscapture/2";
/// The manifest's file name in an output directory.
pub const FILE: &str = "manifest.json";
/// The manifest format before checksums covered whole files.
pub const FORMAT_V1: &str = "hscapture/1";

fn default_sample_format() -> String {
    crate::output::formats::safetensors::NAME.into()
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// The sample files' format (`format.rs`).
    #[serde(default = "default_sample_format")]
    pub sample_format: String,
    pub model: String,
    /// Ascending; `hidden_states[:, k, :]` is layer `layer_ids[k]`.
    pub layer_ids: Vec<usize>,
    /// `after` or `before` (see docs/contract.md).
    pub convention: String,
    /// torch name of the stored dtype.
    pub dtype: String,
    /// torch name of the dtype vLLM ran the model in (what `verify --model`'s tolerance follows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_dtype: Option<String>,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// What each captured layer's output is (`Identity::layer_output`); `sum` in manifests from before it was recorded.
    #[serde(default = "Identity::summed")]
    pub layer_output: String,
    #[serde(default)]
    pub tensor_parallel_size: usize,
    #[serde(default)]
    pub created_by: BTreeMap<String, String>,
    pub samples: Vec<SampleRecord>,
    /// Samples not written because they held NaN/Inf values (`on_nonfinite: skip`), with what was found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub index: u64,
    pub why: String,
}

impl Manifest {
    /// The manifest of a finished capture: the facts of its `identity` (layers, convention, stored dtype, widths,
    /// format), the run's (the model as the run named it, the activations' dtype, the TP size, what made it), its
    /// records and the samples it skipped. Checked as a read manifest is.
    #[allow(clippy::too_many_arguments)]
    pub fn of(
        identity: &Identity,
        model: String,
        model_dtype: Option<String>,
        tensor_parallel_size: usize,
        created_by: BTreeMap<String, String>,
        samples: Vec<SampleRecord>,
        skipped: Vec<Skipped>,
    ) -> CoreResult<Manifest> {
        let m = Manifest {
            format: FORMAT.into(),
            sample_format: identity.format.clone(),
            model,
            layer_ids: identity.layer_ids.clone(),
            convention: identity.convention.clone(),
            dtype: identity.dtype.clone(),
            model_dtype,
            hidden_size: identity.hidden_size,
            num_hidden_layers: identity.num_hidden_layers,
            layer_output: identity.layer_output.clone(),
            tensor_parallel_size,
            created_by,
            samples,
            skipped,
        };
        m.check()?;
        Ok(m)
    }

    /// Parses and checks a manifest: known format, sorted unique layer ids, unique sample files.
    pub fn from_json(text: &str) -> CoreResult<Manifest> {
        let m: Manifest = serde_json::from_str(text).map_err(|e| {
            core_err!(Output, "the manifest is not valid: {e}; it may be corrupted — re-run the extraction to rebuild it").caused_by(&e)
        })?;
        m.check()?;
        Ok(m)
    }

    pub fn check(&self) -> CoreResult<()> {
        ensure!(
            self.format == FORMAT || self.format == FORMAT_V1,
            Output,
            "manifest format {:?} is neither {FORMAT:?} nor {FORMAT_V1:?}: written by another tool, or by a newer hscapture",
            self.format
        );
        ensure!(
            self.layer_ids.windows(2).all(|w| w[0] < w[1]) && !self.layer_ids.is_empty(),
            Output,
            "manifest layer ids {:?} must be non-empty and strictly ascending",
            self.layer_ids
        );
        let mut files: Vec<&str> = self.samples.iter().map(|s| s.file.as_str()).collect();
        files.sort_unstable();
        if let Some(w) = files.windows(2).find(|w| w[0] == w[1]) {
            return Err(core_err!(Output, "manifest lists {} twice", w[0]));
        }
        if let Some(x) = self.skipped.iter().find(|x| self.samples.iter().any(|s| s.index == Some(x.index))) {
            return Err(core_err!(Output, "manifest lists sample {} both as written and as skipped", x.index));
        }
        Ok(())
    }

    /// The identity every file of this capture shares.
    pub fn identity(&self) -> Identity {
        Identity {
            format: self.sample_format.clone(),
            model: self.model.clone(),
            layer_ids: self.layer_ids.clone(),
            convention: self.convention.clone(),
            dtype: self.dtype.clone(),
            hidden_size: self.hidden_size,
            num_hidden_layers: self.num_hidden_layers,
            layer_output: self.layer_output.clone(),
        }
    }

    /// Whether record checksums cover whole files (`hscapture/2`) or only the states (`hscapture/1`).
    pub fn whole_file_checksums(&self) -> bool {
        self.format == FORMAT
    }

    /// Sorts samples (indexed ones by index, then the others by request id) and writes the manifest
    /// atomically and durably.
    pub fn write(&mut self, path: &Path) -> CoreResult<()> {
        self.check()?;
        self.samples.sort_by(|a, b| (a.index.is_none(), a.index, &a.request_id).cmp(&(b.index.is_none(), b.index, &b.request_id)));
        let text = serde_json::to_vec_pretty(self).map_err(|e| core_err!(Output, "cannot encode the manifest: {e}").caused_by(&e))?;
        write_atomic(path, true, |w| w.write_all(&text)).map(|_| ())
    }

    pub fn read(path: &Path) -> CoreResult<Manifest> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| core_err!(Output, "cannot read the manifest {}: {e}", path.display()).caused_by(&e))?;
        Manifest::from_json(&text)
    }
}

#[cfg(test)]
#[path = "tests/manifest.rs"]
mod tests;
