//! `manifest.json`: what a feature directory holds, how it was made, and the checksum of every
//! shard. It is rewritten (atomically) after each shard, so an interrupted `prepare` leaves a
//! manifest with `complete: false` listing exactly the shards that were finished.

use std::path::{Path, PathBuf};

use headway_model::files::write_bytes_atomically;
use headway_model::fingerprint::bytes_sha256;
use headway_model::json::from_str_strict;
use headway_model::{Dtype, SamplingParams};
use serde::{Deserialize, Serialize};

use crate::corpus::ReadReport;
use crate::error::{DatasetError, Result};

/// Version tag of the feature layout (manifest and shards).
pub const FEATURES_FORMAT: &str = "headway-features/1";
pub const MANIFEST_FILE: &str = "manifest.json";

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

/// An input file the sequences came from: the corpus, or a journal of replies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CorpusInfo {
    pub path: String,
    pub format: String,
    pub bytes: u64,
    pub sha256: String,
}

/// Self-distillation (`prepare --regenerate`): every assistant turn replaced by the target's own
/// reply. The command line spells the sampling options `--regen-temperature`, `--regen-top-k`,
/// `--regen-top-p`, `--regen-min-p` and `--seed`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct RegenerateSettings {
    /// How replies are sampled (temperature 0: greedy); each conversation draws from its own seed,
    /// mixed from this one and the conversation.
    #[serde(flatten)]
    #[arg(skip)]
    pub sampling: SamplingParams,
    /// Longest regenerated reply, in tokens (the sequence's --max-len caps it too).
    #[arg(long = "regen-max-new-tokens", default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Conversations regenerated together, in one batched generation; their replies differ from
    /// one-at-a-time generation in the last bits of floating point, so this is part of what
    /// decides the data (rates measured on the CPU are in docs/benchmarks.md).
    #[serde(default = "one")]
    #[arg(long = "regen-batch", default_value_t = 64)]
    pub batch: usize,
    /// Regenerate only the first N assistant turns of each conversation (and what precedes
    /// each) and drop the rest; absent: all.
    #[serde(default)]
    #[arg(long = "regen-turns")]
    pub max_turns: Option<usize>,
}

fn one() -> usize {
    1
}

/// What `prepare` is asked to do with a corpus on a target: every choice here decides the
/// shards' bytes. Declared once: these are the command-line options (`headway-train prepare`),
/// what the library runs, and what the manifest records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
pub struct ExtractionSettings {
    /// Use only the first N unique conversations of the corpus.
    #[arg(long)]
    pub max_seqs: Option<usize>,
    /// Truncate each conversation to its first L tokens.
    #[arg(long, default_value_t = 2048)]
    pub max_len: usize,
    /// Fraction of conversations held out for evaluation (chosen by a hash of their ids).
    #[arg(long = "held-out", default_value_t = 0.02)]
    pub held_out_fraction: f64,
    /// Self-distillation (the command line's `--regenerate` and `--regen-*` options).
    #[arg(skip)]
    pub regenerate: Option<RegenerateSettings>,
    /// Extra residual-stream taps to store besides the final hidden state: layer indices k
    /// (hidden state after k decoder layers, HF's `hidden_states[k]`), e.g. `--layers 2,15,27`
    /// for EAGLE-3-style fusion. Stored as `tap_<k>`.
    #[arg(long = "layers", value_delimiter = ',')]
    pub taps: Vec<usize>,
    /// Storage dtype of the stored hidden states.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: Dtype,
    /// Tokens per shard (a shard closes once it holds at least this many).
    #[arg(long, default_value_t = 65536)]
    pub shard_tokens: usize,
    /// Padded tokens per target forward (sequences are bucketed by length); the command line's
    /// `--batch-tokens`, whose default depends on the device.
    #[arg(skip)]
    pub batch_tokens: usize,
}

impl ExtractionSettings {
    /// What every run checks of these options for a target of `layers` layers; `taps_from`
    /// names where the taps came from in an error (`--layers`, or a default).
    pub(crate) fn check(&self, layers: usize, taps_from: &str) -> Result<()> {
        let invalid = |m: String| Err(DatasetError::Argument(m));
        if self.max_len == 0 || self.shard_tokens == 0 {
            return invalid("--max-len and --shard-tokens must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&self.held_out_fraction) {
            return invalid(format!(
                "held-out fraction {} is not in [0, 1]",
                self.held_out_fraction
            ));
        }
        let taps = &self.taps;
        if let Some((_, tap)) = taps
            .iter()
            .enumerate()
            .find(|&(i, t)| taps[..i].contains(t))
        {
            return invalid(format!(
                "--layers names tap {tap} twice; each layer is stored once (a head that reads a \
                 layer twice takes it twice with its own --taps)"
            ));
        }
        if let Some(&tap) = taps.iter().find(|&&t| t >= layers) {
            return invalid(format!(
                "{taps_from} {tap}: the target has {layers} layers, so taps run from 0 to {}",
                layers.saturating_sub(1)
            ));
        }
        Ok(())
    }
}

/// Everything that decides the shards' bytes. A run resumes only into a directory whose
/// settings are equal (the target's `dir` aside).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub target: TargetInfo,
    pub corpus: CorpusInfo,
    /// The regeneration journal whose replies replaced the corpus's (`--replies`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replies: Option<CorpusInfo>,
    #[serde(flatten)]
    pub extraction: ExtractionSettings,
    /// `cpu` or `cuda`: kernels differ in the last bits, and shards must not mix them.
    pub device_type: String,
}

impl Settings {
    /// The fields where `self` and `other` differ, as `path: A <labels.0>, B <labels.1>`
    /// (ignoring `target.dir`).
    pub fn differences(&self, other: &Settings, labels: (&str, &str)) -> Vec<String> {
        let mut a = serde_json::to_value(self).expect("settings serialise");
        let mut b = serde_json::to_value(other).expect("settings serialise");
        a["target"]["dir"] = serde_json::Value::Null;
        b["target"]["dir"] = serde_json::Value::Null;
        let mut out = Vec::new();
        json_differences(&a, &b, "", &mut out);
        out.into_iter()
            .map(|(path, a, b)| format!("{path}: {a} {}, {b} {}", labels.0, labels.1))
            .collect()
    }
}

/// `(path, a's value, b's value)` for each leaf where `a` and `b` differ.
fn json_differences(
    a: &serde_json::Value,
    b: &serde_json::Value,
    path: &str,
    out: &mut Vec<(String, serde_json::Value, serde_json::Value)>,
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
        _ if a != b => out.push((path.to_string(), a.clone(), b.clone())),
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

/// The key of the manifest's own checksum: SHA-256 of the rest of it as compact JSON (keys
/// sorted), so that a damaged manifest is refused instead of read with other settings or counts.
/// Manifests written before it have none and still load.
const CHECKSUM_KEY: &str = "sha256";

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
    /// Set when `prepare --shard I/N` made the directory: it holds only that slice's shards
    /// (`planned_shards` counts those; `counts` are the whole run's), and training refuses it
    /// until `merge-features` joins the N slices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slice: Option<ShardSlice>,
}

/// Slice `index` of `count` of a sharded `prepare` (`--shard I/N`): the planned shards whose
/// position in the whole run's plan is I modulo N. Every slice plans the whole run (corpus order,
/// dedup, split and shard boundaries), so the slices' shards are the single run's shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSlice {
    pub index: usize,
    pub count: usize,
}

impl ShardSlice {
    /// Whether the shard at `position` of the whole run's plan belongs to this slice.
    pub fn holds(self, position: usize) -> bool {
        position % self.count == self.index
    }
}

impl std::fmt::Display for ShardSlice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for ShardSlice {
    type Err = String;

    /// `I/N` with 0 ≤ I < N.
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        let parsed = text
            .split_once('/')
            .and_then(|(i, n)| Some((i.trim().parse().ok()?, n.trim().parse().ok()?)));
        match parsed {
            Some((index, count)) if index < count => Ok(Self { index, count }),
            _ => Err(format!(
                "expected I/N with 0 ≤ I < N (slice I of N, counted from 0), got {text:?}"
            )),
        }
    }
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
        let format = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("format").and_then(|f| f.as_str()).map(str::to_string));
        if format.as_deref().is_some_and(|f| f != FEATURES_FORMAT) {
            return Err(DatasetError::features(
                dir,
                format!(
                    "{MANIFEST_FILE} has format {format:?}; this Headway reads {FEATURES_FORMAT:?}"
                ),
            ));
        }
        let invalid = |e: &dyn std::fmt::Display| {
            DatasetError::features(dir, format!("{MANIFEST_FILE} is not a valid manifest: {e}"))
        };
        let mut value: serde_json::Value = serde_json::from_str(&text).map_err(|e| invalid(&e))?;
        let recorded = value.as_object_mut().and_then(|o| o.remove(CHECKSUM_KEY));
        let body = value.to_string();
        if let Some(recorded) = recorded {
            let actual = bytes_sha256(body.as_bytes());
            if recorded.as_str() != Some(actual.as_str()) {
                return Err(DatasetError::features(
                    dir,
                    format!(
                        "{MANIFEST_FILE} is damaged: its contents hash to {actual}, its \
                         {CHECKSUM_KEY} says {recorded} (restore it, or rerun prepare into a new \
                         directory)"
                    ),
                ));
            }
        }
        let manifest: Manifest = from_str_strict(&body).map_err(|e| invalid(&e))?;
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
        let mut value = serde_json::to_value(self).expect("the manifest serialises");
        let checksum = bytes_sha256(value.to_string().as_bytes());
        value[CHECKSUM_KEY] = checksum.into();
        let mut text = serde_json::to_string_pretty(&value).expect("the manifest serialises");
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
