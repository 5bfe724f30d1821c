//! Layer ids, the two conventions, and where in the model each id is captured.
//!
//! - `after`: id `i` = the residual stream after decoder layer `i`; valid ids `0..N-1`
//!   (speculators 0.3/0.4, "output of layer i").
//! - `before`: id `i` = the input of decoder layer `i`; `0` = the embeddings, `N` = the output of the
//!   last layer before the final norm; valid ids `0..=N` (vLLM's EAGLE-3 aux layers and
//!   `extract_hidden_states`, speculators' current training).
//!
//! `after` id `i` is `before` id `i + 1`.

use crate::{bail, ensure, error::CoreResult};

/// The meaning of a layer id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Convention {
    After,
    Before,
}

impl Convention {
    pub fn parse(s: &str) -> CoreResult<Convention> {
        match s.trim().to_ascii_lowercase().as_str() {
            "after" | "after-layer" | "after_layer" => Ok(Convention::After),
            "before" | "before-layer" | "before_layer" => Ok(Convention::Before),
            other => bail!(
                Config,
                "unknown layer-id convention {other:?}: expected \"after\" (id i = output of decoder layer i, \
                 speculators 0.3/0.4) or \"before\" (id i = input of decoder layer i, 0 = embeddings, \
                 N = final output before the norm; vLLM and speculators' current training)"
            ),
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Convention::After => "after",
            Convention::Before => "before",
        }
    }

    /// Id `id` of this convention in `to` (None where it has none: `before` 0, the embeddings, in `after`).
    pub fn id_in(self, id: usize, to: Convention) -> Option<usize> {
        match (self, to) {
            (a, b) if a == b => Some(id),
            (Convention::After, Convention::Before) => id.checked_add(1),
            (Convention::Before, Convention::After) => id.checked_sub(1),
            _ => None,
        }
    }

    /// The largest valid id for a model with `n` decoder layers (None for a model without layers).
    pub const fn max_id(self, n: usize) -> Option<usize> {
        match (self, n) {
            (_, 0) => None,
            (Convention::After, n) => Some(n - 1),
            (Convention::Before, n) => Some(n),
        }
    }
}

/// Where a layer slot's tensor is taken from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CapturePoint {
    /// The input of decoder layer 0 (the embeddings, after any scaling the model applies).
    Embeddings,
    /// The residual stream decoder layer `k` hands on (0-based, global index): `hidden_states + residual` for a
    /// fused-residual layer, `hidden_states` for one that returns the stream whole (the plugin tells which).
    LayerOutput(usize),
}

impl CapturePoint {
    /// The point as the number a compiled graph's tap and a device stamp carry: `k` for the output of decoder
    /// layer `k`, -1 for the embeddings (the input of layer 0).
    pub fn code(self) -> i32 {
        match self {
            CapturePoint::Embeddings => -1,
            CapturePoint::LayerOutput(k) => i32::try_from(k).unwrap_or(i32::MAX),
        }
    }

    /// `code` in words, for errors (any code: a cached graph may carry one this capture never makes).
    pub fn describe(code: i32) -> String {
        match code {
            -1 => "the input of decoder layer 0 (the embeddings)".to_string(),
            k if k >= 0 => format!("the output of decoder layer {k}"),
            k => format!("capture point {k} (no such point)"),
        }
    }
}

/// A validated, ordered set of layer ids: slot `s` holds `ids[s]`, ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerPlan {
    pub convention: Convention,
    pub num_hidden_layers: usize,
    pub ids: Vec<usize>,
}

impl LayerPlan {
    /// Validates `ids` for `convention` on a model with `num_hidden_layers` decoder layers.
    /// Refuses an empty list, duplicates and ids out of range; sorts ascending.
    pub fn new(ids: &[i64], convention: Convention, num_hidden_layers: usize) -> CoreResult<LayerPlan> {
        let Some(max) = convention.max_id(num_hidden_layers) else {
            bail!(Config, "the model reports 0 decoder layers: nothing can be captured");
        };
        ensure!(
            !ids.is_empty(),
            Config,
            "the list of layer ids is empty: name at least one layer, e.g. `--layers {}` (convention `{}`)",
            default_ids(convention, num_hidden_layers)?.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","),
            convention.name()
        );
        let mut out = Vec::with_capacity(ids.len());
        for &id in ids {
            if id < 0 || id as u64 > max as u64 {
                let hint = match convention {
                    Convention::After if id as u64 == num_hidden_layers as u64 => format!(
                        "; id {id} is the final output before the norm, which is id {num_hidden_layers} in the \
                         `before` convention and {} in `after`",
                        num_hidden_layers - 1
                    ),
                    _ if id < 0 => "; ids count from 0 (negative ids are not accepted)".to_string(),
                    _ => String::new(),
                };
                bail!(
                    Config,
                    "layer id {id} is out of range for the `{}` convention on a model with {num_hidden_layers} \
                     decoder layers: valid ids are 0..={max}{hint}",
                    convention.name()
                );
            }
            out.push(id as usize);
        }
        out.sort_unstable();
        if let Some(w) = out.windows(2).find(|w| w[0] == w[1]) {
            bail!(Config, "layer id {} is listed twice: each layer may be named once", w[0]);
        }
        Ok(LayerPlan { convention, num_hidden_layers, ids: out })
    }

    pub fn num_slots(&self) -> usize {
        self.ids.len()
    }

    /// Where slot `s` is captured.
    pub fn point(&self, slot: usize) -> CapturePoint {
        let id = self.ids[slot];
        match self.convention {
            Convention::After => CapturePoint::LayerOutput(id),
            Convention::Before if id == 0 => CapturePoint::Embeddings,
            Convention::Before => CapturePoint::LayerOutput(id - 1),
        }
    }

    /// All capture points in slot order.
    pub fn points(&self) -> Vec<CapturePoint> {
        (0..self.num_slots()).map(|s| self.point(s)).collect()
    }

    /// The same layers expressed in the other convention (`None` for an id with no equivalent:
    /// `before` 0, the embeddings, has no `after` id).
    pub fn ids_in(&self, convention: Convention) -> Vec<Option<usize>> {
        self.ids.iter().map(|&id| self.convention.id_in(id, convention)).collect()
    }
}

/// The default ids of each convention's ecosystem for a model with `n` decoder layers:
/// `after` — speculators 0.3/0.4's `[2, N/2, N-3, N-1]`; `before` — speculators' training
/// `[2, N/2, N-3, N]`. Duplicates (tiny models) are removed; a model without layers has none.
pub fn default_ids(convention: Convention, n: usize) -> CoreResult<Vec<usize>> {
    let Some(last) = convention.max_id(n) else {
        bail!(Config, "the model reports 0 decoder layers: there are no default layer ids");
    };
    let mut v: Vec<usize> = [2, n / 2, n.saturating_sub(3), last].into_iter().map(|x| x.min(last)).collect();
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

#[cfg(test)]
#[path = "tests/layers.rs"]
mod tests;
