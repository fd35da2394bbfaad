//! Broken model directories give errors that name the problem, never panics.

use std::path::Path;

use headway_model::testing::{write_safetensors, write_tiny_model};
use headway_model::{CpuThreads, Target, TextTokenizer};
use tch::{Device, Kind, Tensor};

fn load_error(dir: &Path) -> String {
    match Target::load(dir, Kind::Float, Device::Cpu, CpuThreads::default()) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn tiny_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 1).unwrap();
    dir
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn the_tiny_model_directory_loads() {
    let dir = tiny_dir();
    let target = Target::load(dir.path(), Kind::Float, Device::Cpu, CpuThreads::default()).unwrap();
    assert_eq!(target.stop_ids, vec![2]);
    assert!(target.chat_template.is_some());
}

#[test]
fn a_missing_directory_is_named() {
    let err = load_error(Path::new("/nonexistent/model"));
    assert!(
        err.contains("/nonexistent/model: no such target model directory"),
        "{err}"
    );
}

#[test]
fn missing_files_are_named() {
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        let dir = tiny_dir();
        std::fs::remove_file(dir.path().join(file)).unwrap();
        let err = load_error(dir.path());
        assert!(err.contains(file), "missing {file}: {err}");
    }
}

#[test]
fn a_truncated_safetensors_file_is_reported() {
    let dir = tiny_dir();
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );
}

#[test]
fn a_wrongly_shaped_weight_names_the_tensor_and_both_shapes() {
    let dir = tiny_dir();
    let mut tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(dir.path().join("model.safetensors")).unwrap();
    for (name, tensor) in tensors.iter_mut() {
        if name == "model.layers.1.mlp.up_proj.weight" {
            *tensor = Tensor::zeros([100, 64], (Kind::Float, Device::Cpu));
        }
    }
    write_safetensors(&dir.path().join("model.safetensors"), &tensors).unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("model.layers.1.mlp.up_proj.weight")
            && err.contains("[128, 64]")
            && err.contains("[100, 64]"),
        "{err}"
    );
}

#[test]
fn a_missing_weight_is_named() {
    let dir = tiny_dir();
    let tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(dir.path().join("model.safetensors"))
            .unwrap()
            .into_iter()
            .filter(|(name, _)| name != "model.norm.weight")
            .collect();
    write_safetensors(&dir.path().join("model.safetensors"), &tensors).unwrap();
    let err = load_error(dir.path());
    assert!(err.contains("model.norm.weight is missing"), "{err}");
}

#[test]
fn an_untied_model_without_lm_head_is_reported() {
    let dir = tiny_dir();
    edit_config(dir.path(), |c| c["tie_word_embeddings"] = false.into());
    let err = load_error(dir.path());
    assert!(err.contains("lm_head.weight is missing"), "{err}");
}

#[test]
fn an_unsupported_architecture_lists_the_supported_ones() {
    let dir = tiny_dir();
    edit_config(dir.path(), |c| {
        c["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"])
    });
    let err = load_error(dir.path());
    assert!(
        err.contains("GPTNeoXForCausalLM") && err.contains("LlamaForCausalLM"),
        "{err}"
    );
}

#[test]
fn inconsistent_head_counts_are_reported() {
    let dir = tiny_dir();
    edit_config(dir.path(), |c| c["num_key_value_heads"] = 3.into());
    let err = load_error(dir.path());
    assert!(
        err.contains("num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
        "{err}"
    );
}

#[test]
fn malformed_json_names_the_file() {
    let dir = tiny_dir();
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let err = load_error(dir.path());
    assert!(
        err.contains("config.json") && err.contains("invalid JSON"),
        "{err}"
    );
}

#[test]
fn a_corrupt_tokenizer_is_reported() {
    let dir = tiny_dir();
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = TextTokenizer::from_file(&dir.path().join("tokenizer.json"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("tokenizer") && err.contains("tokenizer.json"),
        "{err}"
    );
}

#[test]
fn transformers_5_rope_parameters_set_the_rope_base() {
    let dir = tiny_dir();
    edit_config(dir.path(), |c| {
        c.as_object_mut().unwrap().remove("rope_theta");
        c["rope_parameters"] = serde_json::json!({"rope_theta": 100000.0, "rope_type": "default"});
    });
    let config = headway_model::ModelConfig::from_dir(dir.path()).unwrap();
    assert_eq!(config.rope_theta, 100000.0);
}

/// Issue 23: seeded truncations and bit flips of each file of a model directory (for the
/// safetensors file, in its JSON header, where a flip changes what is read rather than a value):
/// loading either succeeds or fails with an error naming the file, never panics.
#[test]
fn corrupted_model_files_give_named_errors_never_panics() {
    use headway_model::testing::corruption_trial;
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let files = [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ];
    for file in files {
        let dir = tiny_dir();
        let path = dir.path().join(file);
        let bytes = std::fs::read(&path).unwrap();
        // Within the safetensors header a flip changes what is read, not one weight's value.
        let flippable = match file {
            "model.safetensors" => 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize,
            _ => bytes.len(),
        };
        let open =
            || Target::load(dir.path(), Kind::Float, Device::Cpu, CpuThreads::new(1)).map(|_| ());
        // A config that no longer matches the weights (other sizes, an untied LM head) shows as
        // a mismatch in the weights' file, which is named with the tensor: which of the two is
        // wrong only the user can tell.
        let named = |message: &str| {
            message.contains(file)
                || (file == "config.json" && message.contains("model.safetensors"))
        };
        let tally = corruption_trial(&path, flippable, 150, &mut rng, open, named);
        eprintln!("{file}: {tally:?}");
    }
}
