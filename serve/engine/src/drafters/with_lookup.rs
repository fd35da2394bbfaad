//! A model drafter with prompt lookup grafted on: wherever the context repeats an n-gram, what
//! followed it is verified in the same forward as the model's tree. Text that copies its prompt
//! (summaries, retrieval answers, names kept in a translation) gets lookup's long accepted runs,
//! and the rest gets the model's guesses; one verification serves both. Where lookup matches two
//! or more tokens its chain goes alone and the model only catches up (the EAGLE head lazily, at
//! its next draft).

use headway_model::Sampler;

use super::{Drafter, LookupDrafter, Recording, Verified};
use crate::error::Result;
use crate::tree::{DraftTree, Proposal};

pub struct WithLookup<D> {
    model: D,
    lookup: LookupDrafter,
    /// The roots of the steps whose lookup chain went alone, while recording.
    alone_roots: Option<Vec<usize>>,
}

impl<D: Drafter> WithLookup<D> {
    pub fn new(model: D, lookup: LookupDrafter) -> Self {
        Self {
            model,
            lookup,
            alone_roots: None,
        }
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

impl<D: Drafter> Drafter for WithLookup<D> {
    fn prefill(&mut self, verified: &Verified) -> Result<()> {
        self.model.prefill(verified)
    }

    /// The model's tree with the lookup chain added as a deterministic path; a prefix of the
    /// chain that the model drafted too is shared (see [`DraftTree::graft_chain`]), so lossless
    /// acceptance still sees each candidate once per parent among the deterministic ones.
    fn draft(&mut self, verified: &Verified, sampler: &mut Sampler) -> Result<DraftTree> {
        let chain = self.lookup.propose(verified.context);
        if let Some(tree) = lookup_alone(&chain) {
            self.model.skip(verified)?;
            if let Some(roots) = &mut self.alone_roots {
                roots.push(verified.context.len() - 1);
            }
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

/// A recorded step of a model drafter with lookup beside it: the model's record where it drafted,
/// or the root of a step whose lookup chain went alone.
#[derive(Debug, Clone)]
pub enum LookupStep<R> {
    Model(R),
    Alone { root: usize },
}

/// Every step in order: the model's records and the steps lookup took alone, which the tuner
/// replays beside them (steps recorded without lookup would weigh the text lookup copies by the
/// many steps the model alone needs there, not by the few lookup's long chains take).
impl<D: Recording> Recording for WithLookup<D> {
    type Record = LookupStep<D::Record>;

    fn record(&mut self) {
        self.model.record();
        self.alone_roots = Some(Vec::new());
    }

    fn take_records(&mut self) -> Vec<Self::Record> {
        let alone = self.alone_roots.take().unwrap_or_default();
        let mut steps: Vec<Self::Record> = self
            .model
            .take_records()
            .into_iter()
            .map(LookupStep::Model)
            .chain(alone.into_iter().map(|root| LookupStep::Alone { root }))
            .collect();
        steps.sort_by_key(Self::root);
        steps
    }

    fn root(record: &Self::Record) -> usize {
        match record {
            LookupStep::Model(record) => D::root(record),
            LookupStep::Alone { root } => *root,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headway_model::SamplingParams;
    use tch::{Device, Kind, Tensor};

    /// Drafts one fixed token; records each root it drafted at, and counts its skips.
    #[derive(Default)]
    struct Recorded {
        roots: Option<Vec<usize>>,
        skipped: usize,
    }

    impl Drafter for Recorded {
        fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> Result<DraftTree> {
            if let Some(roots) = &mut self.roots {
                roots.push(verified.context.len() - 1);
            }
            Ok(DraftTree::chain(
                &[7],
                std::iter::once(Proposal::Deterministic),
            ))
        }

        fn skip(&mut self, _: &Verified) -> Result<()> {
            self.skipped += 1;
            Ok(())
        }

        fn max_tree_tokens(&self) -> usize {
            1
        }
    }

    impl Recording for Recorded {
        type Record = usize;

        fn record(&mut self) {
            self.roots = Some(Vec::new());
        }

        fn take_records(&mut self) -> Vec<usize> {
            self.roots.take().unwrap_or_default()
        }

        fn root(record: &usize) -> usize {
            *record
        }
    }

    /// Recording through lookup keeps every step in order: the model's records where it drafted,
    /// and the roots of the steps whose chain went alone, where the model only skipped.
    #[test]
    fn recorded_steps_are_the_models_and_lookups_alone_in_order() {
        let mut drafter = WithLookup::new(Recorded::default(), LookupDrafter::default());
        drafter.record();
        let hidden = Tensor::zeros([1, 4], (Kind::Float, Device::Cpu));
        let mut sampler = Sampler::new(SamplingParams::default());
        // Root 2: no earlier match. Root 5: `1 2` matched, a chain of 3 goes alone. Root 8: only
        // the unigram `5` matches, a chain of 1 is grafted.
        let context = [1, 2, 3, 4, 1, 2, 5, 9, 5];
        let mut sizes = Vec::new();
        for root in [2, 5, 8] {
            let verified = Verified {
                context: &context[..=root],
                hidden: &hidden,
                taps: &[],
            };
            sizes.push(drafter.draft(&verified, &mut sampler).unwrap().len());
        }
        assert_eq!(sizes, [1, 3, 2]);
        assert_eq!(drafter.model.skipped, 1);
        let steps: Vec<String> = drafter
            .take_records()
            .iter()
            .map(|step| match step {
                LookupStep::Model(root) => format!("model {root}"),
                LookupStep::Alone { root } => format!("alone {root}"),
            })
            .collect();
        assert_eq!(steps, ["model 2", "alone 5", "model 8"]);
        assert!(drafter.take_records().is_empty(), "recording stopped");
    }

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
