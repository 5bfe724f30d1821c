//! The output side: what a finished sample becomes.
//! - [`sample`], [`pool`]: an assembled sample and the recycled buffers its bytes live in;
//! - [`format`]: the one interface of a stored layout ([`safetensors`], [`legacy`]), with [`compress`];
//! - [`sink`]: where encoded samples go (files, atomically, with a journal line each);
//! - [`writer`]: the threads that feed a sink, behind a bounded queue;
//! - [`atomic`], [`journal`], [`manifest`], [`record`]: files that appear whole, and what they list;
//! - [`verify`]: a capture directory checked against its manifest and the contract.

pub mod atomic;
pub mod compress;
pub mod manifest;
pub mod pool;
pub mod safetensors;
pub mod sample;
pub mod verify;
pub mod writer;
