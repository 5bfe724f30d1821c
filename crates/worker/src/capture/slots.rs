//! Which layer slots a step holds: captured on this rank, received from another pipeline stage, or
//! absent (another stage's layers, on a rank that does not assemble).

use crate::{ensure, error::CoreResult};

#[derive(Clone, Debug)]
pub struct SlotMask {
    filled: Vec<bool>,
    imported: Vec<bool>,
    absent: Vec<bool>,
}

impl SlotMask {
    pub fn new(slots: usize) -> SlotMask {
        SlotMask { filled: vec![false; slots], imported: vec![false; slots], absent: vec![false; slots] }
    }

    pub fn len(&self) -> usize {
        self.filled.len()
    }

    pub fn is_empty(&self) -> bool {
        self.filled.is_empty()
    }

    /// A new step: nothing captured or received yet.
    pub fn new_step(&mut self) {
        self.filled.iter_mut().for_each(|f| *f = false);
        self.imported.iter_mut().for_each(|f| *f = false);
    }

    /// Declares the slots this rank neither captures nor receives.
    pub fn set_absent(&mut self, slots: &[usize]) -> CoreResult<()> {
        let n = self.len();
        ensure!(slots.iter().all(|&s| s < n), Config, "absent slots {slots:?}: only {n} slots exist");
        self.absent = (0..n).map(|s| slots.contains(&s)).collect();
        Ok(())
    }

    /// Marks `slot` (named `name` in errors) as held in this step; each slot once.
    pub fn fill(&mut self, slot: usize, name: &str) -> CoreResult<()> {
        ensure!(slot < self.len(), ShapeContract, "{name}: slot {slot} does not exist");
        ensure!(
            !self.filled[slot],
            ShapeContract,
            "{name} was captured twice in one step: a decoder layer ran twice in one forward, or two hooks are \
             registered on it"
        );
        self.filled[slot] = true;
        Ok(())
    }

    /// As [`SlotMask::fill`], for a slot received from another stage (not part of this rank's checksum).
    pub fn import(&mut self, slot: usize, name: &str) -> CoreResult<()> {
        self.fill(slot, name)?;
        self.imported[slot] = true;
        Ok(())
    }

    pub fn is_filled(&self, slot: usize) -> bool {
        self.filled.get(slot).copied().unwrap_or(false)
    }

    /// Slots neither held nor declared absent.
    pub fn missing(&self) -> Vec<usize> {
        (0..self.len()).filter(|&s| !self.filled[s] && !self.absent[s]).collect()
    }

    /// How many slots this rank holds in a complete step.
    pub fn expected(&self) -> usize {
        self.absent.iter().filter(|&&a| !a).count()
    }

    /// Per slot: whether this rank holds it (all, except another stage's layers).
    pub fn present(&self) -> Vec<bool> {
        self.absent.iter().map(|a| !a).collect()
    }

    /// Per slot: held and captured here (what this rank's tensor-parallel peers hold too).
    pub fn own(&self) -> Vec<bool> {
        self.absent.iter().zip(&self.imported).map(|(a, i)| !a && !i).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::SlotMask;

    #[test]
    fn slots_are_held_once_per_step_and_absent_ones_are_not_missing() {
        let mut m = SlotMask::new(3);
        m.set_absent(&[2]).unwrap();
        assert!(m.set_absent(&[3]).is_err(), "slot 3 does not exist");
        m.fill(0, "layer id 1").unwrap();
        let twice = m.fill(0, "layer id 1").unwrap_err();
        assert!(twice.message.contains("captured twice"), "{twice}");
        assert_eq!((m.missing(), m.expected()), (vec![1], 2));
        m.import(1, "layer id 5 from stage 0").unwrap();
        assert_eq!(m.present(), vec![true, true, false]);
        assert_eq!(m.own(), vec![true, false, false], "a received slot is not this rank's own");
        m.new_step();
        assert_eq!((m.missing(), m.own()), (vec![0, 1], vec![true, true, false]));
        assert!(m.fill(7, "x").is_err());
    }
}
