//! The error type of the model crate: every variant names the file, tensor or field at fault.

use std::path::PathBuf;

/// Errors from loading, converting or running a target model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The I/O error is part of the message, not a source: a chain printed with `{:#}` would
    /// otherwise say it twice.
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("config {path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: unsupported architecture {name:?}: supported are {supported}")]
    UnsupportedArchitecture {
        path: PathBuf,
        name: String,
        supported: String,
    },
    #[error("safetensors {path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error(
        "weight {name} in {path} has shape {found:?}; the model's config asks for {expected:?}"
    )]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    #[error("weight {name} is missing from {path}")]
    MissingWeight { name: String, path: PathBuf },
    #[error("GGUF {path}: {message}")]
    Gguf { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("invalid input: {0}")]
    Input(String),
    /// A request parameter out of its range (sampling settings, token budgets).
    #[error("invalid {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    /// An [`ModelError::Io`] for `path`; use with `map_err(|e| ModelError::io(path, e))`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            error: source,
        }
    }
}
