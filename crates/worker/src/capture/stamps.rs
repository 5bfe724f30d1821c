//! What a device step's stamps prove. The capture kernel stamps its slot every time it runs armed (`armed.rs` in the
//! kernels): which armed step, which capture point, over how many tensor rows. A forward that the host never sees
//! (a replayed CUDA graph) is verified here, after its copies: every slot this rank captures ran for this very
//! step, at the point this capture configured, over every token the step scheduled. Anything else fails the step,
//! naming the slot: rows that were never written are never stored.

use crate::attribution::layers::CapturePoint;
use crate::attribution::plan::StepPlan;
use crate::{bail, error::CoreResult};
use hscapture_kernels::Stamp;

/// The stamps of an armed step, checked slot by slot (`present`: the slots this rank captures).
pub fn verify(
    plan: &StepPlan,
    arm: u32,
    stamps: &[Stamp],
    points: &[i32],
    present: &[bool],
    name: impl Fn(usize) -> String,
) -> CoreResult<()> {
    let step = plan.step;
    for (slot, &want) in points.iter().enumerate() {
        if !present.get(slot).copied().unwrap_or(false) {
            continue;
        }
        let Some(st) = stamps.get(slot) else {
            bail!(Compatibility, "step {step}: no stamp for {} ({} stamps)", name(slot), stamps.len());
        };
        if st.arm != arm {
            let last = if st.arm == 0 { "never ran".to_string() } else { format!("last ran for arm {}", st.arm) };
            bail!(
                Compatibility,
                "step {step}: {} was not captured by the step's forward (its capture kernel {last}; this step is arm \
                 {arm}); expected every captured layer's kernel in every forward. The model ran without hscapture's \
                 capture at that layer: a CUDA graph recorded without it (a compiled graph vLLM loaded from its cache \
                 for a run without hscapture: set VLLM_DISABLE_COMPILE_CACHE=1 once), or a forward that skipped the \
                 layer. Nothing of this step is stored",
                name(slot)
            );
        }
        if st.point != want {
            bail!(
                Compatibility,
                "step {step}: the forward captured {} for {}, but this capture reads {} there: vLLM runs a compiled \
                 graph traced for other capture settings (its compile cache); set VLLM_DISABLE_COMPILE_CACHE=1, or \
                 give the settings in additional_config",
                CapturePoint::describe(st.point),
                name(slot),
                CapturePoint::describe(want)
            );
        }
        if (st.grid as usize) < plan.total_tokens {
            bail!(
                ShapeContract,
                "step {step}: {}: the step scheduled {} tokens but the layer's tensor had {} rows in the forward; a \
                 residual stream sharded across ranks (sequence-parallel MoE) cannot be gathered inside a CUDA graph: \
                 run with cudagraph_mode NONE or --enforce-eager",
                name(slot),
                plan.total_tokens,
                st.grid
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(tokens: usize) -> StepPlan {
        StepPlan { step: 4, total_tokens: tokens, arena_rows: tokens, segments: vec![] }
    }

    #[test]
    fn a_step_whose_forward_ran_every_slot_passes() {
        let st = [Stamp { arm: 9, point: 3, grid: 16 }, Stamp { arm: 9, point: -1, grid: 16 }];
        verify(&plan(10), 9, &st, &[3, -1], &[true, true], |s| format!("slot {s}")).unwrap();
    }

    #[test]
    fn a_slot_that_did_not_run_for_this_step_is_named() {
        let st = [Stamp { arm: 9, point: 3, grid: 16 }, Stamp { arm: 8, point: 5, grid: 16 }];
        let e = verify(&plan(10), 9, &st, &[3, 5], &[true, true], |s| format!("slot {s}")).unwrap_err();
        assert!(e.message.contains("slot 1 was not captured") && e.message.contains("last ran for arm 8"), "{e}");
        let never = [Stamp::default(), Stamp::default()];
        let e = verify(&plan(10), 9, &never, &[3, 5], &[true, true], |s| format!("slot {s}")).unwrap_err();
        assert!(e.message.contains("never ran"), "{e}");
        verify(&plan(10), 9, &st, &[3, 5], &[true, false], |s| format!("slot {s}")).unwrap();
    }

    #[test]
    fn another_capture_point_and_too_few_rows_are_refused() {
        let st = [Stamp { arm: 2, point: 4, grid: 16 }];
        let e = verify(&plan(10), 2, &st, &[3], &[true], |s| format!("slot {s}")).unwrap_err();
        assert!(e.message.contains("the output of decoder layer 4") && e.message.contains("decoder layer 3"), "{e}");
        let st = [Stamp { arm: 2, point: 3, grid: 5 }];
        let e = verify(&plan(10), 2, &st, &[3], &[true], |s| format!("slot {s}")).unwrap_err();
        assert!(e.message.contains("scheduled 10 tokens") && e.message.contains("5 rows"), "{e}");
    }
}
