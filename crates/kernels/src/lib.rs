//! Capture kernels for hscapture.
//!
//! Every kernel exists twice with one meaning: a CUDA version (launched through `cudarc`, loaded
//! dynamically so that this crate builds and runs on machines without CUDA) and a CPU reference in
//! plain Rust. The CPU reference is the specification: tests compare the two bit for bit.
//!
//! The capture kernel, [`capture_rows`], does in one pass what would otherwise be three: add the residual to a
//! decoder layer's hidden states, keep only the rows that are prompt tokens, and store them in the output dtype,
//! while computing for each stored row a checksum (for cross-rank verification) and a count of non-finite values
//! (for the shape contract). On the device it is launched armed ([`armed`]): the same launch on every forward,
//! reading the step from device memory, so that CUDA graphs record it once and replay it.

pub mod armed;
pub mod checksum;
pub mod cpu;
mod cpu_rows;
pub mod cuda;
pub mod dtype;
pub mod fp8;
pub mod launch;

pub use armed::{capture_armed, ArmedLayout, ArmedTarget, Control, Stamp};
pub use checksum::{combine_row, mix64, row_checksum};
pub use cpu::{capture_rows, CaptureTarget, KernelError, RowRun, RowSource};
pub use dtype::DType;
