//! Serving: plain generation, sampling and benchmarks (the speculative engine builds on these).

pub mod bench;
pub mod error;
pub mod generate;
pub mod sampling;

pub use error::{Result, ServeError};
