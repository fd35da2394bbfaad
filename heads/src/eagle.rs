//! The EAGLE head (EAGLE-1 architecture; drafted with EAGLE-2's dynamic trees at serve time).
//!
//! At position i the head reads the target's feature `f_i` (final post-norm hidden state) and the
//! embedding of the token that follows, `t_{i+1}`: `x_i = fc(concat(embed(t_{i+1}), f_i))`, then one
//! Llama decoder layer without the norm before attention, giving `f̂_{i+1}`, a prediction of the
//! next feature, which the target's frozen LM head scores directly. The embedding and LM head are
//! the target's, frozen. Parameter names are the EAGLE repository's (`fc.weight`, `fc.bias`,
//! `layers.0.self_attn.q_proj.weight`, …, no `layers.0.input_layernorm`).

use headway_model::linear::Linear;
use headway_model::{DecoderLayer, KvCache, ModelConfig, Rotary};
use tch::{Device, Kind, Tensor};

use crate::error::{HeadError, Result};
use crate::params::Params;

/// Prefix of the decoder layer's parameters.
pub const LAYER_PREFIX: &str = "layers.0";

/// The head's shape: the target's layer geometry with one layer.
#[derive(Debug, Clone)]
pub struct EagleConfig {
    /// The target's config with `num_hidden_layers = 1` (the draft layer's geometry).
    pub layer: ModelConfig,
}

impl EagleConfig {
    pub fn for_target(target: &ModelConfig) -> Self {
        let mut layer = target.clone();
        layer.num_hidden_layers = 1;
        Self { layer }
    }
}

pub struct EagleHead {
    pub config: EagleConfig,
    pub params: Params,
    /// The target's embedding `[vocab, hidden]`, frozen.
    embed: Tensor,
    /// The target's LM head `[draft vocab, hidden]` (draft-vocabulary rows), frozen.
    lm_head: Tensor,
    rotary: Rotary,
}

impl EagleHead {
    /// A fresh head: linear layers drawn as torch's `nn.Linear` default (uniform ±1/√fan_in, from
    /// libtorch's generator: seed it with `tch::manual_seed`), norm weights one.
    pub fn new(config: EagleConfig, embed: &Tensor, lm_head: &Tensor) -> Result<Self> {
        let c = &config.layer;
        let h = c.hidden_size as i64;
        if embed.size() != [c.vocab_size as i64, h] || lm_head.size().get(1) != Some(&h) {
            return Err(HeadError::Invalid(format!(
                "the EAGLE head for hidden size {h} needs an embedding [{}, {h}] and an LM head [_, {h}], got {:?} and {:?}",
                c.vocab_size,
                embed.size(),
                lm_head.size()
            )));
        }
        let device = embed.device();
        let mut params = Params::new();
        for (name, shape) in parameter_shapes(c) {
            let value = if name.ends_with("norm.weight") {
                Tensor::ones(shape.as_slice(), (Kind::Float, device))
            } else {
                let fan_in = if shape.len() == 2 { shape[1] } else { h * 2 };
                let bound = 1.0 / (fan_in as f64).sqrt();
                Tensor::empty(shape.as_slice(), (Kind::Float, device)).uniform_(-bound, bound)
            };
            params.insert(name, &value);
        }
        Ok(Self {
            rotary: Rotary::new(c, device),
            config,
            params,
            embed: embed.detach().to_kind(Kind::Float),
            lm_head: lm_head.detach().to_kind(Kind::Float),
        })
    }

    pub fn device(&self) -> Device {
        self.embed.device()
    }

    /// Assembles the head's modules from the current parameters. Call again after the parameters
    /// change (the decoder layer holds concatenations of them).
    pub fn modules(&self) -> Result<EagleModules<'_>> {
        let fc = Linear::new(
            self.params.get("fc.weight")?.shallow_clone(),
            Some(self.params.get("fc.bias")?.shallow_clone()),
        );
        let layer =
            DecoderLayer::load_with(&mut &self.params, LAYER_PREFIX, &self.config.layer, false)?;
        Ok(EagleModules {
            head: self,
            fc,
            layer,
            lm_head: Linear::new(self.lm_head.shallow_clone(), None),
        })
    }

    /// A KV cache for the head's layer.
    pub fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        Ok(KvCache::new(
            &self.config.layer,
            batch,
            capacity,
            Kind::Float,
            self.device(),
        )?)
    }
}

/// The head's modules built from its parameters, ready to run.
pub struct EagleModules<'a> {
    head: &'a EagleHead,
    fc: Linear,
    layer: DecoderLayer,
    /// The frozen target LM head (draft-vocabulary rows): drafting runs it on headway's fast CPU
    /// path, training through libtorch.
    lm_head: Linear,
}

impl EagleModules<'_> {
    /// Predicted next features `[batch, new, hidden]` from the target's (or the head's own)
    /// features `[batch, new, hidden]` at `positions` and the ids `[batch, new]` of the tokens
    /// that follow them. With a cache, attention also covers the cached positions; `mask` as in
    /// the target's forward (tree drafting).
    pub fn forward(
        &self,
        features: &Tensor,
        next_ids: &Tensor,
        positions: &Tensor,
        cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let embedded = Tensor::embedding(
            &self.head.embed,
            &next_ids.to_kind(Kind::Int64),
            -1,
            false,
            false,
        );
        let x = self
            .fc
            .forward(&Tensor::cat(&[embedded, features.to_kind(Kind::Float)], -1));
        let rope = self.head.rotary.cos_sin(positions, Kind::Float);
        Ok(self.layer.forward_standalone(&x, &rope, cache, mask)?)
    }

    /// Logits over the draft vocabulary for features `[..., hidden]` (the frozen target LM head).
    pub fn logits(&self, features: &Tensor) -> Tensor {
        self.lm_head.forward(features)
    }

    /// The frozen LM head's weight `[draft vocab, hidden]`.
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.weight()
    }
}

/// Names and shapes of the parameters of an EAGLE head for a target with config `c` (EAGLE
/// repository layout).
pub fn parameter_shapes(c: &ModelConfig) -> Vec<(String, Vec<i64>)> {
    let (h, i) = (c.hidden_size as i64, c.intermediate_size as i64);
    let q = (c.num_attention_heads * c.head_dim) as i64;
    let kv = (c.num_key_value_heads * c.head_dim) as i64;
    let d = c.head_dim as i64;
    let p = |name: &str| format!("{LAYER_PREFIX}.{name}");
    let mut shapes = vec![
        ("fc.weight".to_string(), vec![h, 2 * h]),
        ("fc.bias".to_string(), vec![h]),
        (p("self_attn.q_proj.weight"), vec![q, h]),
        (p("self_attn.k_proj.weight"), vec![kv, h]),
        (p("self_attn.v_proj.weight"), vec![kv, h]),
        (p("self_attn.o_proj.weight"), vec![h, q]),
        (p("post_attention_layernorm.weight"), vec![h]),
        (p("mlp.gate_proj.weight"), vec![i, h]),
        (p("mlp.up_proj.weight"), vec![i, h]),
        (p("mlp.down_proj.weight"), vec![h, i]),
    ];
    if c.qkv_bias {
        for part in ["q", "k", "v"] {
            let rows = if part == "q" { q } else { kv };
            shapes.push((p(&format!("self_attn.{part}_proj.bias")), vec![rows]));
        }
    }
    if c.qk_norm {
        shapes.push((p("self_attn.q_norm.weight"), vec![d]));
        shapes.push((p("self_attn.k_norm.weight"), vec![d]));
    }
    shapes
}

#[cfg(test)]
mod tests {
    use super::*;
    use headway_model::mask::positions;
    use headway_model::testing::tiny_config;

    fn head() -> EagleHead {
        tch::manual_seed(1);
        let config = tiny_config();
        let options = (Kind::Float, Device::Cpu);
        let embed = Tensor::randn(
            [config.vocab_size as i64, config.hidden_size as i64],
            options,
        );
        let lm_head = embed.narrow(0, 0, 50);
        EagleHead::new(EagleConfig::for_target(&config), &embed, &lm_head).unwrap()
    }

    #[test]
    fn every_parameter_learns_and_the_layer_has_no_input_norm() {
        let head = head();
        assert!(head.params.get("layers.0.input_layernorm.weight").is_err());
        let h = head.config.layer.hidden_size as i64;
        let features = Tensor::randn([2, 6, h], (Kind::Float, Device::Cpu));
        let ids = Tensor::randint(50, [2, 6], (Kind::Int64, Device::Cpu));
        let modules = head.modules().unwrap();
        let predicted = modules
            .forward(
                &features,
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
        let _guard = tch::no_grad_guard();
        let head = head();
        let h = head.config.layer.hidden_size as i64;
        let features = Tensor::randn([1, 5, h], (Kind::Float, Device::Cpu));
        let ids = Tensor::randint(50, [1, 5], (Kind::Int64, Device::Cpu));
        let mut cache = head.new_cache(1, 8).unwrap();
        let modules = head.modules().unwrap();
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
