//! The drafting options every front end takes (`generate`, `bench`, `http`), and their resolution
//! into the engine's [`DraftPlan`]: the head or draft model loaded and checked, the tree fixed or
//! tuned on this device. Every refusal names the flag at fault.

use std::path::PathBuf;

use anyhow::{bail, Context};
use headway_checkpoints::{load_head, DraftHead, LoadedHead};
use headway_engine::acceptance::Acceptance;
use headway_engine::autotune::{tune_eagle, tune_lookup, tune_medusa, Tuning};
use headway_engine::drafters::{most_grafted, EagleTreeShape, LookupDrafter};
use headway_engine::tree::TreeChoices;
use headway_engine::{DraftPlan, ModelDraft};
use headway_heads::FeatureHead;
use headway_model::fingerprint::Kinship;
use headway_model::quant::QuantFormat;
use headway_model::{Target, ROW_KERNEL_MAX_ROWS};

/// Decoding methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Method {
    /// Plain autoregressive decoding, one target forward per token.
    Ar,
    /// The EAGLE head (--heads) with EAGLE-2 dynamic trees.
    Eagle,
    /// An EAGLE-3 head (--heads) with EAGLE-2 dynamic trees.
    Eagle3,
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
            Self::Eagle3 => "eagle3",
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
    /// Head checkpoint (or training directory) for --method eagle|eagle3|medusa.
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
    /// on a GPU up to ~60 cost about as much as one. Prompt lookup takes `auto` alone: how many
    /// tokens to propose after a match of 1, 2 and 3 tokens (up to 1, 3 and 5, and
    /// --draft-tokens), picked likewise.
    #[arg(long, default_value = "12")]
    pub tree_tokens: TreeTokens,
    /// Medusa: a JSON list of rank paths ([[0], [1], [0, 0], …], the Medusa repository's format).
    /// Default: the --tree-tokens paths of highest expected acceptance for typical head accuracies.
    #[arg(long)]
    pub tree: Option<PathBuf>,
    /// EAGLE and EAGLE-3: the format the head's matrices draft in. `auto`: Q8_0 beside a target
    /// whose matrices run quantised (a GGUF's), where a draft depth in f32 would read about a
    /// third of a target step; else as trained (f32). `q4_0` and `q4_1` read about half Q8_0's
    /// bytes a depth and cost acceptance: measure both with `bench` (docs/benchmarks.md).
    #[arg(long, value_enum, default_value = "auto")]
    pub head_format: HeadFormat,
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

/// `--head-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HeadFormat {
    Auto,
    F32,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
}

impl HeadFormat {
    /// The quantised format a head drafts in beside `target` (`None`: as trained).
    pub fn drafting_format(self, target: &Target) -> Option<QuantFormat> {
        match self {
            Self::Auto => target.model.runs_quantised().then_some(QuantFormat::Q8_0),
            Self::F32 => None,
            Self::Q8_0 => Some(QuantFormat::Q8_0),
            Self::Q4_0 => Some(QuantFormat::Q4_0),
            Self::Q4_1 => Some(QuantFormat::Q4_1),
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

/// The largest tree `--tree-tokens auto` considers beside `lookup`'s chain: what fits, with the
/// root and the chain's grafted tokens, in the rows verified exactly.
fn auto_max_tree_tokens(lookup: Option<&LookupDrafter>) -> usize {
    (ROW_KERNEL_MAX_ROWS - 1).saturating_sub(lookup.map_or(0, |l| most_grafted(l.num_tokens)))
}

/// New tokens of each `--tree-tokens auto` warm-up prompt.
const WARM_UP_TOKENS: usize = 48;

/// New tokens of each warm-up prompt when tuning prompt lookup alone: its chains come from what
/// a reply repeats, which builds up as it grows (6 Spec-Bench prompts on the Q4_1 GGUF: after 48
/// tokens the replay predicted τ 1.16 where 48 questions of 128 tokens then ran at 1.36; after
/// 128, 1.47 against 1.54), and without a model a warm-up step costs about a plain one.
const LOOKUP_WARM_UP_TOKENS: usize = 128;

impl DraftArgs {
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

    /// Resolves the options into a plan for `target`: loads the head or draft model and, with
    /// `--tree-tokens auto`, tunes the tree on `warm_up` prompts (a short greedy generation of
    /// each), returning what the tuning predicted.
    pub fn plan(
        &self,
        target: &Target,
        warm_up: &[Vec<u32>],
    ) -> anyhow::Result<(DraftPlan, Option<Tuning>)> {
        let model = !matches!(self.method, Method::Ar | Method::Lookup);
        if self.with_lookup && !model {
            bail!(
                "--with-lookup adds prompt lookup to a model's drafts (eagle, medusa, draft); \
                 for lookup alone use --method lookup, not --method {} --with-lookup",
                self.method.name()
            );
        }
        let tuned = !matches!(self.method, Method::Ar | Method::Draft);
        if self.tree_tokens == TreeTokens::Auto && !tuned {
            bail!(
                "--tree-tokens auto tunes EAGLE and Medusa trees and prompt lookup's chains, \
                 not --method {}",
                self.method.name()
            );
        }
        let with_lookup = self.with_lookup.then(|| self.lookup());
        let (draft, tuning) = match self.method {
            Method::Ar => return Ok((DraftPlan::Ar, None)),
            Method::Lookup => {
                let (lookup, tuning) = match self.tree_tokens {
                    TreeTokens::Fixed(_) => (self.lookup(), None),
                    TreeTokens::Auto => {
                        let (lookup, tuning) =
                            tune_lookup(target, &self.lookup(), warm_up, LOOKUP_WARM_UP_TOKENS)?;
                        (lookup, Some(tuning))
                    }
                };
                let plan = DraftPlan::Lookup(lookup);
                plan.check_rows().with_context(|| self.row_flags())?;
                return Ok((plan, tuning));
            }
            Method::Draft => (self.draft_model(target)?, None),
            Method::Eagle => self.eagle(target, with_lookup.as_ref(), warm_up)?,
            Method::Eagle3 => self.eagle3(target, with_lookup.as_ref(), warm_up)?,
            Method::Medusa => self.medusa(target, with_lookup.as_ref(), warm_up)?,
        };
        let draft = Box::new(draft);
        let plan = DraftPlan::Model { draft, with_lookup };
        plan.check_rows().with_context(|| self.row_flags())?;
        Ok((plan, tuning))
    }

    /// The flags that decide how many rows a step verifies, as given.
    fn row_flags(&self) -> String {
        let drafts = match (self.method, &self.tree) {
            (Method::Draft | Method::Lookup, _) => format!("--draft-tokens {}", self.draft_tokens),
            (Method::Medusa, Some(tree)) => format!("--tree {}", tree.display()),
            _ => format!("--tree-tokens {}", self.tree_tokens),
        };
        match self.with_lookup {
            true => format!(
                "{drafts} --with-lookup --draft-tokens {}",
                self.draft_tokens
            ),
            false => drafts,
        }
    }

    /// The prompt-lookup drafter these options describe.
    fn lookup(&self) -> LookupDrafter {
        LookupDrafter {
            num_tokens: self.draft_tokens,
            ..Default::default()
        }
    }

    fn draft_model(&self, target: &Target) -> anyhow::Result<ModelDraft> {
        let Some(dir) = &self.draft_model else {
            bail!("--method draft needs --draft-model DIR");
        };
        // The draft model runs on the target's CPU threads: two pools would fight for the cores.
        let cpu = target.cpu.clone();
        let model = headway_gguf::open_target(dir, target.weight_kind, target.device, cpu)
            .with_context(|| format!("--draft-model {}", dir.display()))?;
        Ok(ModelDraft::DraftModel {
            model: Box::new(model),
            tokens: self.draft_tokens,
        })
    }

    /// The heads of the `--heads` checkpoint for `target` that `pick` takes (this method's
    /// kind; for any other it names what it found), and the draft vocabulary's d2t.
    fn load_heads<H>(
        &self,
        target: &Target,
        pick: fn(DraftHead) -> Result<H, &'static str>,
    ) -> anyhow::Result<(H, Option<Vec<u32>>)> {
        let Some(path) = &self.heads else {
            bail!("--method {} needs --heads CKPT", self.method.name());
        };
        let LoadedHead {
            head,
            draft_vocab,
            kinship,
            ..
        } = load_head(path, target).with_context(|| format!("--heads {}", path.display()))?;
        if let Kinship::SameSource(note) = kinship {
            tracing::info!("--heads {}: {note}", path.display());
        }
        match pick(head) {
            Ok(heads) => Ok((heads, draft_vocab.map(|v| v.d2t))),
            Err(found) => bail!(
                "--heads {} holds {found} heads, not {}",
                path.display(),
                self.method.name()
            ),
        }
    }

    fn eagle(
        &self,
        target: &Target,
        lookup: Option<&LookupDrafter>,
        warm_up: &[Vec<u32>],
    ) -> anyhow::Result<(ModelDraft, Option<Tuning>)> {
        let (mut head, d2t) = self.load_heads(target, |loaded| match loaded {
            DraftHead::Eagle(head) => Ok(head),
            other => Err(other.name()),
        })?;
        head.params.freeze();
        if let Some(format) = self.head_format.drafting_format(target) {
            head.draft_in(format);
        }
        let (shape, tuning) = self.eagle_shape(target, &head, d2t.as_deref(), lookup, warm_up)?;
        Ok((ModelDraft::Eagle { head, d2t, shape }, tuning))
    }

    fn eagle3(
        &self,
        target: &Target,
        lookup: Option<&LookupDrafter>,
        warm_up: &[Vec<u32>],
    ) -> anyhow::Result<(ModelDraft, Option<Tuning>)> {
        let (mut head, d2t) = self.load_heads(target, |loaded| match loaded {
            DraftHead::Eagle3(head) => Ok(head),
            other => Err(other.name()),
        })?;
        let Some(d2t) = d2t else {
            bail!("--heads: an EAGLE-3 checkpoint without its draft vocabulary");
        };
        head.params.freeze();
        if let Some(format) = self.head_format.drafting_format(target) {
            head.draft_in(format);
        }
        let (shape, tuning) = self.eagle_shape(target, &head, Some(&d2t), lookup, warm_up)?;
        Ok((ModelDraft::Eagle3 { head, d2t, shape }, tuning))
    }

    /// The EAGLE-2 tree shape of `--depth`, `--tree-top-k` and `--tree-tokens`, tuned for `head`
    /// on this device with `--tree-tokens auto`.
    fn eagle_shape(
        &self,
        target: &Target,
        head: &dyn FeatureHead,
        d2t: Option<&[u32]>,
        lookup: Option<&LookupDrafter>,
        warm_up: &[Vec<u32>],
    ) -> anyhow::Result<(EagleTreeShape, Option<Tuning>)> {
        let widest = EagleTreeShape {
            depth: self.depth,
            top_k: self.tree_top_k,
            tree_tokens: auto_max_tree_tokens(lookup),
        };
        Ok(match self.tree_tokens {
            TreeTokens::Fixed(tree_tokens) => (
                EagleTreeShape {
                    tree_tokens,
                    ..widest
                },
                None,
            ),
            TreeTokens::Auto => {
                let (shape, tuning) =
                    tune_eagle(target, head, d2t, widest, lookup, warm_up, WARM_UP_TOKENS)?;
                (shape, Some(tuning))
            }
        })
    }

    fn medusa(
        &self,
        target: &Target,
        lookup: Option<&LookupDrafter>,
        warm_up: &[Vec<u32>],
    ) -> anyhow::Result<(ModelDraft, Option<Tuning>)> {
        let (mut heads, d2t) = self.load_heads(target, |loaded| match loaded {
            DraftHead::Medusa(heads) => Ok(heads),
            other => Err(other.name()),
        })?;
        heads.params.freeze();
        let (choices, tuning) = match (&self.tree, self.tree_tokens) {
            (Some(path), _) => (
                TreeChoices::from_file(path)
                    .with_context(|| format!("--tree {}", path.display()))?,
                None,
            ),
            (None, TreeTokens::Fixed(tree_tokens)) => (
                TreeChoices::from_accuracies(
                    &typical_medusa_accuracy(heads.config.num_heads),
                    tree_tokens,
                ),
                None,
            ),
            (None, TreeTokens::Auto) => {
                let d2t = d2t.as_deref();
                let max = auto_max_tree_tokens(lookup);
                let (choices, tuning) =
                    tune_medusa(target, &heads, d2t, max, lookup, warm_up, WARM_UP_TOKENS)?;
                (choices, Some(tuning))
            }
        };
        Ok((
            ModelDraft::Medusa {
                heads,
                d2t,
                choices,
            },
            tuning,
        ))
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
