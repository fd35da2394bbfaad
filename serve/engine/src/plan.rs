//! What drafts for the target, as one value: the front ends resolve their options (command line,
//! server flags) into a [`DraftPlan`] once, loading the head or draft model and tuning the tree
//! there, so that no combination that cannot run reaches the engine and building a drafter
//! cannot fail on a missing piece.

use headway_heads::{Eagle3Head, EagleHead, MedusaHeads};
use headway_model::{Target, ROW_KERNEL_MAX_ROWS};

use crate::drafters::{
    most_nodes, DraftModelDrafter, Drafter, EagleDrafter, EagleTreeShape, LookupDrafter,
    MedusaDrafter, NoDrafter, WithLookup,
};
use crate::error::{EngineError, Result};
use crate::tree::TreeChoices;

/// A model that drafts, with its tree.
pub enum ModelDraft {
    /// A smaller model with the target's tokenizer, drafting chains of `tokens`.
    DraftModel { model: Box<Target>, tokens: usize },
    /// A frozen EAGLE head drafting EAGLE-2 dynamic trees of `shape`; `d2t` maps its draft
    /// vocabulary to target ids.
    Eagle {
        head: EagleHead,
        d2t: Option<Vec<u32>>,
        shape: EagleTreeShape,
    },
    /// A frozen EAGLE-3 head drafting EAGLE-2 dynamic trees of `shape` over its draft
    /// vocabulary, whose target ids are `d2t`.
    Eagle3 {
        head: Eagle3Head,
        d2t: Vec<u32>,
        shape: EagleTreeShape,
    },
    /// Frozen Medusa heads drafting the static tree `choices`.
    Medusa {
        heads: MedusaHeads,
        d2t: Option<Vec<u32>>,
        choices: TreeChoices,
    },
}

impl ModelDraft {
    /// The most tokens it proposes in one step.
    fn max_nodes(&self) -> usize {
        match self {
            Self::DraftModel { tokens, .. } => *tokens,
            Self::Eagle { shape, .. } | Self::Eagle3 { shape, .. } => shape.tree_tokens,
            Self::Medusa { choices, .. } => choices.paths().len(),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::DraftModel { .. } => "draft",
            Self::Eagle { .. } => "eagle",
            Self::Eagle3 { .. } => "eagle3",
            Self::Medusa { .. } => "medusa",
        }
    }
}

/// How each step's tree is drafted.
pub enum DraftPlan {
    /// Plain decoding: no tree, one token per target forward.
    Ar,
    /// Prompt lookup alone: n-gram matches in the context.
    Lookup(LookupDrafter),
    /// A model's tree, with prompt lookup's chain grafted on when `with_lookup` is given (one
    /// verification for both).
    Model {
        draft: Box<ModelDraft>,
        with_lookup: Option<LookupDrafter>,
    },
}

impl DraftPlan {
    /// The method's name in reports: `ar`, `lookup`, `draft`, `eagle`, `medusa`, with `+lookup`
    /// when prompt lookup is grafted on.
    pub fn label(&self) -> String {
        match self {
            Self::Ar => "ar".into(),
            Self::Lookup(_) => "lookup".into(),
            Self::Model {
                draft,
                with_lookup: None,
            } => draft.name().into(),
            Self::Model {
                draft,
                with_lookup: Some(_),
            } => format!("{}+lookup", draft.name()),
        }
    }

    /// The most rows one verification takes: the root and the drafted tree, with a lookup
    /// chain grafted on or verified alone ([`most_nodes`]).
    pub fn max_verified_rows(&self) -> usize {
        1 + match self {
            Self::Ar => 0,
            Self::Lookup(lookup) => lookup.num_tokens,
            Self::Model { draft, with_lookup } => match with_lookup {
                Some(lookup) => most_nodes(draft.max_nodes(), lookup.num_tokens),
                None => draft.max_nodes(),
            },
        }
    }

    /// Refuses a plan whose verification could take more rows than the CPU computes by
    /// decoding's own steps ([`ROW_KERNEL_MAX_ROWS`]): past them greedy output would no longer
    /// be plain decoding's bit for bit.
    pub fn check_rows(&self) -> Result<()> {
        let rows = self.max_verified_rows();
        if rows <= ROW_KERNEL_MAX_ROWS {
            return Ok(());
        }
        Err(EngineError::Invalid {
            field: "tree",
            message: format!(
                "{} verifies up to {rows} rows a step (the root, its drafts and any lookup chain); \
                 the exact path covers {ROW_KERNEL_MAX_ROWS}: draft fewer tokens",
                self.label()
            ),
        })
    }

    /// Whether this is plain decoding.
    pub fn is_ar(&self) -> bool {
        matches!(self, Self::Ar)
    }

    /// A drafter for `target` (which the head or draft model was loaded for) and sequences of up
    /// to `capacity` tokens.
    pub fn drafter<'a>(
        &'a self,
        target: &'a Target,
        capacity: usize,
    ) -> Result<Box<dyn Drafter + 'a>> {
        self.check_rows()?;
        Ok(match self {
            Self::Ar => Box::new(NoDrafter),
            Self::Lookup(lookup) => Box::new(*lookup),
            Self::Model { draft, with_lookup } => {
                let model = model_drafter(draft, target, capacity)?;
                match with_lookup {
                    Some(lookup) => Box::new(WithLookup::new(model, *lookup)),
                    None => model,
                }
            }
        })
    }
}

fn model_drafter<'a>(
    draft: &'a ModelDraft,
    target: &'a Target,
    capacity: usize,
) -> Result<Box<dyn Drafter + 'a>> {
    let cpu = target.cpu.decode();
    Ok(match draft {
        ModelDraft::DraftModel { model, tokens } => {
            Box::new(DraftModelDrafter::new(model, target, *tokens, capacity)?)
        }
        ModelDraft::Eagle { head, d2t, shape } => Box::new(EagleDrafter::new(
            head,
            d2t.as_deref(),
            *shape,
            capacity,
            cpu,
        )?),
        ModelDraft::Eagle3 { head, d2t, shape } => {
            Box::new(EagleDrafter::new(head, Some(d2t), *shape, capacity, cpu)?)
        }
        ModelDraft::Medusa {
            heads,
            d2t,
            choices,
        } => Box::new(MedusaDrafter::new(
            heads,
            d2t.as_deref(),
            choices.clone(),
            cpu,
        )?),
    })
}
