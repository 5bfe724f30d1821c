//! Samples into an object store instead of files (speculators' online training through Mooncake): each finished
//! request's sample becomes one packed object (`packed.rs`) under its request's key. The store's client is the
//! store's own (an [`ObjectStore`]: Mooncake's Python client through the binding, `py/store.rs`); this side
//! decides the object, its key and what a failure leaves behind.
//!
//! A put is whole or absent (Mooncake makes an object visible only once it is complete). A put that fails leaves
//! an error marker under `<key>:error`, which the trainer's reader checks first and raises: the trainer is never
//! left waiting on a manifest whose object will not come. It fails that request alone (`sinks/failed.rs`); the
//! server serves the others on.

use std::sync::Arc;

use crate::output::ledger::record::{file_checksum, SampleRecord};
use crate::output::sinks::packed::{encode, error_key, key_of};
use crate::output::sinks::sink::{NotStored, Sink};
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

    /// Leaves `error` under `key`'s marker. With the marker stored, the trainer learns of it there: the request
    /// fails alone. A store that takes no marker either is unreachable: the capture fails (the engine stops, its
    /// clients get errors) rather than announce objects whose reads would time out one by one.
    fn fail(&self, key: &str, error: crate::CoreError) -> NotStored {
        let text: String = error.message.chars().take(MARKER_TEXT).collect();
        let marker = serde_json::json!({ "error": text }).to_string();
        match self.store.put(&error_key(key), marker.as_bytes()) {
            Ok(()) => NotStored::Request(core_err!(
                Output,
                "sample {key} was not stored: {}; the trainer finds this error under {}",
                error.message,
                error_key(key)
            )),
            Err(e) => NotStored::Capture(core_err!(
                Output,
                "sample {key} was not stored: {}; its error marker could not be stored either ({}): the store is \
                 unreachable, so the capture stops rather than announce objects that will not come",
                error.message,
                e.message
            )),
        }
    }
}

impl Sink for StoreSink {
    fn put(&self, sample: &Sample) -> Result<SampleRecord, NotStored> {
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
