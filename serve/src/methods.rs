//! Choosing and building a drafter from command-line options (shared by `generate`, `bench` and
//! `http`).

use std::path::PathBuf;

use headway_checkpoints::{load_head, DraftHead, LoadedHead};
use headway_model::Target;

use crate::acceptance::Acceptance;
use crate::autotune::{tune_eagle, tune_medusa, Tuned};
use crate::drafters::{
    DraftModelDrafter, Drafter, EagleDrafter, EagleTreeShape, LookupDrafter, MedusaDrafter,
    NoDrafter, WithLookup,
};
use crate::error::{Result, ServeError};
use crate::tree::TreeChoices;

/// Decoding methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Plain autoregressive decoding, one target forward per token.
    Ar,
    /// The EAGLE head (--heads) with EAGLE-2 dynamic trees.
    Eagle,
    /// Medusa heads (--heads) with a static tree.
    Medusa,
    /// A smaller model with the target's tokenizer (--draft-model) drafting a chain.
    Draft,
    /// Prompt lookup: n-gram matches in the context, no model.
    Lookup,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Self::Ar => "ar",
            Self::Eagle => "eagle",
            Self::Medusa => "medusa",
            Self::Draft => "draft",
            Self::Lookup => "lookup",
        }
    }
}

/// Drafting options.
#[derive(Debug, Clone, clap::Args)]
pub struct DraftArgs {
    /// Decoding method.
    #[arg(long, value_enum, default_value = "ar")]
    pub method: Method,
    /// Head checkpoint (or training directory) for --method eagle|medusa.
    #[arg(long)]
    pub heads: Option<PathBuf>,
    /// Draft model directory for --method draft (same tokenizer as the target).
    #[arg(long)]
    pub draft_model: Option<PathBuf>,
    /// EAGLE: draft depths per step.
    #[arg(long, default_value_t = 5)]
    pub depth: usize,
    /// EAGLE: nodes expanded per depth and children per node.
    #[arg(long, default_value_t = 4)]
    pub tree_top_k: usize,
    /// EAGLE and Medusa: nodes in the verified tree, or `auto`: measure the target's latency for
    /// 1–64 new tokens and the drafter on a short warm-up, and pick the tree (EAGLE: depth, top-k
    /// and size up to --depth / --tree-top-k; Medusa: size, tree built from the heads' measured
    /// accuracies) with the highest predicted tokens/s. On a CPU every node costs target compute;
    /// on a GPU up to ~60 cost about as much as one.
    #[arg(long, default_value = "12")]
    pub tree_tokens: TreeTokens,
    /// Medusa: a JSON list of rank paths ([[0], [1], [0, 0], …], the Medusa repository's format).
    /// Default: the --tree-tokens paths of highest expected acceptance for typical head accuracies.
    #[arg(long)]
    pub tree: Option<PathBuf>,
    /// Draft model and prompt lookup: tokens per chain.
    #[arg(long, default_value_t = 5)]
    pub draft_tokens: usize,
    /// EAGLE, Medusa and draft model: also verify prompt lookup's chain (up to --draft-tokens
    /// tokens, where the context repeats an n-gram) in the same forward as the model's tree.
    #[arg(long)]
    pub with_lookup: bool,
    /// LOSSY: Medusa's typical acceptance instead of rejection sampling when sampling (accept a
    /// draft whose target probability exceeds min(--typical-threshold, --typical-alpha ·
    /// exp(−entropy))). Faster at high temperature; the output no longer follows the target's
    /// distribution. Greedy decoding is unaffected.
    #[arg(long)]
    pub typical: bool,
    #[arg(long, default_value_t = 0.09, requires = "typical")]
    pub typical_threshold: f64,
    #[arg(long, default_value_t = 0.3, requires = "typical")]
    pub typical_alpha: f64,
}

impl DraftArgs {
    /// The method's name in reports: `eagle+lookup` with --with-lookup.
    pub fn label(&self) -> String {
        if self.with_lookup {
            format!("{}+lookup", self.method.name())
        } else {
            self.method.name().to_string()
        }
    }

    /// The prompt-lookup drafter these options describe.
    fn lookup(&self) -> LookupDrafter {
        LookupDrafter {
            num_tokens: self.draft_tokens,
            ..Default::default()
        }
    }

    /// The acceptance rule these options ask for.
    pub fn acceptance(&self) -> Acceptance {
        if self.typical {
            Acceptance::Typical {
                threshold: self.typical_threshold,
                alpha: self.typical_alpha,
            }
        } else {
            Acceptance::Lossless
        }
    }
}

/// `--tree-tokens`: a size, or tuned on this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeTokens {
    Fixed(usize),
    Auto,
}

impl std::str::FromStr for TreeTokens {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            _ => match text.parse::<usize>() {
                Ok(n) if n > 0 => Ok(Self::Fixed(n)),
                _ => Err(format!(
                    "{text:?}: expected a positive number of tokens or `auto`"
                )),
            },
        }
    }
}

impl std::fmt::Display for TreeTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fixed(n) => write!(f, "{n}"),
            Self::Auto => f.write_str("auto"),
        }
    }
}

/// The largest tree `--tree-tokens auto` considers.
const AUTO_MAX_TREE_TOKENS: usize = 64;

/// What a drafter is built from: the head or draft model, loaded once, and the tuned tree.
pub struct DraftResources {
    pub head: Option<LoadedHead>,
    pub draft_model: Option<Target>,
    pub tuned: Option<Tuned>,
}

impl DraftResources {
    /// Loads what `args.method` needs for `target`.
    pub fn load(args: &DraftArgs, target: &Target) -> Result<Self> {
        if args.with_lookup && matches!(args.method, Method::Ar | Method::Lookup) {
            return Err(invalid(format!(
                "--with-lookup adds prompt lookup to a model's drafts (eagle, medusa, draft); \
                 for lookup alone use --method lookup, not --method {} --with-lookup",
                args.method.name()
            )));
        }
        let needs_heads = matches!(args.method, Method::Eagle | Method::Medusa);
        let head = match (&args.heads, needs_heads) {
            (Some(path), true) => {
                let mut loaded = load_head(path, target)?;
                let (params, kind) = match &mut loaded.head {
                    DraftHead::Medusa(h) => (&mut h.params, Method::Medusa),
                    DraftHead::Eagle(h) => (&mut h.params, Method::Eagle),
                };
                if kind != args.method {
                    return Err(invalid(format!(
                        "{} holds {} heads, not {}",
                        path.display(),
                        kind.name(),
                        args.method.name()
                    )));
                }
                params.freeze();
                Some(loaded)
            }
            (None, true) => {
                return Err(invalid(format!(
                    "--method {} needs --heads CKPT",
                    args.method.name()
                )))
            }
            _ => None,
        };
        let draft_model = match (&args.draft_model, args.method) {
            (Some(dir), Method::Draft) => Some(Target::load(dir, target.kind, target.device)?),
            (None, Method::Draft) => {
                return Err(invalid("--method draft needs --draft-model DIR".into()))
            }
            _ => None,
        };
        Ok(Self {
            head,
            draft_model,
            tuned: None,
        })
    }

    /// With `--tree-tokens auto`, tunes the tree on `prompts` (a short greedy warm-up of each);
    /// otherwise does nothing.
    pub fn tune(&mut self, args: &DraftArgs, target: &Target, prompts: &[Vec<u32>]) -> Result<()> {
        if args.tree_tokens != TreeTokens::Auto {
            return Ok(());
        }
        let d2t = self
            .head
            .as_ref()
            .and_then(|h| h.draft_vocab.as_ref())
            .map(|v| v.d2t.clone());
        const WARM_UP_TOKENS: usize = 48;
        let lookup = args.with_lookup.then(|| args.lookup());
        self.tuned = match self.head.as_ref().map(|h| &h.head) {
            Some(DraftHead::Eagle(head)) => {
                let max = EagleTreeShape {
                    depth: args.depth,
                    top_k: args.tree_top_k,
                    tree_tokens: AUTO_MAX_TREE_TOKENS,
                };
                Some(tune_eagle(
                    target,
                    head,
                    d2t,
                    max,
                    lookup.as_ref(),
                    prompts,
                    WARM_UP_TOKENS,
                )?)
            }
            Some(DraftHead::Medusa(heads)) => Some(tune_medusa(
                target,
                heads,
                d2t,
                AUTO_MAX_TREE_TOKENS,
                lookup.as_ref(),
                prompts,
                WARM_UP_TOKENS,
            )?),
            None => {
                return Err(invalid(format!(
                    "--tree-tokens auto tunes EAGLE and Medusa trees, not --method {}",
                    args.method.name()
                )))
            }
        };
        Ok(())
    }

    /// A drafter for sequences of up to `capacity` tokens.
    pub fn drafter<'a>(
        &'a self,
        args: &DraftArgs,
        target: &Target,
        capacity: usize,
    ) -> Result<Box<dyn Drafter + 'a>> {
        let drafter = self.model_drafter(args, target, capacity)?;
        Ok(if args.with_lookup {
            Box::new(WithLookup::new(drafter, args.lookup()))
        } else {
            drafter
        })
    }

    /// The drafter of `args.method` alone.
    fn model_drafter<'a>(
        &'a self,
        args: &DraftArgs,
        target: &Target,
        capacity: usize,
    ) -> Result<Box<dyn Drafter + 'a>> {
        let d2t = || {
            self.head
                .as_ref()
                .and_then(|h| h.draft_vocab.as_ref())
                .map(|v| v.d2t.clone())
        };
        Ok(match (args.method, self.head.as_ref().map(|h| &h.head)) {
            (Method::Ar, _) => Box::new(NoDrafter),
            (Method::Lookup, _) => Box::new(args.lookup()),
            (Method::Draft, _) => {
                let model = self
                    .draft_model
                    .as_ref()
                    .expect("loaded for --method draft");
                Box::new(DraftModelDrafter::new(
                    model,
                    target,
                    args.draft_tokens,
                    capacity,
                )?)
            }
            (Method::Eagle, Some(DraftHead::Eagle(head))) => {
                let shape = match args.tree_tokens {
                    TreeTokens::Fixed(tree_tokens) => EagleTreeShape {
                        depth: args.depth,
                        top_k: args.tree_top_k,
                        tree_tokens,
                    },
                    TreeTokens::Auto => self.tuned()?.eagle.expect("tuned for EAGLE"),
                };
                Box::new(EagleDrafter::new(head, d2t(), shape, capacity)?)
            }
            (Method::Medusa, Some(DraftHead::Medusa(heads))) => {
                let choices = match (&args.tree, args.tree_tokens) {
                    (Some(path), _) => TreeChoices::from_file(path)?,
                    (None, TreeTokens::Fixed(tree_tokens)) => TreeChoices::from_accuracies(
                        &typical_medusa_accuracy(heads.config.num_heads),
                        tree_tokens,
                    ),
                    (None, TreeTokens::Auto) => {
                        self.tuned()?.medusa.clone().expect("tuned for Medusa")
                    }
                };
                Box::new(MedusaDrafter::new(heads, d2t(), choices)?)
            }
            _ => unreachable!("DraftResources::load checked the head kind"),
        })
    }
}

impl DraftResources {
    fn tuned(&self) -> Result<&Tuned> {
        self.tuned
            .as_ref()
            .ok_or_else(|| invalid("--tree-tokens auto: call DraftResources::tune first".into()))
    }
}

/// Head-by-rank accuracies used to shape a Medusa tree when none is given: head 0's top guess
/// right ~55% of the time, each later head a quarter worse, ranks 2–5 sharing a geometric tail
/// (the shape of Medusa-1's published per-head accuracies).
pub fn typical_medusa_accuracy(num_heads: usize) -> Vec<Vec<f64>> {
    (0..num_heads)
        .map(|head| {
            let top1 = 0.55 * 0.75f64.powi(head as i32);
            (0..5).map(|rank| top1 * 0.3f64.powi(rank)).collect()
        })
        .collect()
}

fn invalid(message: String) -> ServeError {
    ServeError::Invalid {
        field: "method",
        message,
    }
}
