//! What a capture records of itself: its [`Identity`] (what every one of its files holds) and a
//! [`SampleRecord`] per file written. Both go to the journal as the files appear and to the manifest
//! at the end; a resumed run keeps a file only when both still vouch for it.

use serde::{Deserialize, Serialize};

/// The settings every file of a capture shares. A run may continue another (resume) only with an
/// equal identity: otherwise its directory would mix layer sets, dtypes or models.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// The sample format (`hscapture`, `legacy`, `fp8`; see `format.rs`).
    pub format: String,
    pub model: String,
    /// Ascending; slot `k` of every sample is layer `layer_ids[k]`.
    pub layer_ids: Vec<usize>,
    /// `after` or `before` (docs/contract.md).
    pub convention: String,
    /// torch name of the stored dtype.
    pub dtype: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// What each captured layer's output is: `sum` (`hidden_states + residual`, vLLM's fused residual), `hidden`
    /// (the layer returns the stream whole), `hidden+sum` (both kinds hooked), or `auto` (a driver that has not seen
    /// the model: the workers check it when they open the journal). A capture recorded before there was a rule
    /// stored `sum`.
    #[serde(default = "Identity::summed")]
    pub layer_output: String,
}

impl Identity {
    /// What every capture stored before the rule was recorded.
    pub fn summed() -> String {
        "sum".into()
    }

    /// What differs between `self` (found) and `other` (this run), one `key: found vs this run` each.
    pub fn differences(&self, other: &Identity) -> Vec<String> {
        let mut out = Vec::new();
        let mut cmp = |what: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{what}: {a} vs {b}"));
            }
        };
        cmp("format", self.format.clone(), other.format.clone());
        cmp("model", self.model.clone(), other.model.clone());
        cmp("layer ids", format!("{:?}", self.layer_ids), format!("{:?}", other.layer_ids));
        cmp("convention", self.convention.clone(), other.convention.clone());
        cmp("stored dtype", self.dtype.clone(), other.dtype.clone());
        cmp("hidden size", self.hidden_size.to_string(), other.hidden_size.to_string());
        cmp("decoder layers", self.num_hidden_layers.to_string(), other.num_hidden_layers.to_string());
        cmp("layer output", self.layer_output.clone(), other.layer_output.clone());
        out
    }
}

/// One written sample file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleRecord {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub index: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub request_id: Option<String>,
    /// Path relative to the output root.
    pub file: String,
    /// Prompt tokens (rows) of the sample.
    pub length: usize,
    /// `xxh3:` + the xxh3-64 of the whole file, as written.
    pub checksum: String,
    pub bytes: u64,
}

/// `xxh3:<16 hex digits>`: the checksum records carry.
pub fn checksum_text(hash: u64) -> String {
    format!("xxh3:{hash:016x}")
}

/// xxh3-64 of the hidden-state bytes, as `xxh3:<16 hex digits>`: what manifests of format
/// `hscapture/1` recorded (those of `hscapture/2` record the whole file's checksum).
pub fn content_checksum(data: &[u8]) -> String {
    file_checksum(data)
}

/// The checksum of a whole file's bytes.
pub fn file_checksum(bytes: &[u8]) -> String {
    checksum_text(xxhash_rust::xxh3::xxh3_64(bytes))
}
