//! The one interface of a stored layout: what a finished sample becomes on disk, and back.
//! - `hscapture` (`safetensors.rs`): `hidden_states/hs_{i}.safetensors`, the layout speculators'
//!   current training reads, in the model's or the store dtype, optionally compressed;
//! - `fp8` (`fp8.rs`): the same files with e4m3fn states and a scale per token (speculators' `FP8Transfer`);
//! - `legacy` (`legacy.rs`): speculators 0.3/0.4's `data_{i}.pt`.
//!
//! A format encodes a sample into the parts of one file (written atomically by the sink, hashed on the
//! way) and decodes such a file, checking what it relies on; nothing else in the output side knows a
//! layout.

use std::borrow::Cow;
use std::path::Path;

use crate::attribution::plan::SampleKey;
use crate::output::fp8::Fp8;
use crate::output::legacy::Legacy;
use crate::output::record::{file_checksum, Identity};
use crate::output::safetensors::Safetensors;
use crate::output::sample::{LoadedSample, Sample};
use crate::{bail, core_err, error::CoreResult};
use hscapture_kernels::DType;

pub trait Format: Send + Sync {
    /// The name in manifests, journals and on the command line.
    fn name(&self) -> &'static str;
    /// Sample `key`'s file, relative to the output root.
    fn file(&self, key: &SampleKey) -> String;
    /// The folder (relative to the root, "" for the root) that holds this format's sample files.
    fn folder(&self) -> &'static str;
    /// The sample index a file of this format is named for, from its name in [`Format::folder`].
    fn index_of(&self, name: &str) -> Option<u64>;
    /// The bytes of `sample`'s file, as parts written back to back.
    fn encode<'a>(&self, sample: &'a Sample, identity: &Identity) -> CoreResult<Vec<Cow<'a, [u8]>>>;
    /// The torch name of the dtype this format stores states of `dtype` in (the capture's identity records it).
    fn stored_dtype(&self, dtype: DType) -> &'static str {
        dtype.torch_name()
    }
    /// Reads a file this format wrote (`what` names it in errors); `checksum` is left to the caller.
    fn decode(&self, bytes: &[u8], what: &str) -> CoreResult<LoadedSample>;
}

/// The format called `name`; `compress` (a zstd level) applies to `hscapture`.
pub fn by_name(name: &str, compress: Option<i32>) -> CoreResult<Box<dyn Format>> {
    if let Some(level) = compress {
        if !(1..=22).contains(&level) {
            bail!(Config, "compression level {level}: zstd takes 1..=22 (3 is a good default); leave it unset for none");
        }
        if name != "hscapture" {
            bail!(Config, "compression applies to the hscapture format only; the {name} format stores states as they are");
        }
    }
    match name {
        "hscapture" | "file" => Ok(Box::new(Safetensors { compress })),
        "fp8" => Ok(Box::new(Fp8)),
        "legacy" => Ok(Box::new(Legacy)),
        other => bail!(Config, "unknown format {other:?}: expected hscapture (safetensors files, speculators' current training), fp8 (the same with e4m3fn states and per-token scales, speculators' FP8Transfer) or legacy (data_{{i}}.pt, speculators 0.3/0.4)"),
    }
}

/// The format that reads the file at `path` (by its extension).
pub fn for_file(path: &Path) -> CoreResult<Box<dyn Format>> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => Ok(Box::new(Safetensors { compress: None })),
        Some("pt") => Ok(Box::new(Legacy)),
        _ => bail!(Output, "{}: not a sample file hscapture writes (expected *.safetensors or *.pt)", path.display()),
    }
}

/// Decodes `bytes`, the file at `path`, and records its checksum.
pub fn decode_file(path: &Path, bytes: &[u8]) -> CoreResult<LoadedSample> {
    let mut s = for_file(path)?.decode(bytes, &path.display().to_string())?;
    s.checksum = file_checksum(bytes);
    Ok(s)
}

/// Reads and decodes a sample file of any format.
pub fn read_sample_file(path: &Path) -> CoreResult<LoadedSample> {
    let bytes = std::fs::read(path).map_err(|e| core_err!(Output, "cannot read {}: {e}", path.display()))?;
    decode_file(path, &bytes)
}
