//! `config.json` from GGUF metadata: the GGUF architecture, the hyperparameters under llama.cpp's
//! key names, and Llama-3 rope scaling recovered from the `rope_freqs.weight` tensor.

use serde::Serialize;

use super::file::GgufFile;
use headway_model::Dtype;
use headway_model::{ModelError, Result};

/// GGUF architectures the converter maps onto an HF architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GgufArchitecture {
    Llama,
    Qwen2,
    Qwen3,
}

impl GgufArchitecture {
    const SUPPORTED: &'static str = "llama, qwen2, qwen3";

    /// Reads `general.architecture`.
    pub fn from_file(file: &GgufFile) -> Result<Self> {
        match file.string("general.architecture")? {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(ModelError::UnsupportedArchitecture {
                path: file.path().to_path_buf(),
                name: other.to_string(),
                supported: Self::SUPPORTED.to_string(),
            }),
        }
    }

    /// The prefix of the architecture's hyperparameter keys (`llama.block_count`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// llama.cpp's converter permutes the Q and K rows of llama-arch models only (its rotary
    /// kernel for them pairs adjacent dimensions); Qwen files keep HF's rotate-half layout.
    pub fn rotary_rows_permuted(self) -> bool {
        self == Self::Llama
    }

    /// Qwen3 normalises each head of q and k (`attn_q_norm`, `attn_k_norm`).
    pub fn has_qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// Qwen2 always has q/k/v biases; other architectures have them when the tensors exist.
    pub fn requires_qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    fn key(self, suffix: &str) -> String {
        format!("{}.{suffix}", self.gguf_name())
    }
}

/// The `config.json` written next to the weights, in HF `LlamaConfig` style.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ConfigJson {
    pub architectures: [&'static str; 1],
    pub model_type: &'static str,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub num_hidden_layers: usize,
    pub head_dim: usize,
    pub hidden_act: &'static str,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub torch_dtype: &'static str,
}

/// HF's `rope_scaling` of type `llama3`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(super) struct Llama3RopeScaling {
    pub rope_type: &'static str,
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

/// The tensor llama.cpp writes instead of rope-scaling metadata for Llama 3.1+: one frequency
/// divisor per rotary pair.
pub(super) const ROPE_FREQS_TENSOR: &str = "rope_freqs.weight";

/// rope base llama.cpp assumes when a file has no `rope.freq_base` (older Llama 1/2 files).
const DEFAULT_ROPE_THETA: f64 = 10_000.0;

pub(super) fn build(
    file: &mut GgufFile,
    arch: GgufArchitecture,
    dtype: Dtype,
) -> Result<ConfigJson> {
    let hidden_size = positive(file, &arch.key("embedding_length"))?;
    let num_attention_heads = positive(file, &arch.key("attention.head_count"))?;
    // llama.cpp's default: without a KV head count the model uses plain multi-head attention.
    let num_key_value_heads = match file.optional_usize(&arch.key("attention.head_count_kv"))? {
        Some(n) => n,
        None => num_attention_heads,
    };
    if num_key_value_heads == 0 || !num_attention_heads.is_multiple_of(num_key_value_heads) {
        return Err(file.error(format!(
            "{}: {num_key_value_heads} KV heads do not divide {num_attention_heads} attention heads",
            arch.key("attention.head_count_kv")
        )));
    }
    let head_dim = head_dim(file, arch, hidden_size, num_attention_heads)?;
    let rope_theta = file
        .optional_f64(&arch.key("rope.freq_base"))?
        .unwrap_or(DEFAULT_ROPE_THETA);
    reject_rope_scaling_metadata(file, arch)?;
    let rope_scaling = read_llama3_rope_scaling(file, rope_theta, head_dim)?;
    let vocab_size = match file.optional_usize(&arch.key("vocab_size"))? {
        Some(n) => n,
        None => file.strings("tokenizer.ggml.tokens")?.len(),
    };
    Ok(ConfigJson {
        architectures: [arch.hf_class()],
        model_type: arch.gguf_name(),
        hidden_size,
        intermediate_size: positive(file, &arch.key("feed_forward_length"))?,
        num_attention_heads,
        num_key_value_heads,
        num_hidden_layers: positive(file, &arch.key("block_count"))?,
        head_dim,
        hidden_act: "silu",
        rms_norm_eps: file.f64(&arch.key("attention.layer_norm_rms_epsilon"))?,
        rope_theta,
        rope_scaling,
        max_position_embeddings: positive(file, &arch.key("context_length"))?,
        vocab_size,
        tie_word_embeddings: !file.has_tensor("output.weight"),
        attention_bias: arch.requires_qkv_bias() || file.has_tensor("blk.0.attn_q.bias"),
        bos_token_id: file.optional_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_id: file.optional_u32("tokenizer.ggml.eos_token_id")?,
        pad_token_id: file.optional_u32("tokenizer.ggml.padding_token_id")?,
        torch_dtype: dtype.torch_name(),
    })
}

fn positive(file: &GgufFile, key: &str) -> Result<usize> {
    match file.usize(key)? {
        0 => Err(file.error(format!("metadata key {key} is 0"))),
        n => Ok(n),
    }
}

/// `attention.key_length` when present (Qwen3 decouples it from the hidden size), else the rotary
/// dimension count (llama files), else hidden size over heads.
fn head_dim(
    file: &GgufFile,
    arch: GgufArchitecture,
    hidden_size: usize,
    num_attention_heads: usize,
) -> Result<usize> {
    let explicit = match file.optional_usize(&arch.key("attention.key_length"))? {
        Some(n) => Some(n),
        None => file.optional_usize(&arch.key("rope.dimension_count"))?,
    };
    let head_dim = match explicit {
        Some(n) => n,
        None if hidden_size.is_multiple_of(num_attention_heads) => {
            hidden_size / num_attention_heads
        }
        None => {
            return Err(file.error(format!(
                "no head size in the metadata and embedding length {hidden_size} is not a \
                 multiple of {num_attention_heads} heads"
            )))
        }
    };
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(file.error(format!(
            "head size {head_dim} must be even and positive for rotary embeddings"
        )));
    }
    Ok(head_dim)
}

/// Linear, YaRN and other metadata-driven scalings have no runtime here; refusing them beats
/// writing a config that silently drops them.
fn reject_rope_scaling_metadata(file: &GgufFile, arch: GgufArchitecture) -> Result<()> {
    let key = arch.key("rope.scaling.type");
    match file.optional_string(&key)? {
        None | Some("none") => Ok(()),
        Some(other) => Err(file.error(format!(
            "{key} is {other:?}; only unscaled rope and Llama-3 scaling (rope_freqs.weight) are \
             supported"
        ))),
    }
}

fn read_llama3_rope_scaling(
    file: &mut GgufFile,
    rope_theta: f64,
    head_dim: usize,
) -> Result<Option<Llama3RopeScaling>> {
    if !file.has_tensor(ROPE_FREQS_TENSOR) {
        return Ok(None);
    }
    let divisors = file.read_dense(ROPE_FREQS_TENSOR)?.values;
    llama3_scaling_from_divisors(&divisors, rope_theta, head_dim)
        .map_err(|message| file.error(format!("{ROPE_FREQS_TENSOR}: {message}")))
}

/// Relative tolerance for telling plateau divisors (1 or `factor`) from interpolated ones; the
/// divisors are f32, so genuine interpolated values sit far above it.
const PLATEAU_TOLERANCE: f64 = 1e-4;

/// Largest relative error allowed between the stored divisors and those recomputed from the
/// recovered parameters; f32 storage alone gives ~1e-7.
const REFIT_TOLERANCE: f64 = 1e-3;

/// Recovers HF's `llama3` rope scaling from llama.cpp's per-frequency divisors.
///
/// HF divides frequency `i` by 1 above the high-frequency cutoff, by `factor` below the
/// low-frequency cutoff, and in between by `1 / ((1 - s) / factor + s)` with
/// `s = (L / wavelength - low) / (high - low)` (`L` = original context length). The divisors fix
/// `factor` and the two cutoff wavelengths `L / low` and `L / high`, not all three of `L`, `low`,
/// `high`: scaling them together changes nothing. So `low` is taken as 1 (every Llama 3.x config
/// uses 1) and `L` and `high` follow from a linear fit of `s` against `1 / wavelength` over the
/// interpolated frequencies. The result is checked by recomputing every divisor.
pub(super) fn llama3_scaling_from_divisors(
    divisors: &[f32],
    rope_theta: f64,
    head_dim: usize,
) -> std::result::Result<Option<Llama3RopeScaling>, String> {
    if divisors.len() != head_dim / 2 {
        return Err(format!(
            "has {} entries, expected head_dim / 2 = {}",
            divisors.len(),
            head_dim / 2
        ));
    }
    let divisors: Vec<f64> = divisors.iter().map(|&d| f64::from(d)).collect();
    let factor = divisors.iter().copied().fold(f64::MIN, f64::max);
    if !factor.is_finite() || factor < 1.0 {
        return Err(format!(
            "largest divisor {factor} is not a scaling factor >= 1"
        ));
    }
    if factor - 1.0 <= PLATEAU_TOLERANCE {
        return Ok(None);
    }
    let wavelengths = rotary_wavelengths(rope_theta, head_dim);
    let (high_freq_factor, original_context) = fit_cutoffs(&divisors, &wavelengths, factor)?;
    let scaling = Llama3RopeScaling {
        rope_type: "llama3",
        factor,
        low_freq_factor: 1.0,
        high_freq_factor,
        original_max_position_embeddings: original_context,
    };
    let worst = divisors
        .iter()
        .zip(&wavelengths)
        .map(|(&stored, &wavelength)| {
            (llama3_divisor(&scaling, wavelength) - stored).abs() / stored
        })
        .fold(0.0, f64::max);
    if worst > REFIT_TOLERANCE {
        return Err(format!(
            "divisors do not follow llama3 rope scaling (relative error {worst:.2e} after fitting)"
        ));
    }
    Ok(Some(scaling))
}

/// `(high_freq_factor, original_max_position_embeddings)` with `low_freq_factor` = 1, from the
/// interpolated divisors: their smoothing weight `s` is linear in `1 / wavelength`,
/// `s = L / (high - 1) * x - 1 / (high - 1)`.
fn fit_cutoffs(
    divisors: &[f64],
    wavelengths: &[f64],
    factor: f64,
) -> std::result::Result<(f64, usize), String> {
    let (xs, ys): (Vec<f64>, Vec<f64>) = divisors
        .iter()
        .zip(wavelengths)
        .filter(|&(&d, _)| d > 1.0 + PLATEAU_TOLERANCE && d < factor * (1.0 - PLATEAU_TOLERANCE))
        .map(|(&d, &wavelength)| {
            (
                1.0 / wavelength,
                (1.0 / d - 1.0 / factor) / (1.0 - 1.0 / factor),
            )
        })
        .unzip();
    let (slope, intercept) = fit_line(&xs, &ys).ok_or_else(|| {
        format!(
            "only {} interpolated frequencies; cannot recover the llama3 cutoffs",
            xs.len()
        )
    })?;
    let high_minus_one = -1.0 / intercept;
    let original_context = (slope * high_minus_one).round();
    if !(high_minus_one > 0.0 && original_context >= 1.0) {
        return Err(format!(
            "fitted cutoffs are not a llama3 profile (high_freq_factor {}, original context {})",
            high_minus_one + 1.0,
            original_context
        ));
    }
    // The fit is good to ~1e-6; four decimals recover the round numbers configs use (4, not
    // 4.0000019).
    let high_freq_factor = ((high_minus_one + 1.0) * 1e4).round() / 1e4;
    Ok((high_freq_factor, original_context as usize))
}

/// Wavelength of each rotary pair: `2π θ^(2i / head_dim)`.
fn rotary_wavelengths(rope_theta: f64, head_dim: usize) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| 2.0 * std::f64::consts::PI * rope_theta.powf(2.0 * i as f64 / head_dim as f64))
        .collect()
}

/// HF's `_compute_llama3_parameters`, as the divisor it applies to one frequency.
pub(super) fn llama3_divisor(scaling: &Llama3RopeScaling, wavelength: f64) -> f64 {
    let context = scaling.original_max_position_embeddings as f64;
    let low_freq_wavelength = context / scaling.low_freq_factor;
    let high_freq_wavelength = context / scaling.high_freq_factor;
    if wavelength < high_freq_wavelength {
        1.0
    } else if wavelength > low_freq_wavelength {
        scaling.factor
    } else {
        let smooth = (context / wavelength - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor);
        1.0 / ((1.0 - smooth) / scaling.factor + smooth)
    }
}

/// Least-squares line through `(xs, ys)`; `None` with fewer than two distinct x.
fn fit_line(xs: &[f64], ys: &[f64]) -> Option<(f64, f64)> {
    let n = xs.len() as f64;
    if xs.len() < 2 {
        return None;
    }
    let mean_x = xs.iter().sum::<f64>() / n;
    let mean_y = ys.iter().sum::<f64>() / n;
    let covariance: f64 = xs
        .iter()
        .zip(ys)
        .map(|(x, y)| (x - mean_x) * (y - mean_y))
        .sum();
    let variance: f64 = xs.iter().map(|x| (x - mean_x).powi(2)).sum();
    if variance <= 0.0 {
        return None;
    }
    let slope = covariance / variance;
    Some((slope, mean_y - slope * mean_x))
}
