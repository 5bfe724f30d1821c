//! Where a worker's samples go. Each [`Destination`] carries what only it needs and answers for its own rules: the
//! format its files are in (and so what a row takes), whether it keeps a ledger of records, whether aborted
//! requests are anyone's to report. A new kind of output is one more variant here, one arm where the worker opens
//! it (`worker/mod.rs`), and one branch where Python describes it (`adapters/requested.py`).

use std::path::PathBuf;
use std::time::Duration;

use crate::error::CoreResult;
use crate::output::atomic::Durability;
use crate::output::formats::{by_name, Format};
use crate::output::sinks::staging::SlowDisk;
use crate::output::sinks::store::ObjectStore;

/// Sample files under a root: in `format` (a name or an alias), zstd-compressed at level `compress` where the
/// format allows it, pushed to disk as `durability` says.
#[derive(Clone, Debug)]
pub struct Files {
    pub root: PathBuf,
    pub format: String,
    pub compress: Option<i32>,
    pub durability: Durability,
}

/// Where a worker's samples go.
#[derive(Clone)]
pub enum Destination {
    /// Kept in memory until taken (`take_samples`): speculators' RPC drivers.
    Memory,
    /// A capture directory: one file per sample, each journaled; the run's manifest lists them.
    Directory(Files),
    /// Per-request files a KV-connector client collects (`sinks/staging.rs`): each under a lock until whole, at
    /// most `backlog` bytes of finished samples waiting for their files at a release, swept `collect_within` after
    /// they appeared; `slow_disk` delays them (tests).
    Staging { files: Files, backlog: u64, collect_within: Duration, slow_disk: SlowDisk },
    /// Packed objects in an object store (Mooncake), one per request.
    Store(std::sync::Arc<dyn ObjectStore>),
}

impl std::fmt::Debug for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Destination::Memory => f.write_str("Memory"),
            Destination::Directory(files) => f.debug_tuple("Directory").field(files).finish(),
            Destination::Staging { files, backlog, .. } => {
                f.debug_struct("Staging").field("files", files).field("backlog", backlog).finish_non_exhaustive()
            }
            Destination::Store(_) => f.write_str("Store"),
        }
    }
}

/// What the capture's identity and output go by when samples leave as objects (the packed layout is not a file
/// format).
pub const STORE_FORMAT: &str = "mooncake";

impl Destination {
    /// The format the identity names and rows are sized by; files are written in it. An object store keeps the
    /// states as captured: the plain format's.
    pub fn format(&self) -> CoreResult<Box<dyn Format>> {
        match self {
            Destination::Directory(files) | Destination::Staging { files, .. } => by_name(&files.format, files.compress),
            Destination::Memory | Destination::Store(_) => by_name(crate::output::formats::safetensors::NAME, None),
        }
    }

    /// The name the output goes by in messages and the identity's `format`: its file format's, or the store's.
    pub fn name(&self, format: &dyn Format) -> &'static str {
        match self {
            Destination::Store(_) => STORE_FORMAT,
            _ => format.name(),
        }
    }

    /// Whether it keeps a ledger of what it wrote: a capture directory lists its files; per-request files and
    /// objects belong to their clients (nothing to grow for as long as a server runs).
    pub fn keeps_records(&self) -> bool {
        matches!(self, Destination::Directory(_))
    }

    /// Whether its aborted requests are reported to a driver: a server's (per-request files, objects) are nobody's.
    pub fn reports_aborts(&self) -> bool {
        matches!(self, Destination::Memory | Destination::Directory(_))
    }

    /// Per-request files: the most bytes of finished samples that may wait for their files at a release.
    pub fn backlog(&self) -> u64 {
        match self {
            Destination::Staging { backlog, .. } => *backlog,
            _ => 0,
        }
    }

    /// Per-request files: how long a client has to collect its file.
    pub fn collect_within(&self) -> Duration {
        match self {
            Destination::Staging { collect_within, .. } => *collect_within,
            _ => crate::output::sinks::janitor::COLLECT_WITHIN,
        }
    }
}
