//! Cross-rank checks. With tensor parallelism alone the residual stream is replicated: every TP rank
//! must capture the same bytes. Each rank computes a step checksum; the checksums are gathered over
//! the TP group and compared here.

use crate::{bail, error::CoreResult};

/// Checks that every rank of a group reported the same step checksum. `checksums[i]` comes from
/// group rank `i`. On disagreement the error names the ranks on each side.
pub fn verify_replicated(step: u64, what: &str, checksums: &[u64]) -> CoreResult<()> {
    let Some(&first) = checksums.first() else {
        return Ok(());
    };
    if checksums.iter().all(|&c| c == first) {
        return Ok(());
    }
    let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
    for (rank, &c) in checksums.iter().enumerate() {
        match groups.iter_mut().find(|(v, _)| *v == c) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((c, vec![rank])),
        }
    }
    let sides: Vec<String> = groups.iter().map(|(c, r)| format!("ranks {r:?} checksum {c:016x}")).collect();
    let odd: Vec<usize> = groups.iter().skip(1).flat_map(|(_, r)| r.iter().copied()).collect();
    bail!(
        RankMismatch,
        "step {step}: the {what} ranks captured different hidden states ({}); ranks {odd:?} disagree with rank 0. \
         The residual stream must be identical on every tensor-parallel rank: a rank with different weights, a \
         non-deterministic all-reduce, or a residual sharded across ranks (sequence parallelism) causes this",
        sides.join("; ")
    );
}

#[cfg(test)]
#[path = "tests/checksums.rs"]
mod tests;
