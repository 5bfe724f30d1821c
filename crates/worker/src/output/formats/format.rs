//! The one interface of a stored layout ([`Format`]) and what a driver needs to know of one ([`Descriptor`]).

use std::borrow::Cow;

use crate::error::CoreResult;
use crate::output::formats::sample_file;
use crate::output::ledger::record::Identity;
use crate::sample::SampleKey;
use crate::sample::{LoadedSample, Sample};
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
    /// Whether it stores quantized states (codes and scales): what a device path that quantizes may feed.
    fn quantized(&self) -> bool {
        false
    }
    /// Whether a KV-connector server can hand samples out in this format, one `<request>.safetensors` each.
    fn per_request_files(&self) -> bool {
        self.folder() == sample_file::FOLDER
    }
    /// Reads a file this format wrote (`what` names it in errors); `checksum` is left to the caller.
    fn decode(&self, bytes: &[u8], what: &str) -> CoreResult<LoadedSample>;
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
