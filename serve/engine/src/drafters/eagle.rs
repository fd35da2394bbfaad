//! EAGLE-1 and EAGLE-3 heads with EAGLE-2 dynamic trees.
//!
//! The head runs one step behind the target: at position `i` it reads the target's feature `f_i`
//! and the token `t_{i+1}`, and predicts `f̂_{i+1}`, whose logits guess `t_{i+2}`. Its own KV cache
//! holds one entry per position the target has verified. Drafting expands, depth by depth, the
//! `top_k` most confident nodes of the newest depth (confidence = the product of the head's
//! probabilities along the path), each node's children being the head's `top_k` guesses after
//! it; the `tree_tokens` most confident nodes of everything expanded form the tree. Tree nodes
//! enter the head's cache only while drafting and are dropped (O(1) truncation) afterwards.

use std::time::Instant;

use headway_heads::{FeatureHead, FeatureModules};
use headway_model::linear::{f32_slice, plain_cpu_f32};
use headway_model::mask::positions;
use headway_model::sampling::log_sum_exp;
use headway_model::{CpuPolicy, KvCache, Sampler, TreeInput};
use tch::{Kind, Tensor};

use super::{Drafter, Recording, Verified};
use crate::error::{EngineError, Result};
use crate::tree::{DraftTree, Proposal};

/// The size of EAGLE-2 trees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EagleTreeShape {
    /// Draft depths (head forwards per step).
    pub depth: usize,
    /// Nodes expanded per depth, and children per expanded node.
    pub top_k: usize,
    /// Nodes kept in the verified tree.
    pub tree_tokens: usize,
}

/// One drafted candidate.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub token: u32,
    /// Index of the parent candidate; siblings are created best guess first.
    pub parent: Option<usize>,
    pub depth: usize,
    /// Sum of log-probabilities along the path.
    pub score: f32,
    /// Row in the feature store of the prediction that proposed this token.
    source: usize,
    /// Index in the head's KV cache once the node has been fed (expanded).
    fed: Option<usize>,
}

impl Candidate {
    /// Whether the node was expanded (its children were drafted).
    pub fn expanded(&self) -> bool {
        self.fed.is_some()
    }

    /// The same candidate under another parent index (re-selected subsets of a step).
    pub fn with_parent(&self, parent: Option<usize>) -> Self {
        Self {
            parent,
            ..self.clone()
        }
    }
}

/// Everything drafted in one step, kept for tree-size tuning ([`crate::autotune`]).
#[derive(Debug, Clone)]
pub struct DraftRecord {
    /// Index of the step's root in the token sequence.
    pub root: usize,
    pub candidates: Vec<Candidate>,
    /// Seconds of the catch-up and the root's guesses: what every depth of tree pays.
    pub root_seconds: f64,
    /// Seconds of each later depth's expansion and guesses, in depth order (top-k rows each).
    pub depth_seconds: Vec<f64>,
}

pub struct EagleDrafter<'h> {
    modules: Box<dyn FeatureModules + 'h>,
    /// The target taps the head fuses into its input.
    taps: Vec<usize>,
    d2t: Option<&'h [u32]>,
    cache: KvCache,
    /// Positions whose (feature, next token) pair is in the cache: the target's cached prefix.
    committed: usize,
    shape: EagleTreeShape,
    /// Every step's candidates while recording.
    records: Option<Vec<DraftRecord>>,
    /// Verified features and taps of skipped steps, fed at the next catch-up in one forward.
    skipped: Vec<(Tensor, Vec<Tensor>)>,
    /// The head's prediction after the prompt ([`Drafter::prefill`]) and the context length it
    /// follows: the first step's catch-up, already made.
    primed: Option<(usize, Tensor)>,
}

impl<'h> EagleDrafter<'h> {
    /// `head` must be frozen; `d2t` maps its draft vocabulary to target ids; `capacity` is the
    /// longest context it will see; it runs under `cpu` (the target's decoding policy).
    pub fn new(
        head: &'h dyn FeatureHead,
        d2t: Option<&'h [u32]>,
        shape: EagleTreeShape,
        capacity: usize,
        cpu: CpuPolicy,
    ) -> Result<Self> {
        if shape.depth == 0 || shape.top_k == 0 || shape.tree_tokens == 0 {
            return Err(EngineError::Invalid {
                field: "tree",
                message: format!("EAGLE tree sizes must be positive, got {shape:?}"),
            });
        }
        Ok(Self {
            modules: head.modules(cpu)?,
            taps: head.taps().to_vec(),
            d2t,
            cache: head.new_cache(1, capacity + shape.depth * shape.top_k)?,
            committed: 0,
            shape,
            records: None,
            skipped: Vec::new(),
            primed: None,
        })
    }

    /// Adds the (feature, next token) pairs verified since the last draft; returns the head's last
    /// prediction.
    fn catch_up(&mut self, verified: &Verified) -> Result<Tensor> {
        let skipped = std::mem::take(&mut self.skipped);
        let hidden = rows_in_order(skipped.iter().map(|s| &s.0), verified.hidden);
        let taps: Vec<Tensor> = (0..verified.taps.len())
            .map(|k| rows_in_order(skipped.iter().map(|s| &s.1[k]), &verified.taps[k]))
            .collect();
        let m = hidden.size()[0] as usize;
        let prefix = verified.context.len() - 1;
        let start = prefix - m;
        self.cache.truncate(self.committed)?;
        if start != self.committed {
            return Err(EngineError::Invalid {
                field: "eagle state",
                message: format!(
                    "the head has {} positions but the target verified from {start}",
                    self.committed
                ),
            });
        }
        let device = hidden.device();
        let ids: Vec<i64> = verified.context[start + 1..=prefix]
            .iter()
            .map(|&t| i64::from(t))
            .collect();
        let ids = Tensor::from_slice(&ids).unsqueeze(0).to_device(device);
        let inputs = self.modules.fuse(&hidden, &taps)?;
        let out = self.modules.forward(
            &inputs.unsqueeze(0),
            &ids,
            &positions(start, m, device),
            Some(&mut self.cache),
            None,
        )?;
        self.committed = prefix;
        Ok(out.get(0).get(m as i64 - 1))
    }

    /// The prediction `prefill` made for this `verified`, if it did: its rows are in the cache.
    fn take_primed(&mut self, verified: &Verified) -> Option<Tensor> {
        self.primed
            .take()
            .filter(|(context, _)| *context == verified.context.len())
            .map(|(_, prediction)| prediction)
    }

    /// `top_k` guesses (target ids, log-probabilities) for each row of `features` `[n, hidden]`.
    fn guesses(&self, features: &Tensor) -> Result<Vec<Vec<(u32, f32)>>> {
        let logits = self.modules.logits(features);
        let vocab = logits.size().last().copied().unwrap_or(0) as usize;
        // Drafting on the CPU reads the head's f32 logits where its product wrote them.
        let logits = match plain_cpu_f32(&logits) {
            true => logits.contiguous(),
            false => logits
                .to_device(tch::Device::Cpu)
                .to_kind(Kind::Float)
                .contiguous(),
        };
        let to_target = |i: usize| self.d2t.map_or(i as u32, |m| m[i]);
        Ok(f32_slice(&logits)
            .chunks_exact(vocab.max(1))
            .map(|row| {
                let log_norm = log_sum_exp(row);
                top_logits(row, self.shape.top_k)
                    .into_iter()
                    .map(|(i, logit)| (to_target(i), logit - log_norm))
                    .collect()
            })
            .collect())
    }

    /// Feeds the nodes `expand` (all of one depth) into the head and returns their predictions
    /// `[n, hidden]`. The nodes fed so far sit in the head's cache after the committed prefix, in
    /// feeding order: with the new ones they form a tree whose input the new rows are.
    fn expand(
        &mut self,
        candidates: &mut [Candidate],
        expand: &[usize],
        store: &[Tensor],
    ) -> Result<Tensor> {
        let device = store[0].device();
        let base = self.cache.len();
        for (j, &c) in expand.iter().enumerate() {
            candidates[c].fed = Some(base + j);
        }
        let mut fed: Vec<usize> = (0..candidates.len())
            .filter(|&c| candidates[c].fed.is_some())
            .collect();
        fed.sort_by_key(|&c| candidates[c].fed);
        let tree_index = |c: usize| candidates[c].fed.map(|slot| slot - self.committed);
        let tokens: Vec<u32> = fed.iter().map(|&c| candidates[c].token).collect();
        let parents: Vec<Option<usize>> = fed
            .iter()
            .map(|&c| candidates[c].parent.and_then(tree_index))
            .collect();
        let input =
            TreeInput::tree(self.committed, &tokens, &parents, device)?.last_rows(expand.len());
        let features = Tensor::stack(
            &expand
                .iter()
                .map(|&c| &store[candidates[c].source])
                .collect::<Vec<_>>(),
            0,
        )
        .unsqueeze(0);
        let out = self.modules.forward(
            &features,
            &input.ids,
            &input.positions,
            Some(&mut self.cache),
            input.mask.as_ref(),
        )?;
        Ok(out.get(0))
    }
}

impl Drafter for EagleDrafter<'_> {
    /// The head's pass over the prompt: the first step's catch-up, made before it.
    fn prefill(&mut self, verified: &Verified) -> Result<()> {
        let _no_grad = tch::no_grad_guard();
        let prediction = self.catch_up(verified)?;
        self.primed = Some((verified.context.len(), prediction));
        Ok(())
    }

    fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> Result<DraftTree> {
        let _no_grad = tch::no_grad_guard();
        let started = Instant::now();
        let root = match self.take_primed(verified) {
            Some(prediction) => prediction,
            None => self.catch_up(verified)?,
        };
        let mut store = vec![root];
        let mut candidates: Vec<Candidate> = Vec::new();
        let mut newest: Vec<usize> = Vec::new();
        let root_guesses = self.guesses(&store[0].unsqueeze(0))?.remove(0);
        let root_seconds = started.elapsed().as_secs_f64();
        let mut depth_seconds = Vec::with_capacity(self.shape.depth - 1);
        for (token, score) in root_guesses {
            newest.push(candidates.len());
            candidates.push(Candidate {
                token,
                parent: None,
                depth: 1,
                score,
                source: 0,
                fed: None,
            });
        }
        for _ in 1..self.shape.depth {
            let started = Instant::now();
            newest.sort_by(|&a, &b| candidates[b].score.total_cmp(&candidates[a].score));
            newest.truncate(self.shape.top_k);
            let predictions = self.expand(&mut candidates, &newest, &store)?;
            let guesses = self.guesses(&predictions)?;
            let mut next = Vec::new();
            for (j, (&parent, children)) in newest.iter().zip(guesses).enumerate() {
                store.push(predictions.get(j as i64));
                for (token, logp) in children {
                    next.push(candidates.len());
                    candidates.push(Candidate {
                        token,
                        parent: Some(parent),
                        depth: candidates[parent].depth + 1,
                        score: candidates[parent].score + logp,
                        source: store.len() - 1,
                        fed: None,
                    });
                }
            }
            newest = next;
            depth_seconds.push(started.elapsed().as_secs_f64());
        }
        self.cache.truncate(self.committed)?;
        let tree = best_subtree(&candidates, self.shape.tree_tokens);
        if let Some(records) = &mut self.records {
            records.push(DraftRecord {
                root: verified.context.len() - 1,
                candidates,
                root_seconds,
                depth_seconds,
            });
        }
        Ok(tree)
    }

    /// Keeps the verified rows for the next catch-up: one forward over several steps' rows costs
    /// little more than over one step's.
    fn skip(&mut self, verified: &Verified) -> Result<()> {
        if self.take_primed(verified).is_some() {
            return Ok(());
        }
        self.skipped.push((
            verified.hidden.shallow_clone(),
            verified.taps.iter().map(Tensor::shallow_clone).collect(),
        ));
        Ok(())
    }

    fn max_tree_tokens(&self) -> usize {
        self.shape.tree_tokens
    }

    fn taps(&self) -> &[usize] {
        &self.taps
    }

    fn reset(&mut self) {
        self.committed = 0;
        self.skipped.clear();
        self.primed = None;
        self.cache
            .truncate(0)
            .expect("truncating to 0 always succeeds");
    }
}

/// The `k` largest of `logits` (index, logit), best first and the lower index first among
/// equals: a draft depth's guesses in one pass over the row.
fn top_logits(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    const LANES: usize = 8;
    let mut top: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (c, chunk) in logits.chunks(LANES).enumerate() {
        // Once k are held, most chunks lie wholly at or below the worst of them and change
        // nothing: one vector comparison skips them (a NaN never compares so, and is offered).
        if let Some(&(_, worst)) = top.last().filter(|_| top.len() == k) {
            if chunk
                .iter()
                .fold(true, |all, &logit| all & (logit <= worst))
            {
                continue;
            }
        }
        for (j, &logit) in chunk.iter().enumerate() {
            if top.len() == k && top.last().is_none_or(|&(_, worst)| logit <= worst) {
                continue;
            }
            let at = top.partition_point(|&(_, better)| better >= logit);
            top.insert(at, (c * LANES + j, logit));
            top.truncate(k);
        }
    }
    top
}

/// The skipped steps' rows, then the newest step's, as one tensor.
fn rows_in_order<'t>(skipped: impl Iterator<Item = &'t Tensor>, newest: &'t Tensor) -> Tensor {
    let parts: Vec<&Tensor> = skipped.chain(std::iter::once(newest)).collect();
    Tensor::cat(&parts, 0)
}

/// Keeps every step's candidates.
impl Recording for EagleDrafter<'_> {
    type Record = DraftRecord;

    fn record(&mut self) {
        self.records = Some(Vec::new());
    }

    fn take_records(&mut self) -> Vec<DraftRecord> {
        self.records.take().unwrap_or_default()
    }

    fn root(record: &DraftRecord) -> usize {
        record.root
    }
}

/// EAGLE-2's rerank: the `size` most confident candidates, closed under ancestors (a child's
/// score never exceeds its parent's, so this only matters for ties), parents first and siblings
/// by confidence.
pub fn best_subtree(candidates: &[Candidate], size: usize) -> DraftTree {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        candidates[b]
            .score
            .total_cmp(&candidates[a].score)
            .then(a.cmp(&b))
    });
    let mut keep = vec![false; candidates.len()];
    for &c in order.iter().take(size) {
        let mut node = Some(c);
        while let Some(n) = node.filter(|&n| !keep[n]) {
            keep[n] = true;
            node = candidates[n].parent;
        }
    }
    let mut chosen: Vec<usize> = order.into_iter().filter(|&c| keep[c]).collect();
    chosen.sort_by_key(|&c| candidates[c].depth);
    let mut tree_index = vec![usize::MAX; candidates.len()];
    let mut tree = DraftTree::new();
    for c in chosen {
        let parent = candidates[c].parent.map(|p| tree_index[p]);
        tree_index[c] = tree
            .push(candidates[c].token, parent, Proposal::Deterministic)
            .expect("parents are pushed before their children");
    }
    tree
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use headway_heads::EagleHead;
    use headway_model::testing::tiny_config;
    use tch::Device;

    /// A frozen EAGLE head of `layers` layers with random weights for the tiny test target.
    pub(crate) fn tiny_frozen_head(seed: i64, layers: usize) -> EagleHead {
        tapped_frozen_head(seed, layers, vec![])
    }

    /// The same, fusing `taps` through a random (not the fresh, zero) tap projection.
    fn tapped_frozen_head(seed: i64, layers: usize, taps: Vec<usize>) -> EagleHead {
        let vocab = tiny_config().vocab_size as i64;
        let mut head = headway_heads::testing::tiny_eagle_head(seed, layers, taps, vocab);
        headway_heads::testing::randomize_tap_projection(&mut head, 0.1);
        head.params.freeze();
        head
    }

    /// A row's top-k are `topk`'s: the same indices in the same order, their logits; equal
    /// logits rank lower index first.
    #[test]
    fn top_logits_rank_as_topk_does() {
        let _no_grad = tch::no_grad_guard();
        let logits = Tensor::randn([3, 500], (Kind::Float, Device::Cpu)) * 4.0;
        for k in [1, 4, 10] {
            let (values, index) = logits.topk(k, -1, true, true);
            for row in 0..3 {
                let values = Vec::<f32>::try_from(values.get(row)).unwrap();
                let index = Vec::<i64>::try_from(index.get(row)).unwrap();
                let top = top_logits(&Vec::<f32>::try_from(logits.get(row)).unwrap(), k as usize);
                let (got_index, got_values): (Vec<i64>, Vec<f32>) =
                    top.iter().map(|&(i, v)| (i as i64, v)).unzip();
                assert_eq!(
                    (got_index, got_values),
                    (index, values),
                    "row {row}, top-{k}"
                );
            }
        }
        let mut spiky = vec![0.0f32; 37];
        spiky[20] = f32::NAN;
        spiky[9] = 5.0;
        spiky[30] = 5.0;
        let ranked: Vec<usize> = top_logits(&spiky, 3).iter().map(|&(i, _)| i).collect();
        assert_eq!(
            ranked,
            [20, 9, 30],
            "a NaN ranks first, as libtorch's topk ranks it"
        );
        assert!(top_logits(&spiky, 0).is_empty());
        let ranked: Vec<usize> = top_logits(&[1.0, 3.0, 0.0, 3.0, 2.0], 3)
            .iter()
            .map(|&(i, _)| i)
            .collect();
        assert_eq!(ranked, [1, 3, 4]);
    }

    /// With one child per node the tree is the head's greedy chain, which a plain sequential
    /// run of the head (cache, causal, no tree mask) must reproduce; a second step after some
    /// accepted tokens must agree too (catch-up after truncating the drafted nodes). The prompt's
    /// rows given to `prefill` first change nothing, whether the first step then drafts or skips.
    #[test]
    fn tree_drafting_equals_running_the_head_step_by_step() {
        for (skip_first, prefill) in [(false, false), (true, false), (false, true), (true, true)] {
            let follows = |head: &dyn FeatureHead| {
                tree_drafting_follows_the_heads_chain(head, skip_first, prefill)
            };
            for layers in [1, 2] {
                follows(&tiny_frozen_head(5, layers));
            }
            follows(&tapped_frozen_head(5, 1, vec![1, 0]));
            let mut eagle3 = headway_heads::testing::tiny_eagle3_head(5, vec![0, 1], 64);
            eagle3.params.freeze();
            follows(&eagle3);
        }
    }

    /// With `skip_first`, the first step is skipped and the second catches up on both steps'
    /// rows at once; with `prefill`, the first step's rows go to [`Drafter::prefill`] before it.
    fn tree_drafting_follows_the_heads_chain(
        head: &dyn FeatureHead,
        skip_first: bool,
        prefill: bool,
    ) {
        let _no_grad = tch::no_grad_guard();
        let h = tiny_config().hidden_size as i64;
        let shape = EagleTreeShape {
            depth: 4,
            top_k: 1,
            tree_tokens: 4,
        };
        let cpu = headway_model::CpuThreads::new(2).decode();
        let mut drafter = EagleDrafter::new(head, None, shape, 64, cpu.clone()).unwrap();
        let mut sampler = Sampler::new(Default::default());
        let context: Vec<u32> = vec![3, 17, 40, 2, 99, 5];
        let hidden = Tensor::randn([10, h], (Kind::Float, Device::Cpu));
        let taps: Vec<Tensor> = head
            .taps()
            .iter()
            .map(|_| Tensor::randn([10, h], (Kind::Float, Device::Cpu)))
            .collect();
        for (len, rows) in [(6usize, 0..5i64), (9, 5..8)] {
            let ctx: Vec<u32> = context.iter().copied().chain([7, 8, 9]).take(len).collect();
            let fresh_rows = |t: &Tensor| t.narrow(0, rows.start, rows.end - rows.start);
            let verified = Verified {
                context: &ctx,
                hidden: &fresh_rows(&hidden),
                taps: &taps.iter().map(fresh_rows).collect::<Vec<_>>(),
            };
            if prefill && len == 6 {
                drafter.prefill(&verified).unwrap();
            }
            if skip_first && len == 6 {
                drafter.skip(&verified).unwrap();
                continue;
            }
            let tree = drafter.draft(&verified, &mut sampler).unwrap();
            let chain: Vec<u32> = tree.nodes().iter().map(|n| n.token).collect();
            assert_eq!(tree.max_depth(), 4);
            // Reference: the head over the whole context causally, then its own chain.
            let modules = head.modules(cpu.clone()).unwrap();
            let mut cache = head.new_cache(1, 64).unwrap();
            let prefix = ctx.len() - 1;
            let ids = |t: &[u32]| {
                Tensor::from_slice(&t.iter().map(|&x| i64::from(x)).collect::<Vec<_>>())
                    .unsqueeze(0)
            };
            let prefix_rows = |t: &Tensor| t.narrow(0, 0, prefix as i64);
            let prefix_taps: Vec<Tensor> = taps.iter().map(prefix_rows).collect();
            let inputs = modules.fuse(&prefix_rows(&hidden), &prefix_taps).unwrap();
            let out = modules
                .forward(
                    &inputs.unsqueeze(0),
                    &ids(&ctx[1..]),
                    &positions(0, prefix, Device::Cpu),
                    Some(&mut cache),
                    None,
                )
                .unwrap();
            let mut feature = out.get(0).get(prefix as i64 - 1);
            let mut expected = Vec::new();
            for d in 0..4 {
                let token = modules.logits(&feature).argmax(-1, false).int64_value(&[]) as u32;
                expected.push(token);
                let next = modules
                    .forward(
                        &feature.view([1, 1, h]),
                        &ids(&[token]),
                        &positions(prefix + d, 1, Device::Cpu),
                        Some(&mut cache),
                        None,
                    )
                    .unwrap();
                feature = next.get(0).get(0);
            }
            assert_eq!(chain, expected, "context of {len}");
        }
    }
}
