//! The shape contract on every captured tensor (docs/contract.md, rules 16, 17 and 20), and the one way a
//! layer slot is named in errors.

use crate::attribution::layers::LayerPlan;
use crate::attribution::plan::StepPlan;
use crate::capture::step::SessionConfig;
use crate::capture::tensor::TensorDesc;
use crate::{ensure, error::CoreResult};

/// `layer id 16 (before convention, slot 1)`.
pub fn slot_name(layers: &LayerPlan, slot: usize) -> String {
    match layers.ids.get(slot) {
        Some(id) => format!("layer id {id} ({} convention, slot {slot})", layers.convention.name()),
        None => format!("slot {slot} (of {} layer slots)", layers.num_slots()),
    }
}

/// Checks a layer's tensors for the planned step; returns the number of rows to read (the step's
/// scheduled tokens: padding rows after them are never read).
pub fn check_layer(
    cfg: &SessionConfig,
    plan: &StepPlan,
    name: &str,
    hidden: &TensorDesc,
    residual: Option<&TensorDesc>,
) -> CoreResult<usize> {
    check_tensor(cfg, name, hidden, residual)?;
    ensure!(
        hidden.rows() >= plan.total_tokens,
        ShapeContract,
        "{name}: the step scheduled {} tokens but the layer produced {} rows (shape {:?}); a residual stream \
         sharded across ranks is not replicated and must be gathered",
        plan.total_tokens,
        hidden.rows(),
        hidden.shape
    );
    Ok(plan.total_tokens)
}

/// Checks what a layer's tensors must be whatever the step: width, dtype, a residual like the hidden states (a
/// CUDA graph's recorded launch is checked here once, when vLLM captures the graph).
pub fn check_tensor(cfg: &SessionConfig, name: &str, hidden: &TensorDesc, residual: Option<&TensorDesc>) -> CoreResult<()> {
    // Rows are the second-to-last dimension; any before it may only be 1 (a batch of one). A layer that stacks
    // several streams per token (Gemma 3n's AltUp: [streams, tokens, hidden]) would otherwise be read as more rows,
    // and the step's tokens taken from its first stream alone.
    let lead = hidden.shape.len().saturating_sub(2);
    ensure!(
        hidden.shape.len() >= 2 && hidden.shape[..lead].iter().all(|&d| d == 1),
        ShapeContract,
        "{name}: expected a [tokens, hidden] tensor (leading dimensions of 1 allowed), found shape {:?}; this \
         layer returns several hidden states per token (parallel streams, as Gemma 3n's AltUp) and hscapture does \
         not choose one of them: this model cannot be captured",
        hidden.shape
    );
    ensure!(
        hidden.width() == cfg.hidden_size,
        ShapeContract,
        "{name}: expected hidden size {}, found a tensor of shape {:?}",
        cfg.hidden_size,
        hidden.shape
    );
    ensure!(hidden.dtype == cfg.model_dtype, ShapeContract, "{name}: expected dtype {}, found {}", cfg.model_dtype, hidden.dtype);
    if let Some(r) = residual {
        ensure!(
            r.shape == hidden.shape && r.dtype == hidden.dtype,
            ShapeContract,
            "{name}: residual {:?} {} does not match hidden states {:?} {}",
            r.shape,
            r.dtype,
            hidden.shape,
            hidden.dtype
        );
    }
    Ok(())
}
