//! The exception tree, re-exported by the `hscapture` package:
//! `HscaptureError` ← `ConfigError`, `ShapeContractError` (← `NonFiniteError`, `DegenerateStatesError`), `AttributionError`,
//! `RankMismatchError`, `OutputError`, `CompatibilityError`, `PeerFailedError`, `EngineDiedError`.

use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::{create_exception, PyErr};

use crate::error::{Cause, CoreError, ErrorKind};

create_exception!(hscapture._native, HscaptureError, PyException, "Base class of every error hscapture raises.");
create_exception!(hscapture._native, ConfigError, HscaptureError, "Invalid configuration (layer ids, convention, output, options).");
create_exception!(hscapture._native, ShapeContractError, HscaptureError, "A captured tensor or sample breaks the shape contract.");
create_exception!(hscapture._native, NonFiniteError, ShapeContractError, "Captured hidden states contain NaN or Inf.");
create_exception!(
    hscapture._native,
    DegenerateStatesError,
    ShapeContractError,
    "A captured layer is all zeros, or one row for every token, over different tokens."
);
create_exception!(hscapture._native, AttributionError, HscaptureError, "Tokens cannot be attributed to requests consistently.");
create_exception!(
    hscapture._native,
    RankMismatchError,
    HscaptureError,
    "Tensor-parallel ranks captured different values for replicated states."
);
create_exception!(hscapture._native, OutputError, HscaptureError, "Writing or reading output files failed.");
create_exception!(
    hscapture._native,
    CompatibilityError,
    HscaptureError,
    "The running vLLM, model or machine lacks something hscapture needs."
);
create_exception!(hscapture._native, EngineDiedError, HscaptureError, "vLLM's engine process died while a run was waiting for it.");
create_exception!(
    hscapture._native,
    PeerFailedError,
    HscaptureError,
    "Another rank's capture failed, so this one stops too; that rank's own error is the cause."
);

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        let (m, cause) = (e.message, e.cause);
        let err = match e.kind {
            ErrorKind::Config => ConfigError::new_err(m),
            ErrorKind::ShapeContract => ShapeContractError::new_err(m),
            ErrorKind::NonFinite => NonFiniteError::new_err(m),
            ErrorKind::DegenerateStates => DegenerateStatesError::new_err(m),
            ErrorKind::Attribution => AttributionError::new_err(m),
            ErrorKind::RankMismatch => RankMismatchError::new_err(m),
            ErrorKind::Output => OutputError::new_err(m),
            ErrorKind::Compatibility => CompatibilityError::new_err(m),
        };
        if let Some(c) = cause {
            // What caused it outside the core, as Python's own exception: an OSError carries its errno.
            let cause = match c {
                Cause::Io { errno: Some(n), text, .. } => PyOSError::new_err((n, text)),
                Cause::Io { text, .. } => PyOSError::new_err(text),
                Cause::Library { name, text } => PyValueError::new_err(format!("{name}: {text}")),
            };
            Python::attach(|py| err.set_cause(py, Some(cause)));
        }
        err
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("HscaptureError", py.get_type::<HscaptureError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("ShapeContractError", py.get_type::<ShapeContractError>())?;
    m.add("NonFiniteError", py.get_type::<NonFiniteError>())?;
    m.add("DegenerateStatesError", py.get_type::<DegenerateStatesError>())?;
    m.add("AttributionError", py.get_type::<AttributionError>())?;
    m.add("RankMismatchError", py.get_type::<RankMismatchError>())?;
    m.add("OutputError", py.get_type::<OutputError>())?;
    m.add("CompatibilityError", py.get_type::<CompatibilityError>())?;
    m.add("PeerFailedError", py.get_type::<PeerFailedError>())?;
    m.add("EngineDiedError", py.get_type::<EngineDiedError>())?;
    Ok(())
}

/// Runs `f`, turning a Rust panic (a bug) into a typed `HscaptureError` instead of a `BaseException`
/// that vLLM's `except Exception` would miss.
pub fn guard<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(HscaptureError::new_err(format!(
                "internal error in {what}: {msg}; this is a bug in hscapture, please report it with the command that caused it"
            )))
        }
    }
}
