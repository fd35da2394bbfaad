//! Speculative decoding changes nothing in what the target says: greedy output token for token,
//! sampled output in distribution, and the KV cache it leaves behind.

use std::collections::BTreeMap;

use headway_engine::acceptance::Acceptance;
use headway_engine::drafters::{
    DraftModelDrafter, Drafter, EagleDrafter, EagleTreeShape, LookupDrafter, MedusaDrafter,
    NoDrafter, Verified, WithLookup,
};
use headway_engine::engine::{
    generate_greedy, generate_speculative, step_generations, Generating, Request, Session, Turn,
};
use headway_engine::tree::{DraftTree, Proposal, TreeChoices};
use headway_heads::{
    DraftVocab, Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaConfig, MedusaHeads,
};
use headway_model::mask::positions;
use headway_model::testing::{
    fixture_path, real_target, write_safetensors, write_tiny_model, write_tiny_model_with_width,
    TINY_VOCAB,
};
use headway_model::{
    generate, CpuPolicy, CpuThreads, ForwardInput, KvCache, Message, Sampler, SamplingParams,
    Target,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

fn tiny_target(seed: u64) -> (tempfile::TempDir, Target) {
    tiny_model_with_width(seed, TINY_VOCAB)
}

/// A tiny model like [`tiny_target`]'s with `width` rows of embedding and LM head.
fn tiny_model_with_width(seed: u64, width: usize) -> (tempfile::TempDir, Target) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model_with_width(dir.path(), seed, width).unwrap();
    let target = Target::load(dir.path(), Kind::Float, Device::Cpu, CpuThreads::new(2)).unwrap();
    (dir, target)
}

/// The tiny target of `seed` with every weight `w` replaced by `w · (1 + noise · ε)`, ε standard
/// normal: a draft whose distributions are close to the target's, so that most of its sampled
/// candidates have target mass and the q/p ratio and residual code run on nearly every node.
fn perturbed_copy(seed: u64, noise: f64) -> (tempfile::TempDir, Target) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), seed).unwrap();
    let weights = dir.path().join("model.safetensors");
    // Its own generator, not libtorch's global one: tests running beside this one draw from that
    // too, and the copy would change with the scheduling.
    let mut rng = StdRng::seed_from_u64(seed);
    let mut normal = move || {
        // Box–Muller.
        let (u, v): (f64, f64) = (1.0 - rng.random::<f64>(), rng.random());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    };
    let mut tensors = Tensor::read_safetensors(&weights).unwrap();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let perturbed: Vec<(String, Tensor)> = tensors
        .into_iter()
        .map(|(name, w)| {
            let epsilon: Vec<f32> = (0..w.numel()).map(|_| normal() as f32).collect();
            let factor = Tensor::from_slice(&epsilon).view(w.size().as_slice()) * noise + 1.0;
            (name, w * factor)
        })
        .collect();
    write_safetensors(&weights, &perturbed).unwrap();
    let target = Target::load(dir.path(), Kind::Float, Device::Cpu, CpuThreads::new(2)).unwrap();
    (dir, target)
}

/// LM-head widths of draft models beside [`TINY_VOCAB`]-wide targets (issue 21): a narrower one
/// cannot propose the target's last rows, a wider one has rows the target lacks.
const NARROWER: usize = TINY_VOCAB - 20;
const WIDER: usize = TINY_VOCAB + 80;

fn greedy() -> Sampler {
    Sampler::new(SamplingParams::default())
}

/// Proposes trees around the known plain continuation `truth`: the right path, to a random
/// depth, hides among wrong siblings (before or after it, some with children of their own), and
/// sometimes turns wrong part-way. Accepted paths are then long and scattered through the tree,
/// which is what stresses acceptance and KV compaction.
struct OracleDrafter {
    truth: Vec<u32>,
    rng: StdRng,
    /// Target taps to ask the engine for.
    taps: Vec<usize>,
    /// Every step's verified hidden states and taps.
    seen: Vec<(Tensor, Vec<Tensor>)>,
}

impl OracleDrafter {
    fn wrong(&mut self, right: u32) -> u32 {
        (right + 1 + self.rng.random_range(0..50)) % TINY_VOCAB as u32
    }
}

impl Drafter for OracleDrafter {
    fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> headway_engine::Result<DraftTree> {
        let taps = verified.taps.iter().map(Tensor::shallow_clone).collect();
        self.seen.push((verified.hidden.shallow_clone(), taps));
        let mut tree = DraftTree::new();
        let start = verified.context.len();
        let depth = self.rng.random_range(0..=5);
        let mut parent = None;
        for d in 0..depth {
            let Some(&right) = self.truth.get(start + d) else {
                break;
            };
            let token = if self.rng.random_bool(0.15) {
                self.wrong(right)
            } else {
                right
            };
            let wrong_before = self.rng.random_bool(0.4);
            if wrong_before {
                let w = self.wrong(right);
                let sibling = tree.push(w, parent, Proposal::Deterministic)?;
                if self.rng.random_bool(0.5) {
                    let w = self.wrong(right);
                    tree.push(w, Some(sibling), Proposal::Deterministic)?;
                }
            }
            let node = tree.push(token, parent, Proposal::Deterministic)?;
            if !wrong_before && self.rng.random_bool(0.5) {
                let w = self.wrong(right);
                tree.push(w, parent, Proposal::Deterministic)?;
            }
            parent = Some(node);
        }
        Ok(tree)
    }

    fn max_tree_tokens(&self) -> usize {
        20
    }

    fn taps(&self) -> &[usize] {
        &self.taps
    }
}

fn oracle(target: &Target, prompt: &[u32], new_tokens: usize, seed: u64) -> OracleDrafter {
    let plain = generate(target, prompt, new_tokens + 8, &mut greedy(), &mut |_| {}).unwrap();
    OracleDrafter {
        truth: prompt.iter().chain(&plain.tokens).copied().collect(),
        rng: StdRng::seed_from_u64(seed),
        taps: vec![],
        seen: vec![],
    }
}

/// Fresh two-layer EAGLE head with random weights over a reversed 200-token draft vocabulary (the
/// SmolLM2 test below runs a one-layer head), fusing the target's `taps` through a random
/// projection.
fn random_eagle(target: &Target, taps: Vec<usize>) -> (EagleHead, Vec<u32>) {
    tch::manual_seed(7);
    let d2t: Vec<u32> = (0..200).rev().collect();
    let vocab = DraftVocab { d2t: d2t.clone() };
    let lm_head = DraftVocab::lm_head_rows(Some(&vocab), target.model.lm_head.matrix());
    let mut head = EagleHead::new(
        EagleConfig::for_target(target.model.config(), 2).with_taps(taps),
        target.model.model.embedding(),
        &lm_head,
    )
    .unwrap();
    headway_heads::testing::randomize_tap_projection(&mut head, 0.1);
    head.params.freeze();
    (head, d2t)
}

/// A fresh EAGLE-3 head with random weights fusing taps 0 and 1, drafting over the same reversed
/// 200-token vocabulary.
fn random_eagle3(target: &Target) -> (Eagle3Head, Vec<u32>) {
    tch::manual_seed(8);
    let d2t: Vec<u32> = (0..200).rev().collect();
    let config = Eagle3Config::for_target(target.model.config(), vec![0, 1], d2t.len());
    let rows = Tensor::randn(
        [d2t.len() as i64, target.model.config().hidden_size as i64],
        (Kind::Float, Device::Cpu),
    );
    let mut head = Eagle3Head::new(config, target.model.model.embedding(), &rows).unwrap();
    head.params.freeze();
    (head, d2t)
}

/// Fresh Medusa heads (each the identity, so head k guesses the target's next token).
fn identity_medusa(target: &Target) -> MedusaHeads {
    let config = MedusaConfig {
        num_heads: 3,
        num_layers: 1,
        hidden_size: target.model.config().hidden_size,
        vocab_size: target.model.config().vocab_size,
        shared_lm_head: true,
    };
    let mut heads = MedusaHeads::new(config, target.model.lm_head.weight()).unwrap();
    heads.params.freeze();
    heads
}

fn random_prompts(count: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| {
            let len = rng.random_range(3..24);
            // Ids 3.. avoid the tiny model's special tokens; repeats give prompt lookup matches.
            (0..len).map(|_| rng.random_range(3..60)).collect()
        })
        .collect()
}

fn speculative_tokens(
    target: &Target,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    new_tokens: usize,
) -> (Vec<u32>, f64) {
    let out = generate_greedy(target, drafter, prompt, new_tokens).unwrap();
    (out.generation.tokens.clone(), out.tau())
}

#[test]
fn greedy_speculative_output_equals_plain_greedy_for_every_drafter() {
    let (_dir, target) = tiny_target(11);
    let (_draft_dir, other) = tiny_target(12);
    let (eagle, d2t) = random_eagle(&target, vec![]);
    let (tapped_eagle, _) = random_eagle(&target, vec![1]);
    let (eagle3, d2t3) = random_eagle3(&target);
    let medusa = identity_medusa(&target);
    let new_tokens = 40;
    let capacity = 24 + new_tokens + 1;
    let shape = EagleTreeShape {
        depth: 4,
        top_k: 3,
        tree_tokens: 10,
    };
    let choices = TreeChoices::new(vec![
        vec![0],
        vec![1],
        vec![0, 0],
        vec![0, 1],
        vec![0, 0, 0],
    ])
    .unwrap();
    let mut taus: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for (i, prompt) in random_prompts(20, 3).iter().enumerate() {
        let plain = generate(&target, prompt, new_tokens, &mut greedy(), &mut |_| {}).unwrap();
        let mut drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
            ("ar", Box::new(NoDrafter)),
            ("lookup", Box::new(LookupDrafter::default())),
            (
                "draft (other model)",
                Box::new(DraftModelDrafter::new(&other, &target, 4, capacity).unwrap()),
            ),
            (
                "draft (same model)",
                Box::new(DraftModelDrafter::new(&target, &target, 4, capacity).unwrap()),
            ),
            (
                "eagle",
                Box::new(EagleDrafter::new(&eagle, Some(&d2t), shape, capacity, decode()).unwrap()),
            ),
            (
                "eagle (tapped)",
                Box::new(
                    EagleDrafter::new(&tapped_eagle, Some(&d2t), shape, capacity, decode())
                        .unwrap(),
                ),
            ),
            (
                "eagle3",
                Box::new(
                    EagleDrafter::new(&eagle3, Some(&d2t3), shape, capacity, decode()).unwrap(),
                ),
            ),
            (
                "medusa",
                Box::new(MedusaDrafter::new(&medusa, None, choices.clone(), decode()).unwrap()),
            ),
            (
                "oracle",
                Box::new(oracle(&target, prompt, new_tokens, i as u64)),
            ),
            (
                "eagle + lookup",
                Box::new(WithLookup::new(
                    Box::new(
                        EagleDrafter::new(&eagle, Some(&d2t), shape, capacity, decode()).unwrap(),
                    ),
                    LookupDrafter::default(),
                )),
            ),
            (
                "medusa + lookup",
                Box::new(WithLookup::new(
                    Box::new(MedusaDrafter::new(&medusa, None, choices.clone(), decode()).unwrap()),
                    LookupDrafter::default(),
                )),
            ),
            (
                "draft (other model) + lookup",
                Box::new(WithLookup::new(
                    Box::new(DraftModelDrafter::new(&other, &target, 4, capacity).unwrap()),
                    LookupDrafter::default(),
                )),
            ),
        ];
        for (name, drafter) in &mut drafters {
            let (tokens, tau) = speculative_tokens(&target, drafter.as_mut(), prompt, new_tokens);
            assert_eq!(tokens, plain.tokens, "{name} on prompt {i}: {prompt:?}");
            taus.entry(name).or_default().push(tau);
        }
    }
    let mean = |name: &str| taus[name].iter().sum::<f64>() / taus[name].len() as f64;
    assert!((mean("ar") - 1.0).abs() < 1e-9, "plain decoding has τ = 1");
    // Drafts that are right must really be accepted, or this test proves little.
    assert!(
        mean("draft (same model)") > 3.0,
        "τ {}",
        mean("draft (same model)")
    );
    assert!(mean("oracle") > 1.8, "τ {}", mean("oracle"));
    // Both drafts must come through: the merged tree accepts about what the better one accepts
    // alone (a little less where lookup's longer matches go alone but the model was right), and
    // the draft model and lookup each add to the other here.
    for model in ["eagle", "medusa", "draft (other model)"] {
        let (alone, with) = (mean(model), mean(&format!("{model} + lookup")));
        let best = alone.max(mean("lookup"));
        assert!(
            with > best - 0.05,
            "{model}: τ {alone} alone, {} lookup alone, {with} together",
            mean("lookup")
        );
    }
    assert!(mean("draft (other model) + lookup") > mean("lookup") + 0.02);
}

/// A 16-bit KV cache (`--kv-dtype f16` or `bf16`): speculative decoding, whose accepted paths are
/// compacted in the cache, stays token for token plain decoding with the same cache, and the
/// cache really is in that type (plain decoding's output moves off the f32 cache's on some
/// prompt).
#[test]
fn greedy_speculative_output_equals_plain_greedy_with_a_sixteen_bit_cache() {
    let (_dir, mut target) = tiny_target(11);
    let new_tokens = 40;
    let prompts = random_prompts(12, 5);
    let plain_of = |target: &Target| -> Vec<Vec<u32>> {
        prompts
            .iter()
            .map(|p| {
                generate(target, p, new_tokens, &mut greedy(), &mut |_| {})
                    .unwrap()
                    .tokens
            })
            .collect()
    };
    let wide = plain_of(&target);
    for kind in [Kind::Half, Kind::BFloat16] {
        target.kv_kind = kind;
        assert_eq!(target.new_cache(1, 4).unwrap().layer(0).0.kind(), kind);
        let plain = plain_of(&target);
        if kind == Kind::BFloat16 {
            assert_ne!(plain, wide, "bf16 keys and values move some greedy output");
        }
        let (eagle3, d2t3) = random_eagle3(&target);
        let shape = EagleTreeShape {
            depth: 4,
            top_k: 3,
            tree_tokens: 10,
        };
        for (i, prompt) in prompts.iter().enumerate() {
            let mut drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
                ("lookup", Box::new(LookupDrafter::default())),
                (
                    "oracle",
                    Box::new(oracle(&target, prompt, new_tokens, i as u64)),
                ),
                (
                    "eagle3",
                    Box::new(EagleDrafter::new(&eagle3, Some(&d2t3), shape, 80, decode()).unwrap()),
                ),
            ];
            for (name, drafter) in &mut drafters {
                let (tokens, _) = speculative_tokens(&target, drafter.as_mut(), prompt, new_tokens);
                assert_eq!(
                    tokens, plain[i],
                    "{name}, {kind:?} cache, prompt {i}: {prompt:?}"
                );
            }
        }
    }
}

/// Issue 21: draft models whose LM head is narrower or wider than the target's, over the same
/// tokenizer, leave greedy output unchanged. Drawn with the target's seed they are the target
/// with rows cut off or added, so the wider one, its extra rows masked, drafts the target's own
/// argmax chain, and the narrower one does until the target emits an id past its rows.
#[test]
fn issue_21_greedy_output_is_unchanged_by_a_draft_of_another_lm_head_width() {
    let (_dir, target) = tiny_target(11);
    let (_narrower_dir, narrower) = tiny_model_with_width(11, NARROWER);
    let (_wider_dir, wider) = tiny_model_with_width(11, WIDER);
    let new_tokens = 40;
    let capacity = 24 + new_tokens + 1;
    let mut taus: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for (i, prompt) in random_prompts(10, 5).iter().enumerate() {
        let plain = generate(&target, prompt, new_tokens, &mut greedy(), &mut |_| {}).unwrap();
        for (name, draft) in [("narrower", &narrower), ("wider", &wider)] {
            let mut drafter = DraftModelDrafter::new(draft, &target, 4, capacity).unwrap();
            let (tokens, tau) = speculative_tokens(&target, &mut drafter, prompt, new_tokens);
            assert_eq!(
                tokens, plain.tokens,
                "{name} draft on prompt {i}: {prompt:?}"
            );
            taus.entry(name).or_default().push(tau);
        }
    }
    let mean = |name: &str| taus[name].iter().sum::<f64>() / taus[name].len() as f64;
    assert!(mean("wider") > 3.0, "τ {}", mean("wider"));
    assert!(mean("narrower") > 2.0, "τ {}", mean("narrower"));
}

/// Lossless speculative sampling of `new_tokens` after `prompt` under `params`.
fn sampled(
    target: &Target,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    new_tokens: usize,
    params: SamplingParams,
) -> headway_engine::engine::SpecGeneration {
    let mut sampler = Sampler::new(params);
    let acceptance = Acceptance::Lossless;
    generate_speculative(
        target,
        drafter,
        prompt,
        new_tokens,
        acceptance,
        &mut sampler,
        &mut |_| true,
    )
    .unwrap()
}

/// Issue 21: sampled drafts from a narrower or wider LM head propose only ids the target has,
/// from distributions over the target's width (zero past the draft's own rows), and speculative
/// sampling runs through them. Untruncated sampling makes every row a candidate.
#[test]
fn issue_21_sampled_drafts_of_another_lm_head_width_stay_in_the_target_vocabulary() {
    let (_dir, target) = tiny_target(31);
    let (_narrower_dir, narrower) = tiny_model_with_width(32, NARROWER);
    let (_wider_dir, wider) = tiny_model_with_width(32, WIDER);
    let params = SamplingParams::new(1.0, 0, 1.0, 0.0, 0).unwrap();
    let prompt: Vec<u32> = vec![7, 8, 9, 10];
    let new_tokens = 40;
    let capacity = prompt.len() + new_tokens + 1;
    let verified = Verified {
        context: &prompt,
        hidden: &Tensor::new(),
        taps: &[],
    };
    for (name, draft, proposable) in [
        ("narrower", &narrower, NARROWER),
        ("wider", &wider, TINY_VOCAB),
    ] {
        let mut drafter = DraftModelDrafter::new(draft, &target, 4, capacity).unwrap();
        let mut sampler = Sampler::new(params);
        for _ in 0..100 {
            let tree = drafter.draft(&verified, &mut sampler).unwrap();
            assert_eq!(tree.len(), 4);
            for node in tree.nodes() {
                assert!(
                    (node.token as usize) < proposable,
                    "{name} draft proposed {}",
                    node.token
                );
                let Proposal::Sampled(p) = &node.proposal else {
                    panic!("{name} draft proposed {} deterministically", node.token);
                };
                assert_eq!(p.len(), TINY_VOCAB, "{name} draft distribution");
                assert!(p[proposable..].iter().all(|&x| x == 0.0));
            }
        }
        for seed in 0..20 {
            let out = sampled(
                &target,
                &mut drafter,
                &prompt,
                new_tokens,
                params.with_seed(seed),
            );
            assert!(!out.generation.tokens.is_empty(), "{name} seed {seed}");
        }
    }
}

/// Keys and values of every layer for all cached positions.
fn cache_rows(cache: &KvCache, layers: usize) -> Vec<Tensor> {
    (0..layers)
        .flat_map(|l| {
            let (k, v) = cache.layer(l);
            [k, v]
        })
        .collect()
}

#[test]
fn kv_cache_after_speculative_steps_equals_plain_decoding_of_the_same_tokens() {
    let _no_grad = tch::no_grad_guard();
    let (_dir, target) = tiny_target(21);
    let prompt: Vec<u32> = vec![5, 9, 14, 9, 5, 30, 31];
    let mut drafter = oracle(&target, &prompt, 60, 4);
    drafter.taps = vec![1, 0];
    let mut sampler = greedy();
    let mut session = Session::start(
        &target,
        &prompt,
        60,
        &drafter,
        Acceptance::Lossless,
        &mut sampler,
    )
    .unwrap();
    let mut accepted = 0;
    for _ in 0..12 {
        accepted += session.step(&mut drafter, &mut sampler).unwrap().accepted();
    }
    assert!(
        accepted >= 12,
        "the oracle's drafts were accepted only {accepted} times"
    );
    let tokens = session.tokens();
    let cached = &tokens[..tokens.len() - 1];
    assert_eq!(session.cache().len(), cached.len());
    let config = target.model.config();
    let mut fresh = KvCache::new(config, 1, cached.len(), Kind::Float, Device::Cpu).unwrap();
    let ids =
        Tensor::from_slice(&cached.iter().map(|&t| i64::from(t)).collect::<Vec<_>>()).unsqueeze(0);
    let input = ForwardInput {
        input_ids: &ids,
        positions: &positions(0, cached.len(), Device::Cpu),
        mask: None,
        taps: &drafter.taps,
        cpu: &target.cpu.decode(),
    };
    let plain = target
        .model
        .model
        .forward(&input, Some(&mut fresh))
        .unwrap();
    // Step by step the drafter was handed the hidden states and taps of exactly the positions
    // entering the cache, in order (the last step's arrive with the next draft).
    let seen = Tensor::cat(
        &drafter
            .seen
            .iter()
            .map(|s| s.0.shallow_clone())
            .collect::<Vec<_>>(),
        0,
    );
    let n = seen.size()[0];
    assert!(n > prompt.len() as i64 + 12, "{n} positions seen");
    let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]) < 1e-4;
    assert!(close(&seen, &plain.hidden.get(0).narrow(0, 0, n)));
    for (k, tap) in plain.taps.iter().enumerate() {
        let seen_tap: Vec<Tensor> = drafter
            .seen
            .iter()
            .map(|s| s.1[k].shallow_clone())
            .collect();
        assert!(
            close(&Tensor::cat(&seen_tap, 0), &tap.get(0).narrow(0, 0, n)),
            "tap {k}"
        );
    }
    assert!(!close(&plain.taps[0], &plain.taps[1]));
    let layers = config.num_hidden_layers;
    for (a, b) in cache_rows(session.cache(), layers)
        .iter()
        .zip(cache_rows(&fresh, layers))
    {
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "cache differs by {diff}");
    }
}

/// Draws with a greedy draft chain from `inner` whatever the target samples with: deterministic
/// proposals (the target's own argmax chain when `inner` drafts with the target).
struct GreedyChain<'m>(DraftModelDrafter<'m>);

impl Drafter for GreedyChain<'_> {
    fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> headway_engine::Result<DraftTree> {
        self.0.draft(verified, &mut greedy())
    }

    fn max_tree_tokens(&self) -> usize {
        self.0.max_tree_tokens()
    }

    fn reset(&mut self) {
        self.0.reset()
    }
}

/// Decoding's CPU policy for drafters built by hand.
fn decode() -> CpuPolicy {
    CpuThreads::new(2).decode()
}

const FIRST_TOKENS: usize = 4;
const SAMPLES: usize = 2500;

fn sampling() -> SamplingParams {
    SamplingParams::new(1.0, 3, 1.0, 0.0, 0).unwrap()
}

/// Counts of the first four emitted tokens over `SAMPLES` generations sampled with `params`.
fn sequence_counts(
    mut generate_once: impl FnMut(&mut Sampler) -> Vec<u32>,
    params: SamplingParams,
) -> BTreeMap<Vec<u32>, usize> {
    let mut sampler = Sampler::new(params);
    let mut counts = BTreeMap::new();
    for _ in 0..SAMPLES {
        let mut tokens = generate_once(&mut sampler);
        tokens.truncate(FIRST_TOKENS);
        *counts.entry(tokens).or_insert(0) += 1;
    }
    counts
}

/// Pearson's chi-square test of homogeneity between two samples (rare sequences pooled);
/// returns (statistic, 0.999 critical value).
fn homogeneity(a: &BTreeMap<Vec<u32>, usize>, b: &BTreeMap<Vec<u32>, usize>) -> (f64, f64) {
    let keys: std::collections::BTreeSet<&Vec<u32>> = a.keys().chain(b.keys()).collect();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut rare = (0.0, 0.0);
    for key in keys {
        let (x, y) = (
            *a.get(key).unwrap_or(&0) as f64,
            *b.get(key).unwrap_or(&0) as f64,
        );
        if x + y < 20.0 {
            rare = (rare.0 + x, rare.1 + y);
        } else {
            cells.push((x, y));
        }
    }
    cells.push(rare);
    let (na, nb) = (
        cells.iter().map(|c| c.0).sum::<f64>(),
        cells.iter().map(|c| c.1).sum::<f64>(),
    );
    let mut stat = 0.0;
    for &(x, y) in &cells {
        let total = x + y;
        if total == 0.0 {
            continue;
        }
        let (ex, ey) = (total * na / (na + nb), total * nb / (na + nb));
        stat += (x - ex).powi(2) / ex + (y - ey).powi(2) / ey;
    }
    // Wilson–Hilferty approximation of the chi-square quantile, z = 3.09 for 0.999.
    let df = (cells.len() - 1) as f64;
    let h = 2.0 / (9.0 * df);
    (stat, df * (1.0 - h + 3.09 * h.sqrt()).powi(3))
}

#[test]
fn speculative_sampling_keeps_the_target_distribution_and_typical_acceptance_does_not() {
    let typical = Acceptance::Typical {
        threshold: 0.09,
        alpha: 0.3,
    };
    lossless_under(sampling(), Some(typical), true);
}

/// Min-p (issue 19) is applied to the target and the drafter alike, so acceptance stays lossless;
/// here beside temperature and top-p.
#[test]
fn speculative_sampling_with_min_p_keeps_the_target_distribution() {
    lossless_under(
        SamplingParams::new(0.8, 0, 0.95, 0.1, 0).unwrap(),
        None,
        false,
    );
}

/// Relative noise on the perturbed copy's weights ([`perturbed_copy`]).
const PERTURBATION: f64 = 0.04;

/// Issue 21: the lossless tests' perturbed copy gets most of its sampled candidates accepted, so
/// the distribution tests run the q/p ratio and the residual on most nodes; the unrelated draft
/// model beside it does not, which is why it alone proves little.
#[test]
fn most_sampled_candidates_of_a_perturbed_copy_are_accepted() {
    let (_dir, target) = tiny_target(31);
    let (_copy_dir, copy) = perturbed_copy(31, PERTURBATION);
    let (_other_dir, other) = tiny_target(32);
    let prompt: Vec<u32> = vec![7, 8, 9, 10];
    let new_tokens = 24;
    let capacity = prompt.len() + new_tokens + 8;
    let accepted_share = |draft: &Target| {
        let mut drafter = DraftModelDrafter::new(draft, &target, 3, capacity).unwrap();
        let (mut accepted, mut drafted) = (0, 0);
        for seed in 0..40 {
            let params = sampling().with_seed(seed);
            let out = sampled(&target, &mut drafter, &prompt, new_tokens, params);
            accepted += out.steps.iter().map(|s| s.accepted()).sum::<usize>();
            drafted += out.steps.iter().map(|s| s.tree_tokens).sum::<usize>();
        }
        accepted as f64 / drafted as f64
    };
    let (copy_share, other_share) = (accepted_share(&copy), accepted_share(&other));
    eprintln!("accepted shares: perturbed copy {copy_share:.3}, unrelated {other_share:.3}");
    assert!(
        copy_share > 0.6,
        "perturbed copy: {copy_share:.3} of its nodes accepted"
    );
    assert!(
        copy_share > other_share + 0.2,
        "unrelated draft: {other_share:.3}"
    );
}

/// Plain sampling and speculative sampling under `params` with a sampled draft model (an
/// unrelated one, and a perturbed copy of the target whose candidates are mostly accepted), a
/// deterministic argmax chain, a sampled draft with prompt lookup grafted on, an EAGLE-3 head's
/// tree and, with `other_widths`, draft models of narrower and wider LM heads give the same
/// distribution of the first tokens; `lossy`, given, must not.
fn lossless_under(params: SamplingParams, lossy: Option<Acceptance>, other_widths: bool) {
    let (_dir, target) = tiny_target(31);
    let (_draft_dir, other) = tiny_target(32);
    let prompt: Vec<u32> = vec![7, 8, 9, 10];
    let capacity = prompt.len() + FIRST_TOKENS + 8;
    let plain = sequence_counts(
        |sampler| {
            generate(&target, &prompt, FIRST_TOKENS, sampler, &mut |_| {})
                .unwrap()
                .tokens
        },
        params.with_seed(1),
    );
    let run = |drafter: &mut dyn Drafter, acceptance: Acceptance, seed: u64| {
        sequence_counts(
            |sampler| {
                generate_speculative(
                    &target,
                    drafter,
                    &prompt,
                    FIRST_TOKENS,
                    acceptance,
                    sampler,
                    &mut |_| true,
                )
                .unwrap()
                .generation
                .tokens
            },
            params.with_seed(seed),
        )
    };
    let mut sampled_draft = DraftModelDrafter::new(&other, &target, 3, capacity).unwrap();
    let (_copy_dir, copy) = perturbed_copy(31, PERTURBATION);
    let mut sampled_copy = DraftModelDrafter::new(&copy, &target, 3, capacity).unwrap();
    // Issue 21: LM heads of other widths, their distributions cut or padded to the target's.
    let (_narrower_dir, narrower) = tiny_model_with_width(32, NARROWER);
    let (_wider_dir, wider) = tiny_model_with_width(32, WIDER);
    let mut sampled_narrower = DraftModelDrafter::new(&narrower, &target, 3, capacity).unwrap();
    let mut sampled_wider = DraftModelDrafter::new(&wider, &target, 3, capacity).unwrap();
    let mut argmax_chain =
        GreedyChain(DraftModelDrafter::new(&target, &target, 3, capacity).unwrap());
    // Deterministic lookup candidates tried after sampled siblings.
    let mut sampled_with_lookup = WithLookup::new(
        Box::new(DraftModelDrafter::new(&other, &target, 3, capacity).unwrap()),
        LookupDrafter::default(),
    );
    // An EAGLE-3 head's top-k tree: deterministic siblings at every depth.
    let (eagle3, d2t3) = random_eagle3(&target);
    let shape = EagleTreeShape {
        depth: 3,
        top_k: 3,
        tree_tokens: 8,
    };
    let mut eagle3_tree =
        EagleDrafter::new(&eagle3, Some(&d2t3), shape, capacity, decode()).unwrap();
    let mut drafters: Vec<(&str, &mut dyn Drafter)> = vec![
        ("sampled draft model", &mut sampled_draft),
        ("sampled perturbed copy", &mut sampled_copy),
        ("deterministic argmax chain", &mut argmax_chain),
        ("sampled draft model + lookup", &mut sampled_with_lookup),
        ("EAGLE-3 tree", &mut eagle3_tree),
    ];
    if other_widths {
        drafters.push(("sampled narrower draft model", &mut sampled_narrower));
        drafters.push(("sampled wider draft model", &mut sampled_wider));
    }
    for (name, drafter) in drafters {
        let counts = run(drafter, Acceptance::Lossless, 2);
        let (stat, critical) = homogeneity(&plain, &counts);
        assert!(stat < critical, "{name}: chi2 {stat:.1} ≥ {critical:.1}");
    }
    if let Some(lossy) = lossy {
        let counts = run(&mut argmax_chain, lossy, 3);
        let (stat, critical) = homogeneity(&plain, &counts);
        assert!(
            stat > critical,
            "typical acceptance passed as lossless: chi2 {stat:.1} < {critical:.1}"
        );
    }
}

#[derive(serde::Deserialize)]
struct GreedyFixture {
    cases: Vec<GreedyCase>,
}

#[derive(serde::Deserialize)]
struct GreedyCase {
    messages: Vec<Message>,
}

#[test]
fn greedy_speculative_output_equals_plain_greedy_on_smollm2() {
    let target = real_target();
    let text = std::fs::read_to_string(fixture_path("greedy_reference.json")).unwrap();
    let fixture: GreedyFixture = serde_json::from_str(&text).unwrap();
    tch::manual_seed(3);
    let mut eagle = EagleHead::new(
        EagleConfig::for_target(target.model.config(), 1),
        target.model.model.embedding(),
        target.model.lm_head.weight(),
    )
    .unwrap();
    eagle.params.freeze();
    let config = target.model.config();
    let taps = Eagle3Config::default_taps(config.num_hidden_layers);
    let mut eagle3 = Eagle3Head::new(
        Eagle3Config::for_target(config, taps, config.vocab_size),
        target.model.model.embedding(),
        target.model.lm_head.weight(),
    )
    .unwrap();
    eagle3.params.freeze();
    let medusa = identity_medusa(&target);
    let new_tokens = 48;
    assert!(fixture.cases.len() >= 3);
    for case in &fixture.cases {
        let ids = target.chat_prompt_ids(&case.messages).unwrap();
        let plain = generate(&target, &ids, new_tokens, &mut greedy(), &mut |_| {}).unwrap();
        let capacity = ids.len() + new_tokens + 1;
        let shape = EagleTreeShape {
            depth: 3,
            top_k: 3,
            tree_tokens: 8,
        };
        let mut drafters: Vec<(&str, Box<dyn Drafter>)> = vec![
            ("lookup", Box::new(LookupDrafter::default())),
            (
                "eagle",
                Box::new(
                    EagleDrafter::new(&eagle, None, shape, capacity, target.cpu.decode()).unwrap(),
                ),
            ),
            (
                "eagle + lookup",
                Box::new(WithLookup::new(
                    Box::new(
                        EagleDrafter::new(&eagle, None, shape, capacity, target.cpu.decode())
                            .unwrap(),
                    ),
                    LookupDrafter::default(),
                )),
            ),
            (
                "eagle3",
                Box::new(
                    EagleDrafter::new(&eagle3, None, shape, capacity, target.cpu.decode()).unwrap(),
                ),
            ),
            (
                "medusa",
                Box::new(
                    MedusaDrafter::new(&medusa, None, TreeChoices::chain(2), target.cpu.decode())
                        .unwrap(),
                ),
            ),
            (
                "draft",
                Box::new(DraftModelDrafter::new(&target, &target, 3, capacity).unwrap()),
            ),
        ];
        for (name, drafter) in &mut drafters {
            let (tokens, _) = speculative_tokens(&target, drafter.as_mut(), &ids, new_tokens);
            assert_eq!(
                tokens, plain.tokens,
                "{name} on {:?}",
                case.messages[0].content
            );
        }
    }
}

/// Continuous batching: generations of different prompts and drafters, each joining the batch a
/// step after the one before it and leaving when done, are stepped together (their trees
/// verified in one forward) and each emits plain greedy decoding's tokens.
#[test]
fn generations_stepped_together_each_equal_plain_greedy() {
    let (_dir, target) = tiny_target(11);
    let (eagle3, d2t3) = random_eagle3(&target);
    let shape = EagleTreeShape {
        depth: 3,
        top_k: 2,
        tree_tokens: 6,
    };
    let new_tokens = 30;
    let capacity = 24 + new_tokens + 1;
    let prompts = random_prompts(9, 17);
    let drafter = |index: usize| -> Box<dyn Drafter + '_> {
        let eagle3 = || EagleDrafter::new(&eagle3, Some(&d2t3), shape, capacity, decode()).unwrap();
        match index % 4 {
            0 => Box::new(LookupDrafter::default()),
            1 => Box::new(NoDrafter),
            2 => Box::new(eagle3()),
            _ => Box::new(WithLookup::new(
                Box::new(eagle3()),
                LookupDrafter::default(),
            )),
        }
    };
    let mut waiting = prompts.iter().enumerate();
    let mut running: Vec<(usize, Generating, Box<dyn Drafter>, Sampler)> = Vec::new();
    let mut finished = BTreeMap::new();
    let mut widest = 0;
    loop {
        if let Some((index, prompt)) = waiting.next() {
            let (mut drafter, mut sampler) = (drafter(index), greedy());
            let request = Request {
                prompt_ids: prompt,
                max_new_tokens: new_tokens,
                acceptance: Acceptance::Lossless,
            };
            let generating = Generating::start(
                &target,
                drafter.as_mut(),
                request,
                &mut sampler,
                &mut |_| true,
            )
            .unwrap();
            running.push((index, generating, drafter, sampler));
        }
        if running.is_empty() {
            break;
        }
        widest = widest.max(running.len());
        let mut sinks: Vec<_> = running.iter().map(|_| |_: &str| true).collect();
        let mut turns: Vec<Turn> = running
            .iter_mut()
            .zip(&mut sinks)
            .map(|((_, generating, drafter, sampler), on_text)| Turn {
                generating,
                drafter: drafter.as_mut(),
                sampler,
                on_text,
            })
            .collect();
        step_generations(&mut turns).unwrap();
        drop(turns);
        let (done, rest): (Vec<_>, Vec<_>) = running.into_iter().partition(|r| r.1.is_done());
        running = rest;
        for (index, generating, ..) in done {
            finished.insert(index, generating.finish().generation.tokens);
        }
    }
    assert!(widest >= 4, "at most {widest} generations ran together");
    for (index, prompt) in prompts.iter().enumerate() {
        let plain = generate(&target, prompt, new_tokens, &mut greedy(), &mut |_| {}).unwrap();
        assert_eq!(finished[&index], plain.tokens, "prompt {index}: {prompt:?}");
    }
}
