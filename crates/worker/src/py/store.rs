//! An object store's client as the core's [`ObjectStore`]: a Python object (`hscapture.mooncake.Store`, over
//! Mooncake's own client) whose `put(key, address, size)` stores `size` bytes read from `address` and raises on
//! failure. Called from the writer's threads, holding the GIL only for the call.

use pyo3::prelude::*;

use crate::output::sinks::store::ObjectStore;
use crate::{core_err, error::CoreResult};

pub struct PyStore(Py<PyAny>);

impl PyStore {
    pub fn new(client: Py<PyAny>) -> PyStore {
        PyStore(client)
    }
}

impl ObjectStore for PyStore {
    fn put(&self, key: &str, bytes: &[u8]) -> CoreResult<()> {
        // The client reads `bytes` through its address during the call only (it copies them into the store
        // before returning), and `bytes` outlives the call.
        let (address, size) = (bytes.as_ptr() as usize, bytes.len());
        // Not `attach`: during interpreter shutdown a thread that takes the GIL is stopped inside these frames.
        Python::try_attach(|py| {
            self.0.call_method1(py, "put", (key, address, size)).map(|_| ()).map_err(|e| {
                let text = e.value(py).str().map(|s| s.to_string()).unwrap_or_else(|_| e.to_string());
                core_err!(Output, "{text}")
            })
        })
        .unwrap_or_else(|| Err(core_err!(Output, "{key} was not stored: the Python interpreter is shutting down")))
    }
}
