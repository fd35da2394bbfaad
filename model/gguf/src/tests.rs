//! Conversion tests on tiny synthetic GGUF files written with candle's GGUF writer, laid out the
//! way llama.cpp's converter lays out a real model (Q/K rows permuted for llama).

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use safetensors::SafeTensors;

use super::convert_gguf;
use super::hf_config::{llama3_divisor, llama3_scaling_from_divisors, Llama3RopeScaling};
use super::tensors::unpermute_rotary_rows;
use super::tokenizer::{byte_alphabet, byte_level_spelling};
use headway_model::Dtype;
use headway_model::ModelError;

const LAYERS: usize = 2;
const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;
/// A whole `Q4_K` / `Q6_K` super-block, so that `ffn_down` can take those types.
const FFN: usize = 256;
const CONTEXT: usize = 128;

/// The control tokens at ids 0..3, as in SmolLM2.
const CONTROL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [&str; 4] = ["h e", "l l", "he ll", "hell o"];
const USER_DEFINED_TOKEN: &str = "<think>";

/// Vocabulary: control tokens, the 256 byte symbols, one token per merge, a user-defined token.
fn vocabulary() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = CONTROL_TOKENS.iter().map(|t| t.to_string()).collect();
    let mut types = vec![3; CONTROL_TOKENS.len()];
    tokens.extend(byte_alphabet().iter().map(char::to_string));
    tokens.extend(MERGES.iter().map(|m| m.replace(' ', "")));
    tokens.push(USER_DEFINED_TOKEN.to_string());
    types.resize(tokens.len() - 1, 1);
    types.push(4);
    (tokens, types)
}

fn token_id(text: &str) -> u32 {
    let (tokens, _) = vocabulary();
    tokens
        .iter()
        .position(|t| t == text)
        .expect("token in test vocabulary") as u32
}

/// Deterministic weights that f16 and bf16 represent exactly (sixteenths in [-3.2, 3.1]).
fn weights(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 37 + seed * 11) % 101) as f32 / 16.0 - 3.125)
        .collect()
}

/// llama.cpp's `permute`: HF rotate-half rows to interleaved pairs, per head.
fn permute_rotary_rows(values: &[f32], rows: usize, heads: usize) -> Vec<f32> {
    let cols = values.len() / rows;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut permuted = vec![0.0; values.len()];
    for head in 0..heads {
        for side in 0..2 {
            for pair in 0..half {
                let hf_row = head * head_dim + side * half + pair;
                let gguf_row = head * head_dim + 2 * pair + side;
                permuted[gguf_row * cols..(gguf_row + 1) * cols]
                    .copy_from_slice(&values[hf_row * cols..(hf_row + 1) * cols]);
            }
        }
    }
    permuted
}

/// One tensor of a synthetic model: GGUF name, HF-order shape, stored type, HF-layout values.
struct SyntheticTensor {
    gguf_name: String,
    hf_name: String,
    shape: Vec<usize>,
    dtype: GgmlDType,
    values: Vec<f32>,
}

/// A tiny model written the way llama.cpp would, with knobs to break it.
struct SyntheticGguf {
    arch: &'static str,
    metadata: Vec<(String, Value)>,
    tensors: Vec<SyntheticTensor>,
}

impl SyntheticGguf {
    fn llama() -> Self {
        Self::new("llama")
    }

    fn new(arch: &'static str) -> Self {
        let (tokens, types) = vocabulary();
        let key = |suffix: &str| format!("{arch}.{suffix}");
        let metadata = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            (key("block_count"), Value::U32(LAYERS as u32)),
            (key("context_length"), Value::U32(CONTEXT as u32)),
            (key("embedding_length"), Value::U32(HIDDEN as u32)),
            (key("feed_forward_length"), Value::U32(FFN as u32)),
            (key("attention.head_count"), Value::U32(HEADS as u32)),
            (key("attention.head_count_kv"), Value::U32(KV_HEADS as u32)),
            (key("rope.freq_base"), Value::F32(100_000.0)),
            (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.into_iter().map(Value::String).collect()),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(types.into_iter().map(Value::I32).collect()),
            ),
            (
                "tokenizer.ggml.merges".into(),
                Value::Array(
                    MERGES
                        .iter()
                        .map(|m| Value::String(m.to_string()))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
            ("tokenizer.ggml.unknown_token_id".into(), Value::U32(0)),
            ("tokenizer.ggml.padding_token_id".into(), Value::U32(2)),
            ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
            (
                "tokenizer.chat_template".into(),
                Value::String("{% for m in messages %}{{ m['content'] }}{% endfor %}".into()),
            ),
        ];
        let mut model = Self {
            arch,
            metadata,
            tensors: Vec::new(),
        };
        model.add_standard_tensors();
        model
    }

    fn add_standard_tensors(&mut self) {
        let vocab = vocabulary().0.len();
        let (q_rows, kv_rows) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
        self.add(
            "token_embd.weight",
            "model.embed_tokens.weight",
            &[vocab, HIDDEN],
            GgmlDType::Q8_0,
        );
        self.add(
            "output_norm.weight",
            "model.norm.weight",
            &[HIDDEN],
            GgmlDType::F32,
        );
        for layer in 0..LAYERS {
            let blk = |suffix: &str| format!("blk.{layer}.{suffix}");
            let hf = |suffix: &str| format!("model.layers.{layer}.{suffix}");
            let layer_tensors = [
                (
                    "attn_norm.weight",
                    "input_layernorm.weight",
                    vec![HIDDEN],
                    GgmlDType::F32,
                ),
                (
                    "ffn_norm.weight",
                    "post_attention_layernorm.weight",
                    vec![HIDDEN],
                    GgmlDType::F32,
                ),
                (
                    "attn_q.weight",
                    "self_attn.q_proj.weight",
                    vec![q_rows, HIDDEN],
                    GgmlDType::F16,
                ),
                (
                    "attn_k.weight",
                    "self_attn.k_proj.weight",
                    vec![kv_rows, HIDDEN],
                    GgmlDType::F32,
                ),
                (
                    "attn_v.weight",
                    "self_attn.v_proj.weight",
                    vec![kv_rows, HIDDEN],
                    GgmlDType::BF16,
                ),
                (
                    "attn_output.weight",
                    "self_attn.o_proj.weight",
                    vec![HIDDEN, q_rows],
                    GgmlDType::F32,
                ),
                (
                    "ffn_gate.weight",
                    "mlp.gate_proj.weight",
                    vec![FFN, HIDDEN],
                    GgmlDType::F32,
                ),
                (
                    "ffn_up.weight",
                    "mlp.up_proj.weight",
                    vec![FFN, HIDDEN],
                    GgmlDType::F16,
                ),
                (
                    "ffn_down.weight",
                    "mlp.down_proj.weight",
                    vec![HIDDEN, FFN],
                    GgmlDType::F32,
                ),
            ];
            for (gguf, hf_name, shape, dtype) in layer_tensors {
                self.add(&blk(gguf), &hf(hf_name), &shape, dtype);
            }
            if self.arch == "qwen2" {
                self.add(
                    &blk("attn_q.bias"),
                    &hf("self_attn.q_proj.bias"),
                    &[q_rows],
                    GgmlDType::F32,
                );
                self.add(
                    &blk("attn_k.bias"),
                    &hf("self_attn.k_proj.bias"),
                    &[kv_rows],
                    GgmlDType::F32,
                );
                self.add(
                    &blk("attn_v.bias"),
                    &hf("self_attn.v_proj.bias"),
                    &[kv_rows],
                    GgmlDType::F32,
                );
            }
        }
    }

    fn add(&mut self, gguf_name: &str, hf_name: &str, shape: &[usize], dtype: GgmlDType) {
        let len = shape.iter().product();
        self.tensors.push(SyntheticTensor {
            gguf_name: gguf_name.into(),
            hf_name: hf_name.into(),
            shape: shape.to_vec(),
            dtype,
            values: weights(len, self.tensors.len()),
        });
    }

    fn set_type(&mut self, gguf_name: &str, dtype: GgmlDType) {
        let tensor = self
            .tensors
            .iter_mut()
            .find(|t| t.gguf_name == gguf_name)
            .expect("tensor in the model");
        tensor.dtype = dtype;
    }

    fn set_metadata(&mut self, key: &str, value: Value) {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), value));
    }

    fn remove_metadata(&mut self, key: &str) {
        self.metadata.retain(|(k, _)| k != key);
    }

    fn remove_tensor(&mut self, gguf_name: &str) {
        self.tensors.retain(|t| t.gguf_name != gguf_name);
    }

    fn tensor(&self, hf_name: &str) -> &SyntheticTensor {
        self.tensors
            .iter()
            .find(|t| t.hf_name == hf_name)
            .expect("tensor in synthetic model")
    }

    /// The values as llama.cpp stores them: Q/K rows permuted for llama.
    fn stored_values(&self, tensor: &SyntheticTensor) -> Vec<f32> {
        let heads = if tensor.gguf_name.contains(".attn_q.") {
            HEADS
        } else if tensor.gguf_name.contains(".attn_k.") {
            KV_HEADS
        } else {
            return tensor.values.clone();
        };
        if self.arch == "llama" {
            permute_rotary_rows(&tensor.values, tensor.shape[0], heads)
        } else {
            tensor.values.clone()
        }
    }

    fn write(&self, path: &Path) {
        let quantized: Vec<QTensor> = self
            .tensors
            .iter()
            .map(|t| {
                let dense =
                    Tensor::from_vec(self.stored_values(t), t.shape.as_slice(), &Device::Cpu)
                        .expect("dense tensor");
                QTensor::quantize(&dense, t.dtype).expect("quantize")
            })
            .collect();
        let metadata: Vec<(&str, &Value)> =
            self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &QTensor)> = self
            .tensors
            .iter()
            .zip(&quantized)
            .map(|(t, q)| (t.gguf_name.as_str(), q))
            .collect();
        let mut file = std::fs::File::create(path).expect("create gguf");
        gguf_file::write(&mut file, &metadata, &tensors).expect("write gguf");
    }
}

/// Writes `model` as `model.gguf` in a new temporary directory; returns the directory and path.
fn write_model(model: &SyntheticGguf) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.gguf");
    model.write(&path);
    (dir, path)
}

fn convert_error(model: &SyntheticGguf) -> String {
    let (dir, path) = write_model(model);
    convert_gguf(&path, &dir.path().join("out"), Dtype::F32)
        .expect_err("conversion must fail")
        .to_string()
}

fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("read json")).expect("parse json")
}

fn f32_values(tensors: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    let view = tensors.tensor(name).expect("tensor in safetensors");
    assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn llama_gguf_converts_to_a_directory_the_runtime_loads() {
    let model = SyntheticGguf::llama();
    let (dir, path) = write_model(&model);
    let out = dir.path().join("out");
    let summary = convert_gguf(&path, &out, Dtype::F32).expect("convert");

    assert_eq!(summary.architecture, "LlamaForCausalLM");
    assert_eq!(summary.tensors, model.tensors.len());
    let parameters: usize = model.tensors.iter().map(|t| t.values.len()).sum();
    assert_eq!(summary.parameters, parameters);
    assert_eq!(summary.source_types["Q8_0"], 1);
    let mut written: Vec<String> = std::fs::read_dir(&out)
        .expect("list out dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    written.sort();
    assert_eq!(
        written,
        [
            "config.json",
            "converted_from.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ],
        "no temporary files may be left behind"
    );
    let identity = headway_model::fingerprint::target_identity(&out).expect("identity");
    assert_eq!(
        identity.converted_from,
        Some(headway_model::fingerprint::target_fingerprint(&path).expect("fingerprint")),
        "the conversion names the GGUF it came from"
    );

    let config = read_json(&out.join("config.json"));
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    assert_eq!(config["head_dim"], HEAD_DIM);
    assert_eq!(config["num_key_value_heads"], KV_HEADS);
    assert_eq!(
        config["rms_norm_eps"], 1e-5,
        "f32 metadata is read back as its decimal"
    );
    assert_eq!(config["rope_theta"], 100_000.0);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["vocab_size"], vocabulary().0.len());
    assert_eq!(config["eos_token_id"], 2);
    assert_eq!(config["torch_dtype"], "float32");
    assert!(config.get("rope_scaling").is_none());
    let runtime_config = headway_model::ModelConfig::from_dir(&out).expect("runtime config");
    assert_eq!(runtime_config.head_dim, HEAD_DIM);

    let bytes = std::fs::read(out.join("model.safetensors")).expect("read safetensors");
    let tensors = SafeTensors::deserialize(&bytes).expect("parse safetensors");
    assert!(
        tensors.tensor("lm_head.weight").is_err(),
        "tied models have no lm_head"
    );
    for name in [
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ] {
        assert_eq!(
            f32_values(&tensors, name),
            model.tensor(name).values,
            "{name} un-permuted"
        );
    }
    for name in [
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ] {
        assert_eq!(
            f32_values(&tensors, name),
            model.tensor(name).values,
            "{name}"
        );
    }
    let embedding = model.tensor("model.embed_tokens.weight");
    let converted = f32_values(&tensors, "model.embed_tokens.weight");
    let worst = converted
        .iter()
        .zip(&embedding.values)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(worst < 0.02, "Q8_0 embedding off by {worst}");
    assert_eq!(
        tensors
            .tensor("model.embed_tokens.weight")
            .expect("embedding")
            .shape(),
        embedding.shape
    );

    let tokenizer =
        tokenizers::Tokenizer::from_file(out.join("tokenizer.json")).expect("tokenizer");
    let encoding = tokenizer
        .encode("hello<|im_end|><think>hi", false)
        .expect("encode");
    let expected = ["hello", "<|im_end|>", USER_DEFINED_TOKEN, "h", "i"].map(token_id);
    assert_eq!(encoding.get_ids(), expected);
    let decoded = tokenizer.decode(encoding.get_ids(), false).expect("decode");
    assert_eq!(decoded, "hello<|im_end|><think>hi");
    let tokenizer_config = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tokenizer_config["eos_token"], "<|im_end|>");
    assert_eq!(tokenizer_config["bos_token"], "<|im_start|>");
    assert_eq!(tokenizer_config["add_bos_token"], false);
    assert_eq!(tokenizer_config["model_max_length"], CONTEXT);
    assert!(tokenizer_config["chat_template"]
        .as_str()
        .is_some_and(|t| t.contains("messages")));
}

#[test]
fn bf16_output_rounds_every_tensor_to_bfloat16() {
    let model = SyntheticGguf::llama();
    let (dir, path) = write_model(&model);
    let out = dir.path().join("out");
    convert_gguf(&path, &out, Dtype::Bf16).expect("convert");
    let bytes = std::fs::read(out.join("model.safetensors")).expect("read safetensors");
    let tensors = SafeTensors::deserialize(&bytes).expect("parse safetensors");
    assert!(tensors
        .tensors()
        .iter()
        .all(|(_, view)| view.dtype() == safetensors::Dtype::BF16));
    let q = tensors
        .tensor("model.layers.0.self_attn.q_proj.weight")
        .expect("q_proj");
    let values: Vec<f32> = q
        .data()
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    assert_eq!(
        values,
        model
            .tensor("model.layers.0.self_attn.q_proj.weight")
            .values
    );
    assert_eq!(
        read_json(&out.join("config.json"))["torch_dtype"],
        "bfloat16"
    );
}

#[test]
fn qwen2_rows_stay_unpermuted_and_biases_are_kept() {
    let model = SyntheticGguf::new("qwen2");
    let (dir, path) = write_model(&model);
    let out = dir.path().join("out");
    let summary = convert_gguf(&path, &out, Dtype::F32).expect("convert");
    assert_eq!(summary.architecture, "Qwen2ForCausalLM");
    assert_eq!(read_json(&out.join("config.json"))["attention_bias"], true);
    let bytes = std::fs::read(out.join("model.safetensors")).expect("read safetensors");
    let tensors = SafeTensors::deserialize(&bytes).expect("parse safetensors");
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.bias",
    ] {
        assert_eq!(
            f32_values(&tensors, name),
            model.tensor(name).values,
            "{name}"
        );
    }
}

#[test]
fn output_weight_unties_the_lm_head() {
    let mut model = SyntheticGguf::llama();
    let vocab = vocabulary().0.len();
    model.add(
        "output.weight",
        "lm_head.weight",
        &[vocab, HIDDEN],
        GgmlDType::F32,
    );
    let (dir, path) = write_model(&model);
    let out = dir.path().join("out");
    convert_gguf(&path, &out, Dtype::F32).expect("convert");
    assert_eq!(
        read_json(&out.join("config.json"))["tie_word_embeddings"],
        false
    );
    let bytes = std::fs::read(out.join("model.safetensors")).expect("read safetensors");
    let tensors = SafeTensors::deserialize(&bytes).expect("parse safetensors");
    assert_eq!(
        f32_values(&tensors, "lm_head.weight"),
        model.tensor("lm_head.weight").values
    );
}

#[test]
fn unpermute_inverts_llama_cpp_rotary_permutation() {
    // One head of four rows: HF halves [r0 r1 | r2 r3] are stored interleaved as r0 r2 r1 r3.
    let stored = [0.0, 2.0, 1.0, 3.0];
    assert_eq!(
        unpermute_rotary_rows(&stored, 4, 1).expect("unpermute"),
        [0.0, 1.0, 2.0, 3.0]
    );

    let (rows, cols, heads) = (24, 5, 3);
    let original = weights(rows * cols, 7);
    let permuted = permute_rotary_rows(&original, rows, heads);
    assert_ne!(permuted, original);
    assert_eq!(
        unpermute_rotary_rows(&permuted, rows, heads).expect("unpermute"),
        original
    );
}

#[test]
fn unpermute_rejects_rows_that_do_not_split_into_head_pairs() {
    let message = unpermute_rotary_rows(&[0.0; 12], 6, 2).expect_err("3-row heads have no pairs");
    assert!(message.contains("2 heads"), "{message}");
}

fn llama31_scaling() -> Llama3RopeScaling {
    Llama3RopeScaling {
        rope_type: "llama3",
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    }
}

/// The divisors llama.cpp stores in `rope_freqs.weight`, in f32.
fn rope_freqs(scaling: &Llama3RopeScaling, theta: f64, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let wavelength =
                2.0 * std::f64::consts::PI * theta.powf(2.0 * i as f64 / head_dim as f64);
            llama3_divisor(scaling, wavelength) as f32
        })
        .collect()
}

#[test]
fn llama3_rope_scaling_is_recovered_from_rope_freqs() {
    let scaling = llama31_scaling();
    let divisors = rope_freqs(&scaling, 500_000.0, 128);
    let recovered = llama3_scaling_from_divisors(&divisors, 500_000.0, 128).expect("fit");
    assert_eq!(recovered, Some(scaling));
}

#[test]
fn uniform_rope_freqs_mean_no_scaling() {
    assert_eq!(
        llama3_scaling_from_divisors(&[1.0; 64], 500_000.0, 128),
        Ok(None)
    );
}

#[test]
fn rope_freqs_that_are_not_a_llama3_profile_are_rejected() {
    let mut divisors = rope_freqs(&llama31_scaling(), 500_000.0, 128);
    divisors.reverse();
    let message = llama3_scaling_from_divisors(&divisors, 500_000.0, 128).expect_err("not llama3");
    assert!(message.contains("llama3"), "{message}");
}

#[test]
fn too_few_interpolated_rope_freqs_cannot_be_fitted() {
    // head_dim 8 at θ = 500000 leaves a single frequency between the Llama 3.1 cutoffs.
    let divisors = rope_freqs(&llama31_scaling(), 500_000.0, 8);
    let message =
        llama3_scaling_from_divisors(&divisors, 500_000.0, 8).expect_err("underdetermined");
    assert!(message.contains("interpolated"), "{message}");
}

#[test]
fn rope_freqs_tensor_becomes_rope_scaling_in_the_config() {
    // At θ = 100 the head's wavelengths (6, 20, 63, 199) put two between cutoffs 16 and 64.
    let scaling = Llama3RopeScaling {
        original_max_position_embeddings: 64,
        ..llama31_scaling()
    };
    let mut model = SyntheticGguf::llama();
    model.set_metadata("llama.rope.freq_base", Value::F32(100.0));
    model.tensors.push(SyntheticTensor {
        gguf_name: "rope_freqs.weight".into(),
        hf_name: String::new(),
        shape: vec![HEAD_DIM / 2],
        dtype: GgmlDType::F32,
        values: rope_freqs(&scaling, 100.0, HEAD_DIM),
    });
    let (dir, path) = write_model(&model);
    let out = dir.path().join("out");
    convert_gguf(&path, &out, Dtype::F32).expect("convert");
    let config = read_json(&out.join("config.json"));
    assert_eq!(
        config["rope_scaling"],
        serde_json::json!({
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64
        })
    );
}

#[test]
fn unsupported_tensor_type_is_named_with_its_tensor() {
    let mut model = SyntheticGguf::llama();
    model
        .tensors
        .iter_mut()
        .find(|t| t.gguf_name == "blk.1.ffn_gate.weight")
        .expect("tensor")
        .dtype = GgmlDType::Q5_1;
    let message = convert_error(&model);
    assert!(
        message.contains("blk.1.ffn_gate.weight") && message.contains("Q5_1"),
        "{message}"
    );
}

/// Overwrites the type code in `name`'s tensor info (it follows the name, the dimension count
/// and the u64 dimensions).
fn patch_tensor_type(path: &Path, name: &str, dims: usize, code: u32) {
    let mut bytes = std::fs::read(path).expect("read gguf");
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let start = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("tensor info");
    let type_offset = start + needle.len() + 4 + 8 * dims;
    bytes[type_offset..type_offset + 4].copy_from_slice(&code.to_le_bytes());
    std::fs::write(path, bytes).expect("write gguf");
}

#[test]
fn unknown_tensor_type_code_is_reported() {
    let model = SyntheticGguf::llama();
    let (dir, path) = write_model(&model);
    const IQ4_XS: u32 = 23;
    patch_tensor_type(&path, "blk.0.ffn_up.weight", 2, IQ4_XS);
    let message = convert_gguf(&path, &dir.path().join("out"), Dtype::F32)
        .expect_err("unknown type")
        .to_string();
    assert!(
        message.contains("model.gguf") && message.contains("23"),
        "{message}"
    );
}

#[test]
fn unsupported_architecture_is_named() {
    let mut model = SyntheticGguf::llama();
    model.set_metadata("general.architecture", Value::String("gpt2".into()));
    let (dir, path) = write_model(&model);
    let error = convert_gguf(&path, &dir.path().join("out"), Dtype::F32).expect_err("gpt2");
    assert!(matches!(&error, ModelError::UnsupportedArchitecture { name, .. } if name == "gpt2"));
    assert!(error.to_string().contains("llama, qwen2, qwen3"), "{error}");
}

#[test]
fn truncated_tensor_data_is_reported_with_the_tensor() {
    let model = SyntheticGguf::llama();
    let (dir, path) = write_model(&model);
    let len = std::fs::metadata(&path).expect("metadata").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(len - 100))
        .expect("truncate");
    let out = dir.path().join("out");
    let message = convert_gguf(&path, &out, Dtype::F32)
        .expect_err("truncated")
        .to_string();
    assert!(
        message.contains("truncated") && message.contains("tensor "),
        "{message}"
    );
    assert!(!out.exists(), "nothing is written for a bad file");
}

#[test]
fn truncated_header_is_reported_with_the_file() {
    let model = SyntheticGguf::llama();
    let (dir, path) = write_model(&model);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|f| f.set_len(200))
        .expect("truncate");
    let message = convert_gguf(&path, &dir.path().join("out"), Dtype::F32)
        .expect_err("truncated")
        .to_string();
    assert!(
        message.contains("model.gguf") && message.contains("header"),
        "{message}"
    );
}

#[test]
fn missing_metadata_key_is_named() {
    let mut model = SyntheticGguf::llama();
    model.remove_metadata("llama.embedding_length");
    let message = convert_error(&model);
    assert!(
        message.contains("missing metadata key llama.embedding_length"),
        "{message}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let mut model = SyntheticGguf::llama();
    model.remove_tensor("blk.1.attn_v.weight");
    let message = convert_error(&model);
    assert!(
        message.contains("blk.1.attn_v.weight") && message.contains("missing"),
        "{message}"
    );
}

#[test]
fn tensor_shape_that_contradicts_the_metadata_is_named() {
    let mut model = SyntheticGguf::llama();
    model.set_metadata("llama.feed_forward_length", Value::U32(FFN as u32 * 2));
    let message = convert_error(&model);
    assert!(
        message.contains("model.gguf")
            && message.contains(&format!(
                "has shape [{FFN}, 32], but the metadata implies [{}, 32]",
                2 * FFN
            )),
        "{message}"
    );
}

#[test]
fn sentencepiece_tokenizers_are_refused_by_name() {
    let mut model = SyntheticGguf::llama();
    model.set_metadata("tokenizer.ggml.model", Value::String("llama".into()));
    let message = convert_error(&model);
    assert!(
        message.contains("tokenizer.ggml.model") && message.contains("\"llama\""),
        "{message}"
    );
}

#[test]
fn byte_alphabet_matches_gpt2_bytes_to_unicode() {
    let alphabet = byte_alphabet();
    assert_eq!(alphabet[usize::from(b'a')], 'a');
    assert_eq!(alphabet[usize::from(b' ')], '\u{120}');
    assert_eq!(alphabet[usize::from(b'\n')], '\u{10A}');
    assert_eq!(alphabet[0xAD], '\u{143}');
    let distinct: std::collections::HashSet<char> = alphabet.iter().copied().collect();
    assert_eq!(distinct.len(), 256);
}

#[test]
fn tokens_outside_the_byte_alphabet_are_respelled_from_their_utf8() {
    let alphabet = byte_alphabet();
    assert_eq!(byte_level_spelling("Ġhello", &alphabet), "Ġhello");
    assert_eq!(byte_level_spelling("日", &alphabet), "æĹ¥");
}

/// Logits of `target` for a few tokens, decoding one at a time as serving does.
fn decoded_logits(target: &headway_model::Target) -> tch::Tensor {
    use headway_model::{ForwardInput, KvCache, TreeInput};
    let cpu = target.cpu.decode();
    let mut cache =
        KvCache::new(target.model.config(), 1, 8, target.kind, target.device).expect("cache");
    let rows: Vec<tch::Tensor> = [5u32, 80, 200, 31, 7]
        .iter()
        .enumerate()
        .map(|(at, &id)| {
            let tokens = TreeInput::causal(at, &[id], tch::Device::Cpu);
            let input = ForwardInput::new(&tokens, &[], &cpu);
            let hidden = tch::no_grad(|| target.model.model.forward(&input, Some(&mut cache)))
                .expect("forward")
                .hidden;
            target.model.lm_head.forward(&hidden, &cpu).flatten(0, 1)
        })
        .collect();
    tch::Tensor::cat(&rows, 0)
}

/// A GGUF target opened natively keeps its Q4_0, Q4_1, Q8_0, Q5_0, Q4_K and Q6_K matrices as
/// blocks (q/k/v and gate/up fused even where their types differ) and computes what the converted
/// directory computes, within the activations' 8-bit rounding. That rounding is coarse here: the
/// rows are a single 32-value block, so its errors do not average out (4.6 % of the largest logit
/// measured; SmolLM2's own bound is in `tests/tests/gguf_native.rs`).
#[test]
fn a_gguf_target_runs_its_blocks_natively_close_to_the_converted_directory() {
    let mut model = SyntheticGguf::llama();
    for (name, dtype) in [
        ("blk.0.attn_q.weight", GgmlDType::Q4_1),
        ("blk.0.attn_k.weight", GgmlDType::Q4_1),
        ("blk.0.attn_v.weight", GgmlDType::Q4_1),
        ("blk.0.attn_output.weight", GgmlDType::Q4_0),
        ("blk.0.ffn_gate.weight", GgmlDType::Q5_0),
        ("blk.0.ffn_up.weight", GgmlDType::Q5_0),
        ("blk.0.ffn_down.weight", GgmlDType::Q4K),
        ("blk.1.attn_q.weight", GgmlDType::Q8_0),
        ("blk.1.attn_k.weight", GgmlDType::Q4_0),
        ("blk.1.ffn_gate.weight", GgmlDType::Q8_0),
        ("blk.1.ffn_up.weight", GgmlDType::Q4_1),
        ("blk.1.ffn_down.weight", GgmlDType::Q6K),
    ] {
        model.set_type(name, dtype);
    }
    let (dir, path) = write_model(&model);
    let out = dir.path().join("out");
    convert_gguf(&path, &out, Dtype::F32).expect("convert");
    let threads = headway_model::CpuThreads::new(2);
    let mut native = crate::open_target(&path, tch::Kind::Float, tch::Device::Cpu, threads.clone())
        .expect("open the GGUF");
    let mut converted =
        headway_model::Target::load(&out, tch::Kind::Float, tch::Device::Cpu, threads)
            .expect("load the converted directory");
    // `--kv-dtype`'s default: f16 beside quantised matrices (where the row kernels run), the
    // activations' kind for dense ones; a given type wins.
    native.set_kv_dtype(None);
    converted.set_kv_dtype(None);
    let expected = if headway_model::row_kernel::available() {
        tch::Kind::Half
    } else {
        tch::Kind::Float
    };
    assert_eq!(
        (native.kv_kind, converted.kv_kind),
        (expected, tch::Kind::Float)
    );
    native.set_kv_dtype(Some(Dtype::F32));
    assert_eq!(native.kv_kind, tch::Kind::Float);

    // No matrix fell back to f32: at most 8.5 bits per weight (Q8_0's) against 32.
    let (bytes, f32_bytes) = (
        native.model.decode_step_bytes(),
        converted.model.decode_step_bytes(),
    );
    assert!(bytes * 64 <= f32_bytes * 17, "{bytes} of {f32_bytes} bytes");
    assert!(matches!(
        native.model.lm_head.matrix(),
        headway_model::linear::Matrix::Quantised { .. }
    ));
    assert_eq!(native.path, path);
    assert_eq!(native.stop_ids, converted.stop_ids);
    let prompt = [headway_model::Message::new("user", "hello")];
    assert_eq!(
        native.chat_prompt_ids(&prompt).expect("chat prompt"),
        converted.chat_prompt_ids(&prompt).expect("chat prompt")
    );
    let (got, expected) = (decoded_logits(&native), decoded_logits(&converted));
    let scale = expected.abs().max().double_value(&[]);
    let worst = (&got - &expected).abs().max().double_value(&[]);
    assert!(worst > 0.0, "the quantised kernels must have run");
    assert!(worst < 0.08 * scale, "logits off by {worst} of {scale}");

    // Verifying the five tokens at once gives decoding's bits (row-count invariance).
    let cpu = native.cpu.decode();
    let tokens = headway_model::TreeInput::causal(0, &[5, 80, 200, 31, 7], tch::Device::Cpu);
    let input = headway_model::ForwardInput::new(&tokens, &[], &cpu);
    let mut cache =
        headway_model::KvCache::new(native.model.config(), 1, 8, native.kind, native.device)
            .expect("cache");
    let hidden = tch::no_grad(|| native.model.model.forward(&input, Some(&mut cache)))
        .expect("forward")
        .hidden;
    let together = native.model.lm_head.forward(&hidden, &cpu).flatten(0, 1);
    assert!(
        together.equal(&got),
        "a 5-token forward differs from decoding"
    );
}

/// Every block type kept natively stands for exactly the values candle dequantises (`Q5_0`, `Q4_K`
/// and `Q6_K` are re-expressed, not rounded), also once packed for the kernels; a wrong byte count
/// is named.
#[test]
fn native_blocks_hold_exactly_the_values_candle_dequantises() {
    let (rows, cols) = (5, 512);
    let values = Tensor::randn(0f32, 1f32, (rows, cols), &Device::Cpu).expect("values");
    let native = crate::file::SUPPORTED_TYPES
        .iter()
        .filter_map(|&dtype| Some((dtype, crate::native::native_blocks(dtype)?)));
    assert_eq!(
        native.clone().count(),
        6,
        "Q4_0, Q4_1, Q8_0, Q5_0, Q4_K, Q6_K"
    );
    for (dtype, blocks) in native {
        let quantised = QTensor::quantize(&values, dtype).expect("quantise");
        let want: Vec<f32> = quantised
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all()?.to_vec1())
            .expect("dequantise");
        let bytes = quantised.data().expect("bytes").into_owned();
        let matrix = blocks.matrix(rows, cols, bytes.clone()).expect("blocks");
        let packed = headway_model::linear::Matrix::quantised(matrix.clone());
        for got in [
            matrix.dequantise(tch::Kind::Float, tch::Device::Cpu),
            packed.dense().shallow_clone(),
        ] {
            let got = Vec::<f32>::try_from(got.flatten(0, 1)).expect("floats");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        }
        let err = blocks.matrix(rows, cols, bytes[1..].to_vec()).unwrap_err();
        assert!(err.contains(&format!("got {}", bytes.len() - 1)), "{err}");
    }
    let err = headway_model::quant_gguf::GgufBlocks::Q4_K
        .matrix(1, 96, vec![])
        .unwrap_err();
    assert!(err.contains("256-value blocks"), "{err}");
}

/// Issue 23: random truncations and byte flips of a GGUF's header, metadata and tensor table
/// (1,000 seeded cases): opening it natively either succeeds or fails with an error naming the
/// file, and never panics. Some flips open: GGUF carries no checksum, so a flipped token string
/// or weight byte is a different model, not a detectable fault.
#[test]
fn corrupted_gguf_headers_give_named_errors_never_panics() {
    use headway_model::testing::corruption_trial;
    use rand::SeedableRng;
    let (dir, path) = write_model(&SyntheticGguf::llama());
    let data_start = {
        let mut file = std::fs::File::open(&path).expect("open");
        gguf_file::Content::read(&mut file)
            .expect("parse")
            .tensor_data_offset as usize
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let broken = dir.path().join("broken.gguf");
    std::fs::copy(&path, &broken).expect("copy");
    let open = || {
        crate::open_target(
            &broken,
            tch::Kind::Float,
            tch::Device::Cpu,
            headway_model::CpuThreads::new(1),
        )
        .map(|_| ())
    };
    let tally = corruption_trial(&broken, data_start, 1000, &mut rng, open, |message| {
        message.contains("broken.gguf")
    });
    eprintln!("{tally:?}");
    assert!(
        tally.errors > 800,
        "most corruptions must be caught: {tally:?}"
    );
}
