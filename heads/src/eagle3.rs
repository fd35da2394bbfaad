//! The EAGLE-3 head, as SpecForge, the EAGLE repository, vLLM and SGLang build it.
//!
//! Where the target's features are known (position `i`), `fc` (no bias) fuses the target's
//! residual streams at three layers — low, middle and high, the inputs of layers 2, L/2 and L − 3
//! by default — into one hidden-wide feature `h_i = fc(concat(taps_i))`. One decoder layer then
//! reads `concat(input_layernorm(embed(t_{i+1})), hidden_norm(h_i))` (twice the hidden size) in its
//! attention, with `h_i` as its residual stream, and its output `o_i` is both the feature fed back
//! at the next draft depth (no `fc` there) and, through the final `norm` and the head's **own** LM
//! head over a draft vocabulary, the guess of `t_{i+2}`. Unlike EAGLE-1 it is trained on tokens
//! only (the target's distribution over the draft vocabulary), with training-time test: rounds in
//! which the head reads its own outputs, as drafting does ([`Eagle3Modules::unroll`]).
//!
//! Parameter names are the references' checkpoint names: `fc.weight`, `midlayer.*` (with
//! `midlayer.input_layernorm` and `midlayer.hidden_norm` for the two halves of the attention
//! input), `norm.weight`, `lm_head.weight`. The token embedding is the target's, frozen; the draft
//! vocabulary's ids live in the checkpoint's config (exported as `d2t`/`t2d`).

use headway_model::linear::{f32_slice, plain_cpu_f32, Linear, Matrix};
use headway_model::quant::QuantFormat;
use headway_model::{
    Architecture, AttentionInput, CpuPolicy, DecoderLayer, KvCache, ModelConfig, RmsNorm, Rotary,
    WeightSource,
};
use tch::{Device, Kind, Tensor};

use crate::error::{HeadError, Result};
use crate::feature_head::{FeatureHead, FeatureModules};
use crate::params::{torch_default, Params};

/// Prefix of the draft layer's parameters (the references' name).
pub const MIDLAYER: &str = "midlayer";
const EMBED_NORM: &str = "midlayer.input_layernorm.weight";
const HIDDEN_NORM: &str = "midlayer.hidden_norm.weight";
const FINAL_NORM: &str = "norm.weight";
const LM_HEAD: &str = "lm_head.weight";
const FC: &str = "fc.weight";

/// The head's shape.
#[derive(Debug, Clone)]
pub struct Eagle3Config {
    /// The target's config with one layer: the draft layer's geometry.
    pub layer: ModelConfig,
    /// Target layers `k` whose residual stream (the hidden state after `k` layers, the input of
    /// layer `k`) `fc` fuses, low to high.
    pub taps: Vec<usize>,
    /// Rows of the head's LM head: the size of its draft vocabulary.
    pub draft_vocab: usize,
}

impl Eagle3Config {
    /// A head for `target` fusing `taps` and drafting over `draft_vocab` tokens. The draft layer
    /// is a plain Llama layer whatever the target (no q/k/v bias, no q/k norms), with the
    /// target's sizes and rotary embedding: the layer every reference builds and loads.
    pub fn for_target(target: &ModelConfig, taps: Vec<usize>, draft_vocab: usize) -> Self {
        let mut layer = target.clone();
        layer.num_hidden_layers = 1;
        layer.architecture = Architecture::Llama;
        layer.qkv_bias = false;
        layer.qk_norm = false;
        Self {
            layer,
            taps,
            draft_vocab,
        }
    }

    /// The references' taps for a target of `layers` layers: the inputs of layers 2, L/2 and
    /// L − 3 (SpecForge records the same tensors as the outputs of layers 1, L/2 − 1, L − 4).
    pub fn default_taps(layers: usize) -> Vec<usize> {
        vec![2, layers / 2, layers.saturating_sub(3)]
    }

    /// Names and shapes of the head's parameters.
    pub fn parameter_shapes(&self) -> Result<Vec<(String, Vec<i64>)>> {
        let h = self.layer.hidden_size as i64;
        let mut shapes = vec![(FC.to_string(), vec![h, self.taps.len() as i64 * h])];
        let wide = AttentionInput::Given(2 * self.layer.hidden_size);
        shapes.extend(DecoderLayer::weight_shapes(MIDLAYER, &self.layer, wide)?);
        for norm in [EMBED_NORM, HIDDEN_NORM, FINAL_NORM] {
            shapes.push((norm.to_string(), vec![h]));
        }
        shapes.push((LM_HEAD.to_string(), vec![self.draft_vocab as i64, h]));
        Ok(shapes)
    }
}

pub struct Eagle3Head {
    pub config: Eagle3Config,
    pub params: Params,
    /// The target's embedding `[vocab, hidden]` as it stores it (shared, never copied), frozen.
    embed: Matrix,
    rotary: Rotary,
}

impl Eagle3Head {
    /// A fresh head: `fc` and the layer's matrices drawn as torch's `nn.Linear` default (uniform
    /// ±1/√fan_in, from libtorch's generator: seed it with `tch::manual_seed`), norms one, and the
    /// LM head started from `lm_head_rows`, the target's LM head rows of the draft vocabulary
    /// (the layer learns to produce what the target's head reads; the references start from
    /// random rows).
    pub fn new(config: Eagle3Config, embed: &Matrix, lm_head_rows: &Tensor) -> Result<Self> {
        let c = &config.layer;
        let h = c.hidden_size as i64;
        let rows = [config.draft_vocab as i64, h];
        if config.taps.is_empty()
            || embed.shape() != [c.vocab_size as i64, h]
            || lm_head_rows.size() != rows
        {
            return Err(HeadError::Invalid(format!(
                "the EAGLE-3 head needs taps (got {:?}), an embedding [{}, {h}] (got {:?}) and LM-head rows {rows:?} (got {:?})",
                config.taps,
                c.vocab_size,
                embed.shape(),
                lm_head_rows.size()
            )));
        }
        let device = embed.device();
        let mut params = Params::new();
        for (name, shape) in config.parameter_shapes()? {
            let value = if name == LM_HEAD {
                lm_head_rows.to_kind(Kind::Float)
            } else {
                torch_default(&name, &shape, 2 * h, device)
            };
            params.insert(name, &value);
        }
        Ok(Self {
            rotary: Rotary::new(c, device),
            config,
            params,
            embed: embed.share(),
        })
    }

    pub fn device(&self) -> Device {
        self.embed.device()
    }

    /// From now on [`Self::modules`] runs the head's matrices (fc, the layer's, the LM head) in
    /// `format`, quantised once here and kept only so ([`Params::quantise_matrices`]): for a
    /// frozen head drafting beside a quantised target; it can no longer train.
    pub fn draft_in(&mut self, format: QuantFormat) {
        self.params.quantise_matrices(format);
    }

    /// Assembles the head's modules from the current parameters, to run under `cpu`. Call again
    /// after the parameters change.
    pub fn modules(&self, cpu: CpuPolicy) -> Result<Eagle3Modules<'_>> {
        let h = self.config.layer.hidden_size;
        let eps = self.config.layer.rms_norm_eps;
        let source = &mut &self.params;
        let mut linear = |name: &str| -> Result<Linear> {
            let shape = self.params.shape(name)?;
            Ok(Linear::from_matrix(source.matrix(name, &shape)?, None))
        };
        let (fc, lm_head) = (linear(FC)?, linear(LM_HEAD)?);
        Ok(Eagle3Modules {
            head: self,
            fc,
            embed_norm: RmsNorm::load(source, EMBED_NORM, h, eps)?,
            hidden_norm: RmsNorm::load(source, HIDDEN_NORM, h, eps)?,
            layer: DecoderLayer::load_with(
                source,
                MIDLAYER,
                &self.config.layer,
                AttentionInput::Given(2 * h),
            )?,
            norm: RmsNorm::load(source, FINAL_NORM, h, eps)?,
            lm_head,
            cpu,
        })
    }
}

/// The head's modules built from its parameters, ready to run.
pub struct Eagle3Modules<'a> {
    head: &'a Eagle3Head,
    fc: Linear,
    embed_norm: RmsNorm,
    hidden_norm: RmsNorm,
    layer: DecoderLayer,
    norm: RmsNorm,
    lm_head: Linear,
    cpu: CpuPolicy,
}

impl Eagle3Modules<'_> {
    /// The draft layer's attention input: the normed embedding of `next_ids` beside the normed
    /// `features`; on row loops where drafting runs ([`Self::attention_input_rows`]).
    fn attention_input(&self, features: &Tensor, next_ids: &Tensor) -> Tensor {
        if let Some(rows) = self.attention_input_rows(features, next_ids) {
            return rows;
        }
        let ids = next_ids.to_kind(Kind::Int64);
        let embedded = self.head.embed.rows(&ids).to_kind(Kind::Float);
        Tensor::cat(
            &[
                self.embed_norm.forward(&embedded),
                self.hidden_norm.forward(&features.to_kind(Kind::Float)),
            ],
            -1,
        )
    }

    /// [`Self::attention_input`] where the features and both norms are f32 CPU tensors without
    /// gradients (drafting, not training) and the embedding's rows read in place
    /// ([`Matrix::row_into`]: quantised rows dequantised one by one), each row normed as the
    /// few-row layer norms, in a few libtorch calls rather than a score. `None` elsewhere, or for
    /// an id outside the vocabulary (the ops name it).
    fn attention_input_rows(&self, features: &Tensor, next_ids: &Tensor) -> Option<Tensor> {
        let plain =
            plain_cpu_f32(features) && self.embed_norm.runs_rows() && self.hidden_norm.runs_rows();
        if !plain {
            return None;
        }
        let hidden = self.head.config.layer.hidden_size;
        let ids = Vec::<i64>::try_from(next_ids.to_kind(Kind::Int64).reshape([-1])).ok()?;
        let mut embedded = vec![0f32; ids.len() * hidden];
        for (id, row) in ids.into_iter().zip(embedded.chunks_exact_mut(hidden)) {
            if !self.head.embed.row_into(usize::try_from(id).ok()?, row) {
                return None;
            }
        }
        let features = features.contiguous();
        if features.numel() != embedded.len() {
            return None;
        }
        let (embedded, normed) = (
            self.embed_norm.rows(&embedded),
            self.hidden_norm.rows(f32_slice(&features)),
        );
        let mut input = Vec::with_capacity(2 * normed.len());
        for (e, f) in embedded
            .chunks_exact(hidden)
            .zip(normed.chunks_exact(hidden))
        {
            input.extend_from_slice(e);
            input.extend_from_slice(f);
        }
        let mut size = features.size();
        *size.last_mut()? = 2 * hidden as i64;
        Some(Tensor::from_slice(&input).view(size.as_slice()))
    }

    /// The head's outputs over `ids.len()` rounds of training-time test. Round 0 reads
    /// `features` (`[batch, n, hidden]`, fused from the target's taps) with the next tokens
    /// `ids[0]` (`[batch, n]`) at `positions`; round `k` reads round `k − 1`'s outputs at the same
    /// indices with `ids[k]`, the tokens one further on, at positions shifted by `k`: what a draft
    /// of depth `k + 1` sees. Each round's query at index `i` attends to round 0's keys at indices
    /// up to `i` (the verified prefix) and to every later round's key at `i` (its own draft
    /// chain), EAGLE-3's pattern. Returns each round's outputs `[batch, n, hidden]`, before the
    /// final norm.
    pub fn unroll(&self, features: &Tensor, ids: &[Tensor], positions: &Tensor) -> Vec<Tensor> {
        self.cpu.enter();
        let c = &self.head.config.layer;
        let repeats = (c.num_attention_heads / c.num_key_value_heads) as i64;
        let scale = 1.0 / (c.head_dim as f64).sqrt();
        let (mut keys, mut values): (Vec<Tensor>, Vec<Tensor>) = (Vec::new(), Vec::new());
        let mut outputs: Vec<Tensor> = Vec::with_capacity(ids.len());
        for (round, next_ids) in ids.iter().enumerate() {
            let input = outputs.last().unwrap_or(features);
            let rope = self
                .head
                .rotary
                .cos_sin(&(positions + round as i64), Kind::Float);
            let attention_input = self.attention_input(input, next_ids);
            let (q, k, v) = self
                .layer
                .queries_keys_values(&attention_input, &rope, &self.cpu);
            keys.push(k.repeat_interleave_self_int(repeats, 1, None));
            values.push(v.repeat_interleave_self_int(repeats, 1, None));
            let n = q.size()[2];
            let prefix = q.matmul(&keys[0].transpose(-1, -2)) * scale;
            let later = Tensor::ones([n, n], (Kind::Bool, q.device())).triu(1);
            let mut scores = vec![prefix.masked_fill(&later, f64::NEG_INFINITY)];
            for key in &keys[1..] {
                scores.push((&q * key).sum_dim_intlist(-1, true, Kind::Float) * scale);
            }
            let weights = Tensor::cat(&scores, -1).softmax(-1, Kind::Float);
            let mut attended = weights.narrow(-1, 0, n).matmul(&values[0]);
            for (s, value) in values.iter().enumerate().skip(1) {
                attended += weights.narrow(-1, n + s as i64 - 1, 1) * value;
            }
            outputs.push(self.layer.finish(input, &attended, &self.cpu));
        }
        outputs
    }

    /// The final norm of outputs `[..., hidden]`: what the LM head reads.
    pub fn normed(&self, outputs: &Tensor) -> Tensor {
        self.norm.forward_rows_where_plain(outputs)
    }

    /// The head's LM head `[draft vocab, hidden]` (a parameter).
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.weight()
    }
}

impl FeatureModules for Eagle3Modules<'_> {
    /// `fc` of the concatenated taps; the final hidden state is not read.
    fn fuse(&self, _hidden: &Tensor, taps: &[Tensor]) -> Result<Tensor> {
        if taps.len() != self.head.config.taps.len() {
            return Err(HeadError::Invalid(format!(
                "the EAGLE-3 head fuses the target's taps {:?}, but {} tap tensors were given",
                self.head.config.taps,
                taps.len()
            )));
        }
        let taps: Vec<Tensor> = taps.iter().map(|t| t.to_kind(Kind::Float)).collect();
        Ok(self.fc.forward(&Tensor::cat(&taps, -1), &self.cpu))
    }

    fn forward(
        &self,
        features: &Tensor,
        next_ids: &Tensor,
        positions: &Tensor,
        cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.cpu.enter();
        let features = features.to_kind(Kind::Float);
        let attention_input = self.attention_input(&features, next_ids);
        let rope = self.head.rotary.cos_sin(positions, Kind::Float);
        Ok(self
            .layer
            .forward_given(&features, &attention_input, &rope, cache, mask, &self.cpu)?)
    }

    fn logits(&self, outputs: &Tensor) -> Tensor {
        self.lm_head.forward(&self.normed(outputs), &self.cpu)
    }
}

impl FeatureHead for Eagle3Head {
    fn modules(&self, cpu: CpuPolicy) -> Result<Box<dyn FeatureModules + '_>> {
        Ok(Box::new(Eagle3Head::modules(self, cpu)?))
    }

    fn layer_config(&self) -> &ModelConfig {
        &self.config.layer
    }

    fn device(&self) -> Device {
        Eagle3Head::device(self)
    }

    fn taps(&self) -> &[usize] {
        &self.config.taps
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::tiny_eagle3_head;
    use headway_model::mask::positions;
    use headway_model::testing::tiny_config;
    use headway_model::CpuThreads;

    fn decode() -> CpuPolicy {
        CpuThreads::new(2).decode()
    }

    #[test]
    fn parameters_carry_the_references_names_and_shapes() {
        let head = tiny_eagle3_head(3, vec![0, 1, 1], 40);
        let c = tiny_config();
        let (h, q, kv) = (
            c.hidden_size as i64,
            (c.num_attention_heads * c.head_dim) as i64,
            (c.num_key_value_heads * c.head_dim) as i64,
        );
        let shape = |name: &str| head.params.get(name).unwrap().size();
        assert_eq!(shape("fc.weight"), [h, 3 * h]);
        assert_eq!(shape("midlayer.self_attn.q_proj.weight"), [q, 2 * h]);
        assert_eq!(shape("midlayer.self_attn.k_proj.weight"), [kv, 2 * h]);
        assert_eq!(shape("midlayer.self_attn.o_proj.weight"), [h, q]);
        for norm in [
            "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight",
            "midlayer.post_attention_layernorm.weight",
            "norm.weight",
        ] {
            assert_eq!(shape(norm), [h], "{norm}");
        }
        assert_eq!(shape("lm_head.weight"), [40, h]);
        assert!(head.params.get("fc.bias").is_err());
        assert_eq!(head.params.len(), 13);
        assert_eq!(Eagle3Config::default_taps(32), [2, 16, 29]);
    }

    /// Training-time test must see what drafting sees: round k's output at index i equals
    /// feeding the head the prefix 0..=i with the target's features (a KV cache), then its own
    /// outputs one token at a time, k times, at positions i + 1 … i + k.
    #[test]
    fn unrolled_rounds_equal_cached_drafting_of_each_chain() {
        let _no_grad = tch::no_grad_guard();
        let head = tiny_eagle3_head(7, vec![0, 1], 64);
        let modules = head.modules(decode()).unwrap();
        let h = tiny_config().hidden_size as i64;
        let n = 6;
        let taps: Vec<Tensor> = (0..2)
            .map(|_| Tensor::randn([1, n, h], (Kind::Float, Device::Cpu)))
            .collect();
        let features = modules
            .fuse(&Tensor::zeros([1, n, h], (Kind::Float, Device::Cpu)), &taps)
            .unwrap();
        let ids: Vec<Tensor> = (0..3)
            .map(|_| Tensor::randint(64, [1, n], (Kind::Int64, Device::Cpu)))
            .collect();
        let outputs = modules.unroll(&features, &ids, &positions(0, n as usize, Device::Cpu));
        for i in [0i64, 2, 5] {
            let mut cache = head.new_cache(1, 16).unwrap();
            let prefix = modules
                .forward(
                    &features.narrow(1, 0, i + 1),
                    &ids[0].narrow(1, 0, i + 1),
                    &positions(0, i as usize + 1, Device::Cpu),
                    Some(&mut cache),
                    None,
                )
                .unwrap();
            let mut out = prefix.narrow(1, i, 1);
            let diff = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
            assert!(
                diff(&out, &outputs[0].narrow(1, i, 1)) < 1e-5,
                "round 0 at {i}"
            );
            for (k, next) in ids.iter().enumerate().skip(1) {
                out = modules
                    .forward(
                        &out,
                        &next.narrow(1, i, 1),
                        &positions(i as usize + k, 1, Device::Cpu),
                        Some(&mut cache),
                        None,
                    )
                    .unwrap();
                let d = diff(&out, &outputs[k].narrow(1, i, 1));
                assert!(d < 1e-5, "round {k} at {i}: {d}");
            }
        }
        assert_eq!(modules.logits(&outputs[2]).size(), [1, n, 64]);
    }

    /// Drafting (frozen parameters) builds the attention input and the final norm on row loops,
    /// training on libtorch's ops; both give the same values within float rounding.
    #[test]
    fn the_attention_input_on_rows_matches_the_ops() {
        let _no_grad = tch::no_grad_guard();
        let mut head = tiny_eagle3_head(11, vec![0, 1], 64);
        let h = tiny_config().hidden_size as i64;
        let features = Tensor::randn([2, 3, h], (Kind::Float, Device::Cpu));
        let ids = Tensor::randint(64, [2, 3], (Kind::Int64, Device::Cpu));
        let run = |head: &Eagle3Head| {
            let modules = head.modules(decode()).unwrap();
            let rows = modules.attention_input_rows(&features, &ids).is_some();
            let normed = modules.normed(&features);
            (modules.attention_input(&features, &ids), normed, rows)
        };
        let (ops, ops_normed, ops_rows) = run(&head);
        head.params.freeze();
        let (rows, rows_normed, on_rows) = run(&head);
        assert!(!ops_rows && on_rows, "training on ops, drafting on rows");
        assert_eq!(rows.size(), [2, 3, 2 * h]);
        for (a, b) in [(&ops, &rows), (&ops_normed, &rows_normed)] {
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "|Δ| {diff}");
        }
        let modules = head.modules(decode()).unwrap();
        let vocab = tiny_config().vocab_size as i64;
        let outside = Tensor::from_slice(&[1i64, vocab, 2]).view([1, 3]);
        assert!(modules
            .attention_input_rows(&features.narrow(0, 0, 1), &outside)
            .is_none());
    }

    /// Over a quantised target's embedding the head reads the ids' rows from its blocks (no
    /// dense copy), on rows as on the ops.
    #[test]
    fn a_quantised_embedding_is_read_row_by_row_without_a_dense_copy() {
        use headway_model::quant::quantise;
        let _no_grad = tch::no_grad_guard();
        let c = tiny_config();
        let (vocab, h) = (c.vocab_size, c.hidden_size);
        let values = Vec::<f32>::try_from(Tensor::randn(
            [(vocab * h) as i64],
            (Kind::Float, Device::Cpu),
        ))
        .unwrap();
        let table = Matrix::quantised(quantise(QuantFormat::Q8_0, &values, vocab, h));
        let rows = Tensor::randn([64, h as i64], (Kind::Float, Device::Cpu));
        let config = Eagle3Config::for_target(&c, vec![0, 1], 64);
        let mut head = Eagle3Head::new(config, &table, &rows).unwrap();
        head.params.freeze();
        let modules = head.modules(decode()).unwrap();
        let features = Tensor::randn([1, 3, h as i64], (Kind::Float, Device::Cpu));
        let ids = Tensor::from_slice(&[3i64, 0, vocab as i64 - 1]).view([1, 3]);
        let on_rows = modules.attention_input_rows(&features, &ids).unwrap();
        let ops = Tensor::cat(
            &[
                modules.embed_norm.forward(&table.rows(&ids)),
                modules.hidden_norm.forward(&features),
            ],
            -1,
        );
        let diff = (&on_rows - &ops).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "|Δ| {diff}");
        assert!(
            matches!(&head.embed, Matrix::Quantised { dense, .. } if dense.get().is_none()),
            "the embedding stays quantised"
        );
    }

    /// Drafting in Q8_0 runs every matrix on the quantised kernel and stays close to f32: the
    /// same top guesses, logits within the blocks' rounding.
    #[test]
    fn drafting_in_q8_0_stays_close_to_f32() {
        let _no_grad = tch::no_grad_guard();
        let mut head = tiny_eagle3_head(5, vec![0, 1], 64);
        let h = tiny_config().hidden_size as i64;
        let n = 5;
        let taps: Vec<Tensor> = (0..2)
            .map(|_| Tensor::randn([1, n, h], (Kind::Float, Device::Cpu)))
            .collect();
        let ids = Tensor::randint(64, [1, n], (Kind::Int64, Device::Cpu));
        let run = |head: &Eagle3Head| {
            let modules = head.modules(decode()).unwrap();
            let hidden = Tensor::zeros([1, n, h], (Kind::Float, Device::Cpu));
            let features = modules.fuse(&hidden, &taps).unwrap();
            let place = positions(0, n as usize, Device::Cpu);
            let out = modules
                .forward(&features, &ids, &place, None, None)
                .unwrap();
            let quantised = [&modules.fc, &modules.lm_head]
                .into_iter()
                .chain(modules.layer.linears())
                .all(|l| matches!(l.matrix(), headway_model::linear::Matrix::Quantised { .. }));
            (modules.logits(&out), quantised)
        };
        let (dense, dense_quantised) = run(&head);
        // The same head again for Q4_1 (the Q8_0 one keeps no f32 values to quantise again),
        // copied rather than redrawn: other tests draw from the shared generator meanwhile.
        let mut q4_head = Eagle3Head::new(
            head.config.clone(),
            &head.embed,
            head.params.get(LM_HEAD).unwrap(),
        )
        .unwrap();
        let values = head
            .params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()));
        q4_head.params.load(&values.collect()).unwrap();
        head.draft_in(QuantFormat::Q8_0);
        let (q8, q8_quantised) = run(&head);
        assert!(
            !dense_quantised && q8_quantised,
            "every matrix drafts in Q8_0"
        );
        let scale = dense.abs().max().double_value(&[]);
        let diff = (&q8 - &dense).abs().max().double_value(&[]);
        assert!(diff > 0.0 && diff < 0.05 * scale, "|Δ| {diff} of {scale}");
        let same_top = q8.argmax(-1, false).eq_tensor(&dense.argmax(-1, false));
        assert!(same_top.sum(Kind::Int64).int64_value(&[]) >= n - 1);
        // Q4_1 (`--head-format q4_1`) runs on the same kernels with coarser blocks.
        q4_head.draft_in(QuantFormat::Q4_1);
        let (q4, q4_quantised) = run(&q4_head);
        let q4_diff = (&q4 - &dense).abs().max().double_value(&[]);
        assert!(
            q4_quantised && q4_diff > diff && q4_diff < 0.3 * scale,
            "|Δ| {q4_diff}"
        );
    }

    #[test]
    fn every_parameter_learns_through_the_unrolled_rounds() {
        let head = tiny_eagle3_head(9, vec![0, 1], 32);
        let modules = head.modules(decode()).unwrap();
        let h = tiny_config().hidden_size as i64;
        let taps: Vec<Tensor> = (0..2)
            .map(|_| Tensor::randn([2, 5, h], (Kind::Float, Device::Cpu)))
            .collect();
        let features = modules.fuse(&taps[0], &taps).unwrap();
        let ids: Vec<Tensor> = (0..2)
            .map(|_| Tensor::randint(64, [2, 5], (Kind::Int64, Device::Cpu)))
            .collect();
        let outputs = modules.unroll(
            &features,
            &ids,
            &positions(0, 5, Device::Cpu).expand([2, 5], true),
        );
        let loss = outputs
            .iter()
            .map(|o| modules.logits(o).logsumexp([-1], false).sum(Kind::Float))
            .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b);
        loss.backward();
        for (name, leaf) in head.params.iter() {
            let grad = leaf.grad();
            assert!(
                grad.defined() && grad.abs().sum(Kind::Float).double_value(&[]) > 0.0,
                "{name} got no gradient"
            );
        }
        assert!(modules.fuse(&taps[0], &taps[..1]).is_err());
    }
}
