//! hscapture's core. Everything that decides — token attribution, the shape contract, the cross-rank
//! check, assembly and the output — is plain Rust here and tests without Python; the PyO3 module
//! `hscapture._native` (feature `python`) is a thin layer in `py`.
//!
//! The folders are the architecture, read top to bottom (each imports only from those below it):
//! - [`worker`]: one worker's capture — the step protocol feeding the output;
//! - [`capture`]: the step protocol (contract, accounting, step buffers, device steps, scatter);
//! - [`output`]: what a finished sample becomes (the release gate, destinations, formats, the writer, atomic files,
//!   manifest, verify);
//! - [`attribution`]: which rows of a step are whose, and which layers are captured where;
//! - [`ranks`]: what crosses ranks (the ranks' agreement, checksums, the residual's row layout, pipeline-stage
//!   messages);
//! - [`sample`]: what both sides share: a sample, its key, its buffers, the degenerate-states check, and the
//!   `Handoff` through which capture passes samples, with their steps, to the output's release gate (capture
//!   imports nothing of `output`);
//! - [`error`], [`failure`]: the one error type and a capture's one failure flag; [`blocking`]: the sections of a
//!   call that may last (where the binding lets go of the interpreter's lock).

pub mod attribution;
pub mod blocking;
pub mod capture;
pub mod error;
pub mod failure;
pub mod output;
pub mod ranks;
pub mod sample;
pub mod worker;

#[cfg(feature = "python")]
mod py;

pub use error::{CoreError, CoreResult, ErrorKind};
