//! Which pinned host buffer a device step's copies go to: the bookkeeping of the device path's ring, apart from the
//! memory (CUDA's in `cuda/ring.rs`, host memory in the session's tests).
//!
//! Buffers come in size classes. Each step's copies hold exactly its rows, so a buffer sized for
//! `max_num_batched_tokens` rows is needed only by steps that large; a decode step of one row per request fits a
//! small one. With one class, a decode step waited for a big buffer while the assembler thread still scattered the
//! prompt steps before it (measured on the H200: 237 µs a step under CUDA graphs, decode at 0.94× of plain); with a
//! class of small buffers besides, it takes one of those.
//!
//! A buffer is in exactly one place: free, the step being captured (`cur`), in flight (ended, copies running), or
//! handed out (with the assembler until given back).

use std::collections::VecDeque;

use crate::{bail, ensure, error::CoreResult};

#[derive(Debug)]
pub struct HostPool {
    /// Rows each buffer holds per slot.
    caps: Vec<usize>,
    free: Vec<usize>,
    cur: Option<usize>,
    /// Buffers of ended steps, oldest first.
    flight: VecDeque<usize>,
}

impl HostPool {
    /// `classes`: (buffers, rows per slot) for each size class; a class of no buffers or no rows adds none.
    pub fn new(classes: &[(usize, usize)]) -> CoreResult<HostPool> {
        let caps: Vec<usize> = classes.iter().filter(|c| c.1 > 0).flat_map(|&(n, rows)| std::iter::repeat_n(rows, n)).collect();
        ensure!(!caps.is_empty(), Config, "a ring of no host buffers (classes {classes:?}): at least one is needed");
        // Popped from the end: the first buffers are taken first.
        let free = (0..caps.len()).rev().collect();
        Ok(HostPool { flight: VecDeque::with_capacity(caps.len()), caps, free, cur: None })
    }

    pub fn len(&self) -> usize {
        self.caps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.caps.is_empty()
    }

    /// Rows per slot buffer `i` holds.
    pub fn capacity(&self, i: usize) -> usize {
        self.caps.get(i).copied().unwrap_or(0)
    }

    /// The largest buffer's rows: the most a step may capture.
    pub fn max_capacity(&self) -> usize {
        self.caps.iter().copied().max().unwrap_or(0)
    }

    /// Buffers a step of `rows` rows can take now.
    pub fn available(&self, rows: usize) -> usize {
        let fits = |&i: &usize| self.caps[i] >= rows;
        self.free.iter().filter(|i| fits(i)).count() + self.cur.iter().filter(|i| fits(i)).count()
    }

    /// A buffer for a step of `rows` rows: the smallest free one that holds them. A step abandoned before `end` left
    /// its buffer as `cur`; it serves again if it is large enough, else it goes back to the free ones.
    pub fn take(&mut self, rows: usize) -> CoreResult<usize> {
        if let Some(i) = self.cur {
            if self.caps[i] >= rows {
                return Ok(i);
            }
            self.free.push(i);
            self.cur = None;
        }
        let best = self.free.iter().enumerate().filter(|(_, &i)| self.caps[i] >= rows).min_by_key(|(_, &i)| self.caps[i]);
        let Some((at, &i)) = best else {
            bail!(
                Compatibility,
                "no free host buffer for a step of {rows} rows ({} buffers, {} free, {} in flight): the session must \
                 return one first",
                self.caps.len(),
                self.free.len(),
                self.flight.len()
            );
        };
        self.free.swap_remove(at);
        self.cur = Some(i);
        Ok(i)
    }

    /// The buffer of the step being captured.
    pub fn current(&self) -> Option<usize> {
        self.cur
    }

    /// Ends the current step: its buffer is in flight.
    pub fn end(&mut self) -> CoreResult<usize> {
        let Some(i) = self.cur.take() else {
            bail!(Compatibility, "a device step ended before it was reset");
        };
        self.flight.push_back(i);
        Ok(i)
    }

    /// The oldest step in flight leaves the queue; its buffer is handed out (or given back at once if it could not
    /// be read).
    pub fn pop_oldest(&mut self) -> CoreResult<usize> {
        match self.flight.pop_front() {
            Some(i) => Ok(i),
            None => bail!(Compatibility, "no device step to collect: `end_step` was not called"),
        }
    }

    /// Takes back a buffer that was handed out.
    pub fn give_back(&mut self, i: usize) -> CoreResult<()> {
        ensure!(
            i < self.caps.len() && !self.free.contains(&i) && self.cur != Some(i) && !self.flight.contains(&i),
            Compatibility,
            "host buffer {i} given back twice or unknown (ring of {})",
            self.caps.len()
        );
        self.free.push(i);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_takes_the_smallest_free_buffer_that_holds_it() {
        let mut p = HostPool::new(&[(2, 100), (2, 10)]).unwrap();
        assert_eq!((p.len(), p.max_capacity(), p.available(10), p.available(11), p.available(101)), (4, 100, 4, 2, 0));
        let small = p.take(8).unwrap();
        assert_eq!(p.capacity(small), 10);
        p.end().unwrap();
        let big = p.take(50).unwrap();
        assert_eq!(p.capacity(big), 100);
        p.end().unwrap();
        // Both big ones out: a decode-sized step still finds a small one, a prompt-sized one finds one big.
        assert_eq!((p.available(10), p.available(100)), (2, 1));
        let i = p.pop_oldest().unwrap();
        assert_eq!(i, small);
        p.give_back(i).unwrap();
        assert_eq!(p.available(10), 3);
    }

    #[test]
    fn only_small_buffers_free_refuses_a_big_step_and_names_the_state() {
        let mut p = HostPool::new(&[(1, 100), (3, 10)]).unwrap();
        p.take(100).unwrap();
        p.end().unwrap();
        let e = p.take(11).unwrap_err().to_string();
        assert!(e.contains("11 rows") && e.contains("3 free") && e.contains("1 in flight"), "{e}");
        // The failed take left nothing half-done: a small step still goes.
        let i = p.take(10).unwrap();
        assert_eq!(p.capacity(i), 10);
    }

    #[test]
    fn an_abandoned_steps_buffer_serves_again_only_if_it_is_large_enough() {
        let mut p = HostPool::new(&[(1, 100), (1, 10)]).unwrap();
        let small = p.take(5).unwrap();
        assert_eq!(p.take(7).unwrap(), small, "kept: it fits");
        assert_eq!(p.available(10), 2, "the current buffer counts as available");
        let big = p.take(60).unwrap();
        assert_ne!(big, small);
        assert_eq!(p.capacity(big), 100);
        p.end().unwrap();
        assert_eq!(p.take(3).unwrap(), small, "the small one went back to the free ones");
    }

    #[test]
    fn a_buffer_is_given_back_once_and_only_when_handed_out() {
        let mut p = HostPool::new(&[(2, 4)]).unwrap();
        let i = p.take(4).unwrap();
        assert!(p.give_back(i).is_err(), "the current buffer is not handed out");
        p.end().unwrap();
        assert!(p.give_back(i).is_err(), "in flight");
        assert_eq!(p.pop_oldest().unwrap(), i);
        p.give_back(i).unwrap();
        assert!(p.give_back(i).is_err(), "twice");
        assert!(p.give_back(9).is_err(), "unknown");
        assert!(p.pop_oldest().is_err());
        assert!(p.end().is_err());
    }

    #[test]
    fn empty_classes_are_refused() {
        assert!(HostPool::new(&[(0, 10), (3, 0)]).is_err());
        assert_eq!(HostPool::new(&[(0, 10), (3, 5)]).unwrap().len(), 3);
    }
}
