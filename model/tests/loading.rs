//! Checkpoint layouts and dtypes: sharded safetensors with an index load like a single file, and
//! bf16/f16 weights run close to f32.

use std::path::Path;

use headway_model::testing::{write_safetensors, write_tiny_model};
use headway_model::{CpuThreads, ForwardInput, Target, TreeInput};
use tch::{Device, Kind, Tensor};

fn logits(dir: &Path, kind: Kind) -> Tensor {
    let target = Target::load(dir, kind, Device::Cpu, CpuThreads::new(2)).unwrap();
    let cpu = target.cpu.decode();
    let tokens = TreeInput::causal(0, &[5, 80, 200, 31, 7], Device::Cpu);
    let input = ForwardInput::new(&tokens, &[], &cpu);
    let hidden = tch::no_grad(|| target.model.model.forward(&input, None))
        .unwrap()
        .hidden;
    target
        .model
        .lm_head
        .forward(&hidden, &cpu)
        .to_kind(Kind::Float)
}

#[test]
fn a_sharded_checkpoint_with_an_index_equals_the_single_file() {
    let single = tempfile::tempdir().unwrap();
    write_tiny_model(single.path(), 5).unwrap();
    let sharded = tempfile::tempdir().unwrap();
    write_tiny_model(sharded.path(), 5).unwrap();
    std::fs::remove_file(sharded.path().join("model.safetensors")).unwrap();
    let tensors = Tensor::read_safetensors(single.path().join("model.safetensors")).unwrap();
    let (first, second) = tensors.split_at(tensors.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        write_safetensors(&sharded.path().join(file), part).unwrap();
        for (name, _) in part {
            weight_map.insert(name.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        sharded.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let diff = (logits(single.path(), Kind::Float) - logits(sharded.path(), Kind::Float))
        .abs()
        .max();
    assert_eq!(diff.double_value(&[]), 0.0);
}

#[test]
fn bf16_and_f16_weights_run_close_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 5).unwrap();
    let reference = logits(dir.path(), Kind::Float);
    for kind in [Kind::BFloat16, Kind::Half] {
        let diff = (logits(dir.path(), kind) - &reference)
            .abs()
            .max()
            .double_value(&[]);
        assert!(diff < 0.1, "{kind:?}: max |Δlogit| {diff}");
    }
}
