//! Where a worker's thread spends its time in the core, per call of the step protocol.

/// Nanoseconds a worker's thread spent in each call of the step protocol, summed over the run (`stats()`): the host
/// work a step costs, measured where it is spent. `backlog`: the part of `release` spent waiting for the writer
/// (per-request files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTimes {
    pub begin_step: u64,
    pub plan: u64,
    pub capture: u64,
    pub end_step: u64,
    pub release: u64,
    pub backlog: u64,
    /// The part of `end_step` spent handing the accounted steps' samples on (the gate, the writer).
    pub route: u64,
}
