//! The PyO3 module `hscapture._native`: thin wrappers over the core, split by domain.

use pyo3::prelude::*;

mod errors;
mod facts;
mod functions;
mod interpreter;
mod output;
mod ranks;
mod session;
mod stats;
mod step;
mod store;
mod tensor;

#[pymodule(gil_used = false)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    interpreter::install();
    errors::register(m)?;
    functions::register(m)?;
    facts::register(m)?;
    ranks::register(m)?;
    step::register(m)?;
    m.add_class::<session::CaptureSession>()?;
    m.add_class::<output::Output>()?;
    Ok(())
}
