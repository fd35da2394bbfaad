//! Classic speculative decoding with a smaller model of the same tokenizer: a chain of `k`
//! tokens, greedy when the target decodes greedily, sampled from the draft's own distribution
//! (same temperature / top-k / top-p) otherwise.
//!
//! The two LM heads may differ in width though the tokenizer is shared (Qwen2.5-0.5B has 151,936
//! logits, Qwen2.5-7B 152,064): the rows past the tokenizer are padding. The draft proposes only
//! ids the target has: its logits are cut to the narrower width before the sampling settings
//! apply (a wider draft's distribution is renormalised over the target's ids), and its
//! distribution is laid out over the target's width with zeros beyond its own rows.
//! Acceptance stays exact, because rejection sampling keeps the target's distribution for any
//! draft distribution over the target's ids, as long as the drafted token was drawn from the
//! very distribution acceptance is handed; a zero entry only means the token is never proposed,
//! and the residual `max(0, q − p)` keeps all of the target's mass there.

use std::rc::Rc;

use headway_model::{CpuPolicy, ForwardInput, KvCache, Sampler, Target, TreeInput};
use tch::Tensor;

use super::{Drafter, Verified};
use crate::error::{EngineError, Result};
use crate::tree::{DraftTree, Proposal};

pub struct DraftModelDrafter<'m> {
    model: &'m Target,
    cpu: CpuPolicy,
    cache: KvCache,
    /// The tokens whose keys and values are in `cache`, in order.
    cached: Vec<u32>,
    num_tokens: usize,
    /// Rows of the draft's embedding and LM head: the ids it can read.
    draft_width: usize,
    /// Rows of the target's LM head: draft distributions are laid out over them, as acceptance
    /// compares them with the target's entry by entry.
    target_width: usize,
}

impl<'m> DraftModelDrafter<'m> {
    /// `capacity`: the longest context it will see (prompt + new tokens + tree).
    pub fn new(
        model: &'m Target,
        target: &Target,
        num_tokens: usize,
        capacity: usize,
    ) -> Result<Self> {
        let (draft_vocab, target_vocab) =
            (model.tokenizer.vocab_size(), target.tokenizer.vocab_size());
        if draft_vocab != target_vocab {
            return Err(EngineError::Invalid {
                field: "draft model",
                message: format!(
                    "{} has a tokenizer of {draft_vocab} tokens, the target {} one of {target_vocab}: a draft model must share the target's tokenizer",
                    model.path.display(),
                    target.path.display()
                ),
            });
        }
        // The chain runs up to `num_tokens` past the context.
        let capacity = capacity + num_tokens;
        let cache = KvCache::new(model.model.config(), 1, capacity, model.kind, model.device)?;
        Ok(Self {
            model,
            cpu: model.cpu.decode(),
            cache,
            cached: Vec::new(),
            num_tokens,
            draft_width: model.model.config().vocab_size,
            target_width: target.model.config().vocab_size,
        })
    }

    /// Feeds `tokens` after the cache and returns the logits at the last one, over the ids both
    /// LM heads have (`[min(draft width, target width)]`).
    fn feed(&mut self, tokens: &[u32]) -> Result<Tensor> {
        let input = TreeInput::causal(self.cache.len(), tokens, self.model.device);
        let hidden = self
            .model
            .model
            .model
            .forward(
                &ForwardInput::new(&input, &[], &self.cpu),
                Some(&mut self.cache),
            )?
            .hidden;
        self.cached.extend_from_slice(tokens);
        let last = hidden.get(0).get(tokens.len() as i64 - 1);
        let logits = self.model.model.lm_head.forward(&last, &self.cpu);
        Ok(logits.narrow(0, 0, self.draft_width.min(self.target_width) as i64))
    }

    /// Brings the cache to `context`: keeps the cached prefix that `context` still agrees with,
    /// but always re-feeds at least the last token, and returns the logits after it. `None` where
    /// the context holds an id the draft has no embedding for: a wider target can emit ids the
    /// draft lacks (its padding rows, which a trained model all but never picks), and the draft
    /// cannot read such a context: from then on it proposes nothing and the target decodes the
    /// sequence alone.
    fn catch_up(&mut self, context: &[u32]) -> Result<Option<Tensor>> {
        let common = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.cache.truncate(common)?;
        self.cached.truncate(common);
        if context[common..]
            .iter()
            .any(|&t| t as usize >= self.draft_width)
        {
            return Ok(None);
        }
        self.feed(&context[common..]).map(Some)
    }
}

impl Drafter for DraftModelDrafter<'_> {
    /// Feeds the prompt but its last token, which the first draft feeds.
    fn prefill(&mut self, verified: &Verified) -> Result<()> {
        let before_root = &verified.context[..verified.context.len() - 1];
        if !before_root.is_empty() {
            self.catch_up(before_root)?;
        }
        Ok(())
    }

    fn draft(&mut self, verified: &Verified, sampler: &mut Sampler) -> Result<DraftTree> {
        let Some(mut logits) = self.catch_up(verified.context)? else {
            return Ok(DraftTree::new());
        };
        let (mut tokens, mut proposals) = (Vec::new(), Vec::new());
        for i in 0..self.num_tokens {
            let (token, proposal) = if sampler.params().is_greedy() {
                (
                    logits.argmax(0, false).int64_value(&[]) as u32,
                    Proposal::Deterministic,
                )
            } else {
                let p = sampler.params().distribution(&logits);
                let mut p = Vec::<f32>::try_from(p.to_device(tch::Device::Cpu))?;
                p.resize(self.target_width, 0.0);
                (sampler.sample_slice(&p), Proposal::Sampled(Rc::new(p)))
            };
            tokens.push(token);
            proposals.push(proposal);
            if i + 1 < self.num_tokens {
                logits = self.feed(&[token])?;
            }
        }
        Ok(DraftTree::chain(&tokens, proposals))
    }

    /// The next draft re-syncs its cache with the context.
    fn skip(&mut self, _: &Verified) -> Result<()> {
        Ok(())
    }

    fn max_tree_tokens(&self) -> usize {
        self.num_tokens
    }

    fn reset(&mut self) {
        self.cached.clear();
        self.cache
            .truncate(0)
            .expect("truncating to 0 always succeeds");
    }
}
