//! Medusa-1: every head guesses one depth from the target's last hidden state; a static tree of
//! rank paths combines their top guesses.

use headway_heads::MedusaHeads;
use headway_model::{CpuPolicy, Sampler};

use super::{top_tokens, Drafter, Recording, Verified};
use crate::error::{EngineError, Result};
use crate::tree::{DraftTree, TreeChoices};

pub struct MedusaDrafter<'h> {
    heads: &'h MedusaHeads,
    d2t: Option<&'h [u32]>,
    choices: TreeChoices,
    cpu: CpuPolicy,
    /// Every step's guesses while recording.
    records: Option<Vec<GuessRecord>>,
}

/// The heads' guesses in one step, kept to measure their accuracy per rank
/// ([`crate::autotune`]).
#[derive(Debug, Clone)]
pub struct GuessRecord {
    /// Index of the step's root in the token sequence: head d guesses token `root + d + 1`.
    pub root: usize,
    /// `guesses[d]`: head d's best guesses, best first.
    pub guesses: Vec<Vec<u32>>,
}

/// Ranks recorded per head.
pub const RECORDED_RANKS: usize = 5;

impl<'h> MedusaDrafter<'h> {
    /// `heads` must be frozen ([`headway_heads::Params::freeze`]); `d2t` maps their draft
    /// vocabulary to target ids; the tree may be at most as deep as there are heads; they run
    /// under `cpu` (the target's decoding policy).
    pub fn new(
        heads: &'h MedusaHeads,
        d2t: Option<&'h [u32]>,
        choices: TreeChoices,
        cpu: CpuPolicy,
    ) -> Result<Self> {
        if choices.depth() > heads.config.num_heads {
            return Err(EngineError::Invalid {
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
            cpu,
            records: None,
        })
    }
}

/// Records every head's top guesses at every step.
impl Recording for MedusaDrafter<'_> {
    type Record = GuessRecord;

    fn record(&mut self) {
        self.records = Some(Vec::new());
    }

    fn take_records(&mut self) -> Vec<GuessRecord> {
        self.records.take().unwrap_or_default()
    }

    fn root(record: &GuessRecord) -> usize {
        record.root
    }
}

impl Drafter for MedusaDrafter<'_> {
    fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> Result<DraftTree> {
        let rows = verified.hidden.size()[0];
        let last = verified.hidden.get(rows - 1);
        let recording = self.records.is_some();
        let heads = if recording {
            self.heads.config.num_heads
        } else {
            self.choices.depth()
        };
        let ranks = self.choices.ranks_per_depth();
        let guesses = (0..heads)
            .map(|k| {
                let logits = self.heads.head(k, &last, &self.cpu)?;
                let wanted = ranks.get(k).copied().unwrap_or(0);
                let count = if recording {
                    wanted.max(RECORDED_RANKS)
                } else {
                    wanted
                };
                Ok(top_tokens(&logits, count, self.d2t))
            })
            .collect::<Result<Vec<_>>>()?;
        let tree = self.choices.build(&guesses);
        if let Some(records) = &mut self.records {
            records.push(GuessRecord {
                root: verified.context.len() - 1,
                guesses,
            });
        }
        Ok(tree)
    }

    /// The heads keep no state between steps.
    fn skip(&mut self, _: &Verified) -> Result<()> {
        Ok(())
    }

    fn max_tree_tokens(&self) -> usize {
        self.choices.paths().len()
    }
}
