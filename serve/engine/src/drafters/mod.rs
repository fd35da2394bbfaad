//! Drafters: what proposes the tree of candidate tokens before each verification forward.
//!
//! Every method sits behind [`Drafter`], so the engine, the benchmark and the server treat plain
//! decoding, prompt lookup, a draft model, Medusa heads and the EAGLE head alike.

mod draft_model;
mod eagle;
mod lookup;
mod medusa;
mod with_lookup;

pub use draft_model::DraftModelDrafter;
#[cfg(test)]
pub(crate) use eagle::tests::tiny_frozen_head;
pub use eagle::{best_subtree, Candidate, DraftRecord, EagleDrafter, EagleTreeShape};
pub use lookup::{longest_match, LookupDrafter, Match, LONGEST_MATCH};
pub use medusa::{GuessRecord, MedusaDrafter, RECORDED_RANKS};
pub(crate) use with_lookup::{lookup_alone, most_nodes};
pub use with_lookup::{most_grafted, LookupStep, WithLookup};

use headway_model::Sampler;
use tch::Tensor;

use crate::error::Result;
use crate::tree::DraftTree;

/// What the target has just verified, handed to the drafter before each step.
pub struct Verified<'a> {
    /// Prompt and every emitted token. The last one is the root of the next tree: emitted, but
    /// not yet in the target's KV cache.
    pub context: &'a [u32],
    /// The target's final hidden states `[m, hidden]` of the `m` positions that entered its KV
    /// cache in the last forward: `context[len - 1 - m .. len - 1]`.
    pub hidden: &'a Tensor,
    /// The target's residual-stream taps `[m, hidden]` at the same positions, one per layer in
    /// [`Drafter::taps`].
    pub taps: &'a [Tensor],
}

pub trait Drafter {
    /// Called once a sequence, after the target's prompt forward and before the first
    /// [`Drafter::draft`] or [`Drafter::skip`], which then receive the same `verified`: a drafter
    /// with a cache of its own (EAGLE's head, a draft model) runs its pass over the prompt here,
    /// where it is the prompt's work and not a step's. By default: nothing.
    fn prefill(&mut self, _verified: &Verified) -> Result<()> {
        Ok(())
    }

    /// Proposes the tree to verify after `verified.context`. Called once per target forward, in
    /// order, with every position that entered the target's cache since the previous call.
    fn draft(&mut self, verified: &Verified, sampler: &mut Sampler) -> Result<DraftTree>;

    /// Called instead of [`Drafter::draft`] for a step whose tree comes from elsewhere (see
    /// [`WithLookup`]): stay in step with what was verified. By default this drafts greedily and
    /// drops the tree, which is right for any drafter; drafters override it to do less.
    fn skip(&mut self, verified: &Verified) -> Result<()> {
        let mut greedy = Sampler::new(Default::default());
        self.draft(verified, &mut greedy).map(drop)
    }

    /// The most nodes a tree from this drafter can have (the engine reserves KV cache room).
    fn max_tree_tokens(&self) -> usize;

    /// Target layers whose residual stream (hidden state after that many layers) the drafter
    /// reads besides the final hidden states.
    fn taps(&self) -> &[usize] {
        &[]
    }

    /// Called before a new sequence: drop any state of the previous one.
    fn reset(&mut self) {}
}

/// A boxed drafter drafts as the drafter in it (a model drafter chosen at run time, under
/// [`WithLookup`]).
impl<D: Drafter + ?Sized> Drafter for Box<D> {
    fn prefill(&mut self, verified: &Verified) -> Result<()> {
        (**self).prefill(verified)
    }

    fn draft(&mut self, verified: &Verified, sampler: &mut Sampler) -> Result<DraftTree> {
        (**self).draft(verified, sampler)
    }

    fn skip(&mut self, verified: &Verified) -> Result<()> {
        (**self).skip(verified)
    }

    fn max_tree_tokens(&self) -> usize {
        (**self).max_tree_tokens()
    }

    fn taps(&self) -> &[usize] {
        (**self).taps()
    }

    fn reset(&mut self) {
        (**self).reset()
    }
}

/// Plain decoding: no draft, one token per target forward.
pub struct NoDrafter;

impl Drafter for NoDrafter {
    fn draft(&mut self, _: &Verified, _: &mut Sampler) -> Result<DraftTree> {
        Ok(DraftTree::new())
    }

    fn max_tree_tokens(&self) -> usize {
        0
    }
}

/// Target ids of the `k` largest entries of `logits` (`[vocab or draft vocab]`), best first;
/// `d2t` maps draft-vocabulary indices to target ids.
fn top_tokens(logits: &Tensor, k: usize, d2t: Option<&[u32]>) -> Vec<u32> {
    let (_, index) = logits.topk(k as i64, -1, true, true);
    Vec::<i64>::try_from(index.to_device(tch::Device::Cpu).view([-1]))
        .expect("topk indices are i64")
        .into_iter()
        .map(|i| d2t.map_or(i as u32, |m| m[i as usize]))
        .collect()
}

/// A drafter that can keep what it proposed at every step, so that the auto-tuner can replay
/// smaller trees against the tokens the target then emitted.
pub trait Recording: Drafter {
    type Record;
    /// Starts keeping a record of every step's draft.
    fn record(&mut self);
    /// The records kept since [`Recording::record`]; recording stops.
    fn take_records(&mut self) -> Vec<Self::Record>;
    /// Index of a record's root (the step's last verified token) in the token sequence.
    fn root(record: &Self::Record) -> usize;
}
