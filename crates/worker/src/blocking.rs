//! Sections of a core call that may last: a wait (a device event, a step buffer from the assembler thread, room in
//! the writer's queue, the staging backlog, a request's file lock) or long copying on the caller's thread.
//!
//! The Python binding holds the interpreter's lock through the step protocol's calls and lets go of it around these
//! sections alone ([`install`]): released for a whole call, every call would have to win the lock back from the
//! engine's other Python threads, whatever it did (`bench/step_host.py --busy-thread`). Released here, a wait never
//! stalls those threads, and a writer thread that needs the lock (an object store's Python client) is never waited
//! for by a thread that holds it.
//!
//! A section touches no Python object. Without installed hooks (the core alone, its tests) a section just runs.

use std::sync::OnceLock;

/// Bytes from which copying rows on the caller's thread is a section (below it, letting go of a lock and winning it
/// back costs more than the copy).
pub const LONG_COPY: usize = 1 << 20;

/// How a caller's thread lets go of a lock it may hold for the length of a section: `release` returns a token
/// (what `restore` needs; 0 when this thread held nothing) and `restore` takes the lock back with it.
#[derive(Clone, Copy)]
pub struct Hooks {
    pub release: fn() -> usize,
    pub restore: fn(usize),
}

static HOOKS: OnceLock<Hooks> = OnceLock::new();

/// Installs the hooks for the process (the first installation stays).
pub fn install(hooks: Hooks) {
    let _ = HOOKS.set(hooks);
}

/// Runs `f`, a section that may last, with the caller's lock let go of (and taken back afterwards, also when `f`
/// unwinds).
pub fn section<T>(f: impl FnOnce() -> T) -> T {
    let Some(h) = HOOKS.get() else {
        return f();
    };
    let _back = Back { token: (h.release)(), restore: h.restore };
    f()
}

struct Back {
    token: usize,
    restore: fn(usize),
}

impl Drop for Back {
    fn drop(&mut self) {
        (self.restore)(self.token);
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    // Per thread: the hooks are the process's, and other tests' sections run on their own threads.
    thread_local! {
        static RELEASED: Cell<usize> = const { Cell::new(0) };
        static RESTORED: Cell<usize> = const { Cell::new(0) };
    }

    fn release() -> usize {
        RELEASED.with(|c| c.set(c.get() + 1));
        7
    }

    fn restore(token: usize) {
        if token == 7 {
            RESTORED.with(|c| c.set(c.get() + 1));
        }
    }

    fn counts() -> (usize, usize) {
        (RELEASED.with(Cell::get), RESTORED.with(Cell::get))
    }

    #[test]
    fn a_section_lets_go_and_takes_back_even_when_it_unwinds() {
        super::install(super::Hooks { release, restore });
        assert_eq!(super::section(counts), (1, 0), "let go of while the section runs");
        assert_eq!(counts(), (1, 1), "taken back with the token release gave");
        let r = std::panic::catch_unwind(|| super::section(|| panic!("inside")));
        assert!(r.is_err());
        assert_eq!(counts(), (2, 2), "taken back when the section unwinds");
    }
}
