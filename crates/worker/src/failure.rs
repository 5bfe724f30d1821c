//! A capture's one failure flag, shared by the parts that can fail apart from the caller's call: the
//! step protocol's device steps, the assembler thread and the writer's threads. The first failure is
//! kept with where it happened; every later call of any part reports it, since the step that failed
//! left a gap in some request's rows (docs/contract.md, rule 22).

use std::sync::{Arc, Mutex};

use crate::error::CoreError;

/// Run once, on the thread that reports the first failure (a server gives up its staging locks there).
pub type OnFailure = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct Inner {
    first: Mutex<Option<(String, CoreError)>>,
    on_failure: Mutex<Vec<OnFailure>>,
}

#[derive(Clone, Default)]
pub struct Failure(Arc<Inner>);

impl std::fmt::Debug for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Failure").field(&*self.lock()).finish()
    }
}

impl Failure {
    pub fn new() -> Failure {
        Failure::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(String, CoreError)>> {
        // Poisoned only if a thread panicked holding it; the recorded failure is still whole.
        self.0.first.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` once when the first failure is reported (at once if one is already).
    pub fn on_failure(&self, f: OnFailure) {
        if self.is_set() {
            f();
            return;
        }
        self.0.on_failure.lock().unwrap_or_else(|p| p.into_inner()).push(f);
    }

    /// Records `e` unless a failure is recorded already; `origin` says what failed, as the start of a
    /// sentence ("the writer failed earlier"). Returns `e`, for `Err(failure.report(..))`. The first report runs
    /// the `on_failure` callbacks (after the record is in place, outside its lock).
    pub fn report(&self, origin: &str, e: CoreError) -> CoreError {
        let first = {
            let mut g = self.lock();
            let first = g.is_none();
            if first {
                *g = Some((origin.to_string(), e.clone()));
            }
            first
        };
        if first {
            let callbacks = std::mem::take(&mut *self.0.on_failure.lock().unwrap_or_else(|p| p.into_inner()));
            callbacks.iter().for_each(|f| f());
        }
        e
    }

    /// The first failure, as it was reported.
    pub fn first(&self) -> Option<CoreError> {
        self.lock().as_ref().map(|(_, e)| e.clone())
    }

    pub fn is_set(&self) -> bool {
        self.lock().is_some()
    }

    /// Refuses a call after a failure: an error of the first failure's kind naming it.
    pub fn check(&self) -> Result<(), CoreError> {
        match self.lock().as_ref() {
            None => Ok(()),
            Some((origin, e)) => Err(CoreError::new(
                e.kind,
                format!(
                    "{origin}, so this capture records nothing more (its requests would have gaps); the first \
                     failure: {}",
                    e.message
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Failure;
    use crate::core_err;

    #[test]
    fn the_first_failure_is_kept_and_named_by_every_later_check() {
        let f = Failure::new();
        assert!(f.check().is_ok() && !f.is_set());
        let shared = f.clone();
        let e = shared.report("the writer failed earlier", core_err!(Output, "disk full"));
        assert_eq!(e.message, "disk full");
        f.report("a device step could not be collected", core_err!(Compatibility, "later"));
        let refused = f.check().unwrap_err();
        assert_eq!(refused.kind, crate::ErrorKind::Output);
        assert!(refused.message.starts_with("the writer failed earlier") && refused.message.contains("disk full"), "{refused}");
        assert_eq!(f.first().map(|e| e.message), Some("disk full".into()));
    }

    #[test]
    fn the_first_failure_runs_the_callbacks_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        let f = Failure::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let r = Arc::clone(&runs);
        f.on_failure(Box::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        f.clone().report("the writer failed earlier", core_err!(Output, "disk full"));
        f.report("again", core_err!(Output, "later"));
        assert_eq!(runs.load(Ordering::SeqCst), 1, "once, at the first failure");
        let r = Arc::clone(&runs);
        f.on_failure(Box::new(move || {
            r.fetch_add(10, Ordering::SeqCst);
        }));
        assert_eq!(runs.load(Ordering::SeqCst), 11, "registered after the failure: run at once");
    }
}
