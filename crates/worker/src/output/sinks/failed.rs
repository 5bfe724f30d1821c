//! Samples a server could not store, each failing only its own request: a per-request file that could not be
//! written (a full disk, its partial file removed under the writer, a lock file that could not be created) or an
//! object the store refused. Each client learns of its own (no file once the lock goes, or the store's error
//! marker); the server serves on, and a file that fits once the disk has room again is written. The operator reads
//! it in the worker's log: the first failure at its next step (or shutdown), then at most one line every
//! [`NOTE_EVERY`], with counts.

use std::time::{Duration, Instant};

use crate::error::CoreError;

/// The shortest time between two log lines about failed requests (a full disk fails every request of a busy server).
pub const NOTE_EVERY: Duration = Duration::from_secs(10);

/// Characters of a request id shown in a log line (ids are the client's, of any length).
const SHOWN_ID: usize = 80;

/// The requests whose samples could not be stored, as counts and the first error since the last log line.
#[derive(Debug, Default)]
pub struct FailedRequests {
    total: u64,
    unreported: u64,
    /// The first failure not yet reported: the request id as shown, and the error.
    first: Option<(String, String)>,
    last_note: Option<Instant>,
}

fn shown(req_id: &str) -> String {
    let mut s: String = req_id.chars().take(SHOWN_ID).flat_map(char::escape_debug).collect();
    if req_id.chars().nth(SHOWN_ID).is_some() {
        s.push('…');
    }
    s
}

/// An error's text as logged: bounded and on one line (a store's error names its key, made of the client's id).
fn bounded(message: &str) -> String {
    const SHOWN: usize = 600;
    let one_line = |c: char| if c.is_control() { c.escape_debug().collect() } else { c.to_string() };
    let mut s: String = message.chars().take(SHOWN).map(one_line).collect();
    if message.chars().nth(SHOWN).is_some() {
        s.push('…');
    }
    s
}

impl FailedRequests {
    pub fn record(&mut self, req_id: &str, e: &CoreError) {
        self.total += 1;
        self.unreported += 1;
        if self.first.is_none() {
            self.first = Some((shown(req_id), bounded(&e.message)));
        }
    }

    /// Requests failed so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The log line for the failures not yet reported: none when there are none, or when the last line is younger
    /// than [`NOTE_EVERY`] and `now` is not the last chance (`last`: the output is finishing).
    pub fn take_note(&mut self, now: Instant, last: bool) -> Option<String> {
        if self.unreported == 0 || (!last && self.last_note.is_some_and(|t| now.saturating_duration_since(t) < NOTE_EVERY)) {
            return None;
        }
        let (id, why) = self.first.take().unwrap_or_default();
        let n = std::mem::take(&mut self.unreported);
        self.last_note = Some(now);
        let more = if n > 1 { format!(" and {} more since the last report", n - 1) } else { String::new() };
        Some(format!(
            "request \"{id}\"'s sample{more} could not be stored ({} in all): {why}. Each such request fails alone (its \
             client finds no file, or the store's error marker); the server serves on",
            self.total
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core_err;

    #[test]
    fn the_first_failure_is_reported_at_once_and_later_ones_at_most_every_interval_with_counts() {
        let mut f = FailedRequests::default();
        let t0 = Instant::now();
        assert_eq!(f.take_note(t0, false), None, "nothing failed");
        f.record("cmpl-a", &core_err!(Output, "No space left on device (os error 28)"));
        let first = f.take_note(t0, false).unwrap();
        assert!(first.contains("\"cmpl-a\"") && first.contains("os error 28") && first.contains("(1 in all)"), "{first}");
        assert!(!first.contains("more"), "{first}");
        for i in 0..5 {
            f.record(&format!("cmpl-{i}"), &core_err!(Output, "disk full {i}"));
        }
        assert_eq!(f.take_note(t0 + Duration::from_secs(1), false), None, "one line per interval");
        let later = f.take_note(t0 + NOTE_EVERY, false).unwrap();
        assert!(later.contains("\"cmpl-0\"") && later.contains("4 more") && later.contains("(6 in all)"), "{later}");
        assert!(later.contains("disk full 0"), "the first since the last line: {later}");
        f.record("cmpl-x", &core_err!(Output, "again"));
        assert!(f.take_note(t0 + NOTE_EVERY, true).is_some(), "the last chance reports whatever is left");
        assert_eq!(f.total(), 7);
    }

    #[test]
    fn a_hostile_request_id_is_shown_bounded_and_escaped() {
        let mut f = FailedRequests::default();
        let id = format!("x\n{}", "y".repeat(10_000));
        f.record(&id, &core_err!(Output, "put of k{id} failed"));
        let note = f.take_note(Instant::now(), false).unwrap();
        assert!(note.len() < 1200 && !note.contains('\n') && note.contains("x\\ny"), "{note}");
    }
}
