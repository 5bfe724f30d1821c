//! The device side of a [`Session`]: the device path set up, a step armed before its forward, a tap's capture
//! point checked, and device steps collected in step order once their stamps prove their forward (`stamps.rs`).

use super::*;

/// What failed, in the capture's [`Failure`], when a device step cannot be collected.
const DEVICE_STEP: &str = "an earlier device step could not be collected";

impl Session {
    /// Captures device tensors through `device` from now on (once, before the first step), keeping `in_flight`
    /// ended device steps in flight (0, 1 or 2: their copies run while the next forwards do).
    pub fn set_device(&mut self, device: Box<dyn DeviceBackend>, in_flight: usize) -> CoreResult<()> {
        ensure!(self.device.is_none() && self.fresh(), Config, "the device path is enabled once, before the first step");
        if device.quantizes() {
            let slots = self.protocol.slots();
            ensure!(
                self.config().assemble && slots.expected() == slots.len(),
                Config,
                "fp8 on the device quantizes each token over every layer slot: only on the assembling rank of a \
                 capture whose slots are all captured there (not across pipeline stages)"
            );
            self.buffers.set_quantized()?;
        }
        self.device = Some(DeviceSteps::new(device, in_flight)?);
        Ok(())
    }

    /// Device bytes held by the device path's arena.
    pub fn device_bytes(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.allocated().0)
    }

    /// Accounts for every device step still in flight (waiting for their copies), oldest first.
    pub fn flush(&mut self) -> CoreResult<Vec<StepOutcome>> {
        self.collect_device_steps(0)
    }

    /// Device steps in flight (ended, not yet accounted).
    pub fn steps_in_flight(&self) -> usize {
        self.device.as_ref().map_or(0, DeviceSteps::in_flight)
    }

    pub(super) fn collect_device_steps(&mut self, keep: usize) -> CoreResult<Vec<StepOutcome>> {
        self.failure.check()?;
        let mut outs = Vec::new();
        while self.steps_in_flight() > keep {
            match self.collect_device_step() {
                Ok(o) => outs.push(o),
                Err(e) => return Err(self.failure.report(DEVICE_STEP, e)),
            }
        }
        Ok(outs)
    }

    pub(super) fn collect_device_step(&mut self) -> CoreResult<StepOutcome> {
        let Some(dev) = self.device.as_mut() else {
            bail!(Compatibility, "a device step is pending but the device path is gone");
        };
        let t = std::time::Instant::now();
        let (p, buf) = dev.collect_oldest()?;
        self.accounting.stats.wait_copies_ns += elapsed_ns(t);
        let t = std::time::Instant::now();
        let present = self.protocol.slots().present();
        let layers = &self.protocol.config().layers;
        let stamped = buf.stamps().and_then(|st| verify_stamps(&p.plan, p.arm, &st, &self.points, &present, |s| slot_name(layers, s)));
        let accounted = stamped.and_then(|()| {
            buf.rows().and_then(|rows| self.accounting.account(self.protocol.config(), p.plan, p.events, &*rows, &present, &present))
        });
        let (mut out, job) = match accounted {
            Ok(x) => x,
            Err(e) => {
                dev.recycle(buf)?;
                return Err(e);
            }
        };
        self.accounting.stats.account_ns += elapsed_ns(t);
        let t = std::time::Instant::now();
        out.completed = self.scatter(job, Some(buf))?;
        self.accounting.stats.scatter_ns += elapsed_ns(t);
        for r in &p.drops {
            self.drop_request(r)?;
        }
        out.aborted = std::mem::take(&mut self.aborted);
        Ok(out)
    }

    /// Arms the planned step on the device, on `stream` (the forward's): from now on the capture kernels of the
    /// forward, launched by hooks or replayed from a CUDA graph, store the step's rows. A step with no rows to capture
    /// is not armed (its kernels write nothing). Once per step; nothing without a device.
    pub fn arm(&mut self, stream: u64) -> CoreResult<()> {
        let (Some(plan), None) = (self.protocol.current_plan(), self.armed) else {
            return Ok(());
        };
        let (step, rows, runs) = (plan.step, plan.arena_rows, plan.runs());
        let Some(dev) = self.device.as_mut() else {
            return Ok(());
        };
        if rows == 0 {
            return Ok(());
        }
        // Every pinned buffer large enough for this step is with the assembler thread: wait for one (none free and
        // none out is the device's error to report, in `arm`; buffers in flight are never all the large ones, as
        // each size class has more buffers than steps kept in flight).
        let t = std::time::Instant::now();
        while self.buffers.pinned_out() > 0 && dev.free_host(rows) == 0 {
            self.buffers.reclaim(true, Some(dev))?;
        }
        self.accounting.stats.wait_ring_ns += elapsed_ns(t);
        let arm = self.arms.checked_add(1).filter(|&a| a != 0).unwrap_or(1);
        dev.arm(step, arm, rows, &runs, stream)?;
        (self.arms, self.armed) = (arm, Some(arm));
        Ok(())
    }

    /// Tests only: holds the assembler thread until the returned sender is dropped.
    #[cfg(test)]
    pub(crate) fn hold_assembler_for_test(&self) -> crossbeam_channel::Sender<()> {
        self.buffers.hold().expect("background assembly")
    }

    /// Slot `slot`'s capture point code, after checking that `point` (a compiled graph's tap's) is that one.
    pub fn check_point(&self, slot: usize, point: Option<i32>) -> CoreResult<i32> {
        ensure!(slot < self.points.len(), ShapeContract, "slot {slot} does not exist ({} layer slots)", self.points.len());
        let want = self.points[slot];
        if let Some(p) = point.filter(|&p| p != want) {
            bail!(
                Compatibility,
                "the compiled graph taps {} for {}, but this capture reads {} there: vLLM loaded a torch.compile \
                 artifact cached by a run with other capture settings; set VLLM_DISABLE_COMPILE_CACHE=1, or give the \
                 settings in additional_config",
                CapturePoint::describe(p),
                slot_name(&self.protocol.config().layers, slot),
                CapturePoint::describe(want)
            );
        }
        Ok(want)
    }

    /// The shape contract's step-independent part (width, dtype, rows as the second-to-last dimension) on a slot's
    /// tensors seen outside a step (vLLM's profile and warm-up forwards): a model whose layers can never be captured
    /// is refused at start-up, not at its first request.
    pub fn check_shape(&self, slot: usize, hidden: &TensorDesc, residual: Option<&TensorDesc>) -> CoreResult<()> {
        self.check_point(slot, None)?;
        check_tensor(self.protocol.config(), &slot_name(&self.protocol.config().layers, slot), hidden, residual)
    }
}
