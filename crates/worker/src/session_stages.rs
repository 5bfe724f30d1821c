//! The session's side of pipeline parallelism: the slots a stage neither captures nor receives, and
//! one step's rows of some slots exchanged between stages as a [`StageMessage`].

use super::Session;
use crate::stages::{SlotPart, StageMessage};
use crate::{bail, ensure, error::CoreResult};

impl Session {
    /// Declares the slots this rank will neither capture nor receive (pipeline parallelism: the layers
    /// of other stages, on a rank that does not assemble).
    pub fn set_absent_slots(&mut self, slots: &[usize]) -> CoreResult<()> {
        let n = self.absent.len();
        ensure!(slots.iter().all(|&s| s < n), Config, "absent slots {slots:?}: only {n} slots exist");
        ensure!(
            slots.is_empty() || !self.cfg.assemble,
            Config,
            "the assembling rank must hold every slot; slots {slots:?} would be missing from its samples"
        );
        self.absent = (0..n).map(|s| slots.contains(&s)).collect();
        Ok(())
    }

    /// This step's rows of `slots` (captured here) as one message for the assembling stage.
    pub fn export_slots(&self, slots: &[usize]) -> CoreResult<Vec<u8>> {
        let step = self.tracker.step();
        let Some(plan) = self.tracker.current_plan() else {
            bail!(Attribution, "step {step}: nothing to send to the assembling stage before the step is planned");
        };
        ensure!(!self.on_device, Compatibility, "step {step}: pipeline stages exchange host rows; this step was captured on the device");
        let mut parts = Vec::with_capacity(slots.len());
        for &slot in slots {
            ensure!(
                self.filled.get(slot).copied().unwrap_or(false),
                ShapeContract,
                "step {step}: {} is to be sent to the assembling stage but was not captured on this stage",
                self.slot_name(slot)
            );
            let (data, row_sums, nonfinite) = self.arena.slot_rows(slot);
            parts.push(SlotPart { slot, data: data.to_vec(), row_sums: row_sums.to_vec(), nonfinite: nonfinite.to_vec() });
        }
        let msg = StageMessage { step, rows: plan.arena_rows, row_bytes: self.arena.row_bytes(), parts };
        Ok(msg.encode())
    }

    /// Writes another stage's message into this step's arena; returns the slots it filled.
    pub fn import_slots(&mut self, bytes: &[u8], from: &str) -> CoreResult<Vec<usize>> {
        let msg = StageMessage::decode(bytes)?;
        let step = self.tracker.step();
        let Some(plan) = self.tracker.current_plan() else {
            bail!(Attribution, "step {step}: rows from {from} arrived before this stage planned the step");
        };
        ensure!(
            msg.step == step && msg.rows == plan.arena_rows && msg.row_bytes == self.arena.row_bytes(),
            RankMismatch,
            "{from} sent step {} with {} prompt rows of {} bytes; this stage is at step {step} with {} rows of {} bytes: \
             the pipeline stages disagree about the schedule",
            msg.step,
            msg.rows,
            msg.row_bytes,
            plan.arena_rows,
            self.arena.row_bytes()
        );
        let mut got = Vec::with_capacity(msg.parts.len());
        for p in msg.parts {
            let name = format!("{} from {from}", self.slot_name(p.slot));
            self.mark_filled(p.slot)?;
            self.arena.put_slot(p.slot, &p.data, &p.row_sums, &p.nonfinite, &name)?;
            self.imported[p.slot] = true;
            got.push(p.slot);
        }
        Ok(got)
    }
}
