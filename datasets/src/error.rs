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
    /// A feature directory whose manifest is missing, malformed or from another run.
    #[error("features {dir}: {message}")]
    Features { dir: PathBuf, message: String },
    /// A feature shard that is missing, corrupt or does not match its manifest entry.
    #[error("shard {path}: {message}")]
    Shard { path: PathBuf, message: String },
    /// Features (or a regeneration journal) made with another target than the one given.
    #[error(
        "features in {dir} were extracted from target {expected_fingerprint} ({expected_dir}), \
         but the target given is {found_fingerprint} ({found_dir}); prepare features with this \
         target or pass the one they came from"
    )]
    TargetMismatch {
        dir: PathBuf,
        expected_fingerprint: String,
        expected_dir: String,
        found_fingerprint: String,
        found_dir: String,
    },
    #[error(transparent)]
    Model(#[from] headway_model::ModelError),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
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

    pub(crate) fn features(dir: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Features {
            dir: dir.into(),
            message: message.into(),
        }
    }

    pub(crate) fn shard(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Shard {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Format {
            path: path.into(),
            message: message.into(),
        }
    }
}
