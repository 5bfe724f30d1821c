//! The tensor-parallel ranks' agreement, decided here: what each rank sends at a meeting (a fixed-size record),
//! and what the gathered records mean. Python only carries the records between ranks (`ranksync.py`).
//!
//! - At start-up every rank sends its capture path ([`path_code`]); [`agree_on_paths`] refuses ranks that capture
//!   in different ways, or names the ranks whose set-up failed.
//! - At every call of the step protocol every rank sends [`record`]: whether it failed, how many steps the call
//!   accounted, a digest of their checksums and its global rank. [`decide`] says whether they agree, which peers
//!   failed, or that the steps must be compared one by one ([`compare_steps`], which names the first that differs).

use crate::error::{CoreError, CoreResult, ErrorKind};
use crate::ranks::checksums::verify_replicated;
use crate::{bail, core_err};

/// How a rank captures: no CUDA, host copies in the hook, the device path; or its set-up failed.
pub const PATHS: [&str; 4] = ["none", "host", "device", "failed"];

/// The number a rank's capture path (and, on the device path, the steps it keeps in flight) travels as.
pub fn path_code(path: &str, overlap: u8) -> CoreResult<i64> {
    let Some(i) = PATHS.iter().position(|p| *p == path) else {
        bail!(Config, "capture path {path:?}: expected one of {PATHS:?}");
    };
    let overlap = if path == "device" { i64::from(overlap.min(3)) } else { 0 };
    Ok(i as i64 * 4 + overlap)
}

fn path_of(code: i64) -> (&'static str, i64) {
    let i = usize::try_from(code / 4).unwrap_or(usize::MAX);
    (PATHS.get(i).copied().unwrap_or("unknown"), code.rem_euclid(4))
}

/// The ranks' start-up agreement on how they capture (`codes[r]` from TP rank `r`): Ok(None) when they agree; Ok
/// with the failed ranks' names when some could not set up (this rank stops with them: `PeerFailedError`); a
/// `CompatibilityError` when they capture in different ways — device steps are accounted later than host steps,
/// so the cross-rank check would compare different steps, or the ranks wait for each other at the end.
pub fn agree_on_paths(codes: &[i64]) -> CoreResult<Option<String>> {
    let failed: Vec<usize> = (0..codes.len()).filter(|&r| path_of(codes[r]).0 == "failed").collect();
    if !failed.is_empty() {
        return Ok(Some(format!("tensor-parallel rank(s) {failed:?}")));
    }
    if codes.windows(2).all(|w| w[0] == w[1]) {
        return Ok(None);
    }
    let seen: Vec<String> = codes
        .iter()
        .enumerate()
        .map(|(r, &c)| match path_of(c) {
            (p, 0) => format!("rank {r}: {p}"),
            (p, n) => format!("rank {r}: {p} ({n} steps in flight)"),
        })
        .collect();
    Err(core_err!(
        Compatibility,
        "the tensor-parallel ranks capture in different ways ({}); expected the same path on every rank, since each \
         path accounts steps at different calls and the cross-rank check would compare different steps. A rank that \
         fell back to host copies logged why (its CUDA capture path is unavailable); fix that, or set \
         HSCAPTURE_DEVICE_PATH=off (and the same HSCAPTURE_DEVICE_OVERLAP) for every rank",
        seen.join("; ")
    ))
}

/// FNV-1a over the (step, checksum) pairs, as the signed 64-bit integer a record carries.
pub fn digest(steps: &[(u64, u64)]) -> i64 {
    let mut d: u64 = 0xcbf2_9ce4_8422_2325;
    for &(step, checksum) in steps {
        for v in [step, checksum] {
            d = (d ^ v).wrapping_mul(0x0100_0000_01b3);
        }
    }
    d as i64
}

/// What one rank sends at a meeting.
pub fn record(failed: bool, steps: &[(u64, u64)], global_rank: i64) -> [i64; 4] {
    [i64::from(failed), steps.len() as i64, digest(steps), global_rank]
}

/// What the gathered records of a meeting mean.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Every rank accounted the same steps with the same checksums.
    Agreed,
    /// These peers failed (named by TP and global rank): every rank stops with them.
    PeersFailed(String),
    /// Same counts, different digests: gather each step's checksum and [`compare_steps`].
    CompareSteps,
}

/// Decides a meeting from the records gathered over the group (`records[r]` from TP rank `r`, each [`record`]).
pub fn decide(what: &str, records: &[Vec<i64>]) -> CoreResult<Verdict> {
    if let Some((r, rec)) = records.iter().enumerate().find(|(_, rec)| rec.len() != 4) {
        bail!(RankMismatch, "{what}: rank {r} sent a meeting record of {} values; expected 4 (a bug in hscapture)", rec.len());
    }
    let peers: Vec<String> = records
        .iter()
        .enumerate()
        .filter(|(_, rec)| rec[0] != 0)
        .map(|(r, rec)| format!("tensor-parallel rank {r} (global rank {})", rec[3]))
        .collect();
    if !peers.is_empty() {
        return Ok(Verdict::PeersFailed(peers.join(", ")));
    }
    let counts: Vec<i64> = records.iter().map(|rec| rec[1]).collect();
    if counts.windows(2).any(|w| w[0] != w[1]) {
        bail!(
            RankMismatch,
            "{what}: the tensor-parallel ranks accounted different numbers of steps (per rank {counts:?}); expected \
             the same, since every rank captures the same way (checked at start-up). This is a bug in hscapture: \
             please report it with the workers' logs"
        );
    }
    Ok(if records.windows(2).all(|w| w[0][2] == w[1][2]) { Verdict::Agreed } else { Verdict::CompareSteps })
}

/// After [`Verdict::CompareSteps`]: each step with the checksums gathered for it (index = TP rank). The error names
/// the first step whose checksums differ, or says that none did (the digests still differed: a bug).
pub fn compare_steps(what: &str, gathered: &[(u64, Vec<i64>)]) -> CoreError {
    for (step, checksums) in gathered {
        let c: Vec<u64> = checksums.iter().map(|&x| x as u64).collect();
        if let Err(e) = verify_replicated(*step, what, &c) {
            return e;
        }
    }
    let steps: Vec<u64> = gathered.iter().map(|(s, _)| *s).collect();
    CoreError::new(
        ErrorKind::RankMismatch,
        format!(
            "{what}: the tensor-parallel ranks' digests of steps {steps:?} differ, but no single step's checksum did; \
             expected equal digests. This is a bug in hscapture: please report it"
        ),
    )
}

#[cfg(test)]
#[path = "tests/meeting.rs"]
mod tests;
