//! The output side: what a finished sample becomes.
//! - [`sample`], [`pool`]: an assembled sample and the recycled buffers its bytes live in;
//! - [`format`]: the one interface of a stored layout ([`safetensors`], [`fp8`], [`legacy`] over [`zip`]), with
//!   [`compress`];
//! - [`sink`]: where encoded samples go (files, atomically, each journaled), and [`staging`]: per-request files
//!   for a client that collects them, which [`janitor`] sweeps;
//! - [`store`]: samples as objects in an object store (Mooncake), packed as [`packed`] says;
//! - [`writer`]: the threads that feed a sink, behind a bounded queue;
//! - [`atomic`], [`journal`], [`manifest`], [`record`]: files that appear whole, and what they list;
//! - [`dirlock`]: one writing process per output directory;
//! - [`verify`], [`resume`]: a capture directory checked against its ledger and the contract;
//! - [`degenerate`]: states no layer produces (a slot all zeros, or one row for every token).

pub mod atomic;
pub mod compress;
pub mod degenerate;
pub mod dirlock;
pub mod format;
pub mod fp8;
pub mod janitor;
pub mod journal;
pub mod legacy;
pub mod manifest;
pub mod packed;
pub mod pool;
pub mod record;
pub mod resume;
pub mod safetensors;
pub mod sample;
pub mod sink;
pub mod staging;
pub mod store;
pub mod verify;
pub mod writer;
pub mod zip;

#[cfg(test)]
#[path = "tests/fuzz.rs"]
mod fuzz;
