//! Samples refused for degenerate states (`sample/degenerate.rs`): such a request fails alone, whichever thread
//! assembled it, and a run of them is the capture's error (the scatter decides; this holds what it decided).

use std::sync::{Arc, Mutex};

use crate::sample::SampleKey;

/// A completed request whose sample is refused — its states are degenerate (all zeros, or one row for every token):
/// it fails alone. A prompt can do that legitimately (untrained tokens whose embeddings are all zero stay zero
/// through every layer), so one such request never stops the capture; a run of them does ([`SYSTEMATIC`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub sample: SampleKey,
    pub req_id: String,
    pub why: String,
}

/// Called on the thread that refused a sample, at once (a server's staging locks are given up there: the client
/// waiting for the file finds none instead of waiting forever).
pub type RefusalHook = Arc<dyn Fn(&Refusal) + Send + Sync>;

/// Degenerate samples in a row, none sound between them, from which the capture stops: a hook that reads a tensor
/// no layer computed this way makes every sample degenerate.
pub const SYSTEMATIC: usize = 16;

/// Refused samples, shared by the scatter (on whichever thread) and the session that reports them.
#[derive(Default)]
pub struct Refusals {
    list: Mutex<Vec<Refusal>>,
    hook: Mutex<Option<RefusalHook>>,
}

impl Refusals {
    pub fn set_hook(&self, hook: RefusalHook) {
        *self.hook.lock().unwrap_or_else(|p| p.into_inner()) = Some(hook);
    }

    /// The refusals since the last call.
    pub fn take(&self) -> Vec<Refusal> {
        std::mem::take(&mut *self.list.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub(crate) fn push(&self, r: Refusal) {
        let hook = self.hook.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(h) = hook {
            h(&r);
        }
        self.list.lock().unwrap_or_else(|p| p.into_inner()).push(r);
    }
}
