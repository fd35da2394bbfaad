//! Serving: benchmarks of decoding methods (the speculative engine builds on the target's plain
//! generation and sampling in `headway_model`).

pub mod bench;
pub mod error;

pub use error::{Result, ServeError};
