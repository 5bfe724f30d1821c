//! The `hscapture` format: sample files in the layout speculators' training reads —
//! `hidden_states` `[L, n_layers, H]` and `token_ids` int64 `[L]` in a safetensors file (read with the
//! `safetensors` crate; written without copying the tensor data, the header's keys sorted); optionally the states
//! byte-plane split and zstd-compressed (`hidden_states.zst`, see `compress.rs`). The header's
//! metadata carries the capture's settings (`hscapture.identity`, and for readers that look for them
//! `format`, `convention`, `layer_ids`, `model`).

use std::borrow::Cow;
use std::collections::HashMap;

use crate::error::CoreResult;
use crate::output::formats::sample_file::{
    self, check_sample, file_of, header, identity_metadata, index_in, refuse_quantized, st_dtype, token_bytes, Tensor, COMPRESSED, FOLDER,
    META_CODEC, META_DTYPE, META_SHAPE, PATTERN,
};
use crate::output::formats::{compress, Format};
use crate::output::ledger::record::Identity;
use crate::sample::SampleKey;
use crate::sample::{LoadedSample, Sample};

/// The format's name: the default a capture writes (`worker::defaults::FORMAT`).
pub const NAME: &str = "hscapture";
pub struct Safetensors {
    /// zstd level of byte-plane compression (`compress.rs`); None stores the states as they are.
    pub compress: Option<i32>,
}

/// The parts of `sample`'s file with the given metadata (the states borrowed, not copied).
pub fn encode_with<'a>(sample: &'a Sample, mut metadata: HashMap<String, String>, compress: Option<i32>) -> CoreResult<Vec<Cow<'a, [u8]>>> {
    check_sample(sample)?;
    refuse_quantized(sample, NAME)?;
    let tokens = token_bytes(sample);
    let ti = Tensor { name: "token_ids", dtype: "I64", shape: vec![sample.token_ids.len()], bytes: tokens.len() };
    let (head, states) = match compress {
        Some(level) => {
            let packed = compress::encode(&sample.data, sample.dtype.size(), level)?;
            let [l, n, h] = sample.shape();
            metadata.insert(META_CODEC.into(), compress::CODEC.into());
            metadata.insert(META_SHAPE.into(), format!("{l},{n},{h}"));
            metadata.insert(META_DTYPE.into(), format!("{:?}", st_dtype(sample.dtype)));
            let z = Tensor { name: COMPRESSED, dtype: "U8", shape: vec![packed.len()], bytes: packed.len() };
            (header(&[ti, z], metadata)?, Cow::Owned(packed))
        }
        None => {
            let hs = Tensor {
                name: "hidden_states",
                dtype: sample.dtype.safetensors_name(),
                shape: sample.shape().to_vec(),
                bytes: sample.data.len(),
            };
            (header(&[ti, hs], metadata)?, Cow::Borrowed(sample.data.as_slice()))
        }
    };
    Ok(vec![Cow::Owned(head), Cow::Owned(tokens), states])
}

/// A format that stores states as captured cannot take a device-quantized sample (a session wired wrongly).
impl Format for Safetensors {
    fn name(&self) -> &'static str {
        NAME
    }

    fn file(&self, key: &SampleKey) -> String {
        file_of(key)
    }

    fn folder(&self) -> &'static str {
        FOLDER
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["file"]
    }

    fn file_pattern(&self) -> &'static str {
        PATTERN
    }

    fn compressible(&self) -> bool {
        true
    }

    fn index_of(&self, name: &str) -> Option<u64> {
        index_in(name)
    }

    fn encode<'a>(&self, sample: &'a Sample, identity: &Identity) -> CoreResult<Vec<Cow<'a, [u8]>>> {
        encode_with(sample, identity_metadata(identity)?, self.compress)
    }

    fn decode(&self, bytes: &[u8], what: &str) -> CoreResult<LoadedSample> {
        sample_file::read(bytes, what)
    }
}

#[cfg(test)]
#[path = "tests/safetensors.rs"]
mod tests;
