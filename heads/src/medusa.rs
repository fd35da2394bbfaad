//! Medusa-1 heads: K heads on the target's final hidden state, head k predicting the token k + 2
//! positions ahead (the target's own LM head predicts the next one).
//!
//! Head k is `L` residual blocks `x + SiLU(W x + b)` followed by an LM head. W and b start at zero,
//! so each head starts as the identity and its first guess is the target's next-token guess; the
//! LM head is the head's own copy of the target's (Medusa-1) or, with `shared_lm_head`, the frozen
//! target head itself (far fewer parameters to train and store). Parameter names follow the Medusa
//! repository's `medusa_lm_head.safetensors`: `{k}.{l}.linear.weight`, `{k}.{l}.linear.bias` and
//! `{k}.{L}.weight` for the LM head.

use headway_model::linear::Linear;
use headway_model::CpuPolicy;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{HeadError, Result};
use crate::params::Params;

/// The shape of a set of Medusa heads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MedusaConfig {
    pub num_heads: usize,
    pub num_layers: usize,
    pub hidden_size: usize,
    /// Output size: the target's vocabulary, or the draft vocabulary's.
    pub vocab_size: usize,
    pub shared_lm_head: bool,
}

impl MedusaConfig {
    /// Names and shapes of the heads' parameters (Medusa repository layout).
    pub fn parameter_shapes(&self) -> Vec<(String, Vec<i64>)> {
        let (v, h) = (self.vocab_size as i64, self.hidden_size as i64);
        let mut shapes = Vec::new();
        for k in 0..self.num_heads {
            for l in 0..self.num_layers {
                shapes.push((format!("{k}.{l}.linear.weight"), vec![h, h]));
                shapes.push((format!("{k}.{l}.linear.bias"), vec![h]));
            }
            if !self.shared_lm_head {
                shapes.push((format!("{k}.{}.weight", self.num_layers), vec![v, h]));
            }
        }
        shapes
    }
}

pub struct MedusaHeads {
    pub config: MedusaConfig,
    pub params: Params,
    /// The target's LM head (draft-vocabulary rows), frozen; used when `shared_lm_head`.
    frozen_lm_head: Tensor,
}

impl MedusaHeads {
    /// Fresh heads. `lm_head` is the target's LM head weight `[vocab_size, hidden]` (only the draft
    /// vocabulary's rows when one is used).
    pub fn new(config: MedusaConfig, lm_head: &Tensor) -> Result<Self> {
        let (v, h) = (config.vocab_size as i64, config.hidden_size as i64);
        if lm_head.size() != [v, h] {
            return Err(HeadError::Invalid(format!(
                "Medusa heads of hidden size {h} and vocabulary {v} need an LM head [{v}, {h}], got {:?}",
                lm_head.size()
            )));
        }
        if config.num_heads == 0 {
            return Err(HeadError::Invalid("Medusa needs at least one head".into()));
        }
        let options = (Kind::Float, lm_head.device());
        let mut params = Params::new();
        for k in 0..config.num_heads {
            for l in 0..config.num_layers {
                params.insert(
                    format!("{k}.{l}.linear.weight"),
                    &Tensor::zeros([h, h], options),
                );
                params.insert(format!("{k}.{l}.linear.bias"), &Tensor::zeros([h], options));
            }
            if !config.shared_lm_head {
                params.insert(
                    format!("{k}.{}.weight", config.num_layers),
                    &lm_head.to_kind(Kind::Float),
                );
            }
        }
        Ok(Self {
            config,
            params,
            frozen_lm_head: lm_head.detach().to_kind(Kind::Float),
        })
    }

    /// Logits of every head for `hidden` (`[..., hidden]`): `num_heads` tensors `[..., vocab]`.
    pub fn forward(&self, hidden: &Tensor, cpu: &CpuPolicy) -> Result<Vec<Tensor>> {
        (0..self.config.num_heads)
            .map(|k| self.head(k, hidden, cpu))
            .collect()
    }

    /// Logits of head `k`.
    pub fn head(&self, k: usize, hidden: &Tensor, cpu: &CpuPolicy) -> Result<Tensor> {
        Ok(self
            .head_features(k, hidden, cpu)?
            .matmul(&self.lm_head(k)?.tr()))
    }

    /// What head `k`'s LM head reads: `hidden` after the head's residual blocks, under `cpu`.
    pub fn head_features(&self, k: usize, hidden: &Tensor, cpu: &CpuPolicy) -> Result<Tensor> {
        let mut x = hidden.to_kind(Kind::Float);
        for l in 0..self.config.num_layers {
            let block = Linear::new(
                self.params
                    .get(&format!("{k}.{l}.linear.weight"))?
                    .shallow_clone(),
                Some(
                    self.params
                        .get(&format!("{k}.{l}.linear.bias"))?
                        .shallow_clone(),
                ),
            );
            x = &x + block.forward(&x, cpu).silu();
        }
        Ok(x)
    }

    /// Head `k`'s LM head weight `[vocab, hidden]`: its own (a parameter) or the shared frozen one.
    pub fn lm_head(&self, k: usize) -> Result<&Tensor> {
        if self.config.shared_lm_head {
            Ok(&self.frozen_lm_head)
        } else {
            self.params
                .get(&format!("{k}.{}.weight", self.config.num_layers))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn config(shared: bool) -> MedusaConfig {
        MedusaConfig {
            num_heads: 3,
            num_layers: 2,
            hidden_size: 8,
            vocab_size: 11,
            shared_lm_head: shared,
        }
    }

    #[test]
    fn fresh_heads_are_the_identity_and_gradients_reach_every_parameter() {
        tch::manual_seed(0);
        let lm_head = Tensor::randn([11, 8], (Kind::Float, Device::Cpu));
        let hidden = Tensor::randn([2, 5, 8], (Kind::Float, Device::Cpu));
        for shared in [false, true] {
            let heads = MedusaHeads::new(config(shared), &lm_head).unwrap();
            let expected = hidden.matmul(&lm_head.tr());
            let logits = heads
                .forward(&hidden, &headway_model::CpuThreads::new(2).decode())
                .unwrap();
            assert_eq!(logits.len(), 3);
            for l in &logits {
                assert!((l - &expected).abs().max().double_value(&[]) < 1e-5);
            }
            let expected_params = if shared { 12 } else { 15 };
            assert_eq!(heads.params.len(), expected_params);
            Tensor::stack(&logits, 0)
                .pow_tensor_scalar(2)
                .sum(Kind::Float)
                .backward();
            for (name, p) in heads.params.iter() {
                let grad = p.grad();
                assert!(
                    grad.defined() && grad.abs().sum(Kind::Float).double_value(&[]) > 0.0,
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn a_mis_shaped_lm_head_is_refused() {
        let err = MedusaHeads::new(
            config(false),
            &Tensor::zeros([10, 8], (Kind::Float, Device::Cpu)),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("[11, 8]"), "{err}");
    }
}
