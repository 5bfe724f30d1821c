//! What a capture's files are vouched by: each file's [`record`] and the capture's identity, the [`journal`] the
//! sink appends a record to after each file, and the [`manifest`] a finished run writes.

pub mod journal;
pub mod manifest;
pub mod record;
