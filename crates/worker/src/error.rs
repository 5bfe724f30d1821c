//! The one error type of the core. Every variant becomes a typed Python exception (see `py::errors`)
//! whose message names what was expected, what was found, and what to do.

use std::fmt;

/// Which kind of failure; each maps to one Python exception class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad configuration: layer ids, convention, output directory, options.
    Config,
    /// A captured tensor or an assembled sample breaks the shape contract.
    ShapeContract,
    /// Captured values that are NaN or infinite.
    NonFinite,
    /// A captured layer that is all zeros, or one row for every token, over different tokens.
    DegenerateStates,
    /// Token attribution is impossible or inconsistent (unknown request, gap in a prompt, wrong order).
    Attribution,
    /// Tensor-parallel ranks captured different values for what must be replicated.
    RankMismatch,
    /// Writing or reading output files failed.
    Output,
    /// The running vLLM, model or machine lacks something hscapture needs.
    Compatibility,
}

impl ErrorKind {
    pub const fn name(self) -> &'static str {
        match self {
            ErrorKind::Config => "ConfigError",
            ErrorKind::ShapeContract => "ShapeContractError",
            ErrorKind::NonFinite => "NonFiniteError",
            ErrorKind::DegenerateStates => "DegenerateStatesError",
            ErrorKind::Attribution => "AttributionError",
            ErrorKind::RankMismatch => "RankMismatchError",
            ErrorKind::Output => "OutputError",
            ErrorKind::Compatibility => "CompatibilityError",
        }
    }
}

/// What caused an error outside the core, kept with its kind: an I/O error's kind and OS error number, or another
/// library's error. Python sees it as the exception's `__cause__` (an `OSError` with its `errno` for I/O), so a
/// full disk is `ENOSPC` to a caller's code, not only words in a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cause {
    Io { kind: std::io::ErrorKind, errno: Option<i32>, text: String },
    Library { name: &'static str, text: String },
}

impl From<&std::io::Error> for Cause {
    fn from(e: &std::io::Error) -> Cause {
        Cause::Io { kind: e.kind(), errno: e.raw_os_error(), text: e.to_string() }
    }
}

impl From<&serde_json::Error> for Cause {
    fn from(e: &serde_json::Error) -> Cause {
        Cause::Library { name: "serde_json", text: e.to_string() }
    }
}

impl From<&safetensors::SafeTensorError> for Cause {
    fn from(e: &safetensors::SafeTensorError) -> Cause {
        Cause::Library { name: "safetensors", text: e.to_string() }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Cause::Io { text, .. } => f.write_str(text),
            Cause::Library { name, text } => write!(f, "{name}: {text}"),
        }
    }
}

impl std::error::Error for Cause {}

/// An error of the core: a kind, a complete, lowercase message, and what caused it outside the core, if anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreError {
    pub kind: ErrorKind,
    pub message: String,
    pub cause: Option<Cause>,
}

impl CoreError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        CoreError { kind, message: message.into(), cause: None }
    }

    /// The same error, keeping what caused it (`.caused_by(&io_error)`).
    pub fn caused_by(mut self, cause: impl Into<Cause>) -> Self {
        self.cause = Some(cause.into());
        self
    }
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind.name(), self.message)
    }
}

impl std::error::Error for CoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_ref().map(|c| c as &(dyn std::error::Error + 'static))
    }
}

pub type CoreResult<T> = Result<T, CoreError>;

/// Returns early with a [`CoreError`] of the given kind unless the condition holds.
///
/// `ensure!(rows == expected, ShapeContract, "layer {id}: expected {expected} rows, found {rows}")`
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $kind:ident, $($fmt:tt)+) => {
        if !($cond) {
            return Err($crate::error::CoreError::new($crate::error::ErrorKind::$kind, format!($($fmt)+)));
        }
    };
}

/// Returns early with a [`CoreError`] of the given kind.
#[macro_export]
macro_rules! bail {
    ($kind:ident, $($fmt:tt)+) => {
        return Err($crate::error::CoreError::new($crate::error::ErrorKind::$kind, format!($($fmt)+)))
    };
}

/// Builds a [`CoreError`] of the given kind (for `map_err` and `ok_or_else`).
#[macro_export]
macro_rules! core_err {
    ($kind:ident, $($fmt:tt)+) => {
        $crate::error::CoreError::new($crate::error::ErrorKind::$kind, format!($($fmt)+))
    };
}
