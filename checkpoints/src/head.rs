//! Rebuilding a trained head from its checkpoint on a loaded target (evaluation and serving).

use std::path::Path;

use headway_heads::{DraftVocab, Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaHeads};
use headway_model::fingerprint::{target_identity, Kinship};
use headway_model::Target;

use crate::{invalid, load, Checkpoint, HeadKind, Result};

/// A head's modules with its checkpoint's weights.
pub enum DraftHead {
    Medusa(MedusaHeads),
    Eagle(EagleHead),
    Eagle3(Eagle3Head),
}

impl DraftHead {
    /// `medusa`, `eagle` or `eagle3`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Medusa(_) => "medusa",
            Self::Eagle(_) => "eagle",
            Self::Eagle3(_) => "eagle3",
        }
    }
}

/// A head read back from disk, ready to run on the target it was trained on.
pub struct LoadedHead {
    pub head: DraftHead,
    /// The reduced vocabulary the head drafts over, if it was trained with one.
    pub draft_vocab: Option<DraftVocab>,
    /// The checkpoint's directory and config; its weights are the head's parameters now (moved
    /// there, not kept twice), so `checkpoint.weights` is empty.
    pub checkpoint: Checkpoint,
    /// How the target it runs on relates to the one it was trained on (callers tell the user
    /// when it is not the same file).
    pub kinship: Kinship,
}

/// Loads the checkpoint at `path` (or a training directory's latest), checks that it was trained
/// on `target` (fingerprint) and builds the head around the target's frozen embedding and LM head.
pub fn load_head(path: &Path, target: &Target) -> Result<LoadedHead> {
    let mut checkpoint = load(path)?;
    let kinship = checkpoint.check_target(&target_identity(&target.path)?)?;
    let draft_vocab = checkpoint
        .config
        .draft_vocab
        .clone()
        .map(|d2t| DraftVocab { d2t });
    let lm_head = DraftVocab::lm_head_rows(draft_vocab.as_ref(), target.model.lm_head.matrix());
    let build = |e: headway_heads::HeadError| invalid(&checkpoint.dir, e.to_string());
    let mut head = match &checkpoint.config.head {
        HeadKind::Medusa(config) => {
            DraftHead::Medusa(MedusaHeads::new(config.clone(), &lm_head).map_err(build)?)
        }
        HeadKind::Eagle {
            layers,
            taps,
            embed_scale,
            fc_bias,
        } => DraftHead::Eagle(
            EagleHead::new(
                EagleConfig::for_target(target.model.config(), *layers)
                    .with_taps(taps.clone())
                    .with_embed_scale(*embed_scale)
                    .with_fc_bias(*fc_bias),
                target.model.model.embedding(),
                &lm_head,
            )
            .map_err(build)?,
        ),
        HeadKind::Eagle3 { taps } => {
            let Some(vocab) = &draft_vocab else {
                return Err(invalid(
                    &checkpoint.dir,
                    "an EAGLE-3 checkpoint needs its draft vocabulary (`draft_vocab` in config.json)",
                ));
            };
            let config = Eagle3Config::for_target(target.model.config(), taps.clone(), vocab.len());
            DraftHead::Eagle3(
                Eagle3Head::new(config, target.model.model.embedding(), &lm_head).map_err(build)?,
            )
        }
    };
    let params = match &mut head {
        DraftHead::Medusa(heads) => &mut heads.params,
        DraftHead::Eagle(head) => &mut head.params,
        DraftHead::Eagle3(head) => &mut head.params,
    };
    params
        .load(&std::mem::take(&mut checkpoint.weights))
        .map_err(build)?;
    Ok(LoadedHead {
        head,
        draft_vocab,
        checkpoint,
        kinship,
    })
}
