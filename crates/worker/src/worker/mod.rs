//! One worker's capture: the step protocol ([`Session`]) feeding the output — files written by the
//! writer's threads into a format's sink, or samples kept in memory for the caller (the speculators
//! RPC surface), or nothing on a rank that only verifies. The session, its assembler thread and the
//! writer share one [`Failure`]: the first failure anywhere refuses every later call.
//!
//! Only what the tensor-parallel ranks agreed on is stored: every finished sample, scattered inline or on the
//! assembler thread, goes to the output's release [`Gate`] with its step and waits there until
//! [`WorkerSession::release`], which the caller calls once the ranks' meeting over the steps accounted so far has
//! passed; samples of steps never released are dropped, never written or journaled.
//!
//! Shutdown order: the assembler thread hands its last samples over and lets go of the gate, then the gate lets go
//! of the writer's queue, before the writer finishes (its threads stop only once every submitter is gone).

use std::sync::Arc;

use crate::attribution::plan::StepInput;
use crate::capture::device::DeviceBackend;
use crate::capture::scatter::Refusal;
use crate::capture::session::{Aborted, Session, SessionConfig, StepOutcome};
use crate::capture::tensor::TensorDesc;
use crate::failure::Failure;
use crate::output::gate::{Gate, Onward};
use crate::output::ledger::record::{Identity, SampleRecord};
use crate::output::sinks::janitor;
use crate::output::sinks::sink::{FileSink, Layout};
use crate::output::sinks::staging::{Locks, STALL_DEADLINE};
use crate::output::sinks::store::StoreSink;
use crate::output::sinks::writer::{Writer, WriterConfig};
use crate::sample::Sample;
use crate::{ensure, error::CoreResult};

mod session_view;
mod settings;
mod times;

use crate::capture::step::elapsed_ns;
pub use settings::{defaults, identity, Destination, Files, GrowingBound, OutputSettings, STORE_FORMAT};
pub use times::CallTimes;

/// Aborted requests kept for a driver that never takes them (see [`crate::output::sinks::writer::UNTAKEN_RECORDS`]).
const UNTAKEN_ABORTS: usize = 1 << 16;

/// What a step's accounting reports to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepReport {
    pub step: u64,
    pub checksum: u64,
    pub rows: usize,
    /// Samples this step completed.
    pub completed: usize,
}

enum Output {
    /// This rank checks and checksums only.
    Nothing,
    /// Samples kept for the caller (in the gate).
    Memory,
    Files(Writer),
}

pub struct WorkerSession {
    // Dropped in this order (a session never finished): the assembler thread (in `session`) lets go of the gate,
    // the gate of the writer's queue, and only then does the writer wait for its threads.
    session: Session,
    /// In front of the output: samples wait there until their steps are agreed on.
    gate: Arc<Gate>,
    output: Output,
    /// The format's name (`format.rs`).
    format: &'static str,
    /// What this capture is (its journal, manifest and files record it).
    identity: Identity,
    /// Whether its files store quantized states (the fp8 format): what a quantizing device path may feed.
    quantized_files: bool,
    /// Whether aborted requests are kept for a driver to take (a server's are nobody's).
    reports_aborts: bool,
    aborted: Vec<Aborted>,
    /// A staging directory's locks (per-request files): those of aborted requests are given up.
    locks: Option<Arc<Locks>>,
    /// Per-request files: the most rows of complete samples that may wait for their files at a release.
    backlog_rows: usize,
    /// The bound on a sample that grows with its generated tokens, checked at admission.
    growing: GrowingBound,
    /// Rows of the samples completed by the device step still in flight: they cannot be written before the next
    /// step collects it, so a release does not wait for them.
    in_flight_rows: usize,
    /// The newest step accounted so far: what the next release covers.
    accounted: Option<u64>,
    /// Where the worker's thread spent its time in the core.
    pub times: CallTimes,
    /// Per-request files: when the process started (error records older than that are an earlier run's), how long
    /// a client has to collect a file, and when the staging directory was last swept.
    started: std::time::SystemTime,
    collect_within: std::time::Duration,
    swept: Option<std::time::Instant>,
    /// What the caller should log: stalls, sweeps.
    notes: Vec<String>,
}

impl WorkerSession {
    /// A session; on the assembling rank with a root, its writer opens the output (the journal must be
    /// this capture's, see `journal.rs`).
    pub fn new(cfg: SessionConfig, out: OutputSettings) -> CoreResult<WorkerSession> {
        ensure!(out.threads > 0, Config, "writer threads: expected at least 1, found 0");
        ensure!(out.queue > 0, Config, "writer queue: expected at least 1 sample, found 0");
        let dest = &out.destination;
        let format = dest.format()?;
        let format_name = dest.name(format.as_ref());
        let quantized_files = format.quantized() && matches!(dest, Destination::Directory(_) | Destination::Staging { .. });
        let failure = Failure::new();
        let id = identity(&cfg, &out, format.as_ref());
        let id_kept = id.clone();
        let (cfg_slots, cfg_width, cfg_dtype) = (cfg.layers.num_slots(), cfg.hidden_size, cfg.out_dtype);
        let row_bytes = format.stored_row_bytes(cfg_slots, cfg_width, cfg_dtype);
        let assemble = cfg.assemble;
        let mut session = Session::with_failure(cfg, failure.clone())?;
        let mut staged = None;
        let wcfg = WriterConfig { threads: out.threads, queue: out.queue, pool: Some(session.pool()), keep_records: dest.keeps_records() };
        let output = match dest {
            _ if !assemble => Output::Nothing,
            Destination::Memory => Output::Memory,
            Destination::Store(client) => Output::Files(Writer::start(Arc::new(StoreSink::new(Arc::clone(client))), wcfg, failure)?),
            Destination::Directory(files) => {
                let sink = FileSink::with_layout(&files.root, format, id, files.durability, Layout::Capture)?;
                Output::Files(Writer::start(Arc::new(sink), wcfg, failure)?)
            }
            Destination::Staging { files, slow_disk, .. } => {
                let root = &files.root;
                std::fs::create_dir_all(root)
                    .map_err(|e| crate::core_err!(Output, "cannot create the staging directory {}: {e}", root.display()).caused_by(&e))?;
                crate::output::sinks::staging::check_flock(root)?;
                let locks = Arc::new(Locks::new(root, slow_disk.clone()));
                let held = Arc::clone(&locks);
                // A lock that cannot be taken fails its request alone (`Locks::hold_or_fail`).
                session.set_completion_hook(Arc::new(move |req: &str, rows: Option<usize>| {
                    held.hold_or_fail(req, rows);
                    Ok(())
                }));
                // A refused sample (degenerate states) never gets a file: its client finds none, and does not wait.
                let refused = Arc::clone(&locks);
                session.set_refusal_hook(Arc::new(move |r: &Refusal| refused.abandon(&r.req_id)));
                // A failed capture writes none of the files its locks promise: every lock goes at once, on the
                // thread that failed (the writer's, the assembler's or the worker's), idle server or not.
                let failed = Arc::clone(&locks);
                session.failure().on_failure(Box::new(move || failed.abandon_all()));
                staged = Some(Arc::clone(&locks));
                let sink = FileSink::with_layout(root, format, id, files.durability, Layout::Staging(locks))?;
                Output::Files(Writer::start(Arc::new(sink), wcfg, failure)?)
            }
        };
        let gate = Arc::new(Gate::new(match &output {
            Output::Nothing => Onward::Discard,
            Output::Memory => Onward::Memory,
            Output::Files(w) => Onward::Writer(w.submitter().ok_or_else(|| crate::core_err!(Output, "the writer has stopped"))?),
        }));
        let backlog_rows = usize::try_from(dest.backlog() / row_bytes.max(1) as u64).unwrap_or(usize::MAX);
        let growing = out.growing_bound(cfg_slots, cfg_width, cfg_dtype)?;
        Ok(WorkerSession {
            session,
            gate,
            output,
            format: format_name,
            identity: id_kept,
            aborted: Vec::new(),
            locks: staged,
            backlog_rows,
            growing,
            in_flight_rows: 0,
            accounted: None,
            times: CallTimes::default(),
            started: std::time::SystemTime::now(),
            collect_within: dest.collect_within(),
            reports_aborts: dest.reports_aborts(),
            quantized_files,
            swept: None,
            notes: Vec::new(),
        })
    }

    /// What this capture is: format, model, layers, convention, stored dtype, sizes.
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Per-request files: sweeps the staging directory when the last sweep is [`janitor::SWEEP_EVERY`] old (the first
    /// call sweeps at once); what it removed becomes a note.
    fn sweep(&mut self) {
        let (Some(locks), Output::Files(_)) = (&self.locks, &self.output) else {
            return;
        };
        if self.swept.is_some_and(|t| t.elapsed() < janitor::SWEEP_EVERY) {
            return;
        }
        self.swept = Some(std::time::Instant::now());
        let swept = crate::blocking::section(|| janitor::sweep(locks.root(), self.collect_within, self.started));
        if !swept.is_empty() {
            self.notes.push(format!("staging directory {}: {swept}", locks.root().display()));
        }
    }

    /// Refuses at admission each new request whose sample grows with its generated tokens and could outgrow the
    /// bound (`GrowingBound`). Only that request fails: nothing of it is captured, and the scheduler-side connector,
    /// deciding by the same rule, answers it with an error and no path; a note says why.
    fn refuse_outgrowing(&mut self, input: &mut StepInput) {
        if input.with_outputs.is_empty() {
            return;
        }
        for r in &input.new_requests {
            if !input.with_outputs.contains(&r.req_id) {
                continue;
            }
            if let Some(why) = self.growing.refusal(&r.req_id, r.prompt_token_ids.len(), r.max_tokens) {
                input.with_outputs.retain(|id| id != &r.req_id);
                input.refused.push(r.req_id.clone());
                self.session.count_refused();
                self.notes.push(why);
            }
        }
    }

    /// What happened since the last call that the caller should log (a stalled writer, a sweep, requests whose
    /// samples could not be stored).
    pub fn take_notes(&mut self) -> Vec<String> {
        if let Output::Files(w) = &self.output {
            self.notes.extend(w.take_failed_note(false));
            let dropped = w.take_dropped();
            if dropped > 0 {
                self.notes.push(format!(
                    "{dropped} sample records were never taken by a driver and are dropped from memory (the newest {} are \
                     kept; the capture directory's journal has every one)",
                    crate::output::sinks::writer::UNTAKEN_RECORDS / 2
                ));
            }
        }
        std::mem::take(&mut self.notes)
    }

    /// Tests only: the session itself (the binding goes through `session_view.rs`).
    #[cfg(test)]
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }

    #[cfg(test)]
    pub(crate) fn session_mut(&mut self) -> &mut Session {
        &mut self.session
    }

    /// Scatters rows on the assembler thread (a ring of `ring` step buffers); its completed samples go from there
    /// to the gate (and, once released, to the writer). Only before the first step.
    pub fn set_background(&mut self, ring: usize) -> CoreResult<()> {
        self.session.set_background(ring)?;
        self.session.set_sink(Some(Arc::clone(&self.gate) as Arc<dyn crate::sample::Handoff>))
    }

    /// Captures device tensors through `device` from now on (see [`Session::set_device`]).
    pub fn set_device(&mut self, device: Box<dyn DeviceBackend>, in_flight: usize) -> CoreResult<()> {
        ensure!(
            !device.quantizes() || (self.quantized_files && matches!(self.output, Output::Files(_))),
            Config,
            "the device quantizes to fp8, but this session stores the {} format{}: quantize on the device only for \
             the fp8 format's files",
            self.format,
            if matches!(self.output, Output::Files(_)) { "" } else { " (and writes no files)" }
        );
        self.session.set_device(device, in_flight)
    }

    /// Hands the samples of `outs` to the gate, where they wait for their steps' release, and checks the assembler
    /// thread (waiting for everything handed to it so far, with `fence`).
    fn route(&mut self, outs: Vec<StepOutcome>, fence: bool) -> CoreResult<Vec<StepReport>> {
        let ready = self.session.take_ready(fence)?;
        ensure!(ready.is_empty(), Output, "the assembler thread completed {} samples with no gate to hand them to", ready.len());
        let mut reports = Vec::with_capacity(outs.len());
        for mut out in outs {
            reports.push(StepReport { step: out.step, checksum: out.checksum, rows: out.rows, completed: out.completed.len() });
            self.accounted = Some(self.accounted.map_or(out.step, |a| a.max(out.step)));
            for s in std::mem::take(&mut out.completed) {
                crate::sample::Handoff::submit(&*self.gate, out.step, s)?;
            }
            if let Some(locks) = &self.locks {
                out.aborted.iter().for_each(|a| locks.abandon(&a.req_id));
            }
            // A server's aborted requests are nobody's to report (and would pile up for as long as it runs).
            if self.reports_aborts {
                self.aborted.append(&mut out.aborted);
                if self.aborted.len() > UNTAKEN_ABORTS {
                    // Nobody takes them (a long-lived server with a capture directory): the oldest go.
                    self.aborted.drain(..self.aborted.len() - UNTAKEN_ABORTS / 2);
                }
            }
        }
        Ok(reports)
    }

    /// Every step accounted so far is agreed on (the ranks' meeting passed): its samples are stored. With
    /// per-request files, then waits while more than the backlog's rows of complete samples wait for their files
    /// (those of the step still in flight aside): the step's responses go out only once the writer is that close —
    /// or once [`STALL_DEADLINE`] passed, which becomes a note (`take_notes`).
    pub fn release(&mut self) -> CoreResult<()> {
        let t = std::time::Instant::now();
        if let Some(upto) = self.accounted {
            self.gate.release(upto)?;
        }
        let mut stalled = None;
        if let Some(locks) = &self.locks {
            let exempt = if self.session.steps_in_flight() > 0 { self.in_flight_rows } else { 0 };
            let failure = self.session.failure().clone();
            let w = std::time::Instant::now();
            stalled = locks.wait_for_room(self.backlog_rows.saturating_add(exempt), STALL_DEADLINE, || failure.first())?;
            self.times.backlog += elapsed_ns(w);
        }
        if let Some(s) = stalled {
            self.notes.push(s.to_string());
        }
        self.times.release += elapsed_ns(t);
        Ok(())
    }

    /// See [`Session::begin_step`].
    pub fn begin_step(&mut self, mut input: StepInput) -> CoreResult<Vec<StepReport>> {
        let t = std::time::Instant::now();
        self.sweep();
        self.refuse_outgrowing(&mut input);
        let outs = self.session.begin_step(input)?;
        let r = self.route(outs, false);
        self.times.begin_step += elapsed_ns(t);
        r
    }

    /// See [`Session::plan`], then [`Session::arm`] on `stream` when one is given; returns the step's prompt rows.
    pub fn plan(&mut self, order: &[String], stream: Option<u64>) -> CoreResult<usize> {
        let t = std::time::Instant::now();
        let rows = self.session.plan(order)?.arena_rows;
        if let Some(s) = stream {
            self.session.arm(s)?;
        }
        self.times.plan += elapsed_ns(t);
        Ok(rows)
    }

    /// See [`Session::capture`].
    ///
    /// # Safety
    /// As [`Session::capture`].
    pub unsafe fn capture(
        &mut self,
        slot: usize,
        point: Option<i32>,
        hidden: &TensorDesc,
        residual: Option<&TensorDesc>,
        stream: u64,
    ) -> CoreResult<()> {
        let t = std::time::Instant::now();
        // SAFETY: forwarded from this function's contract.
        let r = unsafe { self.session.capture(slot, point, hidden, residual, stream) };
        self.times.capture += elapsed_ns(t);
        r
    }

    /// See [`Session::end_step`].
    pub fn end_step(&mut self) -> CoreResult<Vec<StepReport>> {
        let t = std::time::Instant::now();
        let outs = self.session.end_step()?;
        // The samples this step completed (their locks were taken just now) wait for it if it stays in flight.
        self.in_flight_rows = self.locks.as_ref().map_or(0, |l| l.take_completed_rows());
        let routed = std::time::Instant::now();
        let r = self.route(outs, false);
        self.times.route += elapsed_ns(routed);
        self.times.end_step += elapsed_ns(t);
        r
    }

    /// Accounts every device step in flight and waits for the assembler thread.
    pub fn flush(&mut self) -> CoreResult<Vec<StepReport>> {
        let outs = self.session.flush()?;
        self.route(outs, true)
    }

    /// Completed samples kept in memory (no output root), removed from the session.
    pub fn take_samples(&mut self) -> CoreResult<Vec<Sample>> {
        self.route(Vec::new(), true)?;
        Ok(self.gate.take_kept())
    }

    /// Requests that ended before their prompt was complete, since the last call.
    pub fn take_aborted(&mut self) -> Vec<Aborted> {
        std::mem::take(&mut self.aborted)
    }

    /// Records of the files written so far (removed from the writer).
    pub fn take_records(&mut self) -> CoreResult<Vec<SampleRecord>> {
        match &self.output {
            Output::Files(w) => {
                w.poll()?;
                Ok(w.take_records())
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Waits until every completed sample is written (the writer keeps running).
    pub fn drain(&mut self) -> CoreResult<Vec<SampleRecord>> {
        self.route(Vec::new(), true)?;
        if let Output::Files(w) = &self.output {
            w.drain()?;
        }
        self.take_records()
    }

    /// Finishes the output: every released sample written, the writer's threads joined — even after an
    /// error, which is reported after that; samples of steps never released are dropped. Returns the
    /// records not yet taken.
    pub fn finish(&mut self) -> CoreResult<Vec<SampleRecord>> {
        let mut first = self.route(Vec::new(), true).err();
        // Always: the writer's threads stop only once the assembler thread has let go of the gate, and the gate of
        // the writer's queue.
        let unset = self.session.set_sink(None).err();
        first = first.or(unset);
        self.gate.close();
        if first.is_none() {
            first = self.route(Vec::new(), true).err();
        }
        let finished = match &mut self.output {
            Output::Files(w) => {
                let r = w.finish();
                self.notes.extend(w.take_failed_note(true)); // the last word on them (`take_notes` after this)
                r
            }
            _ => Ok(Vec::new()),
        };
        // Every sample the writer will ever write is written: a lock still held promises a file that will not come
        // (a step in flight at a shutdown), so it goes, and its client finds no file instead of waiting.
        if let Some(locks) = &self.locks {
            locks.abandon_all();
        }
        match first {
            Some(e) => Err(e),
            None => finished,
        }
    }
}

#[cfg(test)]
#[path = "../tests/worker.rs"]
mod tests;
