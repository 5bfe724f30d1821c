//! What the step protocol is configured with and what it reports per step.

use crate::attribution::layers::LayerPlan;
use crate::sample::Sample;
use crate::sample::SampleKey;
use hscapture_kernels::DType;

/// What a session captures and how.
#[derive(Clone, Debug)]
pub struct SessionConfig {
    pub layers: LayerPlan,
    pub hidden_size: usize,
    /// dtype of the model's activations (what hooks see).
    pub model_dtype: DType,
    /// dtype of the stored states.
    pub out_dtype: DType,
    /// Assemble samples (the writing rank) or only check and checksum (the other ranks).
    pub assemble: bool,
}

/// A request that ended before its prompt was complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aborted {
    pub req_id: String,
    pub sample: SampleKey,
    pub captured: usize,
    pub prompt_len: usize,
}

/// The result of accounting one step.
#[derive(Debug, Default)]
pub struct StepOutcome {
    pub step: u64,
    pub checksum: u64,
    pub rows: usize,
    /// Samples completed by this step (inline assembly; the assembler thread hands its own out).
    pub completed: Vec<Sample>,
    pub aborted: Vec<Aborted>,
}

/// Nanoseconds since `t`, saturated: the step protocol's timings (`SessionStats`, the worker's `CallTimes`).
pub(crate) fn elapsed_ns(t: std::time::Instant) -> u64 {
    u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Running totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    pub steps: u64,
    pub rows: u64,
    pub samples: u64,
    pub aborted: u64,
    /// Samples skipped for non-finite values (opt-in).
    pub skipped: u64,
    /// Requests refused at admission (a sample that could outgrow its bound).
    pub refused: u64,
    /// Nanoseconds the worker's thread waited for a free pinned buffer (the assembler thread held them all), and for
    /// a device step's copies.
    pub wait_ring_ns: u64,
    pub wait_copies_ns: u64,
    /// Nanoseconds the worker's thread spent, at a device step's end, enqueueing its copies (`device_end_ns`), and
    /// for each device step collected, checking its stamps and attributing its rows (`account_ns`) and handing them
    /// to the assembler (`scatter_ns`): the parts of `end_step`.
    pub device_end_ns: u64,
    pub account_ns: u64,
    pub scatter_ns: u64,
}
