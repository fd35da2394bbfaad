//! Errors of the heads crate.

#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    #[error(transparent)]
    Model(#[from] headway_model::ModelError),
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
    /// Parameters or inputs that do not fit the head's configuration.
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T, E = HeadError> = std::result::Result<T, E>;
