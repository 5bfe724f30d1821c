//! The sample formats: what a finished sample becomes on disk, and back.
//! - `hscapture` ([`safetensors`]): `hidden_states/hs_{i}.safetensors`, the layout speculators' current training
//!   reads, in the model's or the store dtype, optionally compressed ([`compress`]);
//! - `fp8` ([`fp8`]): the same files with e4m3fn states and a scale per token (speculators' `FP8Transfer`);
//! - `legacy` ([`legacy`], over [`zip`]): speculators 0.3/0.4's `data_{i}.pt`.
//!
//! [`format`] is the interface every format implements, [`sample_file`] the per-sample safetensors file the first
//! two share (its naming, its writing helpers, its one reader); this module is the registry. A format encodes a
//! sample into the parts of one file (written atomically by the sink, hashed on the way) and decodes such a file,
//! checking what it relies on; nothing else in the output side knows a layout.

pub mod compress;
pub mod format;
pub mod fp8;
pub mod legacy;
pub mod safetensors;
pub mod sample_file;
pub mod zip;

use std::path::Path;

use crate::output::ledger::record::file_checksum;
use crate::sample::LoadedSample;
use crate::{bail, core_err, error::CoreResult};
pub use format::{Descriptor, Format};
use fp8::Fp8;
use legacy::Legacy;
use safetensors::Safetensors;

/// Every format, in the order they are listed to users.
pub fn all() -> Vec<Box<dyn Format>> {
    vec![Box::new(Safetensors { compress: None }), Box::new(Fp8), Box::new(Legacy)]
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
        let levels = compress::LEVELS;
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
    let bytes = std::fs::read(path).map_err(|e| core_err!(Output, "cannot read {}: {e}", path.display()).caused_by(&e))?;
    decode_file(path, &bytes)
}
