//! The packed object of speculators' Mooncake transfer (`hs_connectors/mooncake_store.py`, manifest version 1):
//! one object per request holding `hidden_states` `[T, L, H]` in the capture dtype at offset 0, then `token_ids`
//! `[T]` int64, each tensor starting on a 64-byte boundary and the whole rounded up to 64 bytes (zero padding).
//! Its layout is described by the transfer manifest that travels in the response's `kv_transfer_params`
//! (handle, version, tensor specs, `total_aligned_bytes`); the trainer reads the object with that manifest.
//! The scheduler announces the manifest before the sample exists and the sink encodes the sample with the same
//! [`PackedLayout`], so the two agree by construction (a sample of another shape is refused, not stored).

use serde_json::{json, Value};

use crate::output::formats::sample_file::{check_sample, refuse_quantized};
use crate::sample::Sample;
use crate::{core_err, error::CoreResult};
use hscapture_kernels::DType;

/// The manifest version the layout is (speculators' `VERSION`).
pub const VERSION: u32 = 1;
/// Every tensor and the object's size are multiples of this.
pub const ALIGN: usize = 64;

/// The Mooncake key of request `req_id`'s object: anything but `[A-Za-z0-9_-]` becomes `_`, and a key that
/// would start with a digit gets a leading `k` (the key speculators' connector uses).
pub fn key_of(req_id: &str) -> String {
    let safe: String = req_id.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    if safe.starts_with(|c: char| c.is_ascii_digit()) {
        format!("k{safe}")
    } else {
        safe
    }
}

/// The key of the error marker a failed put leaves for the trainer instead of the object.
pub fn error_key(key: &str) -> String {
    format!("{key}:error")
}

/// Where each tensor of a `[rows, slots, width]` sample lies in its object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedLayout {
    pub rows: usize,
    pub slots: usize,
    pub width: usize,
    pub dtype: DType,
    pub states_bytes: usize,
    pub tokens_offset: usize,
    pub tokens_bytes: usize,
    pub total: usize,
}

fn align(n: usize) -> Option<usize> {
    n.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}

impl PackedLayout {
    /// The layout of `rows` tokens of `slots` layers of `width` values in `dtype` (checked: the sizes come from
    /// the request and the model).
    pub fn of(rows: usize, slots: usize, width: usize, dtype: DType) -> CoreResult<PackedLayout> {
        let overflow = || core_err!(Config, "a packed sample of [{rows}, {slots}, {width}] {dtype} overflows the address space");
        let states_bytes =
            rows.checked_mul(slots).and_then(|v| v.checked_mul(width)).and_then(|v| v.checked_mul(dtype.size())).ok_or_else(overflow)?;
        let tokens_offset = align(states_bytes).ok_or_else(overflow)?;
        let tokens_bytes = rows.checked_mul(8).ok_or_else(overflow)?;
        let total = tokens_offset.checked_add(tokens_bytes).and_then(align).ok_or_else(overflow)?;
        Ok(PackedLayout { rows, slots, width, dtype, states_bytes, tokens_offset, tokens_bytes, total })
    }

    /// The transfer manifest of this layout for the object under `handle`; `mode` is `prompt_only` or `all`
    /// (prompt and generated tokens).
    pub fn manifest(&self, handle: &str, mode: &str) -> Value {
        json!({
            "handle": handle,
            "version": VERSION,
            "tensors": {
                "hidden_states": {
                    "shape": [self.rows, self.slots, self.width],
                    "dtype": format!("torch.{}", self.dtype.torch_name()),
                    "nbytes": self.states_bytes,
                    "offset": 0,
                },
                "token_ids": {"shape": [self.rows], "dtype": "torch.int64", "nbytes": self.tokens_bytes, "offset": self.tokens_offset},
            },
            "metadata": {"num_tokens": self.rows, "total_aligned_bytes": self.total, "extract_mode": mode},
        })
    }
}

/// `sample` as its packed object (the layout of its own shape and dtype).
pub fn encode(sample: &Sample) -> CoreResult<Vec<u8>> {
    check_sample(sample)?;
    refuse_quantized(sample, "packed Mooncake object")?;
    let layout = PackedLayout::of(sample.rows, sample.slots, sample.width, sample.dtype)?;
    let mut object = vec![0u8; layout.total];
    object[..layout.states_bytes].copy_from_slice(&sample.data);
    let tokens = &mut object[layout.tokens_offset..layout.tokens_offset + layout.tokens_bytes];
    for (dst, t) in tokens.chunks_exact_mut(8).zip(&sample.token_ids) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    Ok(object)
}

#[cfg(test)]
#[path = "tests/packed.rs"]
mod tests;
