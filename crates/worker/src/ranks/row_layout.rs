//! How a layer's rows on this rank relate to the step's tokens.
//!
//! With tensor parallelism alone the residual stream is replicated: every TP rank holds all of the
//! forward's tokens (`rows >= the step's scheduled tokens`; padding rows after them are never read).
//! From vLLM 0.26, sequence-parallel MoE shards it at layer boundaries: the forward's `n` tokens are
//! padded to a multiple of the TP size and rank `r` holds rows `[r*c, (r+1)*c)` with `c = ceil(n/tp)`.
//! Gathering the shards in rank order restores the padded stream, whose first rows are the step's
//! tokens. Any other shape is neither, and is refused with the layer, rank and shapes named.

use crate::{bail, error::CoreResult};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowLayout {
    /// Every token on every rank.
    Replicated,
    /// Contiguous chunks of `chunk` rows in TP-rank order; gather them, then read the first rows.
    Sharded { chunk: usize },
}

/// `rows`: the layer's rows on this rank; `forward_tokens`: the tokens the forward ran (its
/// `positions`, padding included); `step_tokens`: the tokens the scheduler scheduled.
pub fn row_layout(
    rows: usize,
    forward_tokens: usize,
    step_tokens: usize,
    tp_size: usize,
    tp_rank: usize,
    what: &str,
) -> CoreResult<RowLayout> {
    if rows >= step_tokens {
        return Ok(RowLayout::Replicated);
    }
    if tp_size > 1 && forward_tokens >= step_tokens && rows == forward_tokens.div_ceil(tp_size) {
        return Ok(RowLayout::Sharded { chunk: rows });
    }
    bail!(
        ShapeContract,
        "{what}, tensor-parallel rank {tp_rank} of {tp_size}: {rows} rows, but the step scheduled {step_tokens} tokens \
         and the forward ran {forward_tokens}; that is neither the replicated stream (>= {step_tokens} rows) nor \
         vLLM's sequence-parallel sharding ({} rows per rank) — this model or vLLM version lays out its residual \
         stream in a way hscapture does not know; report it with these shapes",
        if tp_size > 1 { forward_tokens.div_ceil(tp_size).to_string() } else { "n/a at TP=1".into() }
    )
}

#[cfg(test)]
#[path = "tests/row_layout.rs"]
mod tests;
