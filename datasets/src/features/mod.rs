//! Cached target features: what `headway-train prepare` writes and the trainer reads.
//!
//! A feature directory holds `manifest.json` ([`manifest`]) and safetensors shards ([`shard`]) of
//! `train-NNNNN` and `held_out-NNNNN` sequences: token ids, loss mask, the target's final
//! post-norm hidden state and optional layer taps. [`prepare`] makes one (resumably), and
//! [`FeatureSet`] reads one back, verifying checksums and the target's fingerprint. [`specforge`]
//! makes one from the hidden states SpecForge's offline pipeline captured instead.

pub mod extract;
pub mod feature_set;
pub mod manifest;
pub mod merge;
pub mod prepare;
pub mod shard;
pub mod specforge;

pub use extract::{length_buckets, FeatureExtractor};
pub use feature_set::{FeatureSet, ShardProblem};
pub use manifest::{
    ExtractionSettings, Manifest, RegenerateSettings, ShardEntry, ShardSlice, ShardSplit,
};
pub use merge::{merge, MergeSummary};
pub use prepare::{
    prepare, target_info, ExtractionPlan, PrepareObserver, PrepareOptions, PrepareSummary, Quiet,
};
pub use shard::{SequenceFeatures, ShardData};
pub use specforge::{import_specforge, ImportOptions};
