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
    /// Other names the format is known by (on the command line, in the KV connector's settings).
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// Sample `i`'s file relative to the output root, with `{i}` for the index ([`Format::file`] of an index).
    fn file_pattern(&self) -> &'static str;
    /// Whether its states may be stored compressed.
    fn compressible(&self) -> bool {
        false
    }
    /// The torch name of the dtype this format stores states of `dtype` in (the capture's identity records it).
    fn stored_dtype(&self, dtype: DType) -> &'static str {
        dtype.torch_name()
    }
    /// The bytes one stored value takes for states of `dtype`.
    fn stored_value_bytes(&self, dtype: DType) -> usize {
        dtype.size()
    }
    /// The bytes one row (a token's states at every slot) takes in a file: its stored values and whatever the
    /// format keeps per row beside them.
    fn stored_row_bytes(&self, slots: usize, width: usize, dtype: DType) -> usize {
        slots.saturating_mul(width).saturating_mul(self.stored_value_bytes(dtype))
    }
    /// Whether a KV-connector server can hand samples out in this format, one `<request>.safetensors` each.
    fn per_request_files(&self) -> bool {
        self.folder() == crate::output::safetensors::FOLDER
    }
    /// Reads a file this format wrote (`what` names it in errors); `checksum` is left to the caller.
    fn decode(&self, bytes: &[u8], what: &str) -> CoreResult<LoadedSample>;
}

/// Every format, in the order they are listed to users.
pub fn all() -> Vec<Box<dyn Format>> {
    vec![Box::new(Safetensors { compress: None }), Box::new(Fp8), Box::new(Legacy)]
}

/// What a driver needs to know of a format beyond its files (Python reads it from the core: `py/facts.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Descriptor {
    pub name: &'static str,
    pub aliases: &'static [&'static str],
    pub folder: &'static str,
    pub file_pattern: &'static str,
    /// The dtype every file holds whatever was captured (fp8), or None: the captured (or store) dtype.
    pub stored_dtype: Option<&'static str>,
    /// Bytes per stored value when fixed (fp8: 1), or None: the dtype's size.
    pub value_bytes: Option<usize>,
    pub compressible: bool,
    pub per_request_files: bool,
}

impl Descriptor {
    pub fn of(f: &dyn Format) -> Descriptor {
        fn fixed<T: PartialEq>(a: T, b: T) -> Option<T> {
            (a == b).then_some(a)
        }
        Descriptor {
            name: f.name(),
            aliases: f.aliases(),
            folder: f.folder(),
            file_pattern: f.file_pattern(),
            stored_dtype: fixed(f.stored_dtype(DType::F32), f.stored_dtype(DType::BF16)),
            value_bytes: fixed(f.stored_value_bytes(DType::F32), f.stored_value_bytes(DType::BF16)),
            compressible: f.compressible(),
            per_request_files: f.per_request_files(),
        }
    }
}

/// The format's name that `name` (a name or an alias) stands for.
pub fn canonical(name: &str) -> CoreResult<&'static str> {
    all().iter().find(|f| f.name() == name || f.aliases().contains(&name)).map(|f| f.name()).ok_or_else(|| {
        let known: Vec<String> = all().iter().map(|f| f.name().to_string()).collect();
        core_err!(
            Config,
            "unknown format {name:?}: expected one of {} (hscapture: safetensors files, speculators' current training; fp8: \
             the same with e4m3fn states and per-token scales, speculators' FP8Transfer; legacy: data_{{i}}.pt, \
             speculators 0.3/0.4)",
            known.join(", ")
        )
    })
}

/// The format called `name` (or an alias); `compress` (a zstd level) applies to formats that compress.
pub fn by_name(name: &str, compress: Option<i32>) -> CoreResult<Box<dyn Format>> {
    let name = canonical(name)?;
    if let Some(level) = compress {
        let levels = crate::output::compress::LEVELS;
        if !levels.contains(&level) {
            bail!(
                Config,
                "compression level {level}: zstd takes {}..={} (3 is a good default); leave it unset for none",
                levels.start(),
                levels.end()
            );
        }
        if !all().iter().any(|f| f.name() == name && f.compressible()) {
            bail!(Config, "compression applies to the hscapture format only; the {name} format stores states as they are");
        }
    }
    Ok(match name {
        "fp8" => Box::new(Fp8),
        "legacy" => Box::new(Legacy),
        _ => Box::new(Safetensors { compress }),
    })
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
