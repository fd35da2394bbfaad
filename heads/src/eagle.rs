//! The EAGLE head (EAGLE-1 architecture; drafted with EAGLE-2's dynamic trees at serve time).
//!
//! At position i the head reads the target's feature `f_i` (final post-norm hidden state) and the
//! embedding of the token that follows, `t_{i+1}`: `x_i = fc(concat(embed(t_{i+1}), f_i))`, then
//! Llama decoder layers (one by default) of which the first has no norm before attention, giving
//! `f̂_{i+1}`, a prediction of the next feature, which the target's frozen LM head scores directly.
//! The embedding and LM head are the target's, frozen. Parameter names are the EAGLE repository's
//! (`fc.weight`, `fc.bias`, `layers.0.self_attn.q_proj.weight`, …, no `layers.0.input_layernorm`;
//! its `cnets.py` and vLLM's EAGLE model also give later layers their input norm).
//!
//! Optional tap fusion (after EAGLE-3, which reads low, middle and high target layers): where the
//! target's features are known, the head's input feature is `f_i + tap_proj(taps_i)`, the
//! RMS-normalised residual streams of chosen target layers projected by a zero-initialised
//! matrix. A fresh tapped head is thus exactly EAGLE-1, and the positions where drafting feeds the
//! head its own predictions `f̂` (no taps exist there) get the same kind of input as before.
//!
//! Embedding scale: a target's embeddings are often far smaller than its post-norm features
//! (SmolLM2-135M: RMS 0.14 against 1.9), so `fc` starts out reading the token — the one thing the
//! head knows that the feature does not — at a fraction of the feature's weight, and Adam's
//! steps, the same size for every weight, take long to grow those columns. The head multiplies
//! the embedding by `embed_scale` before `fc` (1 in EAGLE-1); folded into `fc`'s embedding
//! columns on export ([`fold_embed_scale`]), the head is an ordinary EAGLE-1 head.

use headway_model::linear::{Linear, Matrix};
use headway_model::quant::QuantFormat;
use headway_model::weights::quantised_matrix;
use headway_model::{
    AttentionInput, CpuPolicy, DecoderLayer, KvCache, ModelConfig, Rotary, WeightSource,
};
use tch::{Device, Kind, Tensor};

use crate::error::{HeadError, Result};
use crate::feature_head::{FeatureHead, FeatureModules};
use crate::params::{torch_default, Params};

/// The tap fusion's projection `[hidden, taps × hidden]`.
pub(crate) const TAP_PROJ: &str = "tap_proj.weight";

/// What decoder layer `index` reads: only the first reads its input un-normed (`fc`'s output,
/// not a residual stream), as in EAGLE's `cnets.py` and vLLM.
fn input(index: usize) -> AttentionInput {
    match index {
        0 => AttentionInput::Raw,
        _ => AttentionInput::Normed,
    }
}

/// Prefix of decoder layer `index`'s parameters.
pub fn layer_prefix(index: usize) -> String {
    format!("layers.{index}")
}

/// The head's shape: the target's layer geometry with the head's number of layers.
#[derive(Debug, Clone)]
pub struct EagleConfig {
    /// The target's config with `num_hidden_layers` set to the head's (the draft layers' geometry).
    pub layer: ModelConfig,
    /// Target layers `k` whose residual stream (hidden state after `k` decoder layers) the head
    /// fuses into its input; empty for EAGLE-1.
    pub taps: Vec<usize>,
    /// Factor on the token embedding before `fc` (EAGLE-1: 1).
    pub embed_scale: f64,
    /// Whether `fc` has a bias: the EAGLE repository's default and its Vicuna/LLaMA-2 heads have
    /// one; its LLaMA-3 heads and vLLM's loader have none.
    pub fc_bias: bool,
}

impl EagleConfig {
    /// A head of `layers` decoder layers (EAGLE-1: one) for `target`.
    pub fn for_target(target: &ModelConfig, layers: usize) -> Self {
        let mut layer = target.clone();
        layer.num_hidden_layers = layers;
        Self {
            layer,
            taps: Vec::new(),
            embed_scale: 1.0,
            fc_bias: true,
        }
    }

    /// The same head with or without a bias in `fc`.
    pub fn with_fc_bias(self, fc_bias: bool) -> Self {
        Self { fc_bias, ..self }
    }

    /// The same head reading the target's residual stream after each of `taps` layers.
    pub fn with_taps(self, taps: Vec<usize>) -> Self {
        Self { taps, ..self }
    }

    /// The same head with its token embedding multiplied by `embed_scale` before `fc`.
    pub fn with_embed_scale(self, embed_scale: f64) -> Self {
        Self {
            embed_scale,
            ..self
        }
    }

    /// Number of decoder layers.
    pub fn layers(&self) -> usize {
        self.layer.num_hidden_layers
    }
}

pub struct EagleHead {
    pub config: EagleConfig,
    pub params: Params,
    /// The target's embedding `[vocab, hidden]` as it stores it (shared, never copied), frozen.
    embed: Matrix,
    /// The target's LM head `[draft vocab, hidden]` (draft-vocabulary rows), frozen: f32, or
    /// the blocks it drafts in ([`Self::draft_in`]).
    lm_head: Matrix,
    rotary: Rotary,
}

impl EagleHead {
    /// A fresh head: linear layers drawn as torch's `nn.Linear` default (uniform ±1/√fan_in, from
    /// libtorch's generator: seed it with `tch::manual_seed`), norm weights one.
    pub fn new(config: EagleConfig, embed: &Matrix, lm_head: &Tensor) -> Result<Self> {
        let c = &config.layer;
        let h = c.hidden_size as i64;
        if config.layers() == 0 {
            return Err(HeadError::Invalid(
                "an EAGLE head needs at least one decoder layer".into(),
            ));
        }
        if !(config.embed_scale.is_finite() && config.embed_scale > 0.0) {
            return Err(HeadError::Invalid(format!(
                "the EAGLE head's embedding scale must be a positive number, got {}",
                config.embed_scale
            )));
        }
        if embed.shape() != [c.vocab_size as i64, h] || lm_head.size().get(1) != Some(&h) {
            return Err(HeadError::Invalid(format!(
                "the EAGLE head for hidden size {h} needs an embedding [{}, {h}] and an LM head [_, {h}], got {:?} and {:?}",
                c.vocab_size,
                embed.shape(),
                lm_head.size()
            )));
        }
        let device = embed.device();
        let mut params = Params::new();
        for (name, shape) in parameter_shapes(&config)? {
            let value = if name == TAP_PROJ {
                Tensor::zeros(shape.as_slice(), (Kind::Float, device))
            } else {
                torch_default(&name, &shape, h * 2, device)
            };
            params.insert(name, &value);
        }
        Ok(Self {
            rotary: Rotary::new(c, device),
            config,
            params,
            embed: embed.share(),
            lm_head: Matrix::Dense(lm_head.detach().to_kind(Kind::Float)),
        })
    }

    pub fn device(&self) -> Device {
        self.embed.device()
    }

    /// From now on [`Self::modules`] runs the head's matrices (fc, its layers', the LM head) in
    /// `format`, quantised once here and kept only so ([`Params::quantise_matrices`]): for a
    /// frozen head drafting beside a quantised target; it can no longer train.
    pub fn draft_in(&mut self, format: QuantFormat) {
        self.params.quantise_matrices(format);
        self.lm_head = quantised_matrix(self.lm_head.share(), format);
    }

    /// Assembles the head's modules from the current parameters, to run under `cpu` (decoding's
    /// policy when drafting, batch work's in training). Call again after the parameters change
    /// (the decoder layer holds concatenations of them).
    pub fn modules(&self, cpu: CpuPolicy) -> Result<EagleModules<'_>> {
        let bias = match self.config.fc_bias {
            true => Some(self.params.get("fc.bias")?.shallow_clone()),
            false => None,
        };
        let source = &mut &self.params;
        let mut matrix =
            |name: &str| -> Result<Matrix> { Ok(source.matrix(name, &self.params.shape(name)?)?) };
        let fc = Linear::from_matrix(matrix("fc.weight")?, bias);
        let tap_proj = match self.config.taps.is_empty() {
            true => None,
            false => Some(Linear::from_matrix(matrix(TAP_PROJ)?, None)),
        };
        let layers = (0..self.config.layers())
            .map(|index| {
                let prefix = layer_prefix(index);
                DecoderLayer::load_with(source, &prefix, &self.config.layer, input(index))
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(EagleModules {
            head: self,
            fc,
            tap_proj,
            layers,
            lm_head: Linear::from_matrix(self.lm_head.share(), None),
            cpu,
        })
    }
}

impl FeatureHead for EagleHead {
    fn modules(&self, cpu: CpuPolicy) -> Result<Box<dyn FeatureModules + '_>> {
        Ok(Box::new(EagleHead::modules(self, cpu)?))
    }

    fn layer_config(&self) -> &ModelConfig {
        &self.config.layer
    }

    fn device(&self) -> Device {
        EagleHead::device(self)
    }

    fn taps(&self) -> &[usize] {
        &self.config.taps
    }
}

/// The head's modules built from its parameters, ready to run.
pub struct EagleModules<'a> {
    head: &'a EagleHead,
    fc: Linear,
    tap_proj: Option<Linear>,
    layers: Vec<DecoderLayer>,
    /// The frozen target LM head (draft-vocabulary rows): drafting runs it on headway's fast CPU
    /// path, training through libtorch.
    lm_head: Linear,
    cpu: CpuPolicy,
}

impl FeatureModules for EagleModules<'_> {
    /// The head's input features `[..., hidden]` at positions where the target's are known: its
    /// final features `hidden`, plus the projected tap fusion of `taps` (one `[..., hidden]`
    /// tensor per configured tap, in order) for a tapped head.
    fn fuse(&self, hidden: &Tensor, taps: &[Tensor]) -> Result<Tensor> {
        let hidden = hidden.to_kind(Kind::Float);
        match &self.tap_proj {
            None if taps.is_empty() => Ok(hidden),
            Some(proj) if taps.len() == self.head.config.taps.len() => {
                let normed: Vec<Tensor> = taps
                    .iter()
                    .map(|t| rms_normalised(&t.to_kind(Kind::Float)))
                    .collect();
                Ok(hidden + proj.forward(&Tensor::cat(&normed, -1), &self.cpu))
            }
            _ => Err(HeadError::Invalid(format!(
                "the EAGLE head reads the target's taps {:?}, but {} tap tensors were given",
                self.head.config.taps,
                taps.len()
            ))),
        }
    }

    /// Predicted next features `[batch, new, hidden]` from the target's (or the head's own)
    /// features `[batch, new, hidden]` at `positions` and the ids `[batch, new]` of the tokens
    /// that follow them. With a cache, attention also covers the cached positions; `mask` as in
    /// the target's forward (tree drafting).
    fn forward(
        &self,
        features: &Tensor,
        next_ids: &Tensor,
        positions: &Tensor,
        cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let embedded = self
            .head
            .embed
            .rows(&next_ids.to_kind(Kind::Int64))
            .to_kind(Kind::Float)
            * self.head.config.embed_scale;
        self.cpu.enter();
        let x = self.fc.forward(
            &Tensor::cat(&[embedded, features.to_kind(Kind::Float)], -1),
            &self.cpu,
        );
        let rope = self.head.rotary.cos_sin(positions, Kind::Float);
        Ok(DecoderLayer::forward_stack(
            &self.layers,
            &x,
            &rope,
            cache,
            mask,
            &self.cpu,
        )?)
    }

    /// Logits over the draft vocabulary for features `[..., hidden]` (the frozen target LM head).
    fn logits(&self, features: &Tensor) -> Tensor {
        self.lm_head.forward(features, &self.cpu)
    }
}

impl EagleModules<'_> {
    /// The frozen LM head's weight `[draft vocab, hidden]`.
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.weight()
    }
}

/// The embedding scale that brings a target's token embeddings (`embed`, `[vocab, hidden]`) to
/// the RMS of its post-norm features, estimated by the RMS of its final norm's weight.
pub fn balanced_embed_scale(embed: &Tensor, final_norm_weight: &Tensor) -> f64 {
    let rms = |t: &Tensor| {
        t.to_kind(Kind::Float)
            .square()
            .mean(Kind::Float)
            .sqrt()
            .double_value(&[])
    };
    rms(final_norm_weight) / rms(embed)
}

/// `fc.weight` `[hidden, 2·hidden]` of a head with `embed_scale`, rewritten for a head without
/// one: its embedding columns (the first `hidden`, as `fc` reads `concat(embed, feature)`)
/// multiplied by the scale.
pub fn fold_embed_scale(fc_weight: &Tensor, embed_scale: f64) -> Tensor {
    let hidden = fc_weight.size()[0];
    Tensor::cat(
        &[
            fc_weight.narrow(1, 0, hidden) * embed_scale,
            fc_weight.narrow(1, hidden, hidden),
        ],
        1,
    )
}

/// `x / rms(x)` over the last dimension: residual streams grow with depth, so taps of different
/// layers are brought to one scale before they are mixed.
fn rms_normalised(x: &Tensor) -> Tensor {
    x * (x.square().mean_dim(-1, true, Kind::Float) + 1e-6).rsqrt()
}

/// Names and shapes of the parameters of an EAGLE head of shape `config` (EAGLE repository
/// layout, plus `tap_proj.weight` for a tapped head).
pub fn parameter_shapes(config: &EagleConfig) -> Result<Vec<(String, Vec<i64>)>> {
    let h = config.layer.hidden_size as i64;
    let mut shapes = vec![("fc.weight".to_string(), vec![h, 2 * h])];
    if config.fc_bias {
        shapes.push(("fc.bias".to_string(), vec![h]));
    }
    if !config.taps.is_empty() {
        shapes.push((TAP_PROJ.to_string(), vec![h, config.taps.len() as i64 * h]));
    }
    for index in 0..config.layers() {
        let mut layer =
            DecoderLayer::weight_shapes(&layer_prefix(index), &config.layer, input(index))?;
        // Matrices before vectors: the order in which `EagleHead::new` draws them from the seeded
        // generator, kept so that a seed gives the same head as in earlier versions.
        layer.sort_by_key(|(_, shape)| shape.len() == 1);
        shapes.extend(layer);
    }
    Ok(shapes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use headway_model::CpuThreads;

    /// Drafting's CPU policy.
    fn decode() -> CpuPolicy {
        CpuThreads::new(2).decode()
    }
    use headway_model::mask::positions;
    use headway_model::testing::tiny_config;

    fn head(layers: usize) -> EagleHead {
        tapped_head(layers, vec![])
    }

    fn tapped_head(layers: usize, taps: Vec<usize>) -> EagleHead {
        crate::testing::tiny_eagle_head(1, layers, taps, 50)
    }

    #[test]
    fn a_fresh_tapped_head_reads_the_final_features_alone_and_learns_to_read_its_taps() {
        let plain = head(1);
        let mut tapped = tapped_head(1, vec![0, 2]);
        let names = |head: &EagleHead| {
            head.params
                .iter()
                .map(|(n, _)| n.clone())
                .collect::<Vec<_>>()
        };
        let mut extra = names(&tapped);
        extra.retain(|n| !names(&plain).contains(n));
        assert_eq!(extra, ["tap_proj.weight"]);
        let h = plain.config.layer.hidden_size as i64;
        let shape = [2, 6, h];
        let hidden = Tensor::randn(shape, (Kind::Float, Device::Cpu));
        let taps = [
            Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 30.0,
            Tensor::randn(shape, (Kind::Float, Device::Cpu)),
        ];
        let fused = tapped
            .modules(decode())
            .unwrap()
            .fuse(&hidden, &taps)
            .unwrap();
        assert!(fused.equal(&hidden));
        assert!(plain
            .modules(decode())
            .unwrap()
            .fuse(&hidden, &[])
            .unwrap()
            .equal(&hidden));
        let wrong = tapped
            .modules(decode())
            .unwrap()
            .fuse(&hidden, &taps[..1])
            .err()
            .unwrap();
        assert!(wrong.to_string().contains("taps [0, 2]"), "{wrong}");
        assert!(plain
            .modules(decode())
            .unwrap()
            .fuse(&hidden, &taps)
            .is_err());
        // Each tap is normalised to unit RMS, whatever its scale, before the projection.
        let ones = Tensor::ones([h, 2 * h], (Kind::Float, Device::Cpu));
        tapped.params.insert("tap_proj.weight", &ones);
        let fused = tapped
            .modules(decode())
            .unwrap()
            .fuse(&hidden, &taps)
            .unwrap();
        let normed = |t: &Tensor| t / t.square().mean_dim(-1, true, Kind::Float).sqrt();
        let expected =
            &hidden + (normed(&taps[0]) + normed(&taps[1])).sum_dim_intlist(-1, true, Kind::Float);
        assert!((fused - expected).abs().max().double_value(&[]) < 1e-3);
    }

    #[test]
    fn every_parameter_learns_and_only_the_first_layer_has_no_input_norm() {
        for layers in [1, 2] {
            every_parameter_learns(&head(layers));
        }
        every_parameter_learns(&tapped_head(1, vec![1]));
        assert!(head(1)
            .params
            .get("layers.0.input_layernorm.weight")
            .is_err());
        let two = head(2);
        assert!(two.params.get("layers.0.input_layernorm.weight").is_err());
        assert!(two.params.get("layers.1.input_layernorm.weight").is_ok());
        assert!(two.params.get("layers.1.mlp.down_proj.weight").is_ok());
        assert!(two.params.get("layers.2.mlp.down_proj.weight").is_err());
    }

    #[test]
    fn a_scaled_embedding_folded_into_fc_gives_the_same_head() {
        let _guard = tch::no_grad_guard();
        // Every head gets the first head's parameters: a seeded draw per head is not enough when
        // tests beside this one draw from libtorch's generator too.
        let plain = head(1);
        let same_weights = |mut head: EagleHead| {
            for (name, value) in plain.params.iter() {
                head.params.insert(name.clone(), value);
            }
            head
        };
        let h = plain.config.layer.hidden_size as i64;
        let mut scaled = same_weights(head(1));
        scaled.config = scaled.config.clone().with_embed_scale(8.0);
        let features = Tensor::randn([1, 5, h], (Kind::Float, Device::Cpu));
        let ids = Tensor::randint(50, [1, 5], (Kind::Int64, Device::Cpu));
        // With a cache the layer runs on Headway's few-row code, whose bits do not depend on the
        // libtorch thread count that tests running beside this one may change.
        let predict = |head: &EagleHead| {
            let mut cache = head.new_cache(1, 8).unwrap();
            head.modules(decode())
                .unwrap()
                .forward(
                    &features,
                    &ids,
                    &positions(0, 5, Device::Cpu),
                    Some(&mut cache),
                    None,
                )
                .unwrap()
        };
        // Same weights: the scale changes what the head computes.
        assert!(
            (predict(&scaled) - predict(&plain))
                .abs()
                .max()
                .double_value(&[])
                > 1e-3
        );
        let mut folded = same_weights(head(1));
        let fc = fold_embed_scale(scaled.params.get("fc.weight").unwrap(), 8.0);
        folded.params.insert("fc.weight", &fc);
        // A power of two scales exactly, so folding it into fc changes no bit.
        assert!(predict(&folded).equal(&predict(&scaled)));
        let embed = Tensor::full([4, 3], 0.5, (Kind::Float, Device::Cpu));
        let norm = Tensor::full([3], 2.0, (Kind::Float, Device::Cpu));
        assert_eq!(balanced_embed_scale(&embed, &norm), 4.0);
    }

    #[test]
    fn a_head_without_layers_or_with_a_bad_embedding_scale_is_refused() {
        let config = tiny_config();
        let embed = Tensor::zeros(
            [config.vocab_size as i64, config.hidden_size as i64],
            (Kind::Float, Device::Cpu),
        );
        let table = Matrix::Dense(embed.shallow_clone());
        let error = EagleHead::new(EagleConfig::for_target(&config, 0), &table, &embed)
            .err()
            .unwrap();
        assert!(error.to_string().contains("at least one decoder layer"));
        for bad in [0.0, -2.0, f64::NAN] {
            let config = EagleConfig::for_target(&config, 1).with_embed_scale(bad);
            let error = EagleHead::new(config, &table, &embed).err().unwrap();
            assert!(error.to_string().contains("embedding scale"), "{error}");
        }
    }

    fn every_parameter_learns(head: &EagleHead) {
        let h = head.config.layer.hidden_size as i64;
        let features = Tensor::randn([2, 6, h], (Kind::Float, Device::Cpu));
        let taps: Vec<Tensor> = head
            .config
            .taps
            .iter()
            .map(|_| Tensor::randn([2, 6, h], (Kind::Float, Device::Cpu)))
            .collect();
        let ids = Tensor::randint(50, [2, 6], (Kind::Int64, Device::Cpu));
        let modules = head.modules(decode()).unwrap();
        let predicted = modules
            .forward(
                &modules.fuse(&features, &taps).unwrap(),
                &ids,
                &positions(0, 6, Device::Cpu).expand([2, 6], false),
                None,
                None,
            )
            .unwrap();
        assert_eq!(predicted.size(), vec![2, 6, h]);
        assert_eq!(modules.logits(&predicted).size(), vec![2, 6, 50]);
        modules
            .logits(&predicted)
            .pow_tensor_scalar(2)
            .mean(Kind::Float)
            .backward();
        for (name, p) in head.params.iter() {
            let grad = p.grad();
            assert!(
                grad.defined() && grad.abs().sum(Kind::Float).double_value(&[]) > 0.0,
                "{name}"
            );
        }
    }

    #[test]
    fn cached_step_by_step_drafting_equals_one_causal_forward() {
        for layers in [1, 2] {
            cached_steps_equal_one_forward(&head(layers));
        }
    }

    fn cached_steps_equal_one_forward(head: &EagleHead) {
        let _guard = tch::no_grad_guard();
        let h = head.config.layer.hidden_size as i64;
        let features = Tensor::randn([1, 5, h], (Kind::Float, Device::Cpu));
        let ids = Tensor::randint(50, [1, 5], (Kind::Int64, Device::Cpu));
        let mut cache = head.new_cache(1, 8).unwrap();
        let modules = head.modules(decode()).unwrap();
        let full = modules
            .forward(&features, &ids, &positions(0, 5, Device::Cpu), None, None)
            .unwrap();
        // Later inputs do not change earlier outputs (causal), and a cache gives the same result.
        let first = modules
            .forward(
                &features.narrow(1, 0, 3),
                &ids.narrow(1, 0, 3),
                &positions(0, 3, Device::Cpu),
                Some(&mut cache),
                None,
            )
            .unwrap();
        for i in 3..5 {
            let step = modules
                .forward(
                    &features.narrow(1, i, 1),
                    &ids.narrow(1, i, 1),
                    &positions(i as usize, 1, Device::Cpu),
                    Some(&mut cache),
                    None,
                )
                .unwrap();
            assert!((step - full.narrow(1, i, 1)).abs().max().double_value(&[]) < 1e-5);
        }
        assert!((first - full.narrow(1, 0, 3)).abs().max().double_value(&[]) < 1e-5);
        assert_eq!(cache.len(), 5);
    }
}
