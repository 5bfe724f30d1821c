//! The `fp8` format: the `hscapture` layout with the states stored as e4m3fn codes and one f32 scale per token,
//! the file speculators' `FP8HiddenStatesConnector` writes and its `FP8Transfer` reads — `token_ids` I64 `[L]`,
//! `hidden_states_scales` F32 `[L, 1, 1]`, `hidden_states` F8_E4M3 `[L, n_layers, H]` — at half the bytes of
//! bf16. The quantization is `hscapture_kernels::fp8` (bit for bit speculators'); reading a file back
//! dequantizes it as speculators does, to bf16.

use std::borrow::Cow;
use std::collections::HashMap;

use safetensors::{Dtype, SafeTensors};

use crate::attribution::plan::SampleKey;
use crate::output::format::Format;
use crate::output::record::Identity;
use crate::output::safetensors::{check_sample, file_of, header, identity_metadata, index_in, token_bytes, Tensor, FOLDER, PATTERN};
use crate::output::sample::{LoadedSample, Sample};
use crate::{core_err, ensure, error::CoreResult};
use hscapture_kernels::{fp8, DType};

/// The tensor of per-token scales (speculators' `SCALES_KEY`).
pub const SCALES: &str = "hidden_states_scales";
/// The torch name of the stored dtype (the capture's identity records it).
pub const STORED: &str = "float8_e4m3fn";

pub struct Fp8;

/// A sample's states quantized: one code per value, one scale per token.
pub struct Quantized {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// Quantizes `sample`'s states (in its dtype) per token over all of its layers and hidden dims.
pub fn quantize(sample: &Sample) -> CoreResult<Quantized> {
    check_sample(sample)?;
    crate::output::safetensors::refuse_quantized(sample, "fp8 quantizer")?;
    let [rows, slots, width] = sample.shape();
    let per_token = slots * width;
    let mut q = Quantized { codes: vec![0u8; rows * per_token], scales: vec![0f32; rows] };
    fp8::quantize(&sample.data, sample.dtype, rows, per_token, &mut q.codes, &mut q.scales);
    Ok(q)
}

/// The parts of a file holding `codes` and `scales` (the quantized states of `sample`) with the given metadata.
pub fn encode_quantized<'a>(
    sample: &Sample,
    codes: Cow<'a, [u8]>,
    scales: &[f32],
    metadata: HashMap<String, String>,
) -> CoreResult<Vec<Cow<'a, [u8]>>> {
    let [rows, slots, width] = sample.shape();
    ensure!(
        codes.len() == rows * slots * width && scales.len() == rows,
        ShapeContract,
        "{}: {} fp8 codes and {} scales do not make a [{rows}, {slots}, {width}] sample",
        sample.key,
        codes.len(),
        scales.len()
    );
    let tokens = token_bytes(sample);
    let scales: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
    // Scales before codes: every tensor starts aligned to its element size.
    let head = header(
        &[
            Tensor { name: "token_ids", dtype: "I64", shape: vec![rows], bytes: tokens.len() },
            Tensor { name: SCALES, dtype: "F32", shape: vec![rows, 1, 1], bytes: scales.len() },
            Tensor { name: "hidden_states", dtype: "F8_E4M3", shape: vec![rows, slots, width], bytes: codes.len() },
        ],
        metadata,
    )?;
    Ok(vec![Cow::Owned(head), Cow::Owned(tokens), Cow::Owned(scales), codes])
}

/// Reads an fp8 file's states (`hs`, already found to be F8_E4M3) and dequantizes them to bf16.
pub fn decode(
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

impl Format for Fp8 {
    fn name(&self) -> &'static str {
        "fp8"
    }

    fn file(&self, key: &SampleKey) -> String {
        file_of(key)
    }

    fn folder(&self) -> &'static str {
        FOLDER
    }

    fn file_pattern(&self) -> &'static str {
        PATTERN
    }

    fn stored_value_bytes(&self, _: DType) -> usize {
        1
    }

    fn stored_row_bytes(&self, slots: usize, width: usize, _: DType) -> usize {
        slots.saturating_mul(width).saturating_add(std::mem::size_of::<f32>()) // a byte per value and the row's scale
    }

    fn index_of(&self, name: &str) -> Option<u64> {
        index_in(name)
    }

    fn stored_dtype(&self, _: DType) -> &'static str {
        STORED
    }

    fn encode<'a>(&self, sample: &'a Sample, identity: &Identity) -> CoreResult<Vec<Cow<'a, [u8]>>> {
        let metadata = identity_metadata(identity)?;
        match &sample.scales {
            // Quantized on the device already: the codes are stored as they came.
            Some(scales) => {
                check_sample(sample)?;
                encode_quantized(sample, Cow::Borrowed(sample.data.as_slice()), scales, metadata)
            }
            None => {
                let q = quantize(sample)?;
                encode_quantized(sample, Cow::Owned(q.codes), &q.scales, metadata)
            }
        }
    }

    fn decode(&self, bytes: &[u8], what: &str) -> CoreResult<LoadedSample> {
        // One reader for both: the hscapture format's decode recognizes F8_E4M3 states and comes back here.
        crate::output::safetensors::Safetensors { compress: None }.decode(bytes, what)
    }
}

#[cfg(test)]
#[path = "tests/fp8.rs"]
mod tests;
