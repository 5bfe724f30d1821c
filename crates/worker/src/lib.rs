//! hscapture's core. Everything that decides — token attribution, the shape contract, the cross-rank
//! check, assembly and the writer — is plain Rust here and tests without Python; the PyO3 module
//! `hscapture._native` (feature `python`) is a thin layer in `py`.

pub mod arena;
pub mod assembler;
pub mod assembly;
pub mod atomic;
pub mod compress;
pub mod device;
pub mod error;
pub mod gpu;
pub mod layers;
pub mod layout;
pub mod manifest;
pub mod plan;
pub mod pool;
pub mod ranks;
pub mod rows;
pub mod safetensors_io;
pub mod sample;
pub mod scatter;
pub mod session;
pub mod stages;
pub mod tensor;
pub mod verify;
pub mod writer;

#[cfg(feature = "python")]
mod py;

pub use error::{CoreError, CoreResult, ErrorKind};
