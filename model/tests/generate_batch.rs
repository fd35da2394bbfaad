//! Batched generation (right-aligned caches, padded attention, finished sequences dropped) gives
//! each prompt the reply that generating it alone gives.

use headway_model::testing::write_tiny_model;
use headway_model::{generate, generate_batch, CpuThreads, Sampler, SamplingParams, Target};
use tch::{Device, Kind};

fn tiny_target() -> (tempfile::TempDir, Target) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 11).unwrap();
    let target = Target::load(dir.path(), Kind::Float, Device::Cpu, CpuThreads::new(2)).unwrap();
    (dir, target)
}

/// Prompts of 1 to 40 tokens and budgets of 0 to 24 tokens, so sequences start at different
/// offsets and finish at different steps (which drops them from the batch).
fn requests(count: usize) -> (Vec<Vec<u32>>, Vec<usize>) {
    let prompts = (0..count)
        .map(|i| {
            (0..1 + (i * 7) % 40)
                .map(|j| 3 + ((i * 31 + j * 17) % 250) as u32)
                .collect()
        })
        .collect();
    let budgets = (0..count).map(|i| (i * 5) % 25).collect();
    (prompts, budgets)
}

fn sampler(temperature: f64, seed: u64) -> Sampler {
    Sampler::new(SamplingParams::new(temperature, 0, 1.0, 0.0, seed).unwrap())
}

fn assert_batch_equals_one_by_one(temperature: f64) {
    let (_dir, target) = tiny_target();
    let (prompts, budgets) = requests(24);
    let mut samplers: Vec<Sampler> = (0..prompts.len())
        .map(|i| sampler(temperature, i as u64))
        .collect();
    let batched = generate_batch(&target, &prompts, &budgets, &mut samplers).unwrap();
    for (i, (prompt, &budget)) in prompts.iter().zip(&budgets).enumerate() {
        let alone = generate(
            &target,
            prompt,
            budget,
            &mut sampler(temperature, i as u64),
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(
            batched[i].tokens, alone.tokens,
            "prompt {i} (budget {budget})"
        );
        assert_eq!(batched[i].text, alone.text, "prompt {i}");
        assert_eq!(batched[i].stop_reason, alone.stop_reason, "prompt {i}");
    }
}

#[test]
fn greedy_batched_replies_equal_replies_generated_alone() {
    assert_batch_equals_one_by_one(0.0);
}

#[test]
fn sampled_batched_replies_equal_replies_generated_alone_with_the_same_seeds() {
    assert_batch_equals_one_by_one(1.0);
}

#[test]
fn mismatched_budgets_and_samplers_are_errors() {
    let (_dir, target) = tiny_target();
    let (prompts, budgets) = requests(3);
    let mut samplers = vec![sampler(0.0, 0)];
    let error = generate_batch(&target, &prompts, &budgets, &mut samplers).unwrap_err();
    assert!(
        error
            .to_string()
            .contains("3 prompts, 3 token budgets and 1 samplers"),
        "{error}"
    );
    let too_long = vec![vec![5u32; 10]];
    let mut one = vec![sampler(0.0, 0)];
    let error = generate_batch(&target, &too_long, &[1_000_000], &mut one).unwrap_err();
    assert!(
        error.to_string().contains("exceed the model's context"),
        "{error}"
    );
}
