//! GGUF tensors to HF safetensors: name mapping, shape checks against the config, dequantisation,
//! undoing llama.cpp's rotary row permutation, and conversion to the output dtype.

use std::borrow::Cow;
use std::collections::BTreeMap;

use headway_model::Dtype;
use safetensors::View;

use super::file::{ggml_type_name, GgufFile};
use super::hf_config::{ConfigJson, GgufArchitecture, ROPE_FREQS_TENSOR};
use headway_model::{ModelError, Result};

/// Where one GGUF tensor goes and what it must look like.
#[derive(Debug)]
pub(super) struct TensorPlan {
    pub gguf_name: String,
    pub hf_name: String,
    /// HF-order shape the metadata implies.
    pub shape: Vec<usize>,
    /// Set for Q and K projections of permuted (llama-arch) files: the head count to un-permute
    /// with (query heads for Q, KV heads for K).
    pub unpermute_heads: Option<usize>,
}

/// Maps every tensor of the file and checks names, shapes and types before anything is
/// dequantised, so a bad file fails fast.
pub(super) fn plan(
    file: &GgufFile,
    arch: GgufArchitecture,
    config: &ConfigJson,
) -> Result<Vec<TensorPlan>> {
    let mut plans = Vec::new();
    for gguf_name in file.tensor_names() {
        if gguf_name == ROPE_FREQS_TENSOR {
            // Consumed by the config (rope_scaling), not a weight.
            continue;
        }
        let plan = map_tensor(gguf_name, arch, config).ok_or_else(|| {
            file.error(format!(
                "tensor {gguf_name} has no HF counterpart in a {} model",
                arch.gguf_name()
            ))
        })?;
        let found = file.tensor_shape(gguf_name)?;
        if found != plan.shape {
            return Err(file.error(format!(
                "tensor {gguf_name} has shape {found:?}, but the metadata implies {:?}",
                plan.shape
            )));
        }
        file.supported_type(gguf_name)?;
        plans.push(plan);
    }
    check_required_present(file, arch, config)?;
    Ok(plans)
}

/// The HF name, expected HF-order shape and un-permutation of one GGUF tensor; `None` when the
/// architecture has no such tensor.
fn map_tensor(gguf_name: &str, arch: GgufArchitecture, c: &ConfigJson) -> Option<TensorPlan> {
    let plan = |hf_name: String, shape: Vec<usize>, unpermute_heads: Option<usize>| TensorPlan {
        gguf_name: gguf_name.to_string(),
        hf_name,
        shape,
        unpermute_heads,
    };
    match gguf_name {
        "token_embd.weight" => Some(plan(
            "model.embed_tokens.weight".into(),
            vec![c.vocab_size, c.hidden_size],
            None,
        )),
        "output_norm.weight" => Some(plan("model.norm.weight".into(), vec![c.hidden_size], None)),
        "output.weight" => Some(plan(
            "lm_head.weight".into(),
            vec![c.vocab_size, c.hidden_size],
            None,
        )),
        _ => {
            let rest = gguf_name.strip_prefix("blk.")?;
            let (layer_text, suffix) = rest.split_once('.')?;
            let layer: usize = layer_text.parse().ok()?;
            // Only canonical numbers, so `blk.01` and `blk.1` cannot both land on layer 1.
            if layer >= c.num_hidden_layers || layer.to_string() != layer_text {
                return None;
            }
            let (hf_suffix, shape, unpermute_heads) = map_layer_tensor(suffix, arch, c)?;
            Some(plan(
                format!("model.layers.{layer}.{hf_suffix}"),
                shape,
                unpermute_heads,
            ))
        }
    }
}

type LayerTarget = (&'static str, Vec<usize>, Option<usize>);

fn map_layer_tensor(suffix: &str, arch: GgufArchitecture, c: &ConfigJson) -> Option<LayerTarget> {
    let q_rows = c.num_attention_heads * c.head_dim;
    let kv_rows = c.num_key_value_heads * c.head_dim;
    let (hidden, ffn) = (c.hidden_size, c.intermediate_size);
    let permuted = |heads: usize| arch.rotary_rows_permuted().then_some(heads);
    let q_heads = permuted(c.num_attention_heads);
    let kv_heads = permuted(c.num_key_value_heads);
    let mapped = match suffix {
        "attn_norm.weight" => ("input_layernorm.weight", vec![hidden], None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![hidden], None),
        "attn_q.weight" => ("self_attn.q_proj.weight", vec![q_rows, hidden], q_heads),
        "attn_k.weight" => ("self_attn.k_proj.weight", vec![kv_rows, hidden], kv_heads),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![kv_rows, hidden], None),
        "attn_q.bias" => ("self_attn.q_proj.bias", vec![q_rows], q_heads),
        "attn_k.bias" => ("self_attn.k_proj.bias", vec![kv_rows], kv_heads),
        "attn_v.bias" => ("self_attn.v_proj.bias", vec![kv_rows], None),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![hidden, q_rows], None),
        "attn_q_norm.weight" if arch.has_qk_norm() => {
            ("self_attn.q_norm.weight", vec![c.head_dim], None)
        }
        "attn_k_norm.weight" if arch.has_qk_norm() => {
            ("self_attn.k_norm.weight", vec![c.head_dim], None)
        }
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![ffn, hidden], None),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![ffn, hidden], None),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![hidden, ffn], None),
        _ => return None,
    };
    Some(mapped)
}

/// Every tensor the HF model needs must be in the file; `output.weight` may be absent (tied).
fn check_required_present(
    file: &GgufFile,
    arch: GgufArchitecture,
    config: &ConfigJson,
) -> Result<()> {
    let mut per_layer = vec![
        "attn_norm.weight",
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "ffn_norm.weight",
        "ffn_gate.weight",
        "ffn_up.weight",
        "ffn_down.weight",
    ];
    if config.attention_bias {
        per_layer.extend(["attn_q.bias", "attn_k.bias", "attn_v.bias"]);
    }
    if arch.has_qk_norm() {
        per_layer.extend(["attn_q_norm.weight", "attn_k_norm.weight"]);
    }
    let globals = ["token_embd.weight", "output_norm.weight"].map(String::from);
    let layers = (0..config.num_hidden_layers).flat_map(|layer| {
        per_layer
            .iter()
            .map(move |suffix| format!("blk.{layer}.{suffix}"))
    });
    match globals
        .into_iter()
        .chain(layers)
        .find(|name| !file.has_tensor(name))
    {
        Some(name) => Err(ModelError::MissingWeight {
            name,
            path: file.path().to_path_buf(),
        }),
        None => Ok(()),
    }
}

/// A converted tensor, its bytes already in the output dtype.
pub(super) struct OutputTensor {
    shape: Vec<usize>,
    dtype: Dtype,
    bytes: Vec<u8>,
}

impl View for &OutputTensor {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::Bf16 => safetensors::Dtype::BF16,
            Dtype::F16 => safetensors::Dtype::F16,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// The converted weights plus what the summary reports about them.
pub(super) struct ConvertedTensors {
    /// HF name to tensor; ordered so the file layout is reproducible.
    pub tensors: BTreeMap<String, OutputTensor>,
    pub parameters: usize,
    /// How many source tensors had each GGML type.
    pub source_types: BTreeMap<String, usize>,
}

/// Dequantises and converts every planned tensor; only one f32 copy of a tensor exists at a time.
pub(super) fn convert(
    file: &mut GgufFile,
    plans: &[TensorPlan],
    dtype: Dtype,
) -> Result<ConvertedTensors> {
    let mut converted = ConvertedTensors {
        tensors: BTreeMap::new(),
        parameters: 0,
        source_types: BTreeMap::new(),
    };
    for plan in plans {
        let source_type = ggml_type_name(file.supported_type(&plan.gguf_name)?);
        *converted
            .source_types
            .entry(source_type.to_string())
            .or_default() += 1;
        let dense = file.read_dense(&plan.gguf_name)?;
        let values = match plan.unpermute_heads {
            Some(heads) => unpermute_rotary_rows(&dense.values, dense.shape[0], heads)
                .map_err(|message| file.error(format!("tensor {}: {message}", plan.gguf_name)))?,
            None => dense.values,
        };
        converted.parameters += values.len();
        converted.tensors.insert(
            plan.hf_name.clone(),
            OutputTensor {
                shape: dense.shape,
                dtype,
                bytes: encode(&values, dtype),
            },
        );
    }
    Ok(converted)
}

/// Little-endian bytes of `values` in `dtype`; bf16 and f16 round to nearest even, as torch does.
fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// Undoes llama.cpp's rotary permutation of a Q or K projection (weight or bias) of `rows` rows,
/// row-major: row `i` of the result is row [`rotary_row_order`]`[i]` of `values`.
pub(super) fn unpermute_rotary_rows(
    values: &[f32],
    rows: usize,
    heads: usize,
) -> std::result::Result<Vec<f32>, String> {
    let order = rotary_row_order(rows, heads)?;
    if !values.len().is_multiple_of(rows) {
        return Err(format!(
            "{} values do not split into {rows} rows",
            values.len()
        ));
    }
    let cols = values.len() / rows;
    Ok(order
        .iter()
        .flat_map(|&row| &values[row * cols..(row + 1) * cols])
        .copied()
        .collect())
}

/// For each HF row of a Q or K projection with `heads` heads, the GGUF row it comes from.
///
/// llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half of the
/// head, then second half) to interleaved pairs: `w.reshape(heads, 2, head_dim / 2, ..)
/// .swapaxes(1, 2)`. Row `2k + j` of a GGUF head is therefore row `j * head_dim / 2 + k` of the HF
/// head.
pub(super) fn rotary_row_order(
    rows: usize,
    heads: usize,
) -> std::result::Result<Vec<usize>, String> {
    if heads == 0 || rows == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(format!(
            "{rows} rows cannot be split into {heads} heads of rotary pairs"
        ));
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut order = vec![0; rows];
    for head in 0..heads {
        for pair in 0..half {
            for side in 0..2 {
                order[head * head_dim + side * half + pair] = head * head_dim + 2 * pair + side;
            }
        }
    }
    Ok(order)
}
