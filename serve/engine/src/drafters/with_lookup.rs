//! A model drafter with prompt lookup grafted on: wherever the context repeats an n-gram, what
//! followed it is verified in the same forward as the model's tree. Text that copies its prompt
//! (summaries, retrieval answers, names kept in a translation) gets lookup's long accepted runs,
//! and the rest gets the model's guesses; one verification serves both. Where lookup matches two
//! or more tokens its chain goes alone and the model only catches up (the EAGLE head lazily, at
//! its next draft).

use headway_model::Sampler;

use super::{Drafter, LookupDrafter, Verified};
use crate::error::Result;
use crate::tree::{DraftTree, Proposal};

pub struct WithLookup<'a> {
    model: Box<dyn Drafter + 'a>,
    lookup: LookupDrafter,
}

impl<'a> WithLookup<'a> {
    pub fn new(model: Box<dyn Drafter + 'a>, lookup: LookupDrafter) -> Self {
        Self { model, lookup }
    }
}

/// Lookup chains of this many tokens or more (matches of two or more tokens) are verified alone:
/// on Spec-Bench they were mostly right, and on a CPU the model's drafting and extra nodes then
/// cost more than they add.
const LOOKUP_ALONE_FROM: usize = 2;

/// The step's tree when lookup's `chain` is long enough to be verified alone (the model then only
/// keeps its state); `None` when it is grafted onto the model's tree instead.
pub(crate) fn lookup_alone(chain: &[u32]) -> Option<DraftTree> {
    (chain.len() >= LOOKUP_ALONE_FROM)
        .then(|| DraftTree::chain(chain, std::iter::repeat(Proposal::Deterministic)))
}

/// The most tokens of a lookup chain of up to `lookup_tokens` that are grafted onto the model's
/// tree: longer chains go alone.
pub fn most_grafted(lookup_tokens: usize) -> usize {
    lookup_tokens.min(LOOKUP_ALONE_FROM - 1)
}

/// The most nodes a step verifies for a model drafting up to `model_nodes` with lookup chains of
/// up to `lookup_tokens` beside it: a chain long enough to go alone, or the model's tree with the
/// shorter chain grafted on.
pub(crate) fn most_nodes(model_nodes: usize, lookup_tokens: usize) -> usize {
    (model_nodes + most_grafted(lookup_tokens)).max(lookup_tokens)
}

impl Drafter for WithLookup<'_> {
    /// The model's tree with the lookup chain added as a deterministic path; a prefix of the
    /// chain that the model drafted too is shared (see [`DraftTree::graft_chain`]), so lossless
    /// acceptance still sees each candidate once per parent among the deterministic ones.
    fn draft(&mut self, verified: &Verified, sampler: &mut Sampler) -> Result<DraftTree> {
        let chain = self.lookup.propose(verified.context);
        if let Some(tree) = lookup_alone(&chain) {
            self.model.skip(verified)?;
            return Ok(tree);
        }
        let mut tree = self.model.draft(verified, sampler)?;
        tree.graft_chain(&chain);
        Ok(tree)
    }

    fn max_tree_tokens(&self) -> usize {
        most_nodes(self.model.max_tree_tokens(), self.lookup.num_tokens)
    }

    fn taps(&self) -> &[usize] {
        self.model.taps()
    }

    fn skip(&mut self, verified: &Verified) -> Result<()> {
        self.model.skip(verified)
    }

    fn reset(&mut self) {
        self.model.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of one token is grafted onto the model's tree; one of two or more is verified
    /// alone, so it never adds to the tree's nodes.
    #[test]
    fn a_step_verifies_the_tree_with_one_grafted_token_or_a_chain_alone() {
        assert_eq!(most_grafted(0), 0);
        assert_eq!(most_grafted(1), 1);
        assert_eq!(most_grafted(6), 1);
        assert_eq!(most_nodes(62, 6), 63);
        assert_eq!(most_nodes(1, 6), 6);
        assert_eq!(most_nodes(8, 0), 8);
        assert!(lookup_alone(&[1]).is_none());
        assert_eq!(lookup_alone(&[1, 2]).map(|t| t.len()), Some(2));
    }
}
