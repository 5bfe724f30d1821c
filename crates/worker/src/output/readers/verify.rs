//! Checking a capture directory: every sample file against the manifest and the contract, whatever
//! its format (the format decodes; the checks are the same), and every file the manifest does not
//! list (orphans, leftover partial files).

use std::collections::HashSet;
use std::path::Path;

use crate::output::atomic::is_partial;
use crate::output::formats::sample_file::META_IDENTITY;
use crate::output::formats::{by_name, Format};
use crate::output::ledger::manifest::Manifest;
use crate::output::ledger::record::{content_checksum, file_checksum, Identity, SampleRecord};
use crate::sample::degenerate::degenerate_slot;
use crate::sample::LoadedSample;
use crate::{core_err, error::CoreResult};
use hscapture_kernels::DType;

/// Counts values that are NaN or infinite in little-endian data of `dtype`.
pub fn count_nonfinite(data: &[u8], dtype: DType) -> u64 {
    match dtype {
        DType::F32 => {
            data.chunks_exact(4).filter(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000) == 0x7f80_0000).count() as u64
        }
        DType::BF16 => data.chunks_exact(2).filter(|c| (u16::from_le_bytes([c[0], c[1]]) & 0x7f80) == 0x7f80).count() as u64,
        DType::F16 => data.chunks_exact(2).filter(|c| (u16::from_le_bytes([c[0], c[1]]) & 0x7c00) == 0x7c00).count() as u64,
    }
}

/// What `verify_dir` found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    pub samples: usize,
    pub tokens: u64,
    pub bytes: u64,
    /// One line per problem; empty when everything checks.
    pub problems: Vec<String>,
}

/// How a record is named in problems.
pub fn describe(rec: &SampleRecord) -> String {
    rec.index.map_or_else(|| format!("request {:?}", rec.request_id), |i| format!("sample {i}"))
}

/// Checks one file's bytes against its record and the capture's identity; returns the decoded
/// sample, or why it cannot be trusted. `whole_file`: the record's checksum covers the whole file
/// (else only the states, as `hscapture/1` manifests recorded it).
pub fn check_file(
    format: &dyn Format,
    root: &Path,
    rec: &SampleRecord,
    identity: &Identity,
    whole_file: bool,
) -> Result<LoadedSample, Vec<String>> {
    let path = root.join(&rec.file);
    let bytes = std::fs::read(&path).map_err(|e| vec![format!("cannot read {}: {e}", rec.file)])?;
    let mut s = format.decode(&bytes, &rec.file).map_err(|e| vec![e.message])?;
    s.checksum = file_checksum(&bytes);
    let mut problems = Vec::new();
    let recorded = if whole_file { s.checksum.clone() } else { content_checksum(&s.data) };
    if recorded != rec.checksum {
        problems.push(format!("checksum {recorded} but its record says {}; the file changed after it was written", rec.checksum));
    }
    let expected = [rec.length, identity.layer_ids.len(), identity.hidden_size];
    if s.shape != expected {
        problems.push(format!("hidden_states shape {:?}, expected {:?}", s.shape, expected));
    }
    if s.stored != identity.dtype {
        problems.push(format!("dtype {}, the capture stores {}", s.stored, identity.dtype));
    }
    if s.token_ids.len() != rec.length {
        problems.push(format!("{} token ids for {} rows", s.token_ids.len(), rec.length));
    }
    if let Some(found) = s.metadata.get(META_IDENTITY).and_then(|j| serde_json::from_str::<Identity>(j).ok()) {
        let diff = found.differences(identity);
        if !diff.is_empty() {
            problems.push(format!("written by a capture with other settings ({})", diff.join("; ")));
        }
    }
    let bad = count_nonfinite(&s.data, s.dtype);
    if bad > 0 {
        problems.push(format!("{bad} NaN/Inf values"));
    }
    let (slots, row_bytes) = (s.shape[1], s.shape[2] * s.dtype.size());
    if let Some((slot, what)) = degenerate_slot(&s.token_ids, slots, row_bytes, &s.data, None) {
        let id = identity.layer_ids.get(slot).map_or_else(|| format!("slot {slot}"), |i| format!("layer id {i}"));
        problems.push(format!(
            "{id} is {}: no layer computes that for different tokens (a hook on the wrong tensor?)",
            what.describe(s.token_ids.len())
        ));
    }
    if problems.is_empty() {
        Ok(s)
    } else {
        Err(problems)
    }
}

/// Checks every sample the manifest lists (file present, checksum, length, shape, dtype, finite
/// values, token-id count, settings) and every file it does not (orphans, leftover partial files).
pub fn verify_dir(root: &Path) -> CoreResult<VerifyReport> {
    let m = Manifest::read(&root.join(crate::output::ledger::manifest::FILE))?;
    let format = by_name(&m.sample_format, None)?;
    let identity = m.identity();
    let mut rep = VerifyReport::default();
    for rec in &m.samples {
        let what = describe(rec);
        match check_file(format.as_ref(), root, rec, &identity, m.whole_file_checksums()) {
            Ok(_) => {}
            Err(ps) => rep.problems.extend(ps.into_iter().map(|p| format!("{what}: {p}"))),
        }
        rep.samples += 1;
        rep.tokens += rec.length as u64;
        rep.bytes += rec.bytes;
    }
    let listed: HashSet<&str> = m.samples.iter().map(|s| s.file.as_str()).collect();
    rep.problems.extend(unlisted(root, format.as_ref(), &listed)?);
    Ok(rep)
}

/// Files in the format's folder that no record lists: leftover partial files and orphans.
pub fn unlisted(root: &Path, format: &dyn Format, listed: &HashSet<&str>) -> CoreResult<Vec<String>> {
    let dir = root.join(format.folder());
    let entries = std::fs::read_dir(&dir).map_err(|e| core_err!(Output, "cannot list {}: {e}", dir.display()).caused_by(&e))?;
    let prefix = if format.folder().is_empty() { String::new() } else { format!("{}/", format.folder()) };
    let mut out = Vec::new();
    let mut names: Vec<String> = entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    for name in names {
        let rel = format!("{prefix}{name}");
        if is_partial(&name) {
            out.push(format!("leftover partial file {rel} (an interrupted write; safe to delete)"));
        } else if !listed.contains(rel.as_str()) && (format.index_of(&name).is_some() || rel.starts_with("hidden_states/hs_req-")) {
            out.push(format!("{rel} is not in the manifest"));
        }
    }
    Ok(out)
}

#[cfg(test)]
#[path = "tests/verify.rs"]
mod tests;
