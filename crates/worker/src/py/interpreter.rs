//! The interpreter's lock around the core's long sections (`crate::blocking`): the step protocol's per-step calls
//! keep it ([`holding`]), and let go of it only where the core waits or copies at length.

use std::cell::Cell;

use pyo3::ffi;

thread_local! {
    /// Whether this thread is inside [`holding`]: it holds the lock, and nothing in between let go of it.
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (a core call made holding the lock, which touches no Python object and never lets go of the lock
/// itself: no `py.detach` inside) so that the core's long sections let go of the lock.
pub fn holding<T>(f: impl FnOnce() -> T) -> T {
    struct Back(bool);
    impl Drop for Back {
        fn drop(&mut self) {
            HOLDING.with(|h| h.set(self.0));
        }
    }
    let _back = Back(HOLDING.with(|h| h.replace(true)));
    f()
}

/// Lets go of the lock if this thread is in [`holding`]; the token is its thread state (0: nothing let go of, as
/// on the core's own threads).
fn release() -> usize {
    if !HOLDING.with(|h| h.replace(false)) {
        return 0;
    }
    // SAFETY: inside `holding` this thread holds the lock (a pymethod's body, nothing let go of it: the flag is
    // cleared while it is let go of); the section that follows touches no Python object (the contract of
    // `blocking::section`), and `restore` takes the lock back with this state.
    unsafe { ffi::PyEval_SaveThread() as usize }
}

fn restore(token: usize) {
    if token != 0 {
        // SAFETY: `token` is the thread state `release` saved on this thread, taken back once.
        unsafe { ffi::PyEval_RestoreThread(token as *mut ffi::PyThreadState) };
        HOLDING.with(|h| h.set(true));
    }
}

pub fn install() {
    crate::blocking::install(crate::blocking::Hooks { release, restore });
}
