//! Sample files in the layout speculators' training reads: `hidden_states` `[L, n_layers, H]` and
//! `token_ids` int64 `[L]`, written with the `safetensors` crate's header types and without copying
//! the tensor data.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use crate::output::atomic::write_atomic;
use crate::output::sample::{content_checksum, Sample};
use crate::{core_err, ensure, error::CoreResult};
use hscapture_kernels::DType;

pub fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
    }
}

/// The tensor holding compressed states (U8), and the metadata keys that describe them.
pub const COMPRESSED: &str = "hidden_states.zst";
const META_CODEC: &str = "hscapture.compression";
const META_SHAPE: &str = "hscapture.shape";
const META_DTYPE: &str = "hscapture.dtype";

/// Header bytes (length prefix excluded), padded with spaces to a multiple of 8. `compressed`: the
/// length of the compressed states stored instead of `hidden_states`.
fn header(sample: &Sample, metadata: &HashMap<String, String>, compressed: Option<usize>) -> CoreResult<Vec<u8>> {
    let tok_len = sample.token_ids.len() * 8;
    let states = match compressed {
        None => ("hidden_states".to_string(), TensorInfo { dtype: st_dtype(sample.dtype), shape: sample.shape().to_vec(), data_offsets: (tok_len, tok_len + sample.data.len()) }),
        Some(n) => (COMPRESSED.to_string(), TensorInfo { dtype: Dtype::U8, shape: vec![n], data_offsets: (tok_len, tok_len + n) }),
    };
    let infos = vec![
        ("token_ids".to_string(), TensorInfo { dtype: Dtype::I64, shape: vec![sample.token_ids.len()], data_offsets: (0, tok_len) }),
        states,
    ];
    let mut metadata = metadata.clone();
    if compressed.is_some() {
        let [l, n, h] = sample.shape();
        metadata.insert(META_CODEC.into(), crate::output::compress::CODEC.into());
        metadata.insert(META_SHAPE.into(), format!("{l},{n},{h}"));
        metadata.insert(META_DTYPE.into(), format!("{:?}", st_dtype(sample.dtype)));
    }
    let meta = if metadata.is_empty() { None } else { Some(metadata.clone()) };
    let m = Metadata::new(meta, infos).map_err(|e| core_err!(Output, "cannot build the safetensors header: {e}"))?;
    let mut buf = serde_json::to_vec(&m).map_err(|e| core_err!(Output, "cannot encode the safetensors header: {e}"))?;
    buf.resize(buf.len().next_multiple_of(8), b' ');
    Ok(buf)
}

/// Writes `sample` to `path` atomically; returns the file size.
pub fn write_sample_file(path: &Path, sample: &Sample, metadata: &HashMap<String, String>, durable: bool) -> CoreResult<u64> {
    write_sample_file_with(path, sample, metadata, durable, None)
}

/// As [`write_sample_file`]; with `compress = Some(level)` the states are stored byte-plane split and
/// zstd-compressed (`hidden_states.zst`, see `compress.rs`), read back transparently by
/// [`read_sample_file`].
pub fn write_sample_file_with(path: &Path, sample: &Sample, metadata: &HashMap<String, String>, durable: bool, compress: Option<i32>) -> CoreResult<u64> {
    let [rows, slots, width] = sample.shape();
    ensure!(
        sample.data.len() == rows * slots * width * sample.dtype.size() && sample.token_ids.len() == rows,
        ShapeContract,
        "{}: data of {} bytes and {} token ids do not make a [{rows}, {slots}, {width}] {} sample",
        sample.key,
        sample.data.len(),
        sample.token_ids.len(),
        sample.dtype
    );
    let packed = match compress {
        Some(level) => Some(crate::output::compress::encode(&sample.data, sample.dtype.size(), level)?),
        None => None,
    };
    let head = header(sample, metadata, packed.as_ref().map(Vec::len))?;
    write_atomic(path, durable, |w| {
        w.write_all(&(head.len() as u64).to_le_bytes())?;
        w.write_all(&head)?;
        for t in &sample.token_ids {
            w.write_all(&t.to_le_bytes())?;
        }
        w.write_all(packed.as_deref().unwrap_or(&sample.data))
    })
}

/// A sample file read back.
#[derive(Debug)]
pub struct LoadedSample {
    pub token_ids: Vec<i64>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub data: Vec<u8>,
    pub checksum: String,
    pub metadata: HashMap<String, String>,
}

/// Reads a sample file and checks its two tensors' dtypes and shapes agree.
pub fn read_sample_file(path: &Path) -> CoreResult<LoadedSample> {
    let bytes = std::fs::read(path).map_err(|e| core_err!(Output, "cannot read {}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        core_err!(Output, "{} is not a valid safetensors file ({e}); it may be truncated: delete it and re-run to recapture", path.display())
    })?;
    let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| core_err!(Output, "{}: {e}", path.display()))?;
    let metadata = meta.metadata().clone().unwrap_or_default();
    if metadata.contains_key(META_CODEC) {
        return read_compressed(path, &st, metadata);
    }
    let hs = st.tensor("hidden_states").map_err(|e| core_err!(Output, "{}: no `hidden_states` tensor ({e})", path.display()))?;
    let ti = st.tensor("token_ids").map_err(|e| core_err!(Output, "{}: no `token_ids` tensor ({e})", path.display()))?;
    ensure!(ti.dtype() == Dtype::I64, Output, "{}: `token_ids` is {:?}, expected I64", path.display(), ti.dtype());
    let dtype = match hs.dtype() {
        Dtype::F32 => DType::F32,
        Dtype::BF16 => DType::BF16,
        Dtype::F16 => DType::F16,
        other => return Err(core_err!(Output, "{}: `hidden_states` has dtype {other:?}, expected F32, BF16 or F16", path.display())),
    };
    ensure!(
        hs.shape().len() == 3 && ti.shape().len() == 1 && hs.shape()[0] == ti.shape()[0],
        Output,
        "{}: `hidden_states` {:?} and `token_ids` {:?} do not form [L, n_layers, H] and [L]",
        path.display(),
        hs.shape(),
        ti.shape()
    );
    let token_ids = ti.data().chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect();
    Ok(LoadedSample {
        token_ids,
        shape: hs.shape().to_vec(),
        dtype,
        checksum: content_checksum(hs.data()),
        data: hs.data().to_vec(),
        metadata,
    })
}

fn read_compressed(path: &Path, st: &SafeTensors<'_>, metadata: HashMap<String, String>) -> CoreResult<LoadedSample> {
    let what = path.display().to_string();
    let codec = metadata.get(META_CODEC).map(String::as_str).unwrap_or("");
    ensure!(codec == crate::output::compress::CODEC, Output, "{what}: compressed with {codec:?}; this hscapture reads {}", crate::output::compress::CODEC);
    let shape: Vec<usize> = metadata.get(META_SHAPE).map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect()).unwrap_or_default();
    let dtype = match metadata.get(META_DTYPE).map(String::as_str) {
        Some("F32") => DType::F32,
        Some("BF16") => DType::BF16,
        Some("F16") => DType::F16,
        other => return Err(core_err!(Output, "{what}: compressed states of dtype {other:?}, expected F32, BF16 or F16")),
    };
    let z = st.tensor(COMPRESSED).map_err(|e| core_err!(Output, "{what}: no `{COMPRESSED}` tensor ({e})"))?;
    let ti = st.tensor("token_ids").map_err(|e| core_err!(Output, "{what}: no `token_ids` tensor ({e})"))?;
    ensure!(
        shape.len() == 3 && ti.dtype() == Dtype::I64 && ti.shape() == [shape[0]],
        Output,
        "{what}: compressed states of shape {shape:?} and `token_ids` {:?} do not form [L, n_layers, H] and [L]",
        ti.shape()
    );
    let data = crate::output::compress::decode(z.data(), dtype.size(), shape.iter().product::<usize>() * dtype.size(), &what)?;
    let token_ids = ti.data().chunks_exact(8).map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect();
    Ok(LoadedSample { token_ids, shape, dtype, checksum: content_checksum(&data), data, metadata })
}

#[cfg(test)]
#[path = "tests/safetensors.rs"]
mod tests;
