//! The session's step buffers and where rows are scattered: inline, or on the assembler thread with
//! a ring of step buffers (CPU arenas here; the device path's pinned buffers come back through the
//! same channel and go to the device's free list).

use super::{Scattering, Session};
use crate::arena::Arena;
use crate::assembler::{Assembler, StepBuffer};
use crate::device::HostStep;
use crate::sample::Sample;
use crate::scatter::ScatterJob;
use crate::{bail, ensure, error::CoreResult};

impl Session {
    /// Moves the scatter of rows onto the assembler thread, with a ring of `ring` (≥ 2) CPU arenas
    /// (the device path has its own ring). Only before the first step.
    pub fn set_background(&mut self, ring: usize) -> CoreResult<()> {
        ensure!(ring >= 2, Config, "background assembly needs a ring of at least 2 step buffers, found {ring}");
        ensure!(
            self.assembly.stats.steps == 0 && !self.tracker.in_step() && self.pending.is_empty(),
            Config,
            "background assembly is chosen before the first step"
        );
        if let Scattering::Inline(_) = self.scattering {
            self.scattering = Scattering::Background(Assembler::start(super::new_scatter(&self.cfg, &self.assembly.pool))?);
        }
        self.ring = ring;
        Ok(())
    }

    /// Background assembly: completed samples go from the assembler thread straight to the writer
    /// (`Some`), or wait for [`Session::take_ready`] (`None`: also what lets a writer finish). Inline
    /// assembly returns samples in each outcome and ignores this.
    pub fn set_sink(&mut self, w: Option<crate::writer::Submitter>) -> CoreResult<()> {
        match &self.scattering {
            Scattering::Background(a) => a.set_sink(w),
            Scattering::Inline(_) => Ok(()),
        }
    }

    /// Whether rows are scattered on the assembler thread.
    pub fn background(&self) -> bool {
        matches!(self.scattering, Scattering::Background(_))
    }

    /// Samples the assembler thread completed since the last call (none inline: those are in each
    /// step's outcome); with `fence`, after waiting for every step handed to it so far. Reports the
    /// thread's first error.
    pub fn take_ready(&mut self, fence: bool) -> CoreResult<Vec<Sample>> {
        let out = match &self.scattering {
            Scattering::Inline(_) => return Ok(Vec::new()),
            Scattering::Background(a) => {
                if fence {
                    a.fence()?;
                }
                a.take_ready()?
            }
        };
        self.reclaim(false)?;
        Ok(out)
    }

    /// Takes back step buffers the assembler thread is done with (waits for one when `block`).
    pub(super) fn reclaim(&mut self, block: bool) -> CoreResult<()> {
        let Scattering::Background(a) = &self.scattering else {
            return Ok(());
        };
        let mut first = block;
        loop {
            let Some(b) = a.returned(first) else {
                if first {
                    a.check()?;
                    bail!(Output, "the assembler thread stopped while the worker waited for a step buffer");
                }
                return Ok(());
            };
            first = false;
            match b {
                StepBuffer::Arena(x) => self.spare_arenas.push(x),
                StepBuffer::Device(d) => match self.device.as_mut() {
                    Some(dev) => {
                        self.device_out -= 1;
                        dev.recycle(d)?
                    }
                    None => bail!(Compatibility, "a device step buffer came back but the device path is gone"),
                },
            }
        }
    }

    /// An arena for the next step, once the filled one goes to the assembler thread: a spare one, a
    /// new one while the ring is not full, else the first the thread gives back.
    fn next_arena(&mut self) -> CoreResult<Arena> {
        loop {
            if let Some(a) = self.spare_arenas.pop() {
                return Ok(a);
            }
            if self.arenas < self.ring {
                self.arenas += 1;
                return Ok(Arena::new(self.cfg.layers.num_slots(), self.cfg.hidden_size, self.cfg.out_dtype));
            }
            self.reclaim(true)?;
        }
    }

    /// Copies a step's rows and completes its samples: now (inline, returned) or on the assembler
    /// thread (the buffer goes with the job; nothing returned). `buf` None means the current arena.
    pub(super) fn scatter(&mut self, job: ScatterJob, buf: Option<Box<dyn HostStep>>) -> CoreResult<Vec<Sample>> {
        match &mut self.scattering {
            Scattering::Inline(sc) => {
                let r = match &buf {
                    Some(b) => sc.run(job, b.as_rows(), None),
                    None => sc.run(job, &self.arena, None),
                };
                if let (Some(b), Some(dev)) = (buf, self.device.as_mut()) {
                    dev.recycle(b)?;
                }
                r
            }
            Scattering::Background(_) if job.is_empty() => {
                if let (Some(b), Some(dev)) = (buf, self.device.as_mut()) {
                    dev.recycle(b)?;
                }
                Ok(Vec::new())
            }
            Scattering::Background(_) => {
                let sb = match buf {
                    Some(b) => {
                        self.device_out += 1;
                        StepBuffer::Device(b)
                    }
                    None => {
                        let fresh = self.next_arena()?;
                        StepBuffer::Arena(std::mem::replace(&mut self.arena, fresh))
                    }
                };
                if let Scattering::Background(a) = &self.scattering {
                    a.submit(job, sb)?;
                }
                Ok(Vec::new())
            }
        }
    }

    /// Host bytes held by requests whose prompt is not complete (and, in the background, completed
    /// samples not yet collected).
    pub fn request_bytes(&self) -> usize {
        match &self.scattering {
            Scattering::Inline(sc) => sc.held_counter().load(std::sync::atomic::Ordering::Relaxed),
            Scattering::Background(a) => a.held_bytes(),
        }
    }
}
