//! The error type of the datasets crate: every variant names the file and the line, record or
//! conversation at fault.

use std::path::PathBuf;

/// Errors from reading corpora and formatting conversations.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSONL line that is not valid JSON or not the expected shape (`line` counts from 1).
    #[error("{path}:{line}: {source}")]
    Line {
        path: PathBuf,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// A whole ShareGPT record that is not the expected shape (`record` counts from 0 in the
    /// array; `byte` is where it starts in the file).
    #[error("{path}: record {record} (byte {byte}): {message}")]
    Record {
        path: PathBuf,
        record: usize,
        byte: usize,
        message: String,
    },
    /// The file is not in the layout its format requires (e.g. a ShareGPT file that is not an
    /// array), or its format cannot be told from its name and first byte.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    /// A conversation the chat template or tokenizer cannot turn into a training sequence.
    #[error("conversation {id:?}: {message}")]
    Conversation { id: String, message: String },
    #[error("invalid argument: {0}")]
    Argument(String),
    #[error(transparent)]
    Model(#[from] headway_model::ModelError),
}

pub type Result<T, E = DatasetError> = std::result::Result<T, E>;

impl DatasetError {
    /// A [`DatasetError::Io`] for `path`; use with `map_err(|e| DatasetError::io(path, e))`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}
