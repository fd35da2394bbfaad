//! Errors of the engine.

use std::path::PathBuf;

use headway_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    /// A request or setting the engine cannot run (named by `field`).
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

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    /// Whether the request (its prompt, its settings) is at fault rather than the engine or its
    /// files: the HTTP server answers these with 400 instead of 500.
    pub fn is_invalid_request(&self) -> bool {
        matches!(
            self,
            Self::Invalid { .. } | Self::Model(ModelError::Invalid { .. } | ModelError::Input(_))
        )
    }

    pub fn file(path: impl Into<PathBuf>, message: impl std::fmt::Display) -> Self {
        Self::File {
            path: path.into(),
            message: message.to_string(),
        }
    }
}
