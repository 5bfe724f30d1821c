//! The `hscapture` format: sample files in the layout speculators' training reads —
//! `hidden_states` `[L, n_layers, H]` and `token_ids` int64 `[L]` in a safetensors file (read with the
//! `safetensors` crate; written without copying the tensor data, the header's keys sorted); optionally the states
//! byte-plane split and zstd-compressed (`hidden_states.zst`, see `compress.rs`). The header's
//! metadata carries the capture's settings (`hscapture.identity`, and for readers that look for them
//! `format`, `convention`, `layer_ids`, `model`).

use std::borrow::Cow;
use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors};

use crate::attribution::plan::SampleKey;
use crate::output::format::Format;
use crate::output::record::Identity;
use crate::output::sample::{file_stem, LoadedSample, Sample};
use crate::{core_err, ensure, error::CoreResult};
use hscapture_kernels::DType;

/// The version of the file layout, in every file's metadata (`format`).
pub const FILE_FORMAT: &str = "hscapture/1";
/// The tensor holding compressed states (U8), and the metadata keys that describe them.
pub const COMPRESSED: &str = "hidden_states.zst";
const META_CODEC: &str = "hscapture.compression";
const META_SHAPE: &str = "hscapture.shape";
const META_DTYPE: &str = "hscapture.dtype";
pub const META_IDENTITY: &str = "hscapture.identity";

pub struct Safetensors {
    /// zstd level of byte-plane compression (`compress.rs`); None stores the states as they are.
    pub compress: Option<i32>,
}

pub fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

fn from_st(d: Dtype) -> Option<DType> {
    DType::parse(&format!("{d:?}"))
}

/// The metadata every file carries.
pub fn identity_metadata(identity: &Identity) -> CoreResult<HashMap<String, String>> {
    let json = serde_json::to_string(identity).map_err(|e| core_err!(Output, "cannot encode the capture's identity: {e}"))?;
    Ok(HashMap::from([
        ("format".to_string(), FILE_FORMAT.to_string()),
        ("convention".to_string(), identity.convention.clone()),
        ("layer_ids".to_string(), identity.layer_ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")),
        ("model".to_string(), identity.model.clone()),
        (META_IDENTITY.to_string(), json),
    ]))
}

/// One tensor of a file, in file order: name, safetensors dtype, shape, byte length.
pub struct Tensor<'n> {
    pub name: &'n str,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub bytes: usize,
}

/// Header bytes (length prefix included) for `tensors` laid out back to back in that order, padded with spaces to
/// a multiple of 8. The JSON's keys are sorted (a file is a function of its sample: its checksum too).
pub fn header(tensors: &[Tensor<'_>], metadata: HashMap<String, String>) -> CoreResult<Vec<u8>> {
    let mut head = serde_json::Map::new();
    let mut at = 0usize;
    for t in tensors {
        let end = at + t.bytes;
        head.insert(t.name.into(), serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [at, end]}));
        at = end;
    }
    if !metadata.is_empty() {
        let sorted: std::collections::BTreeMap<String, String> = metadata.into_iter().collect();
        head.insert("__metadata__".into(), serde_json::json!(sorted));
    }
    let mut buf = serde_json::to_vec(&head).map_err(|e| core_err!(Output, "cannot encode the safetensors header: {e}"))?;
    buf.resize(buf.len().next_multiple_of(8), b' ');
    Ok([(buf.len() as u64).to_le_bytes().to_vec(), buf].concat())
}

/// `token_ids` as the bytes of an I64 tensor.
pub fn token_bytes(sample: &Sample) -> Vec<u8> {
    sample.token_ids.iter().flat_map(|t| t.to_le_bytes()).collect()
}

/// Checks that a sample's data and token ids make a `[rows, slots, width]` sample.
pub fn check_sample(sample: &Sample) -> CoreResult<()> {
    let [rows, slots, width] = sample.shape();
    ensure!(
        sample.data.len() == rows * slots * width * sample.value_bytes()
            && sample.token_ids.len() == rows
            && sample.scales.as_ref().is_none_or(|s| s.len() == rows),
        ShapeContract,
        "{}: data of {} bytes and {} token ids do not make a [{rows}, {slots}, {width}] {} sample",
        sample.key,
        sample.data.len(),
        sample.token_ids.len(),
        sample.dtype
    );
    Ok(())
}

/// The parts of `sample`'s file with the given metadata (the states borrowed, not copied).
pub fn encode_with<'a>(sample: &'a Sample, mut metadata: HashMap<String, String>, compress: Option<i32>) -> CoreResult<Vec<Cow<'a, [u8]>>> {
    check_sample(sample)?;
    refuse_quantized(sample, "hscapture")?;
    let tokens = token_bytes(sample);
    let ti = Tensor { name: "token_ids", dtype: "I64", shape: vec![sample.token_ids.len()], bytes: tokens.len() };
    let (head, states) = match compress {
        Some(level) => {
            let packed = crate::output::compress::encode(&sample.data, sample.dtype.size(), level)?;
            let [l, n, h] = sample.shape();
            metadata.insert(META_CODEC.into(), crate::output::compress::CODEC.into());
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
pub fn refuse_quantized(sample: &Sample, format: &str) -> CoreResult<()> {
    ensure!(
        sample.scales.is_none(),
        Compatibility,
        "{}: the sample arrived as fp8 codes, which the {format} format does not store; the device quantizes only \
         for the fp8 format",
        sample.key
    );
    Ok(())
}

pub fn token_ids(ti: &safetensors::tensor::TensorView<'_>, what: &str) -> CoreResult<Vec<i64>> {
    ensure!(
        ti.dtype() == Dtype::I64 && ti.shape().len() == 1,
        Output,
        "{what}: `token_ids` is {:?} {:?}, expected I64 [L]",
        ti.dtype(),
        ti.shape()
    );
    Ok(ti.data().chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect())
}

/// The folder of safetensors sample files (the `hscapture` and `fp8` formats).
pub const FOLDER: &str = "hidden_states";
/// Sample `i`'s file (the `hscapture` and `fp8` formats).
pub const PATTERN: &str = "hidden_states/hs_{i}.safetensors";

/// Sample `key`'s safetensors file, relative to the output root.
pub fn file_of(key: &SampleKey) -> String {
    format!("{FOLDER}/{}.safetensors", file_stem(key))
}

/// The sample index of a safetensors file's name (`hs_{i}.safetensors`).
pub fn index_in(name: &str) -> Option<u64> {
    name.strip_prefix("hs_")?.strip_suffix(".safetensors")?.parse().ok()
}

impl Format for Safetensors {
    fn name(&self) -> &'static str {
        "hscapture"
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
        let st = SafeTensors::deserialize(bytes).map_err(|e| {
            core_err!(Output, "{what} is not a valid safetensors file ({e}); it may be truncated: delete it and re-run to recapture")
        })?;
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| core_err!(Output, "{what}: {e}"))?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        let ti = st.tensor("token_ids").map_err(|e| core_err!(Output, "{what}: no `token_ids` tensor ({e})"))?;
        let token_ids = token_ids(&ti, what)?;
        if metadata.contains_key(META_CODEC) {
            return decode_compressed(&st, metadata, token_ids, what);
        }
        let hs = st.tensor("hidden_states").map_err(|e| core_err!(Output, "{what}: no `hidden_states` tensor ({e})"))?;
        if hs.dtype() == Dtype::F8_E4M3 {
            return crate::output::fp8::decode(&st, &hs, metadata, token_ids, what);
        }
        let dtype = from_st(hs.dtype())
            .ok_or_else(|| core_err!(Output, "{what}: `hidden_states` has dtype {:?}, expected F32, BF16 or F16", hs.dtype()))?;
        let shape: [usize; 3] =
            hs.shape().try_into().map_err(|_| core_err!(Output, "{what}: `hidden_states` {:?} is not [L, n_layers, H]", hs.shape()))?;
        ensure!(
            shape[0] == token_ids.len(),
            Output,
            "{what}: `hidden_states` {shape:?} and `token_ids` [{}] do not form [L, n_layers, H] and [L]",
            token_ids.len()
        );
        Ok(LoadedSample::new(token_ids, shape, dtype, hs.data().to_vec(), metadata))
    }
}

fn decode_compressed(st: &SafeTensors<'_>, metadata: HashMap<String, String>, token_ids: Vec<i64>, what: &str) -> CoreResult<LoadedSample> {
    let codec = metadata.get(META_CODEC).map(String::as_str).unwrap_or("");
    ensure!(
        codec == crate::output::compress::CODEC,
        Output,
        "{what}: compressed with {codec:?}; this hscapture reads {}",
        crate::output::compress::CODEC
    );
    let dims: Vec<usize> = metadata.get(META_SHAPE).map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or_default();
    let shape: [usize; 3] = dims
        .as_slice()
        .try_into()
        .map_err(|_| core_err!(Output, "{what}: compressed states of shape {dims:?}, expected [L, n_layers, H]"))?;
    let dtype = metadata
        .get(META_DTYPE)
        .and_then(|d| DType::parse(d))
        .ok_or_else(|| core_err!(Output, "{what}: compressed states of dtype {:?}, expected F32, BF16 or F16", metadata.get(META_DTYPE)))?;
    ensure!(
        shape[0] == token_ids.len(),
        Output,
        "{what}: compressed states of shape {shape:?} and `token_ids` [{}] do not form [L, n_layers, H] and [L]",
        token_ids.len()
    );
    let len = shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| core_err!(Output, "{what}: compressed states of shape {shape:?} overflow; the file is damaged"))?;
    let z = st.tensor(COMPRESSED).map_err(|e| core_err!(Output, "{what}: no `{COMPRESSED}` tensor ({e})"))?;
    let data = crate::output::compress::decode(z.data(), dtype.size(), len, what)?;
    Ok(LoadedSample::new(token_ids, shape, dtype, data, metadata))
}

#[cfg(test)]
#[path = "tests/safetensors.rs"]
mod tests;
