//! Checking a capture directory: every sample file against the manifest and the contract, and
//! rebuilding the records of finished files (for resuming a run whose manifest was never written).

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use crate::output::manifest::Manifest;
use crate::output::safetensors::read_sample_file;
use crate::output::writer::SampleRecord;
use crate::{core_err, error::CoreResult};
use hscapture_kernels::DType;

/// Counts values that are NaN or infinite in little-endian data of `dtype`.
pub fn count_nonfinite(data: &[u8], dtype: DType) -> u64 {
    match dtype {
        DType::F32 => data.chunks_exact(4).filter(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000) == 0x7f80_0000).count() as u64,
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

/// Parses `hs_{i}.safetensors` into `i`.
pub fn index_of(name: &str) -> Option<u64> {
    name.strip_prefix("hs_")?.strip_suffix(".safetensors")?.parse().ok()
}

/// Checks every sample the manifest lists (file present, checksum, length, shape, dtype, finite values,
/// token-id count) and every file it does not (orphans, leftover partial files).
pub fn verify_dir(root: &Path) -> CoreResult<VerifyReport> {
    let m = Manifest::read(&root.join("manifest.json"))?;
    let dtype = DType::parse(&m.dtype).ok_or_else(|| core_err!(Output, "manifest dtype {:?} is not a known dtype", m.dtype))?;
    let mut rep = VerifyReport::default();
    let listed: HashSet<&str> = m.samples.iter().map(|s| s.file.as_str()).collect();
    for s in &m.samples {
        let path = root.join(&s.file);
        let what = s.index.map_or_else(|| format!("request {:?}", s.request_id), |i| format!("sample {i}"));
        let loaded = match read_sample_file(&path) {
            Ok(l) => l,
            Err(e) => {
                rep.problems.push(format!("{what} ({}): {}", s.file, e.message));
                continue;
            }
        };
        let expected = [s.length, m.layer_ids.len(), m.hidden_size];
        if loaded.shape != expected {
            rep.problems.push(format!("{what}: hidden_states shape {:?}, expected {:?}", loaded.shape, expected));
        }
        if loaded.dtype != dtype {
            rep.problems.push(format!("{what}: dtype {}, the manifest says {}", loaded.dtype, dtype));
        }
        if loaded.token_ids.len() != s.length {
            rep.problems.push(format!("{what}: {} token ids for {} rows", loaded.token_ids.len(), s.length));
        }
        if loaded.checksum != s.checksum {
            rep.problems.push(format!("{what}: checksum {} but the manifest recorded {}; the file changed after it was written", loaded.checksum, s.checksum));
        }
        let bad = count_nonfinite(&loaded.data, loaded.dtype);
        if bad > 0 {
            rep.problems.push(format!("{what}: {bad} NaN/Inf values"));
        }
        rep.samples += 1;
        rep.tokens += s.length as u64;
        rep.bytes += s.bytes;
    }
    let dir = root.join("hidden_states");
    let entries = std::fs::read_dir(&dir).map_err(|e| core_err!(Output, "cannot list {}: {e}", dir.display()))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.contains(".partial-") {
            rep.problems.push(format!("leftover partial file hidden_states/{name} (an interrupted write; safe to delete)"));
        } else if name.ends_with(".safetensors") && !listed.contains(format!("hidden_states/{name}").as_str()) {
            rep.problems.push(format!("hidden_states/{name} is not in the manifest"));
        }
    }
    Ok(rep)
}

/// Finished samples by index (record, token ids), and the files that could not be read.
pub type Finished = (BTreeMap<u64, (SampleRecord, Vec<i64>)>, Vec<String>);

/// Records of the finished sample files in `root/hidden_states` (indexed ones), read from the files
/// themselves: what a run killed before writing its manifest leaves behind. Files that do not read
/// back whole are skipped (and reported).
pub fn scan_finished(root: &Path) -> CoreResult<Finished> {
    let dir = root.join("hidden_states");
    let mut out = BTreeMap::new();
    let mut skipped = Vec::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok((out, skipped));
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(i) = index_of(&name) else { continue };
        match read_sample_file(&e.path()) {
            Ok(l) => {
                let bytes = e.metadata().map(|m| m.len()).unwrap_or(0);
                let rec = SampleRecord {
                    index: Some(i),
                    request_id: None,
                    file: format!("hidden_states/{name}"),
                    length: l.token_ids.len(),
                    checksum: l.checksum,
                    bytes,
                };
                out.insert(i, (rec, l.token_ids));
            }
            Err(err) => skipped.push(format!("hidden_states/{name}: {}", err.message)),
        }
    }
    Ok((out, skipped))
}

#[cfg(test)]
#[path = "tests/verify.rs"]
mod tests;
