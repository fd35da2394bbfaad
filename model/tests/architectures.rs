//! Every supported architecture matches transformers on a tiny random model
//! (fixtures from `scripts/make_architecture_fixtures.py`): Llama-3 rope scaling, untied
//! embeddings, Mistral, Qwen2's q/k/v bias, Qwen3's q/k norms with an explicit head_dim; each
//! through libtorch's ops (no cache) and through the few-row decoder layer (a cached forward).

use headway_model::testing::fixture_path;
use headway_model::{CausalLm, CpuThreads, ForwardInput, KvCache, ModelConfig, SafetensorsWeights};
use tch::{Device, Kind, Tensor};

fn check(name: &str) {
    let dir = fixture_path("architectures").join(name);
    let config = ModelConfig::from_dir(&dir).unwrap();
    let mut weights = SafetensorsWeights::open(&dir, Kind::Float, Device::Cpu).unwrap();
    let model = CausalLm::load(&config, &mut weights).unwrap();
    let reference = Tensor::read_safetensors(dir.join("reference.safetensors")).unwrap();
    let get = |key: &str| {
        reference
            .iter()
            .find(|(n, _)| n == key)
            .map(|(_, t)| t.shallow_clone())
            .unwrap()
    };
    let input_ids = get("input_ids").unsqueeze(0);
    let positions = get("position_ids").unsqueeze(0);
    let cpu = CpuThreads::new(2).decode();
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &positions,
        mask: None,
        taps: &[],
        cpu: &cpu,
    };
    let tokens = input_ids.size()[1] as usize;
    let mut cache = KvCache::new(&config, 1, tokens, Kind::Float, Device::Cpu).unwrap();
    for (path, cache) in [("libtorch", None), ("few-row", Some(&mut cache))] {
        let hidden = tch::no_grad(|| model.model.forward(&input, cache))
            .unwrap()
            .hidden;
        let logits = model.lm_head.forward(&hidden.squeeze_dim(0), &cpu);
        let diff = (logits - get("logits")).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "{name}, {path} path: max |Δlogit| {diff}");
    }
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    check("llama3_rope_scaling");
}

#[test]
fn untied_llama_matches_transformers() {
    check("llama_untied");
}

#[test]
fn mistral_matches_transformers() {
    check("mistral");
}

#[test]
fn qwen2_with_qkv_bias_matches_transformers() {
    check("qwen2");
}

#[test]
fn qwen3_with_qk_norm_and_head_dim_matches_transformers() {
    check("qwen3");
}
