//! `--tree-tokens auto`: pick the tree that maximises predicted tokens per second on this device.
//!
//! 1. Decode a few warm-up prompts greedily with the widest tree while recording what the
//!    drafter proposed at every step, and time the drafter and the acceptance.
//! 2. Measure the target's forward latency for 1…64 new tokens after the warm-up steps' mean
//!    context (on a GPU nearly flat, on a CPU nearly linear: this is what decides how wide a tree
//!    may be).
//! 3. Replay the recorded steps against the tokens that were finally emitted (greedy decoding's
//!    output is fixed, so the right token at every depth is known) to estimate the accepted length
//!    of every smaller tree: EAGLE shapes (depth, top-k, tree tokens) by re-selecting from the
//!    recorded candidates, Medusa trees built from the heads' measured per-rank accuracies.
//! 4. Predicted tokens/s = (1 + accepted) / (target latency of 1 + tree tokens + drafting time +
//!    acceptance time).
//!
//! With `--with-lookup` the warm-up decodes with lookup beside the widest tree, as the run will:
//! steps whose lookup chain is long verify it alone, and are replayed as they were for every
//! tree; in the others the chain is grafted onto each replayed model tree (Medusa's trees are
//! then built from each step's recorded guesses instead of the accuracy formula). A warm-up
//! without lookup predicted 0.94 tokens accepted a step where 0.62 came (6 Spec-Bench prompts, 48
//! tokens): text that lookup copies in a few long chains took the model alone many steps, each
//! replayed as one of lookup's long chains.
//!
//! The replay is exact for EAGLE shapes whose expanded nodes the wide run also expanded, and
//! treats the rare others as unexpanded (a slight underestimate).

use std::time::Instant;

use headway_heads::{FeatureHead, MedusaHeads};
use headway_model::{greedy_tokens, ForwardInput, KvCache, Target, TreeInput};
use tch::Kind;

use crate::drafters::{
    best_subtree, longest_match, lookup_alone, Candidate, DraftRecord, Drafter, EagleDrafter,
    EagleTreeShape, GuessRecord, LookupDrafter, LookupStep, MedusaDrafter, Recording, WithLookup,
    LONGEST_MATCH,
};
use crate::engine::{generate_greedy, Step};
use crate::error::Result;
use crate::tree::{DraftTree, Proposal, TreeChoices};

/// Tree sizes tried: up to 63 nodes, which with the root fill the 64 rows verified exactly
/// (`ROW_KERNEL_MAX_ROWS`).
const TREE_SIZES: [usize; 11] = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 63];

/// Target forward seconds by number of new tokens.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyProfile {
    pub tokens: Vec<usize>,
    pub seconds: Vec<f64>,
    /// Fork-joins of the CPU pool in one forward of each size (0 where no pool runs it).
    pub fork_joins: Vec<usize>,
}

impl LatencyProfile {
    /// Median of `reps` forwards of one token (plain decoding: causal, no mask) and of each tree
    /// size in [`TREE_SIZES`] (+1 for the root, tree-masked) after a `prefix`-token prompt.
    pub fn measure(target: &Target, prefix: usize, reps: usize) -> Result<Self> {
        let rows: Vec<usize> = std::iter::once(1)
            .chain(TREE_SIZES.map(|size| size + 1))
            .collect();
        Self::measure_rows(target, prefix, reps, &rows)
    }

    /// Median of `reps` forwards of each number of new tokens in `rows` (ascending) after a
    /// `prefix`-token prompt: one token as plain decoding runs it (causal, no mask), more as a
    /// tree-masked chain (the same work as any tree of that size); each with the LM head and the
    /// greedy choice at every row, as a step verifies.
    pub fn measure_rows(
        target: &Target,
        prefix: usize,
        reps: usize,
        rows: &[usize],
    ) -> Result<Self> {
        let _no_grad = tch::no_grad_guard();
        let cpu = target.cpu.decode();
        let largest = rows.iter().copied().max().unwrap_or(1);
        let mut cache = target.new_cache(1, prefix + largest)?;
        // Any ids the vocabulary has: the work does not depend on them.
        let vocab = target.model.config().vocab_size;
        let tokens =
            |n: usize| -> Vec<u32> { (0..n).map(|i| ((100 + i) % vocab) as u32).collect() };
        let forward = |cache: &mut KvCache, input: &TreeInput| -> Result<f64> {
            let start = Instant::now();
            let output = target
                .model
                .model
                .forward(&ForwardInput::new(input, &[], &cpu), Some(cache))?;
            let logits = target.model.lm_head.forward(&output.hidden.get(0), &cpu);
            greedy_tokens(&logits.to_kind(Kind::Float));
            Ok(start.elapsed().as_secs_f64())
        };
        forward(
            &mut cache,
            &TreeInput::causal(0, &tokens(prefix), target.device),
        )?;
        // A chain-shaped tree: the same work as any tree of this size. Plain decoding (no tree)
        // runs without a mask, as it does in the engine.
        let inputs = rows
            .iter()
            .map(|&n| match n {
                1 => Ok(TreeInput::causal(prefix, &tokens(n), target.device)),
                _ => {
                    let parents: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
                    TreeInput::tree(prefix, &tokens(n), &parents, target.device)
                }
            })
            .collect::<headway_model::Result<Vec<_>>>()?;
        let reps = reps.max(1);
        let mut times = vec![Vec::with_capacity(reps); rows.len()];
        let mut fork_joins = vec![0; rows.len()];
        // Round by round over every size, not one size's forwards in a row: a slow spell of a
        // shared host then lands on one forward of many sizes, which each median drops, instead
        // of on all forwards of one size. Largest first, so that each forward follows one a
        // little larger, as in decoding: right after a forward of 64 rows, one row ran 25–45 %
        // slower than after forwards of its own size, which made the one-row point, and every
        // size's multiple of it, wrong (Intel Xeon host, Q4_1 GGUF after 500 tokens, 2 threads:
        // one row 8.7–10.5 ms smallest first, 6.7–7.1 ms largest first, 6.8–7.3 ms after four
        // one-row forwards; 4 rows 1.21–1.35× one row smallest first, 1.55–1.63× the others).
        for _ in 0..reps {
            for (i, input) in inputs.iter().enumerate().rev() {
                let before = cpu.fork_joins();
                times[i].push(forward(&mut cache, input)?);
                fork_joins[i] = cpu.fork_joins() - before;
                cache.truncate(prefix)?;
            }
        }
        Ok(Self {
            tokens: rows.to_vec(),
            seconds: times
                .iter_mut()
                .map(|t| {
                    t.sort_by(f64::total_cmp);
                    t[t.len() / 2]
                })
                .collect(),
            fork_joins,
        })
    }

    /// One line: each measured row count's forward time and its multiple of one row's.
    pub fn describe(&self) -> String {
        let one = self.seconds.first().copied().unwrap_or(f64::NAN);
        let points: Vec<String> = self
            .tokens
            .iter()
            .zip(&self.seconds)
            .map(|(n, s)| format!("{n}: {:.2} ms ({:.2}×)", s * 1e3, s / one))
            .collect();
        format!("  verified rows → forward time: {}\n", points.join(", "))
    }

    /// Seconds for `n` new tokens (linear between measured sizes).
    pub fn at(&self, n: usize) -> f64 {
        let i = self.tokens.partition_point(|&t| t < n);
        match (i.checked_sub(1), self.tokens.get(i)) {
            (_, Some(&t)) if t == n => self.seconds[i],
            (Some(lo), Some(&hi)) => {
                let (t0, s0) = (self.tokens[lo] as f64, self.seconds[lo]);
                s0 + (self.seconds[i] - s0) * (n as f64 - t0) / (hi as f64 - t0)
            }
            (None, _) => self.seconds[0],
            (Some(_), None) => *self.seconds.last().expect("measured"),
        }
    }
}

/// One candidate tree and its prediction.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Prediction {
    pub description: String,
    pub tree_tokens: usize,
    /// Mean accepted draft tokens per step in the replay.
    pub accepted: f64,
    pub step_seconds: f64,
    pub tokens_per_s: f64,
}

/// What tuning predicted for the tree it chose, for the next best and for plain decoding, and
/// the rows curve it predicted from.
#[derive(Debug, Clone)]
pub struct Tuning {
    pub best: Prediction,
    pub ar_tokens_per_s: f64,
    /// The best few, best first.
    pub ranking: Vec<Prediction>,
    /// The target's forward time by verified rows, measured on this host before tuning.
    pub latency: LatencyProfile,
}

impl Tuning {
    /// A few lines for the log.
    pub fn describe(&self) -> String {
        let mut out = format!(
            "tree auto-tuning (predicted; plain decoding {:.1} tokens/s):\n",
            self.ar_tokens_per_s
        );
        if self.best.tokens_per_s < self.ar_tokens_per_s {
            out.push_str(
                "  warning: plain decoding is predicted faster than any tree on this device (use --method ar)\n",
            );
        }
        for p in &self.ranking {
            out.push_str(&format!(
                "  {:<40} accepted {:.2}/step, τ {:.2}, {:.1} tokens/s ({:.2}× ar)\n",
                p.description,
                p.accepted,
                1.0 + p.accepted,
                p.tokens_per_s,
                p.tokens_per_s / self.ar_tokens_per_s
            ));
        }
        out.push_str(&self.latency.describe());
        out
    }
}

/// What a recorded warm-up gives: every model step's record with the tokens the target emitted
/// after its root and, with a lookup drafter beside the model, its chain there; the steps lookup
/// took alone; and the drafter's and the acceptance's time.
struct WarmUp<R> {
    steps: Vec<(R, Vec<u32>)>,
    lookup_chains: Option<Vec<Vec<u32>>>,
    /// Lookup's chain and the emitted tokens after the root, of each step lookup took alone: the
    /// same for every model tree, they are replayed beside the model's.
    alone: Vec<(Vec<u32>, Vec<u32>)>,
    times: StepTimes,
}

/// The seconds a warm-up's steps spent drafting and accepting, and how many steps it took.
#[derive(Default)]
struct StepTimes {
    draft_seconds: f64,
    accept_seconds: f64,
    step_count: usize,
}

impl<R> WarmUp<R> {
    /// Mean seconds of a warm-up step spent accepting (and compacting the cache): every replayed
    /// step pays them beside its verification.
    fn accept_step(&self) -> f64 {
        self.times.accept_seconds / self.times.step_count.max(1) as f64
    }

    /// The steps lookup took alone, replayed: (accepted tokens, seconds) each.
    fn alone_steps<'w>(
        &'w self,
        latency: &'w LatencyProfile,
    ) -> impl Iterator<Item = (usize, f64)> + 'w {
        let costs = StepCosts {
            draft: 0.0,
            accept: self.accept_step(),
        };
        self.alone.iter().map(move |(chain, truth)| {
            replay_step(DraftTree::new(), Some(chain), truth, latency, costs)
        })
    }
}

/// What a replayed step costs besides verifying its tree: drafting (none where lookup's chain is
/// verified alone) and acceptance with the cache's compaction.
#[derive(Debug, Clone, Copy)]
struct StepCosts {
    draft: f64,
    accept: f64,
}

/// Greedy decoding of every prompt with the drafter `make` builds for the room they need (with
/// `lookup` beside it, as it will run), recording its drafts, then the target's latency profile
/// after the warm-up steps' mean context (attention's cost grows with the context, so the mean
/// step costs the step there: measured after the longest prompt, plain decoding's predicted rate
/// was 0.65–0.97× what Spec-Bench's prompts then decoded at).
fn profile_and_record<D: Recording>(
    target: &Target,
    make: impl FnOnce(usize) -> Result<D>,
    lookup: Option<&LookupDrafter>,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> Result<(LatencyProfile, WarmUp<D::Record>)> {
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let drafter = make(longest + new_tokens + 1)?;
    let mut warm_up = WarmUp {
        steps: Vec::new(),
        lookup_chains: lookup.map(|_| Vec::new()),
        alone: Vec::new(),
        times: StepTimes::default(),
    };
    match lookup {
        None => {
            let mut drafter = drafter;
            for prompt in prompts {
                let (records, sequence) =
                    decode_recorded(target, &mut drafter, prompt, new_tokens, &mut warm_up.times)?;
                for record in records {
                    let truth = sequence[D::root(&record) + 1..].to_vec();
                    warm_up.steps.push((record, truth));
                }
            }
        }
        Some(lookup) => {
            let mut drafter = WithLookup::new(drafter, *lookup);
            for prompt in prompts {
                let (records, sequence) =
                    decode_recorded(target, &mut drafter, prompt, new_tokens, &mut warm_up.times)?;
                for step in records {
                    let root = WithLookup::<D>::root(&step);
                    let (chain, truth) = (
                        lookup.propose(&sequence[..=root]),
                        sequence[root + 1..].to_vec(),
                    );
                    match step {
                        LookupStep::Model(record) => {
                            warm_up.steps.push((record, truth));
                            warm_up.lookup_chains.get_or_insert_default().push(chain);
                        }
                        LookupStep::Alone { .. } => warm_up.alone.push((chain, truth)),
                    }
                }
            }
        }
    }
    Ok((warm_up_latency(target, prompts, new_tokens)?, warm_up))
}

/// The target's latency profile after the mean context of warm-up steps over `prompts` with
/// `new_tokens` each (see [`profile_and_record`]).
fn warm_up_latency(
    target: &Target,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> Result<LatencyProfile> {
    let mean_context = prompts
        .iter()
        .map(|p| p.len() + new_tokens / 2)
        .sum::<usize>()
        / prompts.len().max(1);
    LatencyProfile::measure(target, mean_context.max(64), 5)
}

/// Greedy decoding of `prompt` by `drafter` while it records: its records, and the prompt with
/// the tokens emitted after it; the steps' times are added to `times`.
fn decode_recorded<W: Recording>(
    target: &Target,
    drafter: &mut W,
    prompt: &[u32],
    new_tokens: usize,
    times: &mut StepTimes,
) -> Result<(Vec<W::Record>, Vec<u32>)> {
    drafter.record();
    let (_, sequence) = decode_timed(target, drafter, prompt, new_tokens, times)?;
    Ok((drafter.take_records(), sequence))
}

/// Greedy decoding of `prompt` by `drafter`: its steps, and the prompt with the tokens emitted
/// after it; the steps' times are added to `times`.
fn decode_timed(
    target: &Target,
    drafter: &mut dyn Drafter,
    prompt: &[u32],
    new_tokens: usize,
    times: &mut StepTimes,
) -> Result<(Vec<Step>, Vec<u32>)> {
    let out = generate_greedy(target, drafter, prompt, new_tokens)?;
    times.draft_seconds += out.steps.iter().map(|s| s.draft_seconds).sum::<f64>();
    times.accept_seconds += out.steps.iter().map(|s| s.accept_seconds).sum::<f64>();
    times.step_count += out.steps.len();
    let sequence = prompt
        .iter()
        .chain(&out.generation.tokens)
        .copied()
        .collect();
    Ok((out.steps, sequence))
}

/// Accepted length of `tree` when the right continuation after the root is `truth`.
fn accepted_length(tree: &DraftTree, truth: &[u32]) -> usize {
    let mut parent = None;
    let mut accepted = 0;
    while let Some(&want) = truth.get(accepted) {
        match tree
            .children(parent)
            .find(|&c| tree.nodes()[c].token == want)
        {
            Some(c) => {
                parent = Some(c);
                accepted += 1;
            }
            None => break,
        }
    }
    accepted
}

/// Accepted tokens and seconds of one replayed step whose model tree is `tree`; under
/// `--with-lookup`, `chain` is lookup's proposal for the step, verified alone when long (the model
/// then does not draft) and otherwise grafted onto the tree.
fn replay_step(
    tree: DraftTree,
    chain: Option<&[u32]>,
    truth: &[u32],
    latency: &LatencyProfile,
    costs: StepCosts,
) -> (usize, f64) {
    let (tree, drafted) = match chain {
        None => (tree, true),
        Some(chain) => match lookup_alone(chain) {
            Some(alone) => (alone, false),
            None => {
                let mut tree = tree;
                tree.graft_chain(chain);
                (tree, true)
            }
        },
    };
    let draft = if drafted { costs.draft } else { 0.0 };
    let seconds = latency.at(tree.len() + 1) + draft + costs.accept;
    (accepted_length(&tree, truth), seconds)
}

/// Mean accepted tokens and mean seconds of replayed steps.
fn mean_step(steps: impl Iterator<Item = (usize, f64)>) -> (f64, f64) {
    let (mut count, mut accepted, mut seconds) = (0usize, 0usize, 0.0);
    for (a, s) in steps {
        count += 1;
        accepted += a;
        seconds += s;
    }
    let n = count.max(1) as f64;
    (accepted as f64 / n, seconds / n)
}

/// The candidates an EAGLE drafter of `shape` would have drafted, re-selected from a wider
/// recorded step (children are recorded best first, so narrower top-k keeps a prefix of them).
fn replay_candidates(record: &DraftRecord, depth: usize, top_k: usize) -> Vec<Candidate> {
    let all = &record.candidates;
    let children = |parent: Option<usize>| -> Vec<usize> {
        (0..all.len())
            .filter(|&i| all[i].parent == parent)
            .take(top_k)
            .collect()
    };
    let mut kept: Vec<usize> = children(None);
    let mut newest = kept.clone();
    for _ in 1..depth {
        newest.sort_by(|&a, &b| all[b].score.total_cmp(&all[a].score));
        newest.truncate(top_k);
        newest = newest
            .iter()
            .filter(|&&c| all[c].expanded())
            .flat_map(|&c| children(Some(c)))
            .collect();
        kept.extend(&newest);
    }
    kept.sort_unstable();
    let mut index = vec![usize::MAX; all.len()];
    kept.iter()
        .enumerate()
        .map(|(i, &c)| {
            index[c] = i;
            all[c].with_parent(all[c].parent.map(|p| index[p]))
        })
        .collect()
}

fn prediction(
    description: String,
    tree_tokens: usize,
    accepted: f64,
    step_seconds: f64,
) -> Prediction {
    Prediction {
        description,
        tree_tokens,
        accepted,
        step_seconds,
        tokens_per_s: (1.0 + accepted) / step_seconds,
    }
}

/// The best option and the predictions (the best few, best first, and plain decoding's).
fn finish<T>(mut options: Vec<(Prediction, T)>, latency: &LatencyProfile) -> (T, Tuning) {
    options.sort_by(|a, b| b.0.tokens_per_s.total_cmp(&a.0.tokens_per_s));
    let ranking: Vec<Prediction> = options.iter().take(5).map(|o| o.0.clone()).collect();
    let best = options.into_iter().next().expect("at least one option").1;
    let tuning = Tuning {
        best: ranking[0].clone(),
        ar_tokens_per_s: 1.0 / latency.at(1),
        ranking,
        latency: latency.clone(),
    };
    (best, tuning)
}

/// An EAGLE tree's drafting seconds by its shape, from the widest shape's warm-up: the catch-up
/// and the root's guesses, which every tree pays, then one expansion of top-k rows a further
/// depth, priced from the widest shape's by the target's rows curve (the head's layer and LM
/// head run on the target's kernels, so the curve's shape carries over).
#[derive(Debug, Clone, Copy)]
struct DraftingCost {
    root: f64,
    widest_depth: f64,
    widest_top_k: usize,
}

impl DraftingCost {
    /// Means over the recorded steps of a drafter whose top-k was `widest_top_k` (the head's
    /// pass over each prompt is its prefill, in no step).
    fn recorded<'r>(records: impl Iterator<Item = &'r DraftRecord>, widest_top_k: usize) -> Self {
        let (mut steps, mut root) = (0usize, 0.0);
        let (mut depths, mut depth) = (0usize, 0.0);
        for record in records {
            steps += 1;
            root += record.root_seconds;
            depths += record.depth_seconds.len();
            depth += record.depth_seconds.iter().sum::<f64>();
        }
        Self {
            root: root / steps.max(1) as f64,
            widest_depth: depth / depths.max(1) as f64,
            widest_top_k,
        }
    }

    fn seconds(&self, depth: usize, top_k: usize, latency: &LatencyProfile) -> f64 {
        let width = latency.at(top_k) / latency.at(self.widest_top_k);
        self.root + depth.saturating_sub(1) as f64 * self.widest_depth * width
    }
}

/// Tunes an EAGLE (EAGLE-1 or EAGLE-3) head's tree shape (depth ≤ `max.depth`, top-k ≤ `max.top_k`, tree tokens ≤
/// `max.tree_tokens`) on this device, alone or beside `lookup` (`--with-lookup`).
pub fn tune_eagle(
    target: &Target,
    head: &dyn FeatureHead,
    d2t: Option<&[u32]>,
    max: EagleTreeShape,
    lookup: Option<&LookupDrafter>,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> Result<(EagleTreeShape, Tuning)> {
    let cpu = target.cpu.decode();
    let make = |capacity| EagleDrafter::new(head, d2t, max, capacity, cpu);
    let (latency, warm_up) = profile_and_record(target, make, lookup, prompts, new_tokens)?;
    let accept = warm_up.accept_step();
    let (steps, lookup_chains) = (&warm_up.steps, &warm_up.lookup_chains);
    let chain = |i: usize| lookup_chains.as_ref().map(|c| c[i].as_slice());
    let drafting = DraftingCost::recorded(steps.iter().map(|(record, _)| record), max.top_k);
    let mut options = Vec::new();
    for depth in 1..=max.depth {
        for top_k in [1, 2, 4, 8, 16].into_iter().filter(|&k| k <= max.top_k) {
            let replays: Vec<(Vec<Candidate>, &[u32])> = steps
                .iter()
                .map(|(r, truth)| (replay_candidates(r, depth, top_k), truth.as_slice()))
                .collect();
            // A tree of n tokens is at most n deep and keeps at most n children of a node: a
            // deeper or wider draft selects the same tree for more drafting time. The shape
            // drafts at most top-k nodes at depth 1 and top-k² at each later depth, so sizes past
            // the first that holds them all give the same tree.
            let drafted = top_k + (depth - 1) * top_k * top_k;
            let all_drafted = TREE_SIZES.into_iter().find(|&n| n >= drafted);
            let sizes = TREE_SIZES.into_iter().filter(|&n| {
                n <= max.tree_tokens
                    && n >= depth
                    && n >= top_k
                    && all_drafted.is_none_or(|all| n <= all)
            });
            for tree_tokens in sizes {
                let (accepted, seconds) = mean_step(
                    replays
                        .iter()
                        .enumerate()
                        .map(|(i, (c, truth))| {
                            let tree = best_subtree(c, tree_tokens);
                            let draft = drafting.seconds(depth, top_k, &latency);
                            replay_step(
                                tree,
                                chain(i),
                                truth,
                                &latency,
                                StepCosts { draft, accept },
                            )
                        })
                        .chain(warm_up.alone_steps(&latency)),
                );
                let shape = EagleTreeShape {
                    depth,
                    top_k,
                    tree_tokens,
                };
                let predicted = prediction(
                    format!("depth {depth}, top-k {top_k}, {tree_tokens} tokens"),
                    tree_tokens,
                    accepted,
                    seconds,
                );
                options.push((predicted, shape));
            }
        }
    }
    Ok(finish(options, &latency))
}

/// One step of a lookup warm-up: the match lookup found before it (if any), the tokens after
/// that match (as many as the widest lookup proposes), and the tokens the target emitted after
/// the step's root.
#[derive(Debug, Clone)]
pub struct LookupRecord {
    pub match_length: Option<usize>,
    pub continuation: Vec<u32>,
    pub truth: Vec<u32>,
}

/// Tunes prompt lookup's tokens after a match of each length (`after_match`, each up to
/// `widest`'s) on this device: the warm-up decodes with `widest`, and every step is replayed with
/// each choice of caps, the chain cut to its match length's cap. Matches differ in what they
/// predict (a lone repeated token is right about a quarter of the time, a repeated trigram far
/// more often), and each proposed token costs a verified row.
pub fn tune_lookup(
    target: &Target,
    widest: &LookupDrafter,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> Result<(LookupDrafter, Tuning)> {
    let mut times = StepTimes::default();
    let mut records = Vec::new();
    for prompt in prompts {
        let (steps, sequence) =
            decode_timed(target, &mut widest.clone(), prompt, new_tokens, &mut times)?;
        // The prompt's forward emits the first token; each step's root is the last emitted.
        let mut root = prompt.len();
        for step in &steps {
            records.push(lookup_record(widest, &sequence, root));
            root += step.emitted.len();
        }
    }
    let latency = warm_up_latency(target, prompts, new_tokens)?;
    let costs = StepCosts {
        draft: times.draft_seconds / times.step_count.max(1) as f64,
        accept: times.accept_seconds / times.step_count.max(1) as f64,
    };
    let options = lookup_options(widest, &records, &latency, costs);
    Ok(finish(options, &latency))
}

/// What lookup proposed at `root` of `sequence` (the context up to and including it) and what
/// followed.
fn lookup_record(widest: &LookupDrafter, sequence: &[u32], root: usize) -> LookupRecord {
    let context = &sequence[..=root];
    let found = longest_match(context);
    LookupRecord {
        match_length: found.map(|m| m.length),
        continuation: found.map_or_else(Vec::new, |m| widest.tokens_after(context, m)),
        truth: sequence[root + 1..].to_vec(),
    }
}

/// Every choice of caps up to `widest`'s, predicted from `records` replayed with it.
fn lookup_options(
    widest: &LookupDrafter,
    records: &[LookupRecord],
    latency: &LatencyProfile,
    costs: StepCosts,
) -> Vec<(Prediction, LookupDrafter)> {
    let most = widest.after_match.map(|m| m.min(widest.num_tokens));
    cap_choices(most)
        .into_iter()
        .map(|after_match| {
            let tuned = LookupDrafter {
                after_match,
                ..*widest
            };
            let (accepted, seconds) = mean_step(records.iter().map(|record| {
                let cap = record.match_length.map_or(0, |n| after_match[n - 1]);
                let chain = &record.continuation[..record.continuation.len().min(cap)];
                let tree = DraftTree::chain(chain, std::iter::repeat(Proposal::Deterministic));
                let seconds = latency.at(tree.len() + 1) + costs.draft + costs.accept;
                (accepted_length(&tree, &record.truth), seconds)
            }));
            let caps: Vec<String> = after_match.iter().map(usize::to_string).collect();
            let description = format!("lookup, tokens after a 1/2/3 match: {}", caps.join("/"));
            let longest = after_match.into_iter().max().unwrap_or(0);
            (prediction(description, longest, accepted, seconds), tuned)
        })
        .collect()
}

/// Every array of caps with each entry from 0 to `most`'s.
fn cap_choices(most: [usize; LONGEST_MATCH]) -> Vec<[usize; LONGEST_MATCH]> {
    let mut choices = vec![[0; LONGEST_MATCH]];
    for (i, &top) in most.iter().enumerate() {
        choices = choices
            .into_iter()
            .flat_map(|caps| {
                (0..=top).map(move |cap| {
                    let mut caps = caps;
                    caps[i] = cap;
                    caps
                })
            })
            .collect();
    }
    choices
}

/// Tunes the size of a Medusa tree built from the heads' per-rank accuracies, measured while
/// decoding the warm-up prompts, alone or beside `lookup` (`--with-lookup`).
pub fn tune_medusa(
    target: &Target,
    heads: &MedusaHeads,
    d2t: Option<&[u32]>,
    max_tree_tokens: usize,
    lookup: Option<&LookupDrafter>,
    prompts: &[Vec<u32>],
    new_tokens: usize,
) -> Result<(TreeChoices, Tuning)> {
    let cpu = target.cpu.decode();
    let make = |_| MedusaDrafter::new(heads, d2t, TreeChoices::chain(1), cpu);
    let (latency, warm_up) = profile_and_record(target, make, lookup, prompts, new_tokens)?;
    // Per model step: the heads draft nothing in a step lookup takes alone.
    let costs = StepCosts {
        draft: warm_up.times.draft_seconds / warm_up.steps.len().max(1) as f64,
        accept: warm_up.accept_step(),
    };
    let (steps, lookup_chains) = (&warm_up.steps, &warm_up.lookup_chains);
    let accuracy = rank_accuracy(steps);
    let mut options = Vec::new();
    for tree_tokens in TREE_SIZES.into_iter().filter(|&n| n <= max_tree_tokens) {
        let choices = TreeChoices::from_accuracies(&accuracy, tree_tokens);
        let (accepted, seconds) = match &lookup_chains {
            // Expected accepted length: each path is accepted with the product of its accuracies.
            None => (
                choices
                    .paths()
                    .iter()
                    .map(|path| {
                        path.iter()
                            .enumerate()
                            .map(|(d, &r)| accuracy[d][r])
                            .product::<f64>()
                    })
                    .sum(),
                latency.at(tree_tokens + 1) + costs.draft + costs.accept,
            ),
            Some(chains) => mean_step(
                steps
                    .iter()
                    .zip(chains)
                    .map(|((record, truth), chain)| {
                        let tree = choices.build(&record.guesses);
                        replay_step(tree, Some(chain), truth, &latency, costs)
                    })
                    .chain(warm_up.alone_steps(&latency)),
            ),
        };
        let predicted = prediction(
            format!("{tree_tokens} tokens from measured head accuracies"),
            tree_tokens,
            accepted,
            seconds,
        );
        options.push((predicted, choices));
    }
    Ok(finish(options, &latency))
}

/// `accuracy[d][r]`: how often head d's rank-r guess was the token finally emitted there
/// (`truth` is the emitted continuation after the step's root).
pub fn rank_accuracy(steps: &[(GuessRecord, Vec<u32>)]) -> Vec<Vec<f64>> {
    let heads = steps.first().map_or(0, |s| s.0.guesses.len());
    let ranks = crate::drafters::RECORDED_RANKS;
    let mut hits = vec![vec![0usize; ranks]; heads];
    let mut seen = vec![0usize; heads];
    for (record, truth) in steps {
        for (d, guesses) in record.guesses.iter().enumerate() {
            let Some(&right) = truth.get(d) else {
                continue;
            };
            seen[d] += 1;
            if let Some(r) = guesses.iter().take(ranks).position(|&g| g == right) {
                hits[d][r] += 1;
            }
        }
    }
    hits.iter()
        .zip(&seen)
        .map(|(h, &n)| h.iter().map(|&x| x as f64 / n.max(1) as f64).collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drafters::{tiny_frozen_head, Drafter, Verified};
    use crate::tree::Proposal;
    use headway_model::{CpuPolicy, CpuThreads, Sampler, SamplingParams};
    use tch::{Device, Kind, Tensor};

    fn decode() -> CpuPolicy {
        CpuThreads::new(2).decode()
    }

    #[test]
    fn the_rows_curve_is_described_as_multiples_of_one_row() {
        let profile = LatencyProfile {
            tokens: vec![1, 2, 64],
            seconds: vec![0.004, 0.005, 0.04],
            fork_joins: vec![151; 3],
        };
        assert_eq!(
            profile.describe(),
            "  verified rows → forward time: 1: 4.00 ms (1.00×), 2: 5.00 ms (1.25×), 64: 40.00 ms \
             (10.00×)\n"
        );
    }

    #[test]
    fn latency_interpolates_between_measured_sizes() {
        let profile = LatencyProfile {
            tokens: vec![1, 3, 5],
            seconds: vec![1.0, 2.0, 4.0],
            fork_joins: vec![0; 3],
        };
        assert_eq!(profile.at(1), 1.0);
        assert_eq!(profile.at(2), 1.5);
        assert_eq!(profile.at(4), 3.0);
        assert_eq!(profile.at(9), 4.0);
    }

    /// A replayed step runs as `--with-lookup` would run it: a one-token lookup guess joins the
    /// model's tree (one more node to verify), a longer chain goes alone without the model's
    /// drafting time; every step pays the acceptance.
    #[test]
    fn replayed_steps_with_lookup_graft_short_chains_and_send_long_ones_alone() {
        let latency = LatencyProfile {
            tokens: vec![1, 64],
            seconds: vec![1.0, 64.0],
            fork_joins: vec![0; 2],
        };
        let model_tree = || DraftTree::chain(&[7, 8], std::iter::repeat(Proposal::Deterministic));
        let truth = [7, 9, 4, 5];
        let costs = StepCosts {
            draft: 0.5,
            accept: 0.25,
        };
        assert_eq!(
            replay_step(model_tree(), None, &truth, &latency, costs),
            (1, 3.75)
        );
        assert_eq!(
            replay_step(model_tree(), Some(&[3]), &truth, &latency, costs),
            (1, 4.75)
        );
        // A guess the model drafted too is shared: nothing more to verify.
        let grafted = replay_step(model_tree(), Some(&[7]), &truth, &latency, costs);
        assert_eq!(grafted, (1, 3.75));
        assert_eq!(
            replay_step(model_tree(), Some(&[7, 9, 4]), &truth, &latency, costs),
            (3, 4.25)
        );
        assert_eq!(mean_step([(1, 3.75), (3, 4.25)].into_iter()), (2.0, 4.0));
    }

    /// Unigram matches that never predict and trigram matches that always do, at half a row's
    /// cost for each extra row: lookup should propose nothing after a unigram and its whole
    /// chain after a trigram (no bigram matched: its cap ties, and the smallest is kept).
    #[test]
    fn lookup_caps_follow_what_each_match_length_predicts() {
        let latency = LatencyProfile {
            tokens: vec![1, 2, 4, 8],
            seconds: vec![1.0, 1.5, 2.5, 4.5],
            fork_joins: vec![0; 4],
        };
        let record = |match_length, continuation: &[u32], truth: &[u32]| LookupRecord {
            match_length: Some(match_length),
            continuation: continuation.to_vec(),
            truth: truth.to_vec(),
        };
        let records: Vec<LookupRecord> = (0..10)
            .flat_map(|_| {
                [
                    record(1, &[7], &[8, 9]),
                    record(3, &[1, 2, 3, 4, 5], &[1, 2, 3, 4, 5, 6]),
                ]
            })
            .chain(std::iter::once(LookupRecord {
                match_length: None,
                continuation: Vec::new(),
                truth: vec![4],
            }))
            .collect();
        let costs = StepCosts {
            draft: 0.0,
            accept: 0.0,
        };
        let widest = LookupDrafter::default();
        let options = lookup_options(&widest, &records, &latency, costs);
        assert_eq!(options.len(), 2 * 4 * 6);
        let (best, tuning) = finish(options, &latency);
        assert_eq!(best.after_match, [0, 0, 5]);
        // 50 tokens accepted over 21 steps, 10 of one row, 10 of six and one of one.
        assert!((tuning.best.accepted - 50.0 / 21.0).abs() < 1e-12);
        assert!((tuning.best.step_seconds - (11.0 + 10.0 * 3.5) / 21.0).abs() < 1e-12);
        assert!(tuning.best.description.contains("0/0/5"));
    }

    /// Every tree pays the recorded catch-up; each further depth an expansion priced from the
    /// widest one's by the rows curve.
    #[test]
    fn drafting_cost_follows_the_shape() {
        let record = |root_seconds: f64, depth_seconds: Vec<f64>| DraftRecord {
            root: 0,
            candidates: Vec::new(),
            root_seconds,
            depth_seconds,
        };
        let records = [
            record(1.0, vec![0.5]),
            record(3.0, vec![0.5]),
            record(2.0, vec![1.0]),
        ];
        let cost = DraftingCost::recorded(records.iter(), 4);
        let latency = LatencyProfile {
            tokens: vec![1, 4],
            seconds: vec![1.0, 2.0],
            fork_joins: vec![0; 2],
        };
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(cost.seconds(1, 4, &latency), 2.0));
        assert!(close(cost.seconds(1, 1, &latency), 2.0));
        assert!(close(cost.seconds(3, 4, &latency), 2.0 + 2.0 * 2.0 / 3.0));
        assert!(close(cost.seconds(2, 1, &latency), 2.0 + 2.0 / 3.0 / 2.0));
    }

    #[test]
    fn rank_accuracy_counts_where_each_head_was_right() {
        let record = |guesses: Vec<Vec<u32>>| GuessRecord { root: 0, guesses };
        let steps = vec![
            (record(vec![vec![5, 6], vec![7, 8]]), vec![5, 8]),
            (record(vec![vec![1, 2], vec![3, 4]]), vec![2, 9]),
        ];
        let accuracy = rank_accuracy(&steps);
        assert_eq!(accuracy[0][..2], [0.5, 0.5]);
        assert_eq!(accuracy[1][..2], [0.0, 0.5]);
    }

    /// Re-selecting a narrower, shallower EAGLE tree from a wide recorded step gives the tree
    /// that drafting with the narrow shape gives.
    #[test]
    fn replayed_candidates_equal_drafting_with_the_smaller_shape() {
        let _no_grad = tch::no_grad_guard();
        let head = tiny_frozen_head(9, 1);
        let config = &head.config.layer;
        let context: Vec<u32> = vec![3, 17, 40, 2, 99, 5, 6];
        let hidden = Tensor::randn([6, config.hidden_size as i64], (Kind::Float, Device::Cpu));
        let verified = Verified {
            context: &context,
            hidden: &hidden,
            taps: &[],
        };
        let mut sampler = Sampler::new(SamplingParams::default());
        let wide = EagleTreeShape {
            depth: 4,
            top_k: 4,
            tree_tokens: 64,
        };
        let mut drafter = EagleDrafter::new(&head, None, wide, 32, decode()).unwrap();
        drafter.record();
        drafter.draft(&verified, &mut sampler).unwrap();
        let record = drafter.take_records().remove(0);
        for (depth, top_k, size) in [(3, 2, 5), (4, 4, 10), (2, 1, 2)] {
            let narrow = EagleTreeShape {
                depth,
                top_k,
                tree_tokens: size,
            };
            let tokens = |t: &DraftTree| -> Vec<(u32, Option<usize>)> {
                t.nodes().iter().map(|n| (n.token, n.parent)).collect()
            };
            let mut direct = EagleDrafter::new(&head, None, narrow, 32, decode()).unwrap();
            let drafted = direct.draft(&verified, &mut sampler).unwrap();
            let replayed = best_subtree(&replay_candidates(&record, depth, top_k), size);
            assert_eq!(tokens(&replayed), tokens(&drafted), "{narrow:?}");
        }
    }
}
