//! Errors of the serving library.

use std::path::PathBuf;

use headway_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("invalid {field}: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
    #[error(transparent)]
    Head(#[from] headway_heads::HeadError),
    #[error(transparent)]
    Checkpoint(#[from] headway_checkpoints::CheckpointError),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}

pub type Result<T, E = ServeError> = std::result::Result<T, E>;

impl ServeError {
    pub fn file(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        Self::File {
            path: path.into(),
            message: message.to_string(),
        }
    }
}
