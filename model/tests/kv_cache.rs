//! KV-cache and mask invariants on a tiny random model: incremental decoding, truncation,
//! compaction of an accepted tree path and tree-masked forwards must all reproduce plain forwards.

use headway_model::mask::positions;
use headway_model::testing::tiny_config;
use headway_model::{
    CausalLm, CpuPolicy, CpuThreads, ForwardInput, KvCache, RandomWeights, TreeInput,
};
use tch::{Device, Kind, Tensor};

const TOLERANCE: f64 = 1e-5;

fn tiny_model() -> CausalLm {
    let mut source = RandomWeights::new(7, Kind::Float, Device::Cpu);
    CausalLm::load(&tiny_config(), &mut source).unwrap()
}

/// Decoding's CPU policy (Headway's kernels), as the engine runs the model.
fn decode() -> CpuPolicy {
    CpuThreads::new(2).decode()
}

fn ids(tokens: &[i64]) -> Tensor {
    Tensor::from_slice(tokens).unsqueeze(0)
}

fn empty_cache(model: &CausalLm) -> KvCache {
    cache_of(model, Kind::Float, 64)
}

/// An empty cache of `capacity` positions whose keys and values are stored in `kind`.
fn cache_of(model: &CausalLm, kind: Kind, capacity: usize) -> KvCache {
    KvCache::new(model.config(), 1, capacity, kind, Device::Cpu).unwrap()
}

/// Hidden states of a causal forward over `tokens` after whatever `cache` holds.
fn run(model: &CausalLm, tokens: &[i64], cache: &mut KvCache) -> Tensor {
    let input_ids = ids(tokens);
    let positions = positions(cache.len(), tokens.len(), Device::Cpu);
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &positions,
        mask: None,
        taps: &[],
        cpu: &decode(),
    };
    model.model.forward(&input, Some(cache)).unwrap().hidden
}

/// [`run`] for its effect on the cache only.
fn prefill(model: &CausalLm, tokens: &[i64], cache: &mut KvCache) {
    let _ = run(model, tokens, cache);
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    (a - b).abs().max().double_value(&[])
}

fn assert_cache_eq(a: &KvCache, b: &KvCache, layers: usize) {
    assert_eq!(a.len(), b.len(), "cache lengths differ");
    for layer in 0..layers {
        let ((ka, va), (kb, vb)) = (a.layer(layer), b.layer(layer));
        assert!(
            max_diff(&ka, &kb) < TOLERANCE,
            "keys of layer {layer} differ"
        );
        assert!(
            max_diff(&va, &vb) < TOLERANCE,
            "values of layer {layer} differ"
        );
    }
}

const PROMPT: [i64; 9] = [5, 77, 130, 12, 260, 3, 99, 45, 200];

#[test]
fn step_by_step_decoding_equals_one_full_forward() {
    let model = tiny_model();
    let full = run(&model, &PROMPT, &mut empty_cache(&model));
    let mut cache = empty_cache(&model);
    let mut steps = vec![run(&model, &PROMPT[..3], &mut cache)];
    for &token in &PROMPT[3..] {
        steps.push(run(&model, &[token], &mut cache));
    }
    assert!(max_diff(&full, &Tensor::cat(&steps, 1)) < TOLERANCE);
    assert_eq!(cache.len(), PROMPT.len());
}

#[test]
fn truncate_and_redo_equals_a_fresh_run() {
    let model = tiny_model();
    let mut cache = empty_cache(&model);
    prefill(&model, &PROMPT, &mut cache);
    cache.truncate(4).unwrap();
    let redone = run(&model, &[11, 22, 33], &mut cache);

    let mut fresh_cache = empty_cache(&model);
    let fresh = run(
        &model,
        &[PROMPT[0], PROMPT[1], PROMPT[2], PROMPT[3], 11, 22, 33],
        &mut fresh_cache,
    );
    assert!(max_diff(&redone, &fresh.narrow(1, 4, 3)) < TOLERANCE);
    assert_cache_eq(&cache, &fresh_cache, 2);
}

#[test]
fn truncating_beyond_the_cached_length_is_an_error() {
    let model = tiny_model();
    let mut cache = empty_cache(&model);
    prefill(&model, &PROMPT[..2], &mut cache);
    let err = cache.truncate(5).unwrap_err().to_string();
    assert!(err.contains("cannot truncate"), "{err}");
}

/// A small draft tree after the prefix: two branches from the root token, one of them deeper.
///   node 0 (root, token 40) ─ node 1 (41) ─ node 3 (43) ─ node 4 (44)
///                          └ node 2 (42) ─ node 5 (45)
const TREE_TOKENS: [i64; 6] = [40, 41, 42, 43, 44, 45];
const TREE_PARENTS: [Option<usize>; 6] = [None, Some(0), Some(0), Some(1), Some(3), Some(2)];

fn tree_forward(model: &CausalLm, cache: &mut KvCache) -> Tensor {
    let tokens: Vec<u32> = TREE_TOKENS.iter().map(|&t| t as u32).collect();
    let input = TreeInput::tree(cache.len(), &tokens, &TREE_PARENTS, Device::Cpu).unwrap();
    model
        .model
        .forward(&ForwardInput::new(&input, &[], &decode()), Some(cache))
        .unwrap()
        .hidden
}

/// Root-to-leaf paths of the tree, as node indices.
const TREE_PATHS: [&[usize]; 2] = [&[0, 1, 3, 4], &[0, 2, 5]];

#[test]
fn tree_masked_forward_equals_separate_forwards_of_each_path() {
    let model = tiny_model();
    let mut cache = empty_cache(&model);
    prefill(&model, &PROMPT, &mut cache);
    let tree_hidden = tree_forward(&model, &mut cache);
    for path in TREE_PATHS {
        let mut path_cache = empty_cache(&model);
        prefill(&model, &PROMPT, &mut path_cache);
        let tokens: Vec<i64> = path.iter().map(|&n| TREE_TOKENS[n]).collect();
        let path_hidden = run(&model, &tokens, &mut path_cache);
        for (depth, &node) in path.iter().enumerate() {
            let diff = max_diff(
                &tree_hidden.narrow(1, node as i64, 1),
                &path_hidden.narrow(1, depth as i64, 1),
            );
            assert!(
                diff < TOLERANCE,
                "node {node} differs from its path forward by {diff}"
            );
        }
    }
}

#[test]
fn compacting_an_accepted_path_equals_recomputing_without_the_dropped_nodes() {
    let model = tiny_model();
    let cases = TREE_PATHS
        .iter()
        .flat_map(|path| [(path, Kind::Float), (path, Kind::Half)]);
    for (path, kind) in cases {
        let mut cache = cache_of(&model, kind, 64);
        prefill(&model, &PROMPT, &mut cache);
        let _ = tree_forward(&model, &mut cache);
        let keep: Vec<usize> = path.iter().map(|&n| PROMPT.len() + n).collect();
        cache.compact(PROMPT.len(), &keep).unwrap();

        let mut expected = cache_of(&model, kind, 64);
        let tokens: Vec<i64> = PROMPT
            .iter()
            .copied()
            .chain(path.iter().map(|&n| TREE_TOKENS[n]))
            .collect();
        prefill(&model, &tokens, &mut expected);
        assert_cache_eq(&cache, &expected, 2);

        // Decoding continues from the compacted cache exactly as from the recomputed one.
        let next = run(&model, &[7], &mut cache);
        let next_expected = run(&model, &[7], &mut expected);
        assert!(max_diff(&next, &next_expected) < TOLERANCE);
    }
}

/// A 16-bit cache holds what an f32 cache holds, rounded once as it is written: layer 0's keys
/// and values (which depend on the tokens alone) equal the f32 cache's converted by libtorch,
/// whether the few-row layer wrote them (a short prompt) or libtorch (past 64 tokens).
#[test]
fn a_sixteen_bit_cache_holds_the_f32_cache_rounded_once() {
    let model = tiny_model();
    for tokens in [8, 100] {
        let prompt: Vec<i64> = (0..tokens).map(|t| (t * 7 + 3) % 250).collect();
        let mut wide = cache_of(&model, Kind::Float, 128);
        prefill(&model, &prompt, &mut wide);
        for kind in [Kind::Half, Kind::BFloat16] {
            let mut narrow = cache_of(&model, kind, 128);
            prefill(&model, &prompt, &mut narrow);
            let ((keys, values), (wide_keys, wide_values)) = (narrow.layer(0), wide.layer(0));
            assert_eq!(keys.kind(), kind);
            assert!(
                keys.equal(&wide_keys.to_kind(kind)),
                "{kind:?} keys, {tokens} tokens"
            );
            assert!(
                values.equal(&wide_values.to_kind(kind)),
                "{kind:?} values, {tokens} tokens"
            );
        }
    }
}

#[test]
fn compaction_rejects_unordered_or_out_of_range_positions() {
    let model = tiny_model();
    let mut cache = empty_cache(&model);
    prefill(&model, &PROMPT, &mut cache);
    for keep in [vec![5, 4], vec![2, 5], vec![6, 9]] {
        let err = cache.compact(4, &keep).unwrap_err().to_string();
        assert!(err.contains("invalid compaction"), "{err}");
    }
    assert_eq!(
        cache.len(),
        PROMPT.len(),
        "a rejected compaction leaves the cache untouched"
    );
}

#[test]
fn a_full_cache_is_an_error_not_a_panic() {
    let model = tiny_model();
    let mut cache = KvCache::new(model.config(), 1, 4, Kind::Float, Device::Cpu).unwrap();
    let input_ids = ids(&PROMPT);
    let positions = positions(0, PROMPT.len(), Device::Cpu);
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &positions,
        mask: None,
        taps: &[],
        cpu: &decode(),
    };
    let err = model
        .model
        .forward(&input, Some(&mut cache))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("KV cache full"), "{err}");
}

#[test]
fn taps_return_the_residual_stream_after_k_layers() {
    let model = tiny_model();
    let input_ids = ids(&PROMPT);
    let positions = positions(0, PROMPT.len(), Device::Cpu);
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &positions,
        mask: None,
        taps: &[0, 1],
        cpu: &decode(),
    };
    let out = model.model.forward(&input, None).unwrap();
    let embeddings = model
        .model
        .embed_tokens()
        .index_select(0, &input_ids.squeeze_dim(0))
        .unsqueeze(0);
    assert!(
        max_diff(&out.taps[0], &embeddings) < TOLERANCE,
        "tap 0 is the embedding output"
    );
    assert!(
        max_diff(&out.taps[1], &out.taps[0]) > 1e-3,
        "tap 1 has passed a layer"
    );
    let bad = ForwardInput {
        taps: &[2],
        cpu: &decode(),
        ..input
    };
    let err = model.model.forward(&bad, None).err().unwrap().to_string();
    assert!(err.contains("tap 2 out of range"), "{err}");
}

#[test]
fn wrong_input_shapes_and_ids_are_errors() {
    let model = tiny_model();
    let error = |input_ids: &Tensor, positions: &Tensor, mask: Option<&Tensor>| {
        let input = ForwardInput {
            input_ids,
            positions,
            mask,
            taps: &[],
            cpu: &decode(),
        };
        model.model.forward(&input, None).err().unwrap().to_string()
    };
    let pos = positions(0, PROMPT.len(), Device::Cpu);
    let err = error(&Tensor::from_slice(&PROMPT), &pos, None);
    assert!(err.contains("input_ids must be [batch, new]"), "{err}");

    let pos2 = positions(0, 2, Device::Cpu);
    let err = error(&ids(&[1, 100_000]), &pos2, None);
    assert!(err.contains("outside the vocabulary"), "{err}");

    let bad_mask = Tensor::ones([1, 1, 2, 3], (Kind::Bool, Device::Cpu));
    let err = error(&ids(&[1, 2]), &pos2, Some(&bad_mask));
    assert!(err.contains("mask must be Bool"), "{err}");
}
