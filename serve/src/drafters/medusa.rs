//! Medusa-1: every head guesses one depth from the target's last hidden state; a static tree of
//! rank paths combines their top guesses.

use headway_heads::MedusaHeads;
use headway_model::Sampler;

use super::{top_tokens, Drafter, Verified};
use crate::error::{Result, ServeError};
use crate::tree::{DraftTree, TreeChoices};

pub struct MedusaDrafter<'h> {
    heads: &'h MedusaHeads,
    d2t: Option<Vec<u32>>,
    choices: TreeChoices,
}

impl<'h> MedusaDrafter<'h> {
    /// `heads` must be frozen ([`headway_heads::Params::freeze`]); the tree may be at most as deep
    /// as there are heads.
    pub fn new(
        heads: &'h MedusaHeads,
        d2t: Option<Vec<u32>>,
        choices: TreeChoices,
    ) -> Result<Self> {
        if choices.depth() > heads.config.num_heads {
            return Err(ServeError::Invalid {
                field: "tree",
                message: format!(
                    "the tree is {} deep but the checkpoint has {} Medusa heads",
                    choices.depth(),
                    heads.config.num_heads
                ),
            });
        }
        Ok(Self {
            heads,
            d2t,
            choices,
        })
    }
}

impl Drafter for MedusaDrafter<'_> {
    fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> Result<DraftTree> {
        let rows = verified.hidden.size()[0];
        let last = verified.hidden.get(rows - 1);
        let guesses = self
            .choices
            .ranks_per_depth()
            .into_iter()
            .enumerate()
            .map(|(k, ranks)| {
                let logits = self.heads.head(k, &last)?;
                Ok(top_tokens(&logits, ranks, self.d2t.as_deref()))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.choices.build(&guesses))
    }

    fn max_tree_tokens(&self) -> usize {
        self.choices.paths().len()
    }
}
