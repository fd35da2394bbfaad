//! What the engine's tree drafter asks of a head that drafts feature by feature (EAGLE-1 and
//! EAGLE-3): one drafter serves both.

use headway_model::{CpuPolicy, KvCache, ModelConfig};
use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// A head's modules, assembled to run.
pub trait FeatureModules {
    /// The head's input features `[..., hidden]` at positions where the target's are known, from
    /// the target's final hidden states `hidden` and its residual-stream `taps` (one tensor per
    /// tap of [`FeatureHead::taps`], in order).
    fn fuse(&self, hidden: &Tensor, taps: &[Tensor]) -> Result<Tensor>;

    /// Outputs `[batch, new, hidden]` for input features `[batch, new, hidden]` (fused, or the
    /// head's own earlier outputs when drafting) and the ids `[batch, new]` of the tokens that
    /// follow them, at `positions`; with a cache, attention also covers the cached positions;
    /// `mask` as in the target's forward (tree drafting).
    fn forward(
        &self,
        features: &Tensor,
        next_ids: &Tensor,
        positions: &Tensor,
        cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
    ) -> Result<Tensor>;

    /// Logits over the head's draft vocabulary for outputs `[..., hidden]`.
    fn logits(&self, outputs: &Tensor) -> Tensor;
}

/// A head that drafts feature by feature.
pub trait FeatureHead {
    /// The modules, assembled from the current parameters to run under `cpu`.
    fn modules(&self, cpu: CpuPolicy) -> Result<Box<dyn FeatureModules + '_>>;

    /// The geometry of the head's decoder layers (its `num_hidden_layers` is theirs).
    fn layer_config(&self) -> &ModelConfig;

    /// Where the head's parameters live.
    fn device(&self) -> Device;

    /// Target layers whose residual stream the head reads besides the final hidden states.
    fn taps(&self) -> &[usize];

    /// A KV cache for the head's layers.
    fn new_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        let config = self.layer_config();
        Ok(KvCache::new(
            config,
            batch,
            capacity,
            Kind::Float,
            self.device(),
        )?)
    }
}
