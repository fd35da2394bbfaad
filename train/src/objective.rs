//! What each head learns from a batch: its loss (backpropagated here, head by head, to bound
//! memory) and the accuracy figures reported in training and evaluation.

use std::collections::BTreeMap;

use headway_heads::eagle::EagleModules;
use headway_heads::{DraftVocab, Eagle3Head, EagleHead, FeatureModules, MedusaHeads, Params};
use headway_model::linear::Matrix;
use headway_model::mask::positions;
use headway_model::CpuPolicy;
use tch::{Kind, Reduction, Tensor};

use crate::data::Batch;
use crate::vocab_loss::{
    projected_argmax, projected_cross_entropy, projected_softmax, Scratch, VocabTarget,
};

/// Sums and counts of named figures; reported as means.
#[derive(Debug, Default, Clone)]
pub struct Metrics(pub BTreeMap<String, (f64, f64)>);

impl Metrics {
    pub fn add(&mut self, name: &str, sum: f64, count: f64) {
        let entry = self.0.entry(name.to_string()).or_insert((0.0, 0.0));
        entry.0 += sum;
        entry.1 += count;
    }

    pub fn merge(&mut self, other: &Metrics) {
        for (name, (sum, count)) in &other.0 {
            self.add(name, *sum, *count);
        }
    }

    pub fn mean(&self, name: &str) -> Option<f64> {
        self.0
            .get(name)
            .filter(|(_, c)| *c > 0.0)
            .map(|(s, c)| s / c)
    }

    pub fn means(&self) -> BTreeMap<String, f64> {
        self.0
            .keys()
            .filter_map(|k| self.mean(k).map(|m| (k.clone(), m)))
            .collect()
    }
}

/// A head and its training objective.
pub trait Objective {
    fn params(&self) -> &Params;
    fn params_mut(&mut self) -> &mut Params;
    /// Computes the loss and figures of `batch`; when `backward_scale` is given, also adds
    /// `scale × ∂loss/∂params` to the gradients.
    fn run(&mut self, batch: &Batch, backward_scale: Option<f64>) -> anyhow::Result<Metrics>;
    /// Target layers whose residual-stream taps the batches must carry.
    fn taps(&self) -> &[usize] {
        &[]
    }
    /// Extra evaluation-only figures (EAGLE's chain acceptance).
    fn evaluate(&mut self, batch: &Batch) -> anyhow::Result<Metrics> {
        self.run(batch, None)
    }
}

/// Maps target ids to draft indices and marks ids outside the draft vocabulary invalid.
fn to_draft(
    ids: &Tensor,
    valid: &Tensor,
    draft: Option<&DraftVocab>,
    vocab: usize,
) -> (Tensor, Tensor) {
    match draft {
        None => (ids.shallow_clone(), valid.shallow_clone()),
        Some(d) => {
            let mapped = d.to_draft(ids, vocab);
            let inside = mapped.ge(0);
            (mapped.clamp_min(0), valid.logical_and(&inside))
        }
    }
}

pub struct MedusaObjective {
    pub heads: MedusaHeads,
    /// Loss weight of head k: `decay^k`.
    pub decay: f64,
    pub draft: Option<DraftVocab>,
    pub target_vocab: usize,
    /// Training's CPU policy (batch work: libtorch on every thread).
    cpu: CpuPolicy,
    /// Where the heads' logits are computed, step after step.
    scratch: Scratch,
}

impl MedusaObjective {
    pub fn new(
        heads: MedusaHeads,
        decay: f64,
        draft: Option<DraftVocab>,
        target_vocab: usize,
        cpu: CpuPolicy,
    ) -> Self {
        Self {
            heads,
            decay,
            draft,
            target_vocab,
            cpu,
            scratch: Scratch::default(),
        }
    }
}

impl Objective for MedusaObjective {
    fn params(&self) -> &Params {
        &self.heads.params
    }

    fn params_mut(&mut self) -> &mut Params {
        &mut self.heads.params
    }

    fn run(&mut self, batch: &Batch, backward_scale: Option<f64>) -> anyhow::Result<Metrics> {
        let mut metrics = Metrics::default();
        let len = batch.ids.size()[1];
        let mut total = 0.0;
        for k in 0..self.heads.config.num_heads {
            let shift = k as i64 + 2;
            if len <= shift {
                continue;
            }
            let (targets, valid) = to_draft(
                &batch.ids.narrow(1, shift, len - shift),
                &batch.loss_mask.narrow(1, shift, len - shift),
                self.draft.as_ref(),
                self.target_vocab,
            );
            let count = valid.sum(Kind::Int64).int64_value(&[]);
            if count == 0 {
                continue;
            }
            let features = batch
                .hidden
                .narrow(1, 0, len - shift)
                .masked_select(&valid.unsqueeze(-1))
                .view([count, -1]);
            let targets = targets.masked_select(&valid);
            let scored = projected_cross_entropy(
                &self.heads.head_features(k, &features, &self.cpu)?,
                self.heads.lm_head(k)?,
                VocabTarget::Token(&targets),
                &targets,
                backward_scale.is_some(),
                &mut self.scratch,
            );
            let weight = self.decay.powi(k as i32);
            if let Some(scale) = backward_scale {
                (&scored.loss * (weight * scale)).backward();
            }
            let value = scored.loss.double_value(&[]);
            total += weight * value;
            let (top1, top5) = (scored.top1, scored.top5);
            let n = count as f64;
            metrics.add(&format!("head{k}/loss"), value * n, n);
            metrics.add(&format!("head{k}/top1"), top1, n);
            metrics.add(&format!("head{k}/top5"), top5, n);
        }
        metrics.add("loss", total, 1.0);
        Ok(metrics)
    }
}

pub struct EagleObjective {
    pub head: EagleHead,
    /// Half-width of the uniform noise added to input features in training (EAGLE: 0.1).
    pub noise: f64,
    /// Weight of the soft cross-entropy term (EAGLE: 0.1).
    pub classification_weight: f64,
    /// Rounds of the chain-acceptance estimate in evaluation.
    pub chain_steps: usize,
    /// Rounds of each training step: round r > 1 feeds the head its own round r − 1 predictions
    /// as input features (gradients flowing through them), as drafting does from depth 2 on, and
    /// the loss is the mean over rounds ("training-time test", EAGLE-3 / HASS). 1: EAGLE-1's
    /// teacher forcing. Evaluation scores round 1 and estimates later rounds as `alpha_n`.
    pub unroll: usize,
    /// Training's CPU policy (batch work: libtorch on every thread).
    cpu: CpuPolicy,
    /// Where the target's next-token distributions and the head's logits are computed.
    target_scratch: Scratch,
    logits_scratch: Scratch,
}

/// Rounds of EAGLE's chain-acceptance estimate (α1..α5).
const EAGLE_CHAIN_STEPS: usize = 5;

impl EagleObjective {
    pub fn new(
        head: EagleHead,
        noise: f64,
        classification_weight: f64,
        unroll: usize,
        cpu: CpuPolicy,
    ) -> Self {
        Self {
            head,
            noise,
            classification_weight,
            chain_steps: EAGLE_CHAIN_STEPS,
            unroll: unroll.max(1),
            cpu,
            target_scratch: Scratch::default(),
            logits_scratch: Scratch::default(),
        }
    }
}

/// The next round's input features: position i gets the head's prediction of f_i (its output
/// at i − 1); position 0 keeps the input from the target's features, `target_inputs`.
fn own_predictions_as_inputs(target_inputs: &Tensor, predicted: &Tensor) -> Tensor {
    let len = target_inputs.size()[1];
    Tensor::cat(
        &[
            target_inputs.narrow(1, 0, 1),
            predicted.narrow(1, 0, len - 1),
        ],
        1,
    )
}

/// The head's inputs for positions ..T-1 from the target's features (and taps).
fn target_inputs(modules: &EagleModules, batch: &Batch) -> anyhow::Result<Tensor> {
    let len = batch.ids.size()[1];
    let taps: Vec<Tensor> = batch.taps.iter().map(|t| t.narrow(1, 0, len - 1)).collect();
    Ok(modules.fuse(&batch.hidden.narrow(1, 0, len - 1), &taps)?)
}

/// Predicted features for positions 1.. from input features for positions ..T-1.
fn predict(modules: &EagleModules, inputs: &Tensor, batch: &Batch) -> anyhow::Result<Tensor> {
    let (b, len) = (batch.ids.size()[0], batch.ids.size()[1]);
    let next_ids = batch.ids.narrow(1, 1, len - 1);
    let positions =
        positions(0, (len - 1) as usize, batch.ids.device()).expand([b, len - 1], false);
    Ok(modules.forward(inputs, &next_ids, &positions, None, None)?)
}

impl Objective for EagleObjective {
    fn params(&self) -> &Params {
        &self.head.params
    }

    fn params_mut(&mut self) -> &mut Params {
        &mut self.head.params
    }

    fn taps(&self) -> &[usize] {
        &self.head.config.taps
    }

    fn run(&mut self, batch: &Batch, backward_scale: Option<f64>) -> anyhow::Result<Metrics> {
        let mut metrics = Metrics::default();
        let len = batch.ids.size()[1];
        if len < 2 {
            return Ok(metrics);
        }
        let modules = self.head.modules(self.cpu.clone())?;
        let from_target = target_inputs(&modules, batch)?;
        let mut inputs = from_target.shallow_clone();
        if backward_scale.is_some() && self.noise > 0.0 {
            inputs = &inputs + inputs.rand_like() * (2.0 * self.noise) - self.noise;
        }
        let target = batch.hidden.narrow(1, 1, len - 1);
        let valid = batch.loss_mask.narrow(1, 1, len - 1);
        let count = valid.sum(Kind::Int64).int64_value(&[]);
        if count == 0 {
            return Ok(metrics);
        }
        let pick = |t: &Tensor| t.masked_select(&valid.unsqueeze(-1)).view([count, -1]);
        let picked_target = pick(&target);
        let target_probs = projected_softmax(
            &picked_target,
            modules.lm_head_weight(),
            &mut self.target_scratch,
        );
        let greedy = target_probs.argmax(-1, false);
        let rounds = if backward_scale.is_some() {
            self.unroll
        } else {
            1
        };
        let n = count as f64;
        let mut round_losses = Vec::with_capacity(rounds);
        for round in 1..=rounds {
            let predicted = predict(&modules, &inputs, batch)?;
            let picked = pick(&predicted);
            let regression = picked.smooth_l1_loss(&picked_target, Reduction::Mean, 1.0);
            let scored = projected_cross_entropy(
                &picked,
                modules.lm_head_weight(),
                VocabTarget::Distribution(&target_probs),
                &greedy,
                backward_scale.is_some(),
                &mut self.logits_scratch,
            );
            round_losses.push(&regression + &scored.loss * self.classification_weight);
            if round == 1 {
                metrics.add("regression", regression.double_value(&[]) * n, n);
                metrics.add("classification", scored.loss.double_value(&[]) * n, n);
                metrics.add("top1", scored.top1, n);
                metrics.add("top5", scored.top5, n);
            } else {
                metrics.add(&format!("round{round}/top1"), scored.top1, n);
            }
            if round < rounds {
                inputs = own_predictions_as_inputs(&from_target, &predicted);
            }
        }
        let loss = Tensor::stack(&round_losses, 0).mean(Kind::Float);
        if let Some(scale) = backward_scale {
            (&loss * scale).backward();
        }
        metrics.add("loss", loss.double_value(&[]) * n, n);
        Ok(metrics)
    }

    /// Adds EAGLE's chain acceptance `alpha_n`: in round n every input feature is the head's own
    /// prediction from round n − 1 (tokens stay the real ones), and `alpha_n` is the share of
    /// positions where the head's top token then equals the target's greedy token. This feeds
    /// predictions at every earlier position too, so it is a conservative estimate of drafting,
    /// where only the last n − 1 positions are the head's.
    fn evaluate(&mut self, batch: &Batch) -> anyhow::Result<Metrics> {
        let _guard = tch::no_grad_guard();
        let mut metrics = self.run(batch, None)?;
        let len = batch.ids.size()[1];
        if len < 2 {
            return Ok(metrics);
        }
        let valid = batch.loss_mask.narrow(1, 1, len - 1);
        let count = valid.sum(Kind::Int64).int64_value(&[]);
        if count == 0 {
            return Ok(metrics);
        }
        // Scored only where the loss is (assistant positions): the LM head is the costly part.
        let pick = |t: &Tensor| t.masked_select(&valid.unsqueeze(-1)).view([count, -1]);
        let modules = self.head.modules(self.cpu.clone())?;
        let lm_head = modules.lm_head_weight();
        let scratch = &mut self.logits_scratch;
        let greedy = projected_argmax(&pick(&batch.hidden.narrow(1, 1, len - 1)), lm_head, scratch);
        let from_target = target_inputs(&modules, batch)?;
        let mut inputs = from_target.shallow_clone();
        for step in 1..=self.chain_steps {
            let predicted = predict(&modules, &inputs, batch)?;
            let drafted = projected_argmax(&pick(&predicted), lm_head, scratch);
            let hits = drafted
                .eq_tensor(&greedy)
                .sum(Kind::Float)
                .double_value(&[]);
            let n = count as f64;
            metrics.add(&format!("alpha{step}"), hits, n);
            inputs = own_predictions_as_inputs(&from_target, &predicted);
        }
        Ok(metrics)
    }
}

/// EAGLE-3's training (the references': SpecForge's `eagle3`, the EAGLE repository's
/// `traineagle3`): `rounds` rounds of training-time test ([`Eagle3Modules::unroll`]), each scored
/// on tokens against the target's distribution over the draft vocabulary, round `k` weighted
/// `decay^k`. A position counts where it is an assistant token and the target's greedy token
/// there is in the draft vocabulary; `acc_k` is the share of the assistant positions of round
/// `k` where the head's top token is the target's greedy one (out-of-vocabulary ones count as
/// misses), the acceptance of draft depth `k + 1` along the target's own text.
pub struct Eagle3Objective {
    pub head: Eagle3Head,
    /// Rounds of training-time test (the references: 7).
    pub rounds: usize,
    /// Loss weight of round k: `decay^k` (the references: 0.8).
    pub decay: f64,
    /// The target's whole LM head `[vocab, hidden]`: its greedy token says which positions count.
    target_lm_head: Tensor,
    /// Its draft-vocabulary rows: the teacher distribution.
    draft_rows: Tensor,
    /// Target id → whether it is in the draft vocabulary, `[vocab]` bool.
    in_draft: Tensor,
    /// Target id → draft index (−1 outside), `[vocab]` i64.
    to_draft: Tensor,
    cpu: CpuPolicy,
    teacher_scratch: Scratch,
    greedy_scratch: Scratch,
    logits_scratch: Scratch,
}

/// Rows of the target's greedy projection taken at once (its `[rows, vocab]` logits live in a
/// scratch buffer: 256 × 49k floats is 50 MB).
const GREEDY_ROWS: i64 = 256;

impl Eagle3Objective {
    /// `draft` is the head's vocabulary and `target_lm_head` the target's whole LM head.
    pub fn new(
        head: Eagle3Head,
        draft: &DraftVocab,
        target_lm_head: &Tensor,
        rounds: usize,
        decay: f64,
        cpu: CpuPolicy,
    ) -> Self {
        let target_lm_head = target_lm_head.detach().to_kind(Kind::Float);
        let vocab = target_lm_head.size()[0] as usize;
        let to_draft = draft.to_draft(
            &Tensor::arange(vocab as i64, (Kind::Int64, head.device())),
            vocab,
        );
        Self {
            draft_rows: DraftVocab::lm_head_rows(
                Some(draft),
                &Matrix::Dense(target_lm_head.shallow_clone()),
            ),
            in_draft: to_draft.ge(0),
            to_draft,
            target_lm_head,
            head,
            rounds: rounds.max(1),
            decay,
            cpu,
            teacher_scratch: Scratch::default(),
            greedy_scratch: Scratch::default(),
            logits_scratch: Scratch::default(),
        }
    }

    /// The target's greedy token at each of `hidden`'s rows `[n, hidden]`.
    fn greedy(&mut self, hidden: &Tensor) -> Tensor {
        let chunks: Vec<Tensor> = hidden
            .split(GREEDY_ROWS, 0)
            .iter()
            .map(|rows| projected_argmax(rows, &self.target_lm_head, &mut self.greedy_scratch))
            .collect();
        Tensor::cat(&chunks, 0)
    }
}

impl Objective for Eagle3Objective {
    fn params(&self) -> &Params {
        &self.head.params
    }

    fn params_mut(&mut self) -> &mut Params {
        &mut self.head.params
    }

    fn taps(&self) -> &[usize] {
        &self.head.config.taps
    }

    fn run(&mut self, batch: &Batch, backward_scale: Option<f64>) -> anyhow::Result<Metrics> {
        let mut metrics = Metrics::default();
        let (b, t) = (batch.ids.size()[0], batch.ids.size()[1]);
        let n = t - 1;
        if n < 1 {
            return Ok(metrics);
        }
        let device = batch.ids.device();
        let hidden_size = batch.hidden.size()[2];
        let flat_hidden = batch.hidden.view([b * t, hidden_size]);
        let greedy = self.greedy(&flat_hidden);
        let teacher = projected_softmax(&flat_hidden, &self.draft_rows, &mut self.teacher_scratch);
        let counted = batch
            .loss_mask
            .logical_and(&self.in_draft.index_select(0, &greedy).view([b, t]));
        let modules = self.head.modules(self.cpu.clone())?;
        let taps: Vec<Tensor> = batch.taps.iter().map(|tap| tap.narrow(1, 0, n)).collect();
        let features = modules.fuse(&batch.hidden.narrow(1, 0, n), &taps)?;
        let rounds = self.rounds.min(n as usize) as i64;
        // Round k's next tokens, ids[i + 1 + k], and whether its teacher position i + 1 + k is
        // one that counts (padding past the end).
        let shifted =
            |x: &Tensor, k: i64, fill: Tensor| Tensor::cat(&[x.narrow(1, 1 + k, n - k), fill], 1);
        let ids: Vec<Tensor> = (0..rounds)
            .map(|k| shifted(&batch.ids, k, batch.ids.zeros_like().narrow(1, 0, k)))
            .collect();
        let positions = Tensor::arange(n, (Kind::Int64, device)).expand([b, n], true);
        let outputs = modules.unroll(&features, &ids, &positions);
        let rows = (Tensor::arange(b, (Kind::Int64, device)) * t).unsqueeze(1)
            + Tensor::arange(n, (Kind::Int64, device)).unsqueeze(0);
        let mut total = Tensor::zeros([], (Kind::Float, device));
        for (k, output) in (0..rounds).zip(&outputs) {
            let none = batch.loss_mask.zeros_like().narrow(1, 0, k);
            let valid = shifted(&counted, k, none.shallow_clone());
            let assistant = shifted(&batch.loss_mask, k, none);
            let count = valid.sum(Kind::Int64).int64_value(&[]);
            let positions_k = assistant.sum(Kind::Int64).int64_value(&[]) as f64;
            if count == 0 {
                metrics.add(&format!("acc_{k}"), 0.0, positions_k);
                continue;
            }
            let picked = output.masked_select(&valid.unsqueeze(-1)).view([count, -1]);
            let teacher_rows = (&rows + (1 + k)).masked_select(&valid);
            let target_p = teacher.index_select(0, &teacher_rows);
            let reference = self
                .to_draft
                .index_select(0, &greedy.index_select(0, &teacher_rows));
            let scored = projected_cross_entropy(
                &modules.normed(&picked),
                modules.lm_head_weight(),
                VocabTarget::Distribution(&target_p),
                &reference,
                backward_scale.is_some(),
                &mut self.logits_scratch,
            );
            let value = scored.loss.double_value(&[]);
            metrics.add(&format!("acc_{k}"), scored.top1, positions_k);
            metrics.add(&format!("loss_{k}"), value * count as f64, count as f64);
            total += scored.loss * self.decay.powi(k as i32);
        }
        // A batch without one counted position (no assistant token in the draft vocabulary)
        // has no loss to learn from.
        if let (Some(scale), true) = (backward_scale, total.requires_grad()) {
            (&total * scale).backward();
        }
        let tokens = batch.tokens as f64;
        metrics.add("loss", total.double_value(&[]) * tokens, tokens);
        Ok(metrics)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headway_model::testing::tiny_config;
    use tch::Device;

    fn objective(unroll: usize) -> EagleObjective {
        tapped_objective(unroll, vec![])
    }

    fn tapped_objective(unroll: usize, taps: Vec<usize>) -> EagleObjective {
        let head = headway_heads::testing::tiny_eagle_head(11, 1, taps, 64);
        let cpu = headway_model::CpuThreads::new(2).batch();
        EagleObjective::new(head, 0.0, 0.1, unroll, cpu)
    }

    fn batch() -> Batch {
        tch::manual_seed(12);
        let hidden_size = tiny_config().hidden_size as i64;
        let ids = Tensor::randint(64, [2, 9], (Kind::Int64, Device::Cpu));
        let loss_mask = Tensor::ones([2, 9], (Kind::Bool, Device::Cpu));
        let hidden = Tensor::randn([2, 9, hidden_size], (Kind::Float, Device::Cpu));
        Batch {
            ids,
            loss_mask,
            hidden,
            taps: vec![],
            tokens: 18,
        }
    }

    /// An EAGLE-3 objective over the tiny target drafting over its 40 lowest ids with `rounds`
    /// rounds of training-time test, its teacher the target LM head `lm_head`.
    fn eagle3_objective(lm_head: &Tensor, rounds: usize) -> Eagle3Objective {
        let head = headway_heads::testing::tiny_eagle3_head(5, vec![1, 1, 1], 40);
        let vocab = tiny_config().vocab_size;
        let counts: Vec<u64> = (0..vocab).map(|id| (vocab - id) as u64).collect();
        let draft = DraftVocab::from_counts(&counts, 40).unwrap();
        let cpu = headway_model::CpuThreads::new(2).batch();
        Eagle3Objective::new(head, &draft, lm_head, rounds, 0.8, cpu)
    }

    fn tapped_batch() -> Batch {
        let mut batch = batch();
        batch.taps = (0..3).map(|_| batch.hidden.randn_like()).collect();
        batch
    }

    #[test]
    fn eagle3_scores_each_round_over_all_assistant_tokens_and_trains_every_parameter() {
        let c = tiny_config();
        let lm_head = Tensor::randn(
            [c.vocab_size as i64, c.hidden_size as i64],
            (Kind::Float, Device::Cpu),
        );
        // Most greedy tokens in the draft vocabulary, so every round has some to learn from.
        let _ = lm_head.narrow(0, 0, 40).g_mul_scalar_(4.0);
        let mut objective = eagle3_objective(&lm_head, 3);
        let batch = tapped_batch();
        let trained = objective.run(&batch, Some(1.0)).unwrap();
        for k in 0..3 {
            let acc = trained.mean(&format!("acc_{k}")).unwrap();
            assert!((0.0..=1.0).contains(&acc), "acc_{k} {acc}");
        }
        assert!(trained.mean("acc_3").is_none());
        for (name, p) in objective.head.params.iter() {
            let grad = p.grad();
            assert!(grad.defined(), "{name} has no gradient");
            let size = grad.abs().sum(Kind::Float).double_value(&[]);
            assert!(size > 0.0, "{name}: zero gradient");
        }
        let evaluated = objective.run(&batch, None).unwrap();
        assert_eq!(evaluated.mean("acc_0"), trained.mean("acc_0"));
    }

    /// Where the target's greedy token lies outside the draft vocabulary the head cannot be
    /// right: such positions count as misses and teach nothing; a batch of only such positions
    /// gives accuracy 0 and no gradient (and no error).
    #[test]
    fn eagle3_counts_tokens_outside_the_draft_vocabulary_as_misses() {
        let c = tiny_config();
        let last = c.vocab_size as i64 - 1;
        let lm_head = Tensor::zeros(
            [c.vocab_size as i64, c.hidden_size as i64],
            (Kind::Float, Device::Cpu),
        );
        let _ = lm_head.get(last).fill_(1.0);
        let mut objective = eagle3_objective(&lm_head, 2);
        let mut batch = tapped_batch();
        batch.hidden = batch.hidden.abs() + 0.1;
        let metrics = objective.run(&batch, Some(1.0)).unwrap();
        assert_eq!(metrics.mean("acc_0"), Some(0.0));
        assert_eq!(metrics.mean("acc_1"), Some(0.0));
        for (name, p) in objective.head.params.iter() {
            assert!(!p.grad().defined(), "{name} got a gradient");
        }
    }

    #[test]
    fn a_tapped_head_learns_its_tap_projection_from_the_batches_taps() {
        let mut objective = tapped_objective(2, vec![1]);
        let mut batch = batch();
        batch.taps = vec![batch.hidden.randn_like() * 5.0];
        let metrics = objective.run(&batch, Some(1.0)).unwrap();
        assert!(metrics.mean("round2/top1").is_some());
        let grad = objective.params().get("tap_proj.weight").unwrap().grad();
        assert!(grad.abs().sum(Kind::Float).double_value(&[]) > 0.0);
        batch.taps.clear();
        let error = objective.run(&batch, None).err().unwrap().to_string();
        assert!(error.contains("taps [1]"), "{error}");
    }

    fn gradients(objective: &EagleObjective) -> Vec<Tensor> {
        objective
            .head
            .params
            .iter()
            .map(|(_, p)| p.grad().copy())
            .collect()
    }

    /// Round 2 is the computation behind `alpha2` (round 1 and `alpha1` agree too), and its loss
    /// joins the gradients: an unrolled step's differ from teacher forcing's in every weight.
    /// One head serves both steps: tests running in parallel draw from libtorch's one generator,
    /// so two heads built from the same seed need not be equal.
    #[test]
    fn the_second_round_is_alpha2s_computation_and_changes_the_gradients() {
        let batch = batch();
        let mut objective = objective(2);
        let trained = objective.run(&batch, Some(1.0)).unwrap();
        let unrolled_gradients = gradients(&objective);
        let evaluated = objective.evaluate(&batch).unwrap();
        let (round2, alpha2) = (trained.mean("round2/top1"), evaluated.mean("alpha2"));
        assert_eq!(round2, alpha2);
        assert_eq!(trained.mean("top1"), evaluated.mean("alpha1"));
        assert!(
            evaluated.mean("round2/top1").is_none(),
            "evaluation scores round 1 only"
        );
        for (_, p) in objective.head.params.iter() {
            let _ = p.grad().zero_();
        }
        objective.unroll = 1;
        let taught = objective.run(&batch, Some(1.0)).unwrap();
        assert_eq!(taught.mean("top1"), trained.mean("top1"));
        assert!(taught.mean("round2/top1").is_none());
        for (a, b) in unrolled_gradients.iter().zip(gradients(&objective)) {
            assert!(a.defined() && b.defined());
            assert!((a - b).abs().max().double_value(&[]) > 0.0);
        }
    }
}
