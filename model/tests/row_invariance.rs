//! Bitwise row-count invariance: the final hidden state and logits of a token verified inside a
//! tree of any size (1…64 new tokens, any shape, any prefix length) are `equal` — not close — to
//! decoding it alone after its ancestors. The greedy identity of speculative decoding rests on it:
//! two logits a few ulps apart would otherwise pick different tokens in the two runs.
//!
//! Prefix lengths cross the block sizes of libtorch's CPU attention (32 queries, 512 keys), which
//! the decode policy no longer uses, so a regression to it fails here.

use headway_model::config::HfConfig;
use headway_model::mask::tree_depths;
use headway_model::testing::tiny_config_json;
use headway_model::{
    CausalLm, CpuPolicy, CpuThreads, ForwardInput, KvCache, ModelConfig, RandomWeights,
    SequenceForward, TreeInput,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

const TREE_SIZES: [usize; 9] = [1, 2, 3, 5, 8, 16, 17, 32, 64];

/// The tiny model's layout, and one whose sizes are no multiple of any vector width (hidden 80,
/// 5 query heads over 1 key/value head of 16, MLP 200), so tails of every kernel are exercised.
fn configs() -> Vec<ModelConfig> {
    let odd = serde_json::json!({
        "hidden_size": 80, "intermediate_size": 200, "num_attention_heads": 5,
        "num_key_value_heads": 1, "max_position_embeddings": 2048,
    });
    let mut odd_json = tiny_config_json();
    for (key, value) in odd.as_object().expect("an object") {
        odd_json[key] = value.clone();
    }
    let mut tiny_json = tiny_config_json();
    tiny_json["max_position_embeddings"] = 2048.into();
    [tiny_json, odd_json]
        .into_iter()
        .map(|json| {
            let raw: HfConfig = serde_json::from_value(json).expect("a valid config");
            raw.resolve(std::path::Path::new("config.json"))
                .expect("it resolves")
        })
        .collect()
}

fn model(config: &ModelConfig, kind: Kind) -> CausalLm {
    let mut source = RandomWeights::new(11, kind, Device::Cpu);
    CausalLm::load(config, &mut source).unwrap()
}

fn decode() -> CpuPolicy {
    CpuThreads::new(2).decode()
}

/// A random tree of `size` nodes (parents before children) and its tokens.
fn random_tree(rng: &mut StdRng, size: usize, vocab: usize) -> (Vec<u32>, Vec<Option<usize>>) {
    let parents = (0..size)
        .map(|node| match node {
            0 => None,
            // Mostly under one of the last few nodes: deep paths as well as wide levels.
            _ if rng.random_bool(0.1) => None,
            _ => Some(rng.random_range(node.saturating_sub(4)..node)),
        })
        .collect();
    let tokens = (0..size)
        .map(|_| rng.random_range(0..vocab as u32))
        .collect();
    (tokens, parents)
}

/// Final hidden states `[1, n, hidden]` and logits `[1, n, vocab]` of `input` after the cache.
fn forward(model: &CausalLm, input: &TreeInput, cache: &mut KvCache) -> (Tensor, Tensor) {
    let cpu = decode();
    let hidden = model
        .model
        .forward(&ForwardInput::new(input, &[], &cpu), Some(cache))
        .unwrap()
        .hidden;
    let logits = model.lm_head.forward(&hidden, &cpu);
    (hidden, logits)
}

/// Checks every node of a random tree of `size` tokens after a random prefix of `prefix`
/// tokens against decoding it alone after its ancestors, the cache's keys and values stored in
/// `kind`.
fn check_tree(model: &CausalLm, kind: Kind, prefix: usize, size: usize, seed: u64) {
    let config = model.config();
    let mut rng = StdRng::seed_from_u64(seed);
    let prompt: Vec<u32> = (0..prefix)
        .map(|_| rng.random_range(0..config.vocab_size as u32))
        .collect();
    let (tokens, parents) = random_tree(&mut rng, size, config.vocab_size);
    let mut cache = KvCache::new(config, 1, prefix + size + 1, kind, Device::Cpu).unwrap();
    let _prefill = forward(
        model,
        &TreeInput::causal(0, &prompt, Device::Cpu),
        &mut cache,
    );
    let tree = TreeInput::tree(prefix, &tokens, &parents, Device::Cpu).unwrap();
    let (tree_hidden, tree_logits) = forward(model, &tree, &mut cache);
    // Depth first: when a node is decoded, the cache holds the prefix and exactly its ancestors.
    let depths = tree_depths(&parents);
    let mut pending: Vec<usize> = (0..size).rev().filter(|&n| parents[n].is_none()).collect();
    let mut checked = 0;
    while let Some(node) = pending.pop() {
        let depth = depths[node];
        cache.truncate(prefix + depth).unwrap();
        let alone = TreeInput::causal(prefix + depth, &tokens[node..=node], Device::Cpu);
        let (hidden, logits) = forward(model, &alone, &mut cache);
        let row = |t: &Tensor| t.narrow(1, node as i64, 1);
        let what = format!(
            "{kind:?}, hidden {}, prefix {prefix}, tree of {size} (seed {seed}): node {node} at depth {depth}",
            config.hidden_size
        );
        assert!(hidden.equal(&row(&tree_hidden)), "hidden differs: {what}");
        assert!(logits.equal(&row(&tree_logits)), "logits differ: {what}");
        pending.extend(
            (0..size)
                .rev()
                .filter(|&child| parents[child] == Some(node)),
        );
        checked += 1;
    }
    assert_eq!(checked, size, "every node is checked");
}

#[test]
fn every_tree_size_verifies_each_token_bit_for_bit_as_decoding_it() {
    for config in configs() {
        for kind in [Kind::Float, Kind::BFloat16] {
            let model = model(&config, kind);
            for (seed, &size) in TREE_SIZES.iter().enumerate() {
                check_tree(&model, kind, 37, size, seed as u64);
            }
        }
    }
}

/// A 16-bit cache under f32 activations (`--kv-dtype`): keys and values rounded as they are
/// written, by the few-row layer or by libtorch's prefill past 64 tokens, read back widened.
#[test]
fn sixteen_bit_caches_keep_verification_bit_exact() {
    for config in configs() {
        let model = model(&config, Kind::Float);
        for cache_kind in [Kind::Half, Kind::BFloat16] {
            for (seed, &size) in TREE_SIZES.iter().enumerate() {
                check_tree(&model, cache_kind, 37, size, seed as u64);
            }
            for prefix in [70, 513] {
                check_tree(&model, cache_kind, prefix, 64, prefix as u64);
            }
        }
    }
}

#[test]
fn prefixes_across_attention_block_sizes_keep_verification_bit_exact() {
    for config in configs() {
        for kind in [Kind::Float, Kind::BFloat16] {
            let model = model(&config, kind);
            for prefix in [1, 31, 33, 511, 513, 1100] {
                for size in [17, 64] {
                    check_tree(&model, kind, prefix, size, prefix as u64);
                }
            }
        }
    }
}

/// Several new tokens in order after the cache (a causal mask, no tree) also equal decoding them
/// one at a time.
#[test]
fn a_causal_run_equals_decoding_its_tokens_one_by_one() {
    let cases = configs()
        .into_iter()
        .flat_map(|config| [(config.clone(), Kind::Float), (config, Kind::Half)]);
    for (config, cache_kind) in cases {
        let model = model(&config, Kind::Float);
        let mut rng = StdRng::seed_from_u64(5);
        let tokens: Vec<u32> = (0..80).map(|_| rng.random_range(0..300)).collect();
        let (prompt, run) = tokens.split_at(16);
        let mut cache = KvCache::new(&config, 1, 128, cache_kind, Device::Cpu).unwrap();
        let _prefill = forward(
            &model,
            &TreeInput::causal(0, prompt, Device::Cpu),
            &mut cache,
        );
        let (together, _) = forward(&model, &TreeInput::causal(16, run, Device::Cpu), &mut cache);
        cache.truncate(16).unwrap();
        for (i, token) in run.iter().enumerate() {
            let input = TreeInput::causal(16 + i, std::slice::from_ref(token), Device::Cpu);
            let (alone, _) = forward(&model, &input, &mut cache);
            assert!(
                alone.equal(&together.narrow(1, i as i64, 1)),
                "token {i} of a causal run of {} ({cache_kind:?} cache)",
                run.len()
            );
        }
    }
}

/// The real SmolLM2: f32 trees of 64 and 17 tokens after a short prompt and after one longer than
/// 512 tokens; with bf16 weights (f32 activations on the CPU, the row kernel widening them) trees
/// of 64 and 17.
#[test]
fn smollm2_verifies_trees_bit_for_bit_as_decoding_them() {
    let dir = headway_model::testing::real_target_dir();
    for kind in [Kind::Float, Kind::BFloat16] {
        let target = headway_model::Target::load(&dir, kind, Device::Cpu, CpuThreads::new(2))
            .expect("loading the real target");
        assert_eq!(target.weight_kind, kind);
        assert_eq!(target.kind, Kind::Float, "activations on the CPU");
        let trees: &[(usize, usize)] = match kind {
            Kind::Float => &[(40, 64), (600, 17)],
            _ => &[(40, 64), (40, 17)],
        };
        for &(prefix, size) in trees {
            check_tree(&target.model, target.kind, prefix, size, size as u64);
        }
    }
}

/// One sequence of a batch: its prompt's length and what it feeds next (`None`: a causal run of
/// that many tokens, else a random tree of that many).
struct BatchedSequence {
    prefix: usize,
    new: usize,
    tree: bool,
}

/// Sequences of different lengths, some decoding one token, some verifying trees and one feeding
/// a causal run, forwarded together (more rows than one fused pass takes, so they split): each
/// gets the hidden states its own forward gives and its cache the same rows, bit for bit.
#[test]
fn sequences_forwarded_together_get_their_own_forwards_bits() {
    let batch = [(5, 1, false), (37, 8, true), (1, 1, false), (120, 17, true)]
        .into_iter()
        .chain([
            (600, 3, true),
            (64, 1, false),
            (9, 4, false),
            (20, 30, true),
        ])
        .chain([(3, 1, false), (513, 40, true), (7, 1, false)])
        .map(|(prefix, new, tree)| BatchedSequence { prefix, new, tree });
    let batch: Vec<BatchedSequence> = batch.collect();
    for config in configs() {
        let model = model(&config, Kind::Float);
        for (cache_kind, threads) in [(Kind::Float, 1), (Kind::Half, 1), (Kind::Float, 2)] {
            let mut rng = StdRng::seed_from_u64(21);
            let mut alone_caches = Vec::new();
            let mut together_caches = Vec::new();
            let mut inputs = Vec::new();
            for sequence in &batch {
                let prompt: Vec<u32> = (0..sequence.prefix)
                    .map(|_| rng.random_range(0..config.vocab_size as u32))
                    .collect();
                let room = sequence.prefix + sequence.new;
                let caches = [(); 2].map(|_| {
                    let mut cache =
                        KvCache::new(&config, 1, room, cache_kind, Device::Cpu).unwrap();
                    let prompt = TreeInput::causal(0, &prompt, Device::Cpu);
                    let _prefill = forward(&model, &prompt, &mut cache);
                    cache
                });
                let [alone, together] = caches;
                let input = if sequence.tree {
                    let (tokens, parents) = random_tree(&mut rng, sequence.new, config.vocab_size);
                    TreeInput::tree(sequence.prefix, &tokens, &parents, Device::Cpu).unwrap()
                } else {
                    let tokens: Vec<u32> = (0..sequence.new)
                        .map(|_| rng.random_range(0..config.vocab_size as u32))
                        .collect();
                    TreeInput::causal(sequence.prefix, &tokens, Device::Cpu)
                };
                alone_caches.push(alone);
                together_caches.push(together);
                inputs.push(input);
            }
            // One thread: a pool of this test's own (pools are shared by thread count), so that
            // the fork-joins counted below are its alone while other tests run; two: the
            // sequences' rows split between the threads.
            let cpu = CpuThreads::new(threads).decode();
            let taps = [1];
            let mut sequences: Vec<SequenceForward> = inputs
                .iter()
                .zip(together_caches.iter_mut())
                .map(|(input, cache)| SequenceForward {
                    input: ForwardInput::new(input, &taps, &cpu),
                    cache,
                })
                .collect();
            let joins = cpu.fork_joins();
            let together = model.model.forward_sequences(&mut sequences).unwrap();
            let together_joins = cpu.fork_joins() - joins;
            drop(sequences);
            let joins = cpu.fork_joins();
            for (index, (input, cache)) in inputs.iter().zip(alone_caches.iter_mut()).enumerate() {
                let alone = model
                    .model
                    .forward(&ForwardInput::new(input, &taps, &cpu), Some(cache))
                    .unwrap();
                let what = format!(
                    "hidden {}, {cache_kind:?} cache, sequence {index}",
                    config.hidden_size
                );
                assert!(
                    alone.hidden.equal(&together[index].hidden),
                    "hidden differs: {what}"
                );
                assert!(
                    alone.taps[0].equal(&together[index].taps[0]),
                    "tap differs: {what}"
                );
                let other = &together_caches[index];
                assert_eq!(cache.len(), other.len(), "{what}");
                for layer in 0..config.num_hidden_layers {
                    let (keys, values) = cache.layer(layer);
                    let (other_keys, other_values) = other.layer(layer);
                    assert!(
                        keys.equal(&other_keys),
                        "keys of layer {layer} differ: {what}"
                    );
                    assert!(
                        values.equal(&other_values),
                        "values of layer {layer} differ: {what}"
                    );
                }
            }
            // Three passes (of 37, 30 and 40 rows), against eleven forwards.
            let alone_joins = cpu.fork_joins() - joins;
            assert!(
                threads > 1 || 2 * together_joins < alone_joins,
                "{together_joins} fork-joins together, {alone_joins} alone: not fused"
            );
        }
    }
}
