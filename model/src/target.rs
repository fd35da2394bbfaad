//! A target model directory loaded as a whole: weights, tokenizer, chat template and stop tokens;
//! plus the command-line options every binary uses to pick one.

use std::path::{Path, PathBuf};

use tch::{Device, Kind};

use crate::chat::{ChatTemplate, Message};
use crate::config::ModelConfig;
use crate::cpu::CpuThreads;
use crate::dtype::Dtype;
use crate::kv_cache::KvCache;
use crate::llama::CausalLm;
use crate::row_kernel;
use crate::tokenizer::TextTokenizer;
use crate::weights::{SafetensorsWeights, WeightSource};
use crate::{ModelError, Result};

/// Name of the embedded default target's directory under [`headway_home`]`/models`.
pub const DEFAULT_TARGET_NAME: &str = "SmolLM2-135M-Instruct";

/// Headway's cache root: `$HEADWAY_HOME`, else `$HOME/.cache/headway`.
pub fn headway_home() -> PathBuf {
    if let Some(home) = std::env::var_os("HEADWAY_HOME") {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache").join("headway")
}

/// Where `make` converts the embedded SmolLM2-135M-Instruct GGUF to.
pub fn default_target_dir() -> PathBuf {
    headway_home().join("models").join(DEFAULT_TARGET_NAME)
}

/// The error for a target that is not there, naming what was looked for: a GGUF file (by its
/// extension) or a model directory, and how to make the embedded default.
pub fn missing_target(path: &Path) -> ModelError {
    let is_gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let what = if is_gguf {
        "no such GGUF file"
    } else {
        "no such target model directory"
    };
    let hint = if path == default_target_dir() {
        " (the embedded default: run `make model`)"
    } else {
        ""
    };
    ModelError::io(
        path,
        std::io::Error::new(std::io::ErrorKind::NotFound, format!("{what}{hint}")),
    )
}

/// Parses `cpu`, `cuda` or `cuda:N`; `cuda` when no GPU is usable is an error, not a silent CPU run.
pub fn parse_device(text: &str) -> Result<Device> {
    let device = match text {
        "cpu" => Device::Cpu,
        "cuda" => Device::Cuda(0),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Device::Cuda(n),
            _ => {
                return Err(ModelError::Input(format!(
                    "unknown device {other:?}: use cpu, cuda or cuda:N"
                )))
            }
        },
    };
    if let Device::Cuda(n) = device {
        let available = tch::Cuda::device_count() as usize;
        if n >= available {
            return Err(ModelError::Input(format!(
                "device {text} requested but {available} CUDA device(s) are usable"
            )));
        }
    }
    Ok(device)
}

/// Parses `--device`: one device ([`parse_device`]), or a comma-separated list of CUDA devices
/// (`cuda:0,cuda:1`) — or of `cpu` entries, the same code path on one machine — over which the
/// target's layers are spread ([`layer_placement`]).
pub fn parse_devices(text: &str) -> Result<Vec<Device>> {
    let devices = text
        .split(',')
        .map(|d| parse_device(d.trim()))
        .collect::<Result<Vec<_>>>()?;
    if devices.iter().any(|d| d.is_cuda() != devices[0].is_cuda()) {
        return Err(ModelError::Input(format!(
            "--device {text}: place layers over CUDA devices or over the CPU, not both"
        )));
    }
    Ok(devices)
}

/// The device of each of `layers` layers spread over `devices` in contiguous, near-equal runs
/// (as accelerate's balanced device maps place them); empty for one device (no placement).
pub fn layer_placement(devices: &[Device], layers: usize) -> Vec<Device> {
    if devices.len() <= 1 {
        return Vec::new();
    }
    (0..layers)
        .map(|i| devices[i * devices.len() / layers])
        .collect()
}

/// Options that choose and place the target model.
#[derive(Debug, Clone, clap::Args)]
pub struct TargetArgs {
    /// Target model: an HF-style directory with config.json, model.safetensors (or an index of
    /// shards), tokenizer.json and tokenizer_config.json, or a GGUF file (its Q4_0, Q4_1, Q5_0,
    /// Q8_0, Q4_K and Q6_K matrices run quantised on the CPU, other types dequantised). Default:
    /// the embedded SmolLM2-135M-Instruct under $HEADWAY_HOME/models (made by `make model`).
    #[arg(long, env = "HEADWAY_TARGET")]
    pub target: Option<PathBuf>,
    /// Where to run: cpu, cuda or cuda:N; or a list, cuda:0,cuda:1,…, to spread the layers over
    /// several GPUs (a target larger than one): embeddings, final norm and LM head stay on the
    /// first, hidden states move from device to device between layers.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight and activation dtype.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: Dtype,
    /// CPU threads for inference (0: one per core, libtorch's default).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Element type of the KV cache. Default: f16 where the target's matrices run quantised on
    /// the CPU (a GGUF: measured faster there, and llama.cpp's default), else the activations'.
    /// A 16-bit cache halves attention's bytes; keys and values are rounded once, as they are
    /// written, and speculative decoding stays identical to plain decoding with the same cache.
    #[arg(long, value_enum)]
    pub kv_dtype: Option<Dtype>,
}

impl TargetArgs {
    /// The target: `--target`, else the embedded default.
    pub fn path(&self) -> PathBuf {
        self.target.clone().unwrap_or_else(default_target_dir)
    }
}

/// What a target is made of besides its weights.
pub struct TargetParts {
    /// The model directory, or the GGUF file.
    pub path: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: TextTokenizer,
    pub chat_template: Option<ChatTemplate>,
}

impl TargetParts {
    /// The configuration, tokenizer and chat template of the HF directory `dir` (its weights
    /// are read by [`Target::load`]).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(missing_target(dir));
        }
        Ok(Self {
            path: dir.to_path_buf(),
            config: ModelConfig::from_dir(dir)?,
            tokenizer: TextTokenizer::from_file(&dir.join("tokenizer.json"))?,
            chat_template: ChatTemplate::from_dir(dir)?,
        })
    }
}

/// Everything needed to run a target: model, tokenizer, chat template, stop ids.
pub struct Target {
    /// The model directory, or the GGUF file.
    pub path: PathBuf,
    pub model: CausalLm,
    pub tokenizer: TextTokenizer,
    /// `None` for base models without a chat template.
    pub chat_template: Option<ChatTemplate>,
    /// Generation stops at any of these: the config's EOS ids plus the chat end-of-turn token.
    pub stop_ids: Vec<u32>,
    /// The kind activations and hidden-state features run in.
    pub kind: Kind,
    /// The kind [`Self::new_cache`] stores keys and values in: `kind` as loaded;
    /// [`Self::set_kv_dtype`] applies `--kv-dtype` and its default.
    pub kv_kind: Kind,
    /// The kind the dense weight matrices are stored in: `kind`, or bf16 under f32 activations
    /// (see [`activation_kind`]).
    pub weight_kind: Kind,
    pub device: Device,
    /// The CPU threads it runs on (shared with models that run beside it: a draft model).
    pub cpu: CpuThreads,
}

impl Target {
    /// Loads the HF directory `dir` with weights in `kind` on `device`, running CPU work on `cpu`;
    /// activations run in [`activation_kind`].
    pub fn load(dir: &Path, kind: Kind, device: Device, cpu: CpuThreads) -> Result<Self> {
        Self::load_placed(dir, kind, &[device], cpu)
    }

    /// [`Self::load`] with the layers spread over `devices` ([`layer_placement`]); the rest on
    /// the first.
    pub fn load_placed(
        dir: &Path,
        kind: Kind,
        devices: &[Device],
        cpu: CpuThreads,
    ) -> Result<Self> {
        let parts = TargetParts::from_dir(dir)?;
        let activations = activation_kind(kind, devices[0]);
        let mut weights =
            SafetensorsWeights::open(dir, activations, devices[0])?.with_matrix_kind(kind);
        let target = Self::from_parts_placed(parts, &mut weights, activations, devices, cpu)?;
        Ok(Self {
            weight_kind: kind,
            ..target
        })
    }

    /// A target from its parts and a source of its weights (how a GGUF file is loaded).
    pub fn from_parts(
        parts: TargetParts,
        weights: &mut dyn WeightSource,
        kind: Kind,
        device: Device,
        cpu: CpuThreads,
    ) -> Result<Self> {
        Self::from_parts_placed(parts, weights, kind, &[device], cpu)
    }

    /// [`Self::from_parts`] with the layers spread over `devices`; `weights` hands out tensors on
    /// the first, which holds everything but the layers.
    pub fn from_parts_placed(
        parts: TargetParts,
        weights: &mut dyn WeightSource,
        kind: Kind,
        devices: &[Device],
        cpu: CpuThreads,
    ) -> Result<Self> {
        let placement = layer_placement(devices, parts.config.num_hidden_layers);
        let model = tch::no_grad(|| CausalLm::load_placed(&parts.config, weights, &placement))?;
        let device = devices[0];
        let stop_ids = stop_ids(&parts.config, &parts.tokenizer);
        Ok(Self {
            path: parts.path,
            model,
            tokenizer: parts.tokenizer,
            chat_template: parts.chat_template,
            stop_ids,
            kind,
            kv_kind: kind,
            weight_kind: kind,
            device,
            cpu,
        })
    }

    /// Sets [`Self::kv_kind`] to `dtype`, or with `None` to the default `--kv-dtype` documents:
    /// f16 where the matrices run quantised on the CPU's row kernels, else the activations' kind.
    pub fn set_kv_dtype(&mut self, dtype: Option<Dtype>) {
        let quantised_cpu =
            self.device == Device::Cpu && self.model.runs_quantised() && row_kernel::available();
        self.kv_kind = match dtype {
            Some(dtype) => dtype.kind(),
            None if quantised_cpu => Kind::Half,
            None => self.kind,
        };
    }

    /// An empty KV cache for `batch` sequences of up to `capacity` positions, each layer's on
    /// that layer's device.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        let devices = self.model.model.layer_devices();
        KvCache::placed(self.model.config(), batch, capacity, self.kv_kind, &devices)
    }

    /// Prompt text for `messages` (chat template with the generation prompt), or an error naming
    /// the directory when the model has no template.
    pub fn chat_prompt(&self, messages: &[Message]) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            ModelError::Template(format!("{} has no chat_template", self.path.display()))
        })?;
        template.render(messages, true)
    }

    /// Token ids of [`Target::chat_prompt`] (the template writes the special tokens itself).
    pub fn chat_prompt_ids(&self, messages: &[Message]) -> Result<Vec<u32>> {
        self.tokenizer.encode(&self.chat_prompt(messages)?, false)
    }
}

/// The kind a target whose weight matrices are stored in `kind` computes in on `device`: on the
/// CPU, bf16 matrices run under f32 activations — the row kernel widens bf16 weights as it streams
/// them, so decoding reads half of f32's bytes while norms, rotary, attention and the cache stay in
/// Headway's f32 few-row code (libtorch's bf16 ops cost more per op there than f32's); elsewhere
/// (GPUs, f16) the weights' kind.
pub fn activation_kind(kind: Kind, device: Device) -> Kind {
    match (kind, device) {
        (Kind::BFloat16, Device::Cpu) => Kind::Float,
        _ => kind,
    }
}

/// EOS ids from the config plus the end-of-turn tokens of ChatML and Llama 3 when present in the
/// vocabulary (a chat model ends its turn with them even when the config names another EOS).
fn stop_ids(config: &ModelConfig, tokenizer: &TextTokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = config
        .eos_token_ids
        .iter()
        .filter_map(|&id| u32::try_from(id).ok())
        .collect();
    for end_of_turn in ["<|im_end|>", "<|eot_id|>"] {
        if let Some(id) = tokenizer.token_id(end_of_turn) {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_spread_in_contiguous_near_equal_runs() {
        let gpus: Vec<Device> = (0..4).map(Device::Cuda).collect();
        let placement = layer_placement(&gpus, 30);
        let count = |d: Device| placement.iter().filter(|&&p| p == d).count();
        assert_eq!(
            gpus.iter().map(|&d| count(d)).collect::<Vec<_>>(),
            [8, 7, 8, 7]
        );
        assert!(placement.windows(2).all(|w| w[0] == w[1]
            || w[1]
                == Device::Cuda(match w[0] {
                    Device::Cuda(i) => i + 1,
                    _ => unreachable!(),
                })));
        assert!(layer_placement(&[Device::Cpu], 30).is_empty());
        assert_eq!(
            parse_devices("cpu, cpu").unwrap(),
            [Device::Cpu, Device::Cpu]
        );
        assert!(parse_devices("cpu,gpu").is_err());
    }

    #[test]
    fn a_missing_target_is_named_as_a_file_or_a_directory() {
        let file = missing_target(Path::new("/nonexistent.gguf")).to_string();
        assert_eq!(file, "/nonexistent.gguf: no such GGUF file");
        let dir = missing_target(Path::new("/nonexistent")).to_string();
        assert_eq!(dir, "/nonexistent: no such target model directory");
        let default = missing_target(&default_target_dir()).to_string();
        assert!(
            default.ends_with("(the embedded default: run `make model`)"),
            "{default}"
        );
    }
}
