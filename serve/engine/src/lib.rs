//! The speculative decoding engine: draft a tree, verify it in one target forward, keep the
//! accepted path. No HTTP, plotting or command-line code lives here; `headway-serve`'s front ends
//! (the CLI, the Spec-Bench benchmark, the HTTP server) drive it.
//!
//! [`plan`] is what drafts, resolved once into one value ([`DraftPlan`]); [`drafters`] propose
//! the trees (EAGLE, Medusa, a draft model, prompt lookup, none); [`engine`] runs draft → one
//! tree-verification forward → acceptance → KV compaction; [`acceptance`] keeps the output exactly
//! the target's, greedy or sampled; [`tree`] is the draft tree as data; [`autotune`] picks the tree
//! size that this device runs fastest.

pub mod acceptance;
pub mod autotune;
pub mod drafters;
pub mod engine;
pub mod error;
pub mod plan;
pub mod tree;

pub use error::{EngineError, Result};
pub use plan::{DraftPlan, ModelDraft};
