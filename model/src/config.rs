//! Model configuration: the HF `config.json` as written ([`HfConfig`]) and the resolved runtime
//! [`ModelConfig`] with every default applied and every architecture switch made explicit.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{ModelError, Result};

/// Architectures this runtime implements, all of them Llama-family decoders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// Llama 1/2/3 (incl. Llama-3 rope scaling) and SmolLM / SmolLM2.
    Llama,
    /// Mistral: Llama with an optional sliding window.
    Mistral,
    /// Qwen2 / Qwen2.5: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm over each head of q and k before rotary embedding.
    Qwen3,
}

const SUPPORTED: &str = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM";

impl Architecture {
    /// The architecture HF calls `name`, in the config at `path`.
    fn from_hf_name(name: &str, path: &Path) -> Result<Self> {
        match name {
            "LlamaForCausalLM" => Ok(Self::Llama),
            "MistralForCausalLM" => Ok(Self::Mistral),
            "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                name: other.to_string(),
                supported: SUPPORTED.to_string(),
            }),
        }
    }
}

/// A token id or a list of them (HF allows both for `eos_token_id`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(i64),
    Many(Vec<i64>),
}

impl TokenIds {
    fn to_vec(&self) -> Vec<i64> {
        match self {
            Self::One(id) => vec![*id],
            Self::Many(ids) => ids.clone(),
        }
    }
}

/// `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5, which also moves
/// `rope_theta` in here); only the Llama-3 kind changes the frequencies.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfRopeScaling {
    #[serde(alias = "type", default = "default_rope_type")]
    pub rope_type: String,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
}

fn default_rope_type() -> String {
    "default".to_string()
}

/// `config.json` exactly as HF writes it: optional fields stay optional, unknown fields are ignored
/// (HF configs carry many keys irrelevant to inference).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub num_hidden_layers: usize,
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<HfRopeScaling>,
    pub rope_parameters: Option<HfRopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub bos_token_id: Option<TokenIds>,
    pub eos_token_id: Option<TokenIds>,
    pub sliding_window: Option<usize>,
    pub torch_dtype: Option<String>,
}

/// Llama-3 frequency-dependent rotary scaling ("llama3" `rope_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// The resolved configuration the runtime uses: no options left, architecture switches explicit.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_hidden_layers: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest sequence the model may attend over (Mistral's sliding window caps it, since
    /// attending past the window would silently change the model).
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// Qwen2 puts a bias on q, k and v.
    pub qkv_bias: bool,
    /// Qwen3 normalises each head of q and k.
    pub qk_norm: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_ids: Vec<i64>,
}

impl HfConfig {
    /// Reads `config.json` from `path`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Applies HF's defaults and validates the sizes; `path` only labels errors.
    pub fn resolve(&self, path: &Path) -> Result<ModelConfig> {
        let bad = |message: String| ModelError::Config {
            path: path.to_path_buf(),
            message,
        };
        let arch_name = self.architectures.first().ok_or_else(|| {
            bad("no `architectures` entry: cannot tell which model this is".into())
        })?;
        let architecture = Architecture::from_hf_name(arch_name, path)?;
        let num_key_value_heads = self.num_key_value_heads.unwrap_or(self.num_attention_heads);
        if self.num_attention_heads == 0 || num_key_value_heads == 0 {
            return Err(bad(
                "num_attention_heads and num_key_value_heads must be > 0".into(),
            ));
        }
        if !self.num_attention_heads.is_multiple_of(num_key_value_heads) {
            return Err(bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, num_key_value_heads
            )));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if self.hidden_size.is_multiple_of(self.num_attention_heads) => {
                self.hidden_size / self.num_attention_heads
            }
            None => {
                return Err(bad(format!(
                    "hidden_size {} is not divisible by num_attention_heads {}",
                    self.hidden_size, self.num_attention_heads
                )))
            }
        };
        if !head_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "head_dim {head_dim} must be even for rotary embeddings"
            )));
        }
        let max_position_embeddings = match (architecture, self.sliding_window) {
            (Architecture::Mistral, Some(window)) => window.min(self.max_position_embeddings),
            _ => self.max_position_embeddings,
        };
        Ok(ModelConfig {
            architecture,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads,
            head_dim,
            num_hidden_layers: self.num_hidden_layers,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self
                .rope_theta
                .or(self.rope_parameters.as_ref().and_then(|p| p.rope_theta))
                .unwrap_or(10_000.0),
            rope_scaling: self.llama3_rope_scaling(path)?,
            max_position_embeddings,
            vocab_size: self.vocab_size,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2 || self.attention_bias.unwrap_or(false),
            qk_norm: architecture == Architecture::Qwen3,
            bos_token_id: self
                .bos_token_id
                .as_ref()
                .and_then(|ids| ids.to_vec().first().copied()),
            eos_token_ids: self
                .eos_token_id
                .as_ref()
                .map(TokenIds::to_vec)
                .unwrap_or_default(),
        })
    }

    fn llama3_rope_scaling(&self, path: &Path) -> Result<Option<Llama3RopeScaling>> {
        let Some(scaling) = self.rope_scaling.as_ref().or(self.rope_parameters.as_ref()) else {
            return Ok(None);
        };
        let missing = |field: &str| ModelError::Config {
            path: path.to_path_buf(),
            message: format!("rope_scaling of type llama3 lacks `{field}`"),
        };
        match scaling.rope_type.as_str() {
            "default" => Ok(None),
            "llama3" => Ok(Some(Llama3RopeScaling {
                factor: scaling.factor.ok_or_else(|| missing("factor"))?,
                low_freq_factor: scaling
                    .low_freq_factor
                    .ok_or_else(|| missing("low_freq_factor"))?,
                high_freq_factor: scaling
                    .high_freq_factor
                    .ok_or_else(|| missing("high_freq_factor"))?,
                original_max_position_embeddings: scaling
                    .original_max_position_embeddings
                    .ok_or_else(|| missing("original_max_position_embeddings"))?,
            })),
            other => Err(ModelError::Config {
                path: path.to_path_buf(),
                message: format!("rope_scaling type {other:?} is not supported (default, llama3)"),
            }),
        }
    }
}

impl ModelConfig {
    /// Reads and resolves `config.json` in the model directory `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        HfConfig::from_file(&path)?.resolve(&path)
    }

    /// Rows of the fused q/k/v projection: query heads, then key heads, then value heads.
    pub fn qkv_rows(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }
}
