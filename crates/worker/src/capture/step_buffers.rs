//! The step buffers and where their rows are scattered. The current step's rows go to a CPU
//! [`Arena`] (host captures) or to a device's pinned buffer (device captures). Scattering runs inline
//! (on the worker's thread, before the next step) or on the assembler thread, which gets each step's
//! buffer by ownership with its job and gives it back once its rows are copied: CPU arenas round a
//! ring of `ring` buffers, and a device's pinned buffers go back to the device's free list.
//!
//! Invariants: a buffer is with exactly one side at a time (no buffer is read and written at once);
//! the worker waits for one to come back only when every buffer of its ring is out (backpressure), so
//! host memory stays at the ring.

use std::sync::Arc;

use crate::capture::arena::Arena;
use crate::capture::assembler::{Assembler, StepBuffer};
use crate::capture::device::PinnedStep;
use crate::capture::device_steps::DeviceSteps;
use crate::capture::scatter::{Geometry, Refusals, Scatter, ScatterJob};
use crate::capture::tensor::TensorDesc;
use crate::failure::Failure;
use crate::sample::pool::BufferPool;
use crate::sample::Handoff;
use crate::sample::Sample;
use crate::{bail, ensure, error::CoreResult};
use hscapture_kernels::{capture_rows, RowRun};

enum Scattering {
    Inline(Scatter),
    Background(Assembler),
}

pub struct StepBuffers {
    geo: Geometry,
    /// Each slot's name in the scatter's errors.
    names: Arc<[String]>,
    pool: Arc<BufferPool>,
    failure: Failure,
    /// The current step's CPU arena.
    arena: Arena,
    /// CPU arenas of the ring not in use, how many exist, and how many may.
    spare: Vec<Arena>,
    arenas: usize,
    ring: usize,
    scattering: Scattering,
    /// Device pinned buffers with the assembler thread.
    pinned_out: usize,
    /// Samples the scatter refused (degenerate states), wherever it runs.
    refusals: Arc<Refusals>,
}

impl StepBuffers {
    pub fn new(geo: Geometry, names: Arc<[String]>, pool: Arc<BufferPool>, failure: Failure) -> StepBuffers {
        let refusals = Arc::new(Refusals::default());
        let scattering = Scattering::Inline(Scatter::named(geo, Arc::clone(&pool), Arc::clone(&names), Arc::clone(&refusals)));
        StepBuffers {
            geo,
            names,
            pool,
            failure,
            arena: Arena::new(geo.slots, geo.width, geo.dtype),
            spare: Vec::new(),
            arenas: 1,
            ring: 1,
            scattering,
            pinned_out: 0,
            refusals,
        }
    }

    /// Moves the scatter onto the assembler thread, with a ring of `ring` (≥ 2) CPU arenas.
    pub fn set_background(&mut self, ring: usize) -> CoreResult<()> {
        ensure!(ring >= 2, Config, "background assembly needs a ring of at least 2 step buffers, found {ring}");
        if let Scattering::Inline(_) = self.scattering {
            let scatter = Scatter::named(self.geo, Arc::clone(&self.pool), Arc::clone(&self.names), Arc::clone(&self.refusals));
            self.scattering = Scattering::Background(Assembler::start(scatter, self.failure.clone())?);
        }
        self.ring = ring;
        Ok(())
    }

    /// Rows arrive as fp8 codes and scales (a quantizing device) from now on, on the same side (inline or the
    /// assembler thread, which keeps the sink it was given: a sample completed after the last call into the session
    /// still reaches the writer). Only before the first step.
    pub fn set_quantized(&mut self) -> CoreResult<()> {
        match &mut self.scattering {
            Scattering::Inline(sc) => sc.set_quantized()?,
            Scattering::Background(a) => a.set_quantized()?,
        }
        self.geo.quantized = true;
        Ok(())
    }

    pub fn quantized(&self) -> bool {
        self.geo.quantized
    }

    /// Samples the scatter refused (see [`Refusals`]), on whichever thread it runs.
    pub fn refusals(&self) -> &Arc<Refusals> {
        &self.refusals
    }

    pub fn background(&self) -> bool {
        matches!(self.scattering, Scattering::Background(_))
    }

    /// Background assembly: completed samples go from the assembler thread straight to the writer
    /// (`Some`), or wait for [`StepBuffers::take_ready`] (`None`: also what lets a writer finish).
    pub fn set_sink(&mut self, w: Option<Arc<dyn Handoff>>) -> CoreResult<()> {
        match &self.scattering {
            Scattering::Background(a) => a.set_sink(w),
            Scattering::Inline(_) => Ok(()),
        }
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Copies a host layer's planned rows (`runs`, `rows` read) into slot `slot` of the step's arena.
    ///
    /// # Safety
    /// Both descriptors describe live host memory of the described extent that nobody writes while this
    /// call runs.
    pub unsafe fn capture_host(
        &mut self,
        slot: usize,
        name: &str,
        (hidden, residual): (&TensorDesc, Option<&TensorDesc>),
        rows: usize,
        runs: &[RowRun],
    ) -> CoreResult<()> {
        ensure!(
            !self.geo.quantized,
            Compatibility,
            "{name}: a host tensor in a session whose device quantizes to fp8; every slot must be captured on the device"
        );
        // SAFETY: forwarded from this function's contract.
        let h = unsafe { hidden.cpu_rows(name, rows)? };
        let r = match residual {
            // SAFETY: as above.
            Some(r) => Some(unsafe { r.cpu_rows(name, rows)? }),
            None => None,
        };
        let mut target = self.arena.target(slot, name)?;
        capture_rows(&h, r.as_ref(), runs, &mut target).map_err(|e| crate::core_err!(ShapeContract, "{name}: {e}"))
    }

    pub fn arena_mut(&mut self) -> &mut Arena {
        &mut self.arena
    }

    /// Device pinned buffers with the assembler thread.
    pub fn pinned_out(&self) -> usize {
        self.pinned_out
    }

    /// Forgets a request's partial sample (after every step already handed over).
    pub fn drop_request(&mut self, req_id: &str) -> CoreResult<()> {
        match &mut self.scattering {
            Scattering::Inline(sc) => {
                sc.drop_request(req_id);
                Ok(())
            }
            Scattering::Background(a) => a.drop_request(req_id),
        }
    }

    /// Copies a step's rows and completes its samples: now (inline, returned) or on the assembler
    /// thread (the buffer goes with the job; nothing returned). `pinned` None means the current arena.
    pub fn scatter(
        &mut self,
        job: ScatterJob,
        pinned: Option<Box<dyn PinnedStep>>,
        device: Option<&mut DeviceSteps>,
    ) -> CoreResult<Vec<Sample>> {
        let give_back = |b: Box<dyn PinnedStep>, device: Option<&mut DeviceSteps>| match device {
            Some(d) => d.recycle(b),
            None => bail!(Compatibility, "a device step buffer has no device path to go back to"),
        };
        match &mut self.scattering {
            Scattering::Inline(sc) => {
                // Copying a large step's rows on the caller's thread: a section (letting go of a lock costs more
                // than copying a few rows).
                let arena = &self.arena;
                let bytes = job.segments.iter().map(|s| s.len).sum::<usize>().saturating_mul(self.geo.token_bytes());
                let run = || match &pinned {
                    Some(b) => b.rows().and_then(|rows| sc.run(job, &*rows, None)),
                    None => sc.run(job, arena, None),
                };
                let r = if bytes >= crate::blocking::LONG_COPY { crate::blocking::section(run) } else { run() };
                if let Some(b) = pinned {
                    give_back(b, device)?;
                }
                r
            }
            Scattering::Background(_) if job.is_empty() => {
                if let Some(b) = pinned {
                    give_back(b, device)?;
                }
                Ok(Vec::new())
            }
            Scattering::Background(_) => {
                let buf = match pinned {
                    Some(b) => {
                        self.pinned_out += 1;
                        StepBuffer::Pinned(b)
                    }
                    None => {
                        let fresh = self.next_arena(device)?;
                        StepBuffer::Arena(std::mem::replace(&mut self.arena, fresh))
                    }
                };
                match &self.scattering {
                    Scattering::Background(a) => a.submit(job, buf)?,
                    Scattering::Inline(_) => bail!(Output, "the assembler thread is gone"),
                }
                Ok(Vec::new())
            }
        }
    }

    /// Takes back step buffers the assembler thread is done with (waits for one when `block`).
    pub fn reclaim(&mut self, block: bool, mut device: Option<&mut DeviceSteps>) -> CoreResult<()> {
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
                StepBuffer::Arena(x) => self.spare.push(x),
                StepBuffer::Pinned(p) => match device.as_deref_mut() {
                    Some(d) => {
                        self.pinned_out = self.pinned_out.saturating_sub(1);
                        d.recycle(p)?
                    }
                    None => bail!(Compatibility, "a device step buffer came back but the device path is gone"),
                },
            }
        }
    }

    /// An arena for the next step, once the filled one goes to the assembler thread: a spare one, a
    /// new one while the ring is not full, else the first the thread gives back.
    fn next_arena(&mut self, mut device: Option<&mut DeviceSteps>) -> CoreResult<Arena> {
        loop {
            if let Some(a) = self.spare.pop() {
                return Ok(a);
            }
            if self.arenas < self.ring {
                self.arenas += 1;
                return Ok(Arena::new(self.geo.slots, self.geo.width, self.geo.dtype));
            }
            self.reclaim(true, device.as_deref_mut())?;
        }
    }

    /// Samples the assembler thread completed since the last call (none inline: those are in each
    /// step's outcome); with `fence`, after waiting for every step handed to it so far.
    pub fn take_ready(&mut self, fence: bool, device: Option<&mut DeviceSteps>) -> CoreResult<Vec<Sample>> {
        let out = match &self.scattering {
            Scattering::Inline(_) => return Ok(Vec::new()),
            Scattering::Background(a) => {
                if fence {
                    a.fence()?;
                }
                a.take_ready()?
            }
        };
        self.reclaim(false, device)?;
        Ok(out)
    }

    /// Host bytes held by requests whose prompt is not complete (and, in the background, completed
    /// samples not yet collected).
    pub fn request_bytes(&self) -> usize {
        match &self.scattering {
            Scattering::Inline(sc) => sc.held_counter().load(std::sync::atomic::Ordering::Relaxed),
            Scattering::Background(a) => a.held_bytes(),
        }
    }

    /// Host bytes held by the CPU arenas.
    pub fn arena_bytes(&self) -> usize {
        self.arena.allocated_bytes() + self.spare.iter().map(Arena::allocated_bytes).sum::<usize>()
    }

    /// CPU arenas made so far (at most the ring).
    pub fn arenas(&self) -> usize {
        self.arenas
    }

    /// Tests only: holds the assembler thread (after the messages already queued) until the returned
    /// sender is used or dropped; None inline.
    #[cfg(test)]
    pub(crate) fn hold(&self) -> Option<crossbeam_channel::Sender<()>> {
        match &self.scattering {
            Scattering::Background(a) => Some(a.hold()),
            Scattering::Inline(_) => None,
        }
    }

    /// Stops the assembler thread (it may be reading a device's pinned buffers: before the device goes).
    pub fn stop(&mut self) {
        self.scattering =
            Scattering::Inline(Scatter::named(self.geo, Arc::clone(&self.pool), Arc::clone(&self.names), Arc::clone(&self.refusals)));
    }
}
