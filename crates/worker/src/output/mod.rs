//! The output side: what a finished sample becomes.
//! - [`destination`]: where a worker's samples go, each kind with its own rules;
//! - [`gate`]: the release gate in front of it (only what the ranks agreed on passes);
//! - [`formats`]: the sample formats, their one interface and registry;
//! - [`sinks`]: where encoded samples go (files, per-request files, an object store) and the writer threads;
//! - [`ledger`]: records, the journal and the manifest, which vouch for the files;
//! - [`readers`]: a capture directory verified and resumed;
//! - [`atomic`]: files that appear whole (the one way every file here is written).

pub mod atomic;
pub mod destination;
pub mod formats;
pub mod gate;
pub mod ledger;
pub mod readers;
pub mod sinks;

#[cfg(test)]
#[path = "tests/fuzz.rs"]
mod fuzz;
