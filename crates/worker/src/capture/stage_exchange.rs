//! The session's side of pipeline parallelism: one step's rows of some slots, captured on this stage,
//! sent to the assembling stage as a [`StageMessage`]; and such a message written into the receiving
//! stage's arena as if captured there, after checking it against the receiver's own plan.

use crate::attribution::plan::StepPlan;
use crate::capture::arena::Arena;
use crate::capture::slots::SlotMask;
use crate::ranks::stage_message::{SlotPart, StageMessage};
use crate::{bail, ensure, error::CoreResult};

/// The rows of `wanted` slots of step `step` as one message.
pub fn export(
    step: u64,
    plan: Option<&StepPlan>,
    slots: &SlotMask,
    arena: &Arena,
    wanted: &[usize],
    name: impl Fn(usize) -> String,
) -> CoreResult<Vec<u8>> {
    let Some(plan) = plan else {
        bail!(Attribution, "step {step}: nothing to send to the assembling stage before the step is planned");
    };
    let mut parts = Vec::with_capacity(wanted.len());
    for &slot in wanted {
        ensure!(
            slots.is_filled(slot),
            ShapeContract,
            "step {step}: {} is to be sent to the assembling stage but was not captured on this stage",
            name(slot)
        );
        let (data, row_sums, nonfinite) = arena.slot_rows(slot);
        parts.push(SlotPart { slot, data: data.to_vec(), row_sums: row_sums.to_vec(), nonfinite: nonfinite.to_vec() });
    }
    Ok(StageMessage { step, rows: plan.arena_rows, row_bytes: arena.row_bytes(), parts }.encode())
}

/// Writes a message from stage `from` into `arena` for step `step`; returns the slots it filled.
#[allow(clippy::too_many_arguments)]
pub fn import(
    step: u64,
    plan: Option<&StepPlan>,
    slots: &mut SlotMask,
    arena: &mut Arena,
    bytes: &[u8],
    from: &str,
    name: impl Fn(usize) -> String,
) -> CoreResult<Vec<usize>> {
    let msg = StageMessage::decode(bytes)?;
    let Some(plan) = plan else {
        bail!(Attribution, "step {step}: rows from {from} arrived before this stage planned the step");
    };
    ensure!(
        msg.step == step && msg.rows == plan.arena_rows && msg.row_bytes == arena.row_bytes(),
        RankMismatch,
        "{from} sent step {} with {} prompt rows of {} bytes; this stage is at step {step} with {} rows of {} bytes: \
         the pipeline stages disagree about the schedule",
        msg.step,
        msg.rows,
        msg.row_bytes,
        plan.arena_rows,
        arena.row_bytes()
    );
    let mut got = Vec::with_capacity(msg.parts.len());
    for p in msg.parts {
        let what = format!("{} from {from}", name(p.slot));
        slots.import(p.slot, &what)?;
        arena.put_slot(p.slot, &p.data, &p.row_sums, &p.nonfinite, &what)?;
        got.push(p.slot);
    }
    Ok(got)
}
