//! `OUT/records.jsonl`, the journal: its first line is the capture's [`Identity`], then one line per
//! finished sample file, appended (and, when durable, synced) only once the file is in place. It is
//! the manifest of runs that never end (online serving), and what a resumed run trusts when the run
//! before it died before writing its manifest.
//!
//! Invariants: a record line is appended only after its file was renamed into place; a line is
//! written whole under the journal's lock; a journal whose identity differs from the writer's is
//! refused before any file is written.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::output::ledger::record::{Identity, SampleRecord};
use crate::{bail, core_err, error::CoreResult};

pub const FILE: &str = "records.jsonl";

#[derive(Serialize, Deserialize)]
struct Header {
    identity: Identity,
}

pub struct Journal {
    path: PathBuf,
    durable: bool,
    file: Mutex<std::fs::File>,
}

/// What a journal on disk says.
#[derive(Debug, Default)]
pub struct Contents {
    /// None for a journal without an identity line (written by an hscapture before the identity was
    /// recorded).
    pub identity: Option<Identity>,
    pub records: Vec<SampleRecord>,
    /// Lines that are not whole records (a write the machine did not finish), one description each.
    pub damaged: Vec<String>,
}

fn open_err(path: &Path, e: std::io::Error) -> crate::CoreError {
    core_err!(Output, "cannot open {}: {e}; choose an output directory you can write", path.display()).caused_by(&e)
}

impl Journal {
    /// Opens `root/records.jsonl` for `identity`: a new journal starts with the identity line; an
    /// existing one must carry the same identity.
    pub fn open(root: &Path, identity: &Identity, durable: bool) -> CoreResult<Journal> {
        let path = root.join(FILE);
        if path.exists() {
            let found = read(root)?;
            match found.identity {
                Some(id) if id == *identity => {}
                Some(id) => bail!(
                    Config,
                    "{} belongs to a capture with other settings ({}); expected this run's: resume it with the same \
                     settings, or use another output directory",
                    path.display(),
                    id.differences(identity).join("; ")
                ),
                None if found.records.is_empty() && found.damaged.is_empty() => {}
                None => bail!(
                    Config,
                    "{} was written by an older hscapture (no identity line): its files cannot be checked against \
                     this run's settings; finish that capture with the version that started it, or use another \
                     output directory",
                    path.display()
                ),
            }
        }
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(|e| open_err(&path, e))?;
        let empty = file.metadata().map_err(|e| open_err(&path, e))?.len() == 0;
        if empty {
            let line = serde_json::to_string(&Header { identity: identity.clone() })
                .map_err(|e| core_err!(Output, "cannot encode the capture's identity: {e}").caused_by(&e))?;
            file.write_all(format!("{line}\n").as_bytes())
                .and_then(|_| if durable { file.sync_data() } else { Ok(()) })
                .map_err(|e| core_err!(Output, "cannot write {}: {e} (disk full?)", path.display()).caused_by(&e))?;
        }
        Ok(Journal { path, durable, file: Mutex::new(file) })
    }

    /// Appends `rec` (its file is in place).
    pub fn append(&self, rec: &SampleRecord) -> CoreResult<()> {
        let line =
            serde_json::to_string(rec).map_err(|e| core_err!(Output, "cannot encode the record of {}: {e}", rec.file).caused_by(&e))?;
        let mut f = self.file.lock().unwrap_or_else(|p| p.into_inner());
        f.write_all(format!("{line}\n").as_bytes())
            .and_then(|_| if self.durable { f.sync_data() } else { Ok(()) })
            .map_err(|e| core_err!(Output, "cannot append to {}: {e} (disk full?)", self.path.display()).caused_by(&e))
    }
}

/// Reads `root/records.jsonl` (empty contents when there is none).
pub fn read(root: &Path) -> CoreResult<Contents> {
    let path = root.join(FILE);
    let text = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Contents::default()),
        Err(e) => bail!(Output, "cannot read {}: {e}", path.display()),
    };
    let mut out = Contents::default();
    for (n, line) in text.split(|&b| b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        if n == 0 {
            if let Ok(h) = serde_json::from_slice::<Header>(line) {
                out.identity = Some(h.identity);
                continue;
            }
        }
        match serde_json::from_slice::<SampleRecord>(line) {
            Ok(r) => out.records.push(r),
            Err(e) => out.damaged.push(format!("{}:{}: {e}", path.display(), n + 1)),
        }
    }
    Ok(out)
}
