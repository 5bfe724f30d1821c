//! hscapture's core. Everything that decides — token attribution, the shape contract, the cross-rank
//! check, assembly and the writer — is plain Rust here and tests without Python; the PyO3 module
//! `hscapture._native` (feature `python`) is a thin layer in [`py`].

pub mod error;
pub mod layers;
pub mod plan;
pub mod tensor;

pub use error::{CoreError, CoreResult, ErrorKind};
