//! Samples into an object store instead of files (speculators' online training through Mooncake): each finished
//! request's sample becomes one packed object (`packed.rs`) under its request's key. The store's client is the
//! store's own (an [`ObjectStore`]: Mooncake's Python client through the binding, `py/store.rs`); this side
//! decides the object, its key and what a failure leaves behind.
//!
//! A put is whole or absent (Mooncake makes an object visible only once it is complete). A put that fails leaves
//! an error marker under `<key>:error`, which the trainer's reader checks first and raises, and fails the capture
//! (the engine stops, so later requests fail too): the trainer is never left waiting on a manifest whose object
//! will not come.

use std::sync::Arc;

use crate::output::ledger::record::{file_checksum, SampleRecord};
use crate::output::sinks::packed::{encode, error_key, key_of};
use crate::output::sinks::sink::Sink;
use crate::sample::Sample;
use crate::{core_err, error::CoreResult};

/// An object store's client.
pub trait ObjectStore: Send + Sync {
    /// Stores `bytes` under `key`, whole or not at all.
    fn put(&self, key: &str, bytes: &[u8]) -> CoreResult<()>;
}

/// Longest error text a marker carries (the reader's limit).
const MARKER_TEXT: usize = 4096;

pub struct StoreSink {
    store: Arc<dyn ObjectStore>,
}

impl StoreSink {
    pub fn new(store: Arc<dyn ObjectStore>) -> StoreSink {
        StoreSink { store }
    }

    /// Leaves `error` under `key`'s marker; says in the error whether the marker could be left too.
    fn fail(&self, key: &str, error: crate::CoreError) -> crate::CoreError {
        let text: String = error.message.chars().take(MARKER_TEXT).collect();
        let marker = serde_json::json!({ "error": text }).to_string();
        let left = match self.store.put(&error_key(key), marker.as_bytes()) {
            Ok(()) => format!("the trainer finds this error under {}", error_key(key)),
            Err(e) => format!("its error marker could not be stored either ({}); the trainer's read of {key} times out", e.message),
        };
        core_err!(Output, "sample {key} was not stored: {}; {left}", error.message)
    }
}

impl Sink for StoreSink {
    fn put(&self, sample: &Sample) -> CoreResult<SampleRecord> {
        let key = key_of(&sample.req_id);
        let object = encode(sample).and_then(|object| self.store.put(&key, &object).map(|()| object)).map_err(|e| self.fail(&key, e))?;
        Ok(SampleRecord {
            index: None,
            request_id: Some(sample.req_id.clone()),
            file: key,
            length: sample.rows,
            checksum: file_checksum(&object),
            bytes: object.len() as u64,
        })
    }
}

#[cfg(test)]
#[path = "tests/store.rs"]
mod tests;
