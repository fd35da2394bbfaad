//! Serving: the speculative decoding engine, its drafters and the benchmarks.
//!
//! [`engine`] runs draft → one tree-verification forward → acceptance → KV compaction;
//! [`drafters`] proposes the trees (EAGLE, Medusa, draft model, prompt lookup, none);
//! [`acceptance`] keeps the output exactly the target's, greedy or sampled; [`bench`] measures it
//! all on Spec-Bench.

pub mod acceptance;
pub mod autotune;
pub mod bench;
pub mod drafters;
pub mod engine;
pub mod error;
pub mod http;
pub mod methods;
pub mod plot;
pub mod tree;

pub use error::{Result, ServeError};
