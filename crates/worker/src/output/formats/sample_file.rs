//! The per-sample safetensors file that the `hscapture` and `fp8` formats share: its naming
//! (`hidden_states/hs_{i}.safetensors`), the helpers that write its header and tensors, and the one reader of all
//! its variants — states in the model's or the store dtype, byte-plane compressed (`compress.rs`), or e4m3fn codes
//! with a scale per token (dequantized to bf16). The header's metadata carries the capture's identity.

use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors};

use crate::output::formats::compress;
use crate::output::ledger::record::Identity;
use crate::sample::SampleKey;
use crate::sample::{file_stem, LoadedSample, Sample};
use crate::{core_err, ensure, error::CoreResult};
use hscapture_kernels::{fp8, DType};

/// The version of the file layout, in every file's metadata (`format`).
pub const FILE_FORMAT: &str = "hscapture/1";

/// The tensor holding compressed states (U8), and the metadata keys that describe them.
pub const COMPRESSED: &str = "hidden_states.zst";
pub const META_CODEC: &str = "hscapture.compression";
pub const META_SHAPE: &str = "hscapture.shape";
pub const META_DTYPE: &str = "hscapture.dtype";
pub const META_IDENTITY: &str = "hscapture.identity";

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
    let json = serde_json::to_string(identity).map_err(|e| core_err!(Output, "cannot encode the capture's identity: {e}").caused_by(&e))?;
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
    let mut buf = serde_json::to_vec(&head).map_err(|e| core_err!(Output, "cannot encode the safetensors header: {e}").caused_by(&e))?;
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

/// The tensor of per-token scales (speculators' `SCALES_KEY`).
pub const SCALES: &str = "hidden_states_scales";
/// The torch name of the stored dtype (the capture's identity records it).
pub const STORED: &str = "float8_e4m3fn";

/// Reads a per-sample file of either format (`what` names it in errors).
pub fn read(bytes: &[u8], what: &str) -> CoreResult<LoadedSample> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| {
        core_err!(Output, "{what} is not a valid safetensors file ({e}); it may be truncated: delete it and re-run to recapture")
            .caused_by(&e)
    })?;
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| core_err!(Output, "{what}: {e}").caused_by(&e))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    let ti = st.tensor("token_ids").map_err(|e| core_err!(Output, "{what}: no `token_ids` tensor ({e})").caused_by(&e))?;
    let token_ids = token_ids(&ti, what)?;
    if metadata.contains_key(META_CODEC) {
        return decode_compressed(&st, metadata, token_ids, what);
    }
    let hs = st.tensor("hidden_states").map_err(|e| core_err!(Output, "{what}: no `hidden_states` tensor ({e})").caused_by(&e))?;
    if hs.dtype() == Dtype::F8_E4M3 {
        return dequantize(&st, &hs, metadata, token_ids, what);
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

fn decode_compressed(st: &SafeTensors<'_>, metadata: HashMap<String, String>, token_ids: Vec<i64>, what: &str) -> CoreResult<LoadedSample> {
    let codec = metadata.get(META_CODEC).map(String::as_str).unwrap_or("");
    ensure!(codec == compress::CODEC, Output, "{what}: compressed with {codec:?}; this hscapture reads {}", compress::CODEC);
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
    let z = st.tensor(COMPRESSED).map_err(|e| core_err!(Output, "{what}: no `{COMPRESSED}` tensor ({e})").caused_by(&e))?;
    let data = compress::decode(z.data(), dtype.size(), len, what)?;
    Ok(LoadedSample::new(token_ids, shape, dtype, data, metadata))
}

/// Reads an fp8 file's states (`hs`, already found to be F8_E4M3) and dequantizes them to bf16.
fn dequantize(
    st: &SafeTensors<'_>,
    hs: &safetensors::tensor::TensorView<'_>,
    metadata: HashMap<String, String>,
    token_ids: Vec<i64>,
    what: &str,
) -> CoreResult<LoadedSample> {
    let shape: [usize; 3] =
        hs.shape().try_into().map_err(|_| core_err!(Output, "{what}: `hidden_states` {:?} is not [L, n_layers, H]", hs.shape()))?;
    let rows = token_ids.len();
    ensure!(shape[0] == rows, Output, "{what}: `hidden_states` {shape:?} and `token_ids` [{rows}] do not form [L, n_layers, H] and [L]");
    let sc = st.tensor(SCALES).map_err(|e| {
        core_err!(Output, "{what}: fp8 `hidden_states` without `{SCALES}` ({e}); the file cannot be dequantized: recapture it")
            .caused_by(&e)
    })?;
    ensure!(
        sc.dtype() == Dtype::F32 && sc.shape() == [rows, 1, 1],
        Output,
        "{what}: `{SCALES}` is {:?} {:?}, expected F32 [{rows}, 1, 1]",
        sc.dtype(),
        sc.shape()
    );
    let scales: Vec<f32> = sc.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if let Some((t, s)) = scales.iter().enumerate().find(|(_, s)| !(s.is_finite() && **s > 0.0)) {
        return Err(core_err!(
            Output,
            "{what}: token {t}'s scale is {s}, expected a finite positive number; the file is damaged: recapture it"
        ));
    }
    let per_token = shape[1] * shape[2];
    let mut data = vec![0u8; hs.data().len() * 2];
    for (i, &code) in hs.data().iter().enumerate() {
        let v = fp8::dequantize_bf16(code, scales[i / per_token.max(1)]);
        data[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
    }
    let mut s = LoadedSample::new(token_ids, shape, DType::BF16, data, metadata);
    s.stored = STORED.to_string();
    Ok(s)
}
