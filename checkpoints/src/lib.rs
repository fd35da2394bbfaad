//! Head checkpoints and training state on disk.
//!
//! A training run's output directory holds one directory per checkpoint, `step-NNNNNNNN/`, and a
//! `latest` file naming the newest complete one:
//!
//! ```text
//! OUT/latest                       "step-00001000"
//! OUT/step-00001000/config.json    head kind and sizes, target fingerprint, draft vocabulary, step
//! OUT/step-00001000/model.safetensors   the head's parameters (reference-repository names)
//! OUT/step-00001000/training/      optimizer moments + trainer state (only what --resume needs)
//! ```
//!
//! A checkpoint is written into a temporary directory and renamed into place, then `latest` is
//! replaced atomically, so a kill at any moment leaves `latest` pointing at a complete checkpoint.

pub mod head;
mod storage;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use headway_heads::MedusaConfig;
use headway_model::files::{remove_stale_temp_files, write_bytes_atomically};
use headway_model::fingerprint::{bytes_sha256, Kinship, TargetIdentity};
use headway_model::safetensors_io::{from_safetensors_bytes, to_safetensors_bytes};
use headway_model::ModelError;
use serde::{Deserialize, Serialize};
use tch::Tensor;

pub const CHECKPOINT_FORMAT: &str = "headway-head/1";
pub const LATEST_FILE: &str = "latest";
const CONFIG_FILE: &str = "config.json";
const WEIGHTS_FILE: &str = "model.safetensors";
const TRAINING_DIR: &str = "training";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// SHA-256 of each training-state file, by name (checkpoints written before it lack it).
const TRAINING_CHECKSUMS_FILE: &str = "checksums.json";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error(
        "checkpoint {path} was trained on target {expected}, but the target given is {found}; \
         use the target it was trained on"
    )]
    TargetMismatch {
        path: PathBuf,
        expected: String,
        found: String,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
}

pub use head::{load_head, DraftHead, LoadedHead};
pub use storage::WeightStorage;

pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;

fn invalid(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::Invalid {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Which head a checkpoint holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum HeadKind {
    Medusa(MedusaConfig),
    Eagle {
        /// Decoder layers of the head (checkpoints from before the option hold one).
        #[serde(default = "one_layer")]
        layers: usize,
        /// Target layers whose residual stream the head fuses into its input (none: EAGLE-1).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        taps: Vec<usize>,
        /// Factor on the token embedding before `fc` (EAGLE-1, and checkpoints from before the
        /// option: 1).
        #[serde(default = "unit_scale", skip_serializing_if = "is_unit_scale")]
        embed_scale: f64,
        /// Whether `fc` has a bias (checkpoints from before the option: yes).
        #[serde(default = "yes", skip_serializing_if = "is_yes")]
        fc_bias: bool,
    },
    /// An EAGLE-3 head fusing these target layers' residual streams (its draft vocabulary is the
    /// config's `draft_vocab`).
    Eagle3 {
        taps: Vec<usize>,
    },
}

fn one_layer() -> usize {
    1
}

fn yes() -> bool {
    true
}

fn is_yes(value: &bool) -> bool {
    *value
}

fn unit_scale() -> f64 {
    1.0
}

fn is_unit_scale(scale: &f64) -> bool {
    *scale == 1.0
}

impl HeadKind {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Medusa(_) => "medusa",
            Self::Eagle { .. } => "eagle",
            Self::Eagle3 { .. } => "eagle3",
        }
    }
}

/// The target a head was trained on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetRef {
    pub fingerprint: String,
    /// For a target directory converted from a GGUF, that file's fingerprint: the head then
    /// serves on the GGUF too ([`headway_model::fingerprint::TargetIdentity::kinship`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub converted_from: Option<String>,
    pub dir: String,
    pub hidden_size: usize,
    pub vocab_size: usize,
}

/// `config.json` of a checkpoint. Unknown keys are refused: a checkpoint from a newer format
/// must not be read as if it were this one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    pub format: String,
    pub head: HeadKind,
    pub target: TargetRef,
    /// Draft index → target id when the head drafts over a reduced vocabulary.
    pub draft_vocab: Option<Vec<u32>>,
    /// Optimizer updates the weights have seen.
    pub step: u64,
    /// SHA-256 of model.safetensors.
    pub weights_sha256: String,
    /// How model.safetensors stores the weights (absent: f32, as trained).
    #[serde(default, skip_serializing_if = "WeightStorage::is_f32")]
    pub weight_storage: WeightStorage,
}

/// What `--resume` needs besides the weights.
pub struct TrainingState {
    /// Optimizer tensors by name.
    pub optimizer: Vec<(String, Tensor)>,
    /// The trainer's own state (step, RNG, data position, settings), as JSON.
    pub trainer: serde_json::Value,
}

/// A checkpoint read back.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: CheckpointConfig,
    pub weights: BTreeMap<String, Tensor>,
}

/// Name of the checkpoint directory for `step`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

/// Removes what a [`save`] killed midway leaves in `out`: `.step-NNNNNNNN.<random>.tmp/`
/// directories, never published (the rename is what publishes a checkpoint), and the temporary
/// file of an unfinished `latest`. Returns how many. Training calls it before it writes into
/// `out`, so killed runs do not pile them up.
pub fn remove_unfinished_saves(out: &Path) -> Result<usize> {
    let entries = match std::fs::read_dir(out) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(ModelError::io(out, e).into()),
    };
    let mut removed = 0;
    for entry in entries {
        let path = entry.map_err(|e| ModelError::io(out, e))?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.is_some_and(|n| n.starts_with(".step-") && n.ends_with(".tmp")) && path.is_dir() {
            std::fs::remove_dir_all(&path).map_err(|e| ModelError::io(&path, e))?;
            removed += 1;
        }
    }
    Ok(removed + remove_stale_temp_files(out)?)
}

/// Writes a checkpoint of `weights` into `out/step-NNNNNNNN/` and points `out/latest` at it.
/// `config.weights_sha256` is filled in here. Returns the checkpoint's directory.
pub fn save(
    out: &Path,
    config: &CheckpointConfig,
    weights: &[(String, Tensor)],
    training: Option<&TrainingState>,
) -> Result<PathBuf> {
    std::fs::create_dir_all(out).map_err(|e| ModelError::io(out, e))?;
    let name = step_dir_name(config.step);
    let final_dir = out.join(&name);
    write_in_place_of(&final_dir, config, weights, training)?;
    write_bytes_atomically(&out.join(LATEST_FILE), name.as_bytes())?;
    Ok(final_dir)
}

/// Writes the checkpoint of `weights` as the directory `dir` itself (config.json and
/// model.safetensors, no training state), replacing what is there: a head to ship or serve.
pub fn save_as(dir: &Path, config: &CheckpointConfig, weights: &[(String, Tensor)]) -> Result<()> {
    if dir.exists() && !dir.join(CONFIG_FILE).exists() {
        return Err(invalid(
            dir,
            "exists and is not a checkpoint: give a new directory or a checkpoint to replace",
        ));
    }
    let parent = parent_of(dir);
    std::fs::create_dir_all(parent).map_err(|e| ModelError::io(parent, e))?;
    write_in_place_of(dir, config, weights, None)
}

/// Writes the checkpoint into a temporary directory beside `dir`, then renames it to `dir`
/// (replacing an older one), so a kill leaves either checkpoint whole.
fn write_in_place_of(
    dir: &Path,
    config: &CheckpointConfig,
    weights: &[(String, Tensor)],
    training: Option<&TrainingState>,
) -> Result<()> {
    let parent = parent_of(dir);
    let name = dir
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    let temp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempdir_in(parent)
        .map_err(|e| ModelError::io(parent, e))?;
    let stored = config.weight_storage.store(weights);
    let bytes = to_safetensors_bytes(&stored, None, &dir.join(WEIGHTS_FILE))?;
    let config = CheckpointConfig {
        weights_sha256: bytes_sha256(&bytes),
        ..config.clone()
    };
    write_file(&temp.path().join(WEIGHTS_FILE), &bytes)?;
    let json = serde_json::to_string_pretty(&config).expect("checkpoint config serialises") + "\n";
    write_file(&temp.path().join(CONFIG_FILE), json.as_bytes())?;
    if let Some(training) = training {
        let dir = temp.path().join(TRAINING_DIR);
        std::fs::create_dir(&dir).map_err(|e| ModelError::io(&dir, e))?;
        let bytes = to_safetensors_bytes(&training.optimizer, None, &dir.join(OPTIMIZER_FILE))?;
        write_file(&dir.join(OPTIMIZER_FILE), &bytes)?;
        let json = serde_json::to_string_pretty(&training.trainer).expect("JSON value serialises");
        write_file(&dir.join(TRAINER_STATE_FILE), json.as_bytes())?;
        let checksums = serde_json::json!({
            OPTIMIZER_FILE: bytes_sha256(&bytes),
            TRAINER_STATE_FILE: bytes_sha256(json.as_bytes()),
        });
        write_file(
            &dir.join(TRAINING_CHECKSUMS_FILE),
            checksums.to_string().as_bytes(),
        )?;
    }
    // The old checkpoint moves aside first and goes only once the new one holds its name.
    let replaced = parent.join(format!(".{name}.replaced.tmp"));
    if dir.exists() {
        std::fs::rename(dir, &replaced).map_err(|e| ModelError::io(dir, e))?;
    }
    let temp_path = temp.keep();
    std::fs::rename(&temp_path, dir).map_err(|e| ModelError::io(dir, e))?;
    if replaced.exists() {
        std::fs::remove_dir_all(&replaced).map_err(|e| ModelError::io(&replaced, e))?;
    }
    Ok(())
}

/// The directory holding `dir` (`.` for a bare name).
fn parent_of(dir: &Path) -> &Path {
    dir.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path).map_err(|e| ModelError::io(path, e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| ModelError::io(path, e))?;
    Ok(())
}

/// The checkpoint directory `path` stands for: itself when it holds a `config.json`, else the
/// one its `latest` file names.
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(CONFIG_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join(LATEST_FILE);
    let name = std::fs::read_to_string(&latest).map_err(|_| {
        invalid(path, format!("neither {CONFIG_FILE} nor {LATEST_FILE} found: not a checkpoint or training output directory"))
    })?;
    let dir = path.join(name.trim());
    if !dir.join(CONFIG_FILE).exists() {
        return Err(invalid(
            &dir,
            format!("{LATEST_FILE} names it but it has no {CONFIG_FILE}"),
        ));
    }
    Ok(dir)
}

/// Reads the checkpoint at `path` (a checkpoint or a training output directory), verifying the
/// weights' checksum.
pub fn load(path: &Path) -> Result<Checkpoint> {
    let dir = resolve(path)?;
    let config_path = dir.join(CONFIG_FILE);
    let text =
        std::fs::read_to_string(&config_path).map_err(|e| ModelError::io(&config_path, e))?;
    let format = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("format").and_then(|f| f.as_str()).map(str::to_string));
    if let Some(format) = format.filter(|f| f != CHECKPOINT_FORMAT) {
        return Err(invalid(
            &dir,
            format!("format {format:?}, this Headway reads {CHECKPOINT_FORMAT:?}"),
        ));
    }
    let config: CheckpointConfig = serde_json::from_str(&text).map_err(|e| {
        invalid(
            &dir,
            format!("{CONFIG_FILE} is not a head checkpoint config: {e}"),
        )
    })?;
    let weights_path = dir.join(WEIGHTS_FILE);
    let bytes = std::fs::read(&weights_path).map_err(|e| ModelError::io(&weights_path, e))?;
    let sha256 = bytes_sha256(&bytes);
    if sha256 != config.weights_sha256 {
        return Err(invalid(
            &dir,
            format!(
                "{WEIGHTS_FILE} is corrupt: checksum {sha256}, config.json says {}",
                config.weights_sha256
            ),
        ));
    }
    let (stored, _) = from_safetensors_bytes(&bytes, &weights_path)?;
    let weights = config.weight_storage.load(stored, &weights_path)?;
    Ok(Checkpoint {
        dir,
        config,
        weights,
    })
}

/// Reads the training state saved with the checkpoint at `dir`, verifying its checksums where
/// the checkpoint has them.
pub fn load_training_state(dir: &Path) -> Result<(BTreeMap<String, Tensor>, serde_json::Value)> {
    let training = dir.join(TRAINING_DIR);
    let checksums = training_checksums(dir)?;
    let read = |name: &str| -> Result<Vec<u8>> {
        let path = training.join(name);
        let bytes = std::fs::read(&path).map_err(|e| ModelError::io(&path, e))?;
        let Some(checksums) = &checksums else {
            return Ok(bytes);
        };
        let listed = format!("{TRAINING_DIR}/{TRAINING_CHECKSUMS_FILE}");
        match checksums.get(name).and_then(|v| v.as_str()) {
            None => Err(invalid(dir, format!("{listed} has no checksum for {name}"))),
            Some(expected) if bytes_sha256(&bytes) != expected => Err(invalid(
                dir,
                format!("{TRAINING_DIR}/{name} is corrupt: its checksum is not {expected}"),
            )),
            Some(_) => Ok(bytes),
        }
    };
    let optimizer_path = training.join(OPTIMIZER_FILE);
    let (optimizer, _) = from_safetensors_bytes(&read(OPTIMIZER_FILE)?, &optimizer_path)?;
    let text = String::from_utf8(read(TRAINER_STATE_FILE)?)
        .map_err(|e| invalid(dir, format!("{TRAINER_STATE_FILE}: {e}")))?;
    let state = serde_json::from_str(&text)
        .map_err(|e| invalid(dir, format!("{TRAINER_STATE_FILE}: {e}")))?;
    Ok((optimizer.into_iter().collect(), state))
}

/// The training state's checksums file of the checkpoint at `dir`, if it has one.
fn training_checksums(dir: &Path) -> Result<Option<serde_json::Value>> {
    let path = dir.join(TRAINING_DIR).join(TRAINING_CHECKSUMS_FILE);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let checksums: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        invalid(
            dir,
            format!("{TRAINING_DIR}/{TRAINING_CHECKSUMS_FILE}: {e}"),
        )
    })?;
    Ok(Some(checksums))
}

impl TargetRef {
    /// The identity of the target the head was trained on.
    pub fn identity(&self) -> TargetIdentity {
        TargetIdentity {
            fingerprint: self.fingerprint.clone(),
            converted_from: self.converted_from.clone(),
        }
    }
}

impl Checkpoint {
    /// Checks that the head was trained on `target`, or on the same GGUF in another form (its
    /// conversion, or the file a converted target came from), and says which.
    pub fn check_target(&self, target: &TargetIdentity) -> Result<Kinship> {
        self.config
            .target
            .identity()
            .kinship(target)
            .ok_or_else(|| CheckpointError::TargetMismatch {
                path: self.dir.clone(),
                expected: self.config.target.fingerprint.clone(),
                found: target.fingerprint.clone(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn config(step: u64) -> CheckpointConfig {
        CheckpointConfig {
            format: CHECKPOINT_FORMAT.into(),
            head: HeadKind::Eagle {
                layers: 2,
                taps: vec![2, 15],
                embed_scale: 1.0,
                fc_bias: true,
            },
            target: TargetRef {
                fingerprint: "sha256:abc".into(),
                converted_from: Some("sha256:gguf".into()),
                dir: "/t".into(),
                hidden_size: 4,
                vocab_size: 10,
            },
            draft_vocab: Some(vec![3, 1]),
            step,
            weights_sha256: String::new(),
            weight_storage: WeightStorage::F32,
        }
    }

    #[test]
    fn saves_round_trip_and_latest_follows_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let w = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
        let training = TrainingState {
            optimizer: vec![("m.w".into(), w.ones_like())],
            trainer: serde_json::json!({"step": 5}),
        };
        save(
            dir.path(),
            &config(5),
            &[("w".into(), w.shallow_clone())],
            Some(&training),
        )
        .unwrap();
        save(dir.path(), &config(9), &[("w".into(), &w * 2.0)], None).unwrap();
        let latest = load(dir.path()).unwrap();
        assert_eq!(latest.config.step, 9);
        assert!(latest.weights["w"].equal(&(&w * 2.0)));
        let older = load(&dir.path().join("step-00000005")).unwrap();
        assert_eq!(older.config.draft_vocab, Some(vec![3, 1]));
        let (optimizer, state) = load_training_state(&older.dir).unwrap();
        assert!(optimizer["m.w"].equal(&w.ones_like()));
        assert_eq!(state["step"], 5);
        let served = |fingerprint: &str| TargetIdentity {
            fingerprint: fingerprint.into(),
            converted_from: None,
        };
        assert_eq!(
            older.check_target(&served("sha256:abc")).unwrap(),
            Kinship::Same
        );
        let on_the_gguf = older.check_target(&served("sha256:gguf")).unwrap();
        assert!(matches!(on_the_gguf, Kinship::SameSource(note) if note.contains("sha256:abc")));
        let err = older
            .check_target(&served("sha256:def"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("sha256:abc") && err.contains("sha256:def"),
            "{err}"
        );
    }

    #[test]
    fn unfinished_saves_are_removed_and_published_checkpoints_kept() {
        let out = tempfile::tempdir().unwrap();
        let w = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let kept = save(out.path(), &config(2), &[("w".into(), w)], None).unwrap();
        let unfinished = out.path().join(".step-00000004.Ab12Cd.tmp");
        std::fs::create_dir_all(unfinished.join(TRAINING_DIR)).unwrap();
        std::fs::write(unfinished.join(WEIGHTS_FILE), b"half").unwrap();
        std::fs::write(out.path().join(".latest.Xy34Zw.tmp"), b"step-").unwrap();
        assert_eq!(remove_unfinished_saves(out.path()).unwrap(), 2);
        assert!(!unfinished.exists());
        assert_eq!(load(out.path()).unwrap().dir, kept);
        assert_eq!(
            remove_unfinished_saves(&out.path().join("absent")).unwrap(),
            0
        );
    }

    /// Issue 23: seeded truncations and bit flips of each file of a checkpoint: loading it and
    /// its training state either succeeds or fails with an error naming the checkpoint, never
    /// panics; the weights and the training state carry checksums, so only a flip in the config
    /// can still load (one that leaves valid JSON of the right shape: a different step, say).
    #[test]
    fn corrupted_checkpoint_files_give_named_errors_never_panics() {
        use headway_model::testing::corruption_trial;
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let out = tempfile::tempdir().unwrap();
        let w = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
        let training = TrainingState {
            optimizer: vec![("m.w".into(), w.ones_like())],
            trainer: serde_json::json!({"step": 5, "rng": [1, 2, 3]}),
        };
        let dir = save(out.path(), &config(5), &[("w".into(), w)], Some(&training)).unwrap();
        let training_dir = Path::new(TRAINING_DIR);
        for file in [
            Path::new(CONFIG_FILE).to_path_buf(),
            Path::new(WEIGHTS_FILE).to_path_buf(),
            training_dir.join(OPTIMIZER_FILE),
            training_dir.join(TRAINER_STATE_FILE),
            training_dir.join(TRAINING_CHECKSUMS_FILE),
        ] {
            let path = dir.join(&file);
            let open = || {
                load(&dir)
                    .and_then(|c| load_training_state(&c.dir))
                    .map(|_| ())
            };
            let named = |message: &str| message.contains("step-00000005");
            let tally = corruption_trial(&path, usize::MAX, 200, &mut rng, open, named);
            eprintln!("{}: {tally:?}", file.display());
            if file != Path::new(CONFIG_FILE) {
                assert_eq!(
                    tally.opened,
                    0,
                    "{}: checksummed, never silently",
                    file.display()
                );
            }
        }
    }

    #[test]
    fn eagle_heads_saved_before_the_layers_taps_and_scale_options_read_as_eagle_1() {
        let old: HeadKind = serde_json::from_str(r#"{"kind": "eagle"}"#).unwrap();
        let one = HeadKind::Eagle {
            layers: 1,
            taps: vec![],
            embed_scale: 1.0,
            fc_bias: true,
        };
        assert_eq!(old, one);
        let two = HeadKind::Eagle {
            layers: 2,
            taps: vec![],
            embed_scale: 1.0,
            fc_bias: true,
        };
        let text = serde_json::to_string(&two).unwrap();
        assert_eq!(text, r#"{"kind":"eagle","layers":2}"#);
        let tapped = HeadKind::Eagle {
            layers: 1,
            taps: vec![2, 15],
            embed_scale: 13.5,
            fc_bias: true,
        };
        let text = serde_json::to_string(&tapped).unwrap();
        assert_eq!(
            text,
            r#"{"kind":"eagle","layers":1,"taps":[2,15],"embed_scale":13.5}"#
        );
        assert_eq!(serde_json::from_str::<HeadKind>(&text).unwrap(), tapped);
        let unbiased = HeadKind::Eagle {
            layers: 1,
            taps: vec![],
            embed_scale: 1.0,
            fc_bias: false,
        };
        let text = serde_json::to_string(&unbiased).unwrap();
        assert_eq!(text, r#"{"kind":"eagle","layers":1,"fc_bias":false}"#);
        assert_eq!(serde_json::from_str::<HeadKind>(&text).unwrap(), unbiased);
    }

    #[test]
    fn a_corrupt_checkpoint_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let w = Tensor::randn([8], (Kind::Float, Device::Cpu));
        let path = save(dir.path(), &config(1), &[("w".into(), w)], None).unwrap();
        let weights = path.join(WEIGHTS_FILE);
        let mut bytes = std::fs::read(&weights).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&weights, bytes).unwrap();
        let err = load(dir.path()).err().unwrap().to_string();
        assert!(
            err.contains("step-00000001") && err.contains("corrupt"),
            "{err}"
        );
        let err = load(&dir.path().join("nothing")).err().unwrap().to_string();
        assert!(err.contains("not a checkpoint"), "{err}");
    }

    /// A config written by a newer format is refused by name, not half read.
    #[test]
    fn unknown_keys_and_other_formats_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let w = Tensor::randn([8], (Kind::Float, Device::Cpu));
        let path = save(dir.path(), &config(1), &[("w".into(), w)], None).unwrap();
        let config_path = path.join(CONFIG_FILE);
        let original: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        let with = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut value = original.clone();
            edit(&mut value);
            std::fs::write(&config_path, value.to_string()).unwrap();
            load(dir.path()).err().map(|e| e.to_string())
        };
        let err = with(&|v| v["draft_depth"] = 3.into()).unwrap();
        assert!(err.contains("unknown field `draft_depth`"), "{err}");
        let err = with(&|v| v["head"]["rope"] = "new".into()).unwrap();
        assert!(err.contains("unknown field `rope`"), "{err}");
        let err = with(&|v| v["target"]["dtype"] = "bf16".into()).unwrap();
        assert!(err.contains("unknown field `dtype`"), "{err}");
        let err = with(&|v| v["format"] = "headway-head/2".into()).unwrap();
        assert!(
            err.contains("\"headway-head/2\", this Headway reads"),
            "{err}"
        );
        let medusa = HeadKind::Medusa(MedusaConfig {
            num_heads: 2,
            num_layers: 1,
            hidden_size: 4,
            vocab_size: 10,
            shared_lm_head: false,
        });
        let mut text = serde_json::to_value(&medusa).unwrap();
        assert!(serde_json::from_value::<HeadKind>(text.clone()).is_ok());
        text["decay"] = 0.5.into();
        let err = serde_json::from_value::<HeadKind>(text)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `decay`"), "{err}");
        assert!(with(&|_| {}).is_none());
    }
}
