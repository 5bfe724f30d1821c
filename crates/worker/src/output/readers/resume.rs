//! What a resumed run may keep of an earlier capture in the same directory. A file is kept only when
//! the capture's own ledger vouches for it: the journal (`records.jsonl`, written as files appear, so
//! it survives a run killed before its manifest) or the manifest recorded its checksum when it was
//! written, the ledger's identity equals this run's, and the file still reads back whole with that
//! checksum and the recorded shape. Everything else is recaptured, with the reason reported; a
//! ledger of other settings refuses the resume, naming what differs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use crate::output::formats::{by_name, Format};
use crate::output::ledger::journal;
use crate::output::ledger::manifest::Manifest;
use crate::output::ledger::record::{Identity, SampleRecord};
use crate::output::readers::verify::check_file;
use crate::{bail, error::CoreResult};

/// A finished sample a resumed run keeps: its record and its token ids (the driver checks them
/// against the input).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kept {
    pub record: SampleRecord,
    pub token_ids: Vec<i64>,
}

#[derive(Debug, Default)]
pub struct Plan {
    /// Kept samples by index.
    pub kept: BTreeMap<u64, Kept>,
    /// Samples to capture again, one line each saying why.
    pub recapture: Vec<String>,
    /// The identity the ledger records (None without a ledger).
    pub identity: Option<Identity>,
}

/// The ledger of the capture in `root`: its identity and its records, the journal's last word for
/// each file winning over the manifest's.
fn ledger(root: &Path) -> CoreResult<(Option<Identity>, Vec<SampleRecord>, Vec<String>)> {
    let manifest_path = root.join(crate::output::ledger::manifest::FILE);
    let manifest = if manifest_path.exists() { Some(Manifest::read(&manifest_path)?) } else { None };
    if let Some(m) = &manifest {
        if !m.whole_file_checksums() {
            bail!(
                Config,
                "{} was written by an older hscapture (manifest format {}), whose checksums do not cover whole files; \
                 its files cannot be proven for a resume: check them with `hscapture verify`, and capture into a new \
                 directory (or --overwrite)",
                root.display(),
                m.format
            );
        }
    }
    let j = journal::read(root)?;
    let mut notes = j.damaged.iter().map(|d| format!("journal line not readable, ignored: {d}")).collect::<Vec<_>>();
    let identity = match (manifest.as_ref().map(Manifest::identity), j.identity) {
        (Some(a), Some(b)) if a != b => bail!(
            Output,
            "{}: the manifest and the journal (records.jsonl) describe different captures ({}); the directory was \
             mixed or edited: capture into a new directory (or --overwrite)",
            root.display(),
            a.differences(&b).join("; ")
        ),
        (Some(a), _) => Some(a),
        (None, b) => b,
    };
    if identity.is_none() && !j.records.is_empty() {
        notes.push("the journal has no identity line (an older hscapture): none of its files is kept".into());
        return Ok((None, Vec::new(), notes));
    }
    let mut by_file: HashMap<String, SampleRecord> = HashMap::new();
    for r in manifest.map(|m| m.samples).unwrap_or_default().into_iter().chain(j.records) {
        by_file.insert(r.file.clone(), r);
    }
    let mut records: Vec<SampleRecord> = by_file.into_values().collect();
    records.sort_by(|a, b| (a.index, &a.file).cmp(&(b.index, &b.file)));
    Ok((identity, records, notes))
}

/// What a run of `identity` resuming the capture in `root` keeps, and what it recaptures.
pub fn plan(root: &Path, identity: &Identity) -> CoreResult<Plan> {
    let (found, records, notes) = ledger(root)?;
    let mut out = Plan { recapture: notes, ..Default::default() };
    if let Some(found) = &found {
        // The stored dtype may be left to vLLM ("auto"), and the layer-output rule is known once the model is: the
        // workers check both when they open the journal.
        let left = |d: &String| {
            (identity.dtype == "auto" && d.starts_with("stored dtype"))
                || (identity.layer_output == "auto" && d.starts_with("layer output"))
        };
        let diff: Vec<String> = found.differences(identity).into_iter().filter(|d| !left(d)).collect();
        if !diff.is_empty() {
            bail!(
                Config,
                "{} holds a capture with other settings ({}); expected this run's: resume with the same settings, or \
                 use --overwrite / another --out",
                root.display(),
                diff.join("; ")
            );
        }
    }
    let format = by_name(&identity.format, None)?;
    let mut vouched: HashSet<String> = HashSet::new();
    if let Some(found) = &found {
        for rec in records.iter().filter(|r| r.index.is_some()) {
            vouched.insert(rec.file.clone());
            let Some(i) = rec.index else { continue };
            match check_file(format.as_ref(), root, rec, found, true) {
                Ok(s) => {
                    out.kept.insert(i, Kept { record: rec.clone(), token_ids: s.token_ids });
                }
                Err(why) => out.recapture.push(format!("sample {i} ({}): {}; it is captured again", rec.file, why.join("; "))),
            }
        }
    }
    out.recapture.extend(unvouched(root, format.as_ref(), &vouched));
    out.identity = found;
    Ok(out)
}

/// Sample files no record vouches for (written, but their journal line never was).
fn unvouched(root: &Path, format: &dyn Format, vouched: &HashSet<String>) -> Vec<String> {
    let prefix = if format.folder().is_empty() { String::new() } else { format!("{}/", format.folder()) };
    let Ok(entries) = std::fs::read_dir(root.join(format.folder())) else {
        return Vec::new();
    };
    let mut out: Vec<(u64, String)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let i = format.index_of(&name)?;
            let rel = format!("{prefix}{name}");
            (!vouched.contains(&rel)).then_some((i, rel))
        })
        .collect();
    out.sort();
    out.into_iter()
        .map(|(i, rel)| format!("sample {i} ({rel}): no record of it was written (the run stopped before its journal line), so its content cannot be proven; it is captured again"))
        .collect()
}

#[cfg(test)]
#[path = "tests/resume.rs"]
mod tests;
