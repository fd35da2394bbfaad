//! `manifest.json`: what a feature directory holds, how it was made, and the checksum of every
//! shard. It is rewritten (atomically) after each shard, so an interrupted `prepare` leaves a
//! manifest with `complete: false` listing exactly the shards that were finished.

use std::path::{Path, PathBuf};

use headway_model::files::write_bytes_atomically;
use serde::{Deserialize, Serialize};

use crate::corpus::ReadReport;
use crate::error::{DatasetError, Result};

/// Version tag of the feature layout (manifest and shards).
pub const FEATURES_FORMAT: &str = "headway-features/1";
pub const MANIFEST_FILE: &str = "manifest.json";

/// Storage dtype of hidden states in the shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum FeatureDtype {
    F32,
    Bf16,
    F16,
}

impl FeatureDtype {
    pub fn kind(self) -> tch::Kind {
        match self {
            Self::F32 => tch::Kind::Float,
            Self::Bf16 => tch::Kind::BFloat16,
            Self::F16 => tch::Kind::Half,
        }
    }

    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
}

/// The target the features came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetInfo {
    /// Where it was loaded from (informational: a moved target keeps its fingerprint).
    pub dir: String,
    /// [`headway_model::fingerprint::target_fingerprint`]: config and weights.
    pub fingerprint: String,
    pub architecture: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    /// SHA-256 of tokenizer.json and of the chat template source: ids and masks depend on them.
    pub tokenizer_sha256: String,
    pub chat_template_sha256: String,
    pub end_of_turn: String,
}

/// The corpus file the sequences came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorpusInfo {
    pub path: String,
    pub format: String,
    pub bytes: u64,
    pub sha256: String,
}

/// Self-distillation settings (`--regenerate`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RegenerateSettings {
    /// 0: greedy.
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: usize,
    /// Cap on each regenerated reply (the sequence's `max_len` caps it too).
    pub max_new_tokens: usize,
    pub seed: u64,
    /// Conversations generated together (their replies differ from one-at-a-time generation in
    /// the last bits of floating point, so the batch is part of what decides the data).
    #[serde(default = "one")]
    pub batch: usize,
    /// Keep only the first N assistant turns (regenerated) and what precedes each; `None`: all.
    #[serde(default)]
    pub max_turns: Option<usize>,
}

fn one() -> usize {
    1
}

/// Everything that decides the shards' bytes. A run resumes only into a directory whose
/// settings are equal (the target's `dir` aside).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub target: TargetInfo,
    pub corpus: CorpusInfo,
    pub max_seqs: Option<usize>,
    pub max_len: usize,
    pub held_out_fraction: f64,
    pub regenerate: Option<RegenerateSettings>,
    /// Extra residual-stream taps (layer indices, HF `hidden_states[k]`), stored as `tap_<k>`.
    pub taps: Vec<usize>,
    pub dtype: FeatureDtype,
    /// A shard is closed once it holds at least this many tokens.
    pub shard_tokens: usize,
    /// Padded tokens per forward (length-bucketed batches).
    pub batch_tokens: usize,
    /// `cpu` or `cuda`: kernels differ in the last bits, and shards must not mix them.
    pub device_type: String,
}

impl Settings {
    /// The fields where `self` (the directory's) and `other` (this run's) differ, as
    /// `path: old in the directory, new now` (ignoring `target.dir`).
    pub fn differences(&self, other: &Settings) -> Vec<String> {
        let mut a = serde_json::to_value(self).expect("settings serialise");
        let mut b = serde_json::to_value(other).expect("settings serialise");
        a["target"]["dir"] = serde_json::Value::Null;
        b["target"]["dir"] = serde_json::Value::Null;
        let mut out = Vec::new();
        json_differences(&a, &b, "", &mut out);
        out
    }
}

fn json_differences(
    a: &serde_json::Value,
    b: &serde_json::Value,
    path: &str,
    out: &mut Vec<String>,
) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            for (key, value) in x {
                let child = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                json_differences(
                    value,
                    y.get(key).unwrap_or(&serde_json::Value::Null),
                    &child,
                    out,
                );
            }
        }
        _ if a != b => out.push(format!("{path}: {a} in the directory, {b} now")),
        _ => {}
    }
}

/// Which side of the train / held-out split a shard holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardSplit {
    Train,
    HeldOut,
}

impl ShardSplit {
    pub fn name(self) -> &'static str {
        match self {
            Self::Train => "train",
            Self::HeldOut => "held_out",
        }
    }
}

/// One finished shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    /// File name inside the feature directory.
    pub file: String,
    pub split: ShardSplit,
    pub sequences: usize,
    pub tokens: usize,
    pub assistant_tokens: usize,
    pub bytes: u64,
    /// `sha256:<hex>` of the file.
    pub sha256: String,
}

/// Totals over the planned sequences (all shards, finished or not).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Counts {
    pub corpus: ReadReport,
    pub duplicates_dropped: usize,
    pub conversations_used: usize,
    /// Conversations the chat template or tokenizer could not format (skipped).
    pub format_errors: usize,
    /// Sequences with no assistant token left after truncation (skipped).
    pub no_assistant_tokens: usize,
    pub sequences: usize,
    pub train_sequences: usize,
    pub held_out_sequences: usize,
    pub tokens: usize,
    pub assistant_tokens: usize,
    /// Sequences cut to `max_len`.
    pub truncated: usize,
}

/// The whole manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// False while `prepare` runs or after it was interrupted.
    pub complete: bool,
    pub settings: Settings,
    pub counts: Counts,
    pub planned_shards: usize,
    /// Finished shards, in plan order (train shards first).
    pub shards: Vec<ShardEntry>,
    /// The command line that made the directory.
    pub command: Vec<String>,
}

impl Manifest {
    /// Reads `dir/manifest.json`; `Ok(None)` when there is none.
    pub fn read(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(MANIFEST_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(DatasetError::io(&path, e)),
        };
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| {
            DatasetError::features(dir, format!("{MANIFEST_FILE} is not a valid manifest: {e}"))
        })?;
        if manifest.format != FEATURES_FORMAT {
            return Err(DatasetError::features(
                dir,
                format!(
                    "{MANIFEST_FILE} has format {:?}; this Headway reads {FEATURES_FORMAT:?}",
                    manifest.format
                ),
            ));
        }
        Ok(Some(manifest))
    }

    /// Writes `dir/manifest.json` atomically (pretty JSON, so it reads well and diffs).
    pub fn write(&self, dir: &Path) -> Result<()> {
        let mut text = serde_json::to_string_pretty(self).expect("the manifest serialises");
        text.push('\n');
        write_bytes_atomically(&dir.join(MANIFEST_FILE), text.as_bytes())?;
        Ok(())
    }

    /// Path of shard `entry` in `dir`.
    pub fn shard_path(dir: &Path, entry: &ShardEntry) -> PathBuf {
        dir.join(&entry.file)
    }

    /// Bytes of all finished shards.
    pub fn shard_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.bytes).sum()
    }
}
