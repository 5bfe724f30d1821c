//! The ranks' agreement (`ranks/meeting.rs`) for `ranksync.py`, which only carries the records between ranks.

use pyo3::prelude::*;

use super::errors::guard;
use crate::ranks::meeting::{self, Verdict};

/// The number a rank's capture path travels as at start-up (`path`: none, host, device or failed).
#[pyfunction]
fn path_code(path: &str, overlap: u8) -> PyResult<i64> {
    guard("path_code", || Ok(meeting::path_code(path, overlap)?))
}

/// The ranks' start-up agreement on their capture paths (index = TP rank): None when they agree, the failed ranks'
/// names when some could not set up; `CompatibilityError` when they capture in different ways.
#[pyfunction]
fn agree_on_paths(codes: Vec<i64>) -> PyResult<Option<String>> {
    guard("agree_on_paths", || Ok(meeting::agree_on_paths(&codes)?))
}

/// What this rank sends at a meeting: whether it failed, and the (step, checksum) pairs the call accounted.
#[pyfunction]
fn meeting_record(failed: bool, steps: Vec<(u64, i64)>, global_rank: i64) -> Vec<i64> {
    let steps: Vec<(u64, u64)> = steps.into_iter().map(|(s, c)| (s, c as u64)).collect();
    meeting::record(failed, &steps, global_rank).to_vec()
}

/// What the gathered records mean: `("agreed", None)`, `("peers_failed", names)` or `("compare_steps", None)`;
/// `RankMismatchError` when the ranks accounted different numbers of steps.
#[pyfunction]
fn decide_meeting(what: &str, records: Vec<Vec<i64>>) -> PyResult<(&'static str, Option<String>)> {
    guard("decide_meeting", || {
        Ok(match meeting::decide(what, &records)? {
            Verdict::Agreed => ("agreed", None),
            Verdict::PeersFailed(peers) => ("peers_failed", Some(peers)),
            Verdict::CompareSteps => ("compare_steps", None),
        })
    })
}

/// After `compare_steps`: each step with its checksums gathered over the group. Always raises
/// `RankMismatchError`, naming the first step that differs.
#[pyfunction]
fn compare_steps(what: &str, gathered: Vec<(u64, Vec<i64>)>) -> PyResult<()> {
    guard("compare_steps", || Err(meeting::compare_steps(what, &gathered).into()))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(path_code, m)?)?;
    m.add_function(wrap_pyfunction!(agree_on_paths, m)?)?;
    m.add_function(wrap_pyfunction!(meeting_record, m)?)?;
    m.add_function(wrap_pyfunction!(decide_meeting, m)?)?;
    m.add_function(wrap_pyfunction!(compare_steps, m)?)?;
    Ok(())
}
