//! The `fp8` format: the `hscapture` layout with the states stored as e4m3fn codes and one f32 scale per token,
//! the file speculators' `FP8HiddenStatesConnector` writes and its `FP8Transfer` reads — `token_ids` I64 `[L]`,
//! `hidden_states_scales` F32 `[L, 1, 1]`, `hidden_states` F8_E4M3 `[L, n_layers, H]` — at half the bytes of
//! bf16. The quantization is `hscapture_kernels::fp8` (bit for bit speculators'); reading a file back
//! dequantizes it as speculators does, to bf16.

use std::borrow::Cow;
use std::collections::HashMap;

use crate::output::formats::sample_file::{
    self, check_sample, file_of, header, identity_metadata, index_in, token_bytes, Tensor, FOLDER, PATTERN, SCALES, STORED,
};
use crate::output::formats::Format;
use crate::output::ledger::record::Identity;
use crate::sample::SampleKey;
use crate::sample::{LoadedSample, Sample};
use crate::{ensure, error::CoreResult};
use hscapture_kernels::{fp8, DType};

pub struct Fp8;

/// A sample's states quantized: one code per value, one scale per token.
pub struct Quantized {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

/// Quantizes `sample`'s states (in its dtype) per token over all of its layers and hidden dims.
pub fn quantize(sample: &Sample) -> CoreResult<Quantized> {
    check_sample(sample)?;
    crate::output::formats::sample_file::refuse_quantized(sample, "fp8 quantizer")?;
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

    fn quantized(&self) -> bool {
        true
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
        sample_file::read(bytes, what) // one reader for every variant of the file
    }
}

#[cfg(test)]
#[path = "tests/fp8.rs"]
mod tests;
