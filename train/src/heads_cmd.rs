//! `headway-train medusa | eagle | eval`: building a head for a target and its features, and
//! running the trainer or the evaluation.

use std::path::{Path, PathBuf};

use anyhow::Context;
use headway_checkpoints::{
    load_head, CheckpointConfig, DraftHead, HeadKind, LoadedHead, TargetRef, WeightStorage,
    CHECKPOINT_FORMAT,
};
use headway_datasets::features::{FeatureSet, ShardSplit};
use headway_heads::eagle::balanced_embed_scale;
use headway_heads::{
    DraftVocab, Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaConfig, MedusaHeads,
};
use headway_model::fingerprint::{target_identity, TargetIdentity};
use headway_model::{Target, TargetArgs};
use tch::{Kind, Tensor};

use crate::data::{tap_columns, BatchStream};
use crate::distributed::DistributedArgs;
use crate::objective::{Eagle3Objective, EagleObjective, MedusaObjective, Objective};
use crate::optim::AdamWConfig;
use crate::trainer::{evaluate, summary_line, Precision, TrainSettings, Trainer};
use crate::Hooks;

/// Options every head trainer takes.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// Feature directory made by `headway-train prepare`.
    #[arg(long)]
    features: PathBuf,
    /// Output directory: checkpoints `step-N/`, `latest`, and tensorboard logs in `logs/`.
    #[arg(long)]
    out: PathBuf,
    /// The target the features came from (checked by fingerprint) and where to train.
    #[command(flatten)]
    target: TargetArgs,
    /// Optimizer updates to run (overrides --epochs).
    #[arg(long)]
    steps: Option<u64>,
    /// Passes over the training split (used when --steps is not given).
    #[arg(long, default_value_t = 1)]
    epochs: u64,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-4)]
    lr: f64,
    /// Linear warm-up steps before the cosine decay.
    #[arg(long, default_value_t = 50)]
    warmup: u64,
    /// Final learning rate as a fraction of the peak.
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Micro-batches per optimizer update.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Gradient-norm clipping threshold.
    #[arg(long, default_value_t = 0.5)]
    clip: f64,
    /// Padded tokens per micro-batch.
    #[arg(long, default_value_t = 2048)]
    batch_tokens: usize,
    /// Seed of initialisation, data order and noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Save a checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 200)]
    save_every: u64,
    /// Continue from the latest checkpoint in --out (same options required).
    #[arg(long)]
    resume: bool,
    /// Start from this head's weights (a checkpoint, or a training directory's latest) instead
    /// of a fresh initialisation, with a fresh optimizer and schedule: to train a shipped head
    /// further on new data. Its shape (layers, taps, draft vocabulary, …) is the checkpoint's;
    /// options that would change it are refused, those with defaults are not read.
    #[arg(long, value_name = "CHECKPOINT", conflicts_with = "resume")]
    init: Option<PathBuf>,
    /// Draft over the N most frequent target tokens of the training data instead of the whole
    /// vocabulary (a smaller LM-head product per draft step).
    #[arg(long)]
    draft_vocab: Option<usize>,
    /// Arithmetic of the training steps [default: bf16 on CUDA, f32 elsewhere].
    #[arg(long, value_enum)]
    precision: Option<Precision>,
    /// Also write the run's figures (steps, tokens, seconds, tokens/s, held-out figures) to this
    /// JSON file (scripts/bench_train_torch.py compares them with PyTorch).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Data-parallel training over several processes (torchrun's environment).
    #[command(flatten)]
    distributed: DistributedArgs,
}

impl TrainArgs {
    /// The target options, with `--device cuda` resolved to this rank's GPU.
    fn target_args(&self) -> TargetArgs {
        TargetArgs {
            device: self.distributed.device(&self.target.device),
            ..self.target.clone()
        }
    }
}

#[derive(clap::Args)]
pub struct MedusaArgs {
    #[command(flatten)]
    common: TrainArgs,
    /// Number of heads (head k predicts the token k + 2 ahead).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Residual blocks per head.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Use the frozen target LM head instead of a trained copy per head.
    #[arg(long)]
    shared_lm_head: bool,
    /// Loss weight of head k is DECAY^k.
    #[arg(long, default_value_t = 0.8)]
    decay: f64,
}

#[derive(clap::Args)]
pub struct EagleArgs {
    #[command(flatten)]
    common: TrainArgs,
    /// Half-width of the uniform noise added to input features during training.
    #[arg(long, default_value_t = 0.1)]
    noise: f64,
    /// Weight of the soft cross-entropy term next to the feature regression.
    #[arg(long, default_value_t = 0.1)]
    classification_weight: f64,
    /// Decoder layers in the head (EAGLE-1: one; more cost drafting time for accuracy).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=32))]
    layers: u16,
    /// Rounds per training step: rounds after the first feed the head its own predicted features,
    /// as drafting past depth 1 does (training-time test; 1 = EAGLE-1's teacher forcing). Each
    /// round costs about one more forward and backward.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    unroll: u16,
    /// Target layers k (comma-separated) whose residual stream, the hidden state after k decoder
    /// layers, the head fuses into its input where the target's features are known (after
    /// EAGLE-3's low/middle/high-layer fusion). The features must store them: `prepare --layers`.
    /// Serving then asks the target for them too. Default: none (EAGLE-1).
    #[arg(long, value_delimiter = ',')]
    taps: Vec<usize>,
    /// Factor on the token embedding before the head's `fc`, or `auto`: the target's feature RMS
    /// over its embedding RMS, so that the token and the feature start on one scale (1 =
    /// EAGLE-1; `export` folds the factor into `fc`).
    #[arg(long, default_value = "auto", value_parser = parse_embed_scale)]
    embed_scale: EmbedScale,
    /// Give `fc` a bias, as the EAGLE repository's Vicuna and LLaMA-2 heads have. Without it
    /// (the default) the head is what vLLM's EAGLE loader builds and the LLaMA-3 heads are.
    #[arg(long)]
    fc_bias: bool,
}

#[derive(clap::Args)]
pub struct Eagle3Args {
    #[command(flatten)]
    common: TrainArgs,
    /// Target layers k (comma-separated, low to high) whose residual streams, the hidden state
    /// after k decoder layers, `fc` fuses. Default: the references' 2, L/2 and L − 3. The
    /// features must store them: `prepare --layers`.
    #[arg(long, value_delimiter = ',')]
    taps: Vec<usize>,
    /// Rounds of training-time test: later rounds feed the head its own outputs, as drafting
    /// past depth 1 does; each costs about one more forward and backward.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u16).range(1..=16))]
    ttt: u16,
    /// Loss weight of round k is DECAY^k.
    #[arg(long, default_value_t = 0.8)]
    decay: f64,
}

/// Draft depths `eval` scores an EAGLE-3 head at (`acc_0` … `acc_6`, the references' seven).
const EVAL_ROUNDS: usize = 7;

/// EAGLE-3's draft vocabulary when --draft-vocab is not given (the references use 32,000 of
/// Llama-3's 128k; SmolLM2's 8,192 most frequent tokens cover about 95% of ShareGPT's replies),
/// or the whole vocabulary of a smaller one.
const EAGLE3_DRAFT_VOCAB: usize = 8192;

/// `--embed-scale`.
#[derive(Debug, Clone, Copy)]
enum EmbedScale {
    Auto,
    Factor(f64),
}

fn parse_embed_scale(text: &str) -> Result<EmbedScale, String> {
    if text == "auto" {
        return Ok(EmbedScale::Auto);
    }
    match text.parse::<f64>() {
        Ok(factor) if factor.is_finite() && factor > 0.0 => Ok(EmbedScale::Factor(factor)),
        _ => Err(format!(
            "expected `auto` or a positive number, got {text:?}"
        )),
    }
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// A head checkpoint (or a training output directory: its latest checkpoint).
    #[arg(long)]
    heads: PathBuf,
    /// Feature directory whose held-out split to evaluate on.
    #[arg(long)]
    features: PathBuf,
    /// The target the head was trained on and where to run it.
    #[command(flatten)]
    target: TargetArgs,
    /// Padded tokens per evaluation batch.
    #[arg(long, default_value_t = 2048)]
    batch_tokens: usize,
    /// Also write the held-out figures to this JSON file (`make bench-eagle3` reads them).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The target and features, checked against each other.
struct Setup {
    target: Target,
    features: FeatureSet,
    identity: TargetIdentity,
}

fn setup(args: &TargetArgs, features: &Path) -> anyhow::Result<Setup> {
    let target = headway_gguf::load_target(args)
        .with_context(|| format!("loading target {}", args.path().display()))?;
    let features = FeatureSet::open(features)?;
    if let Some(slice) = features.manifest.slice {
        anyhow::bail!(
            "{} holds only slice {slice} of a sharded prepare; join the {} slices with \
             `headway-train merge-features` and train on the result",
            features.dir.display(),
            slice.count
        );
    }
    let identity = target_identity(&target.path)?;
    features.check_target(&identity.fingerprint, &target.path)?;
    Ok(Setup {
        target,
        features,
        identity,
    })
}

/// Assistant-token counts per target id over the training split.
fn token_counts(features: &FeatureSet, vocab: usize) -> anyhow::Result<Vec<u64>> {
    let mut counts = vec![0u64; vocab];
    for (index, _) in features.shards(ShardSplit::Train) {
        let shard = features.load_shard(index)?;
        let ids = shard
            .input_ids
            .masked_select(&shard.loss_mask.to_kind(Kind::Bool));
        for id in Vec::<i32>::try_from(&ids)? {
            counts[id as usize] += 1;
        }
    }
    Ok(counts)
}

fn draft_vocab(setup: &Setup, size: Option<usize>) -> anyhow::Result<Option<DraftVocab>> {
    let Some(size) = size else { return Ok(None) };
    let vocab = setup.target.model.config().vocab_size;
    let counts = token_counts(&setup.features, vocab)?;
    let draft = DraftVocab::from_counts(&counts, size)?;
    eprintln!(
        "draft vocabulary: {size} tokens cover {:.1}% of the training assistant tokens",
        100.0 * draft.coverage(&counts)
    );
    Ok(Some(draft))
}

/// The target LM head rows the head drafts over.
fn lm_head_rows(target: &Target, draft: Option<&DraftVocab>) -> Tensor {
    DraftVocab::lm_head_rows(draft, target.model.lm_head.matrix())
}

/// The head `--init` names, loaded on `setup`'s target to be trained further: its modules, draft
/// vocabulary and shape, refused unless it is a `kind` head with the draft vocabulary
/// `--draft-vocab` asks for (when it asks).
fn initial_head(
    setup: &Setup,
    args: &TrainArgs,
    kind: &str,
) -> anyhow::Result<Option<(DraftHead, Option<DraftVocab>, HeadKind)>> {
    let Some(dir) = &args.init else {
        return Ok(None);
    };
    let loaded =
        load_head(dir, &setup.target).with_context(|| format!("--init {}", dir.display()))?;
    let name = loaded.head.name();
    anyhow::ensure!(
        name == kind,
        "--init {}: a {name} head, and this command trains {kind}",
        dir.display()
    );
    let size = loaded.draft_vocab.as_ref().map(DraftVocab::len);
    if let Some(asked) = args.draft_vocab.filter(|&asked| Some(asked) != size) {
        anyhow::bail!(
            "--draft-vocab {asked}: the head --init names drafts over {}",
            size.map_or("the whole vocabulary".to_string(), |n| format!(
                "{n} tokens"
            ))
        );
    }
    eprintln!(
        "starting from {} (step {} of its own training)",
        loaded.checkpoint.dir.display(),
        loaded.checkpoint.config.step
    );
    Ok(Some((
        loaded.head,
        loaded.draft_vocab,
        loaded.checkpoint.config.head,
    )))
}

fn settings(
    args: &TrainArgs,
    features: &FeatureSet,
    device: tch::Device,
) -> anyhow::Result<TrainSettings> {
    let total_steps = match args.steps {
        Some(steps) => steps,
        None => {
            let stream = BatchStream::new(
                features,
                ShardSplit::Train,
                args.seed,
                true,
                args.batch_tokens,
                device,
                Default::default(),
            )?;
            let batches: usize = (0..args.epochs)
                .map(|e| stream.batches_in_epoch(e))
                .sum::<anyhow::Result<usize>>()?;
            (batches as u64).div_ceil(args.grad_accum as u64)
        }
    };
    anyhow::ensure!(
        total_steps > 0 && args.grad_accum > 0 && args.save_every > 0,
        "--steps, --grad-accum and --save-every must be at least 1"
    );
    Ok(TrainSettings {
        lr: args.lr,
        min_lr_ratio: args.min_lr_ratio,
        warmup_steps: args.warmup,
        total_steps,
        grad_accum: args.grad_accum,
        clip: args.clip,
        batch_tokens: args.batch_tokens,
        seed: args.seed,
        adamw: AdamWConfig {
            weight_decay: args.weight_decay,
            ..AdamWConfig::default()
        },
        save_every: args.save_every,
        precision: args.precision.unwrap_or(match device {
            tch::Device::Cuda(_) => Precision::Bf16,
            _ => Precision::F32,
        }),
    })
}

fn checkpoint_config(
    setup: &Setup,
    head: HeadKind,
    draft: Option<&DraftVocab>,
    step: u64,
) -> CheckpointConfig {
    let c = setup.target.model.config();
    CheckpointConfig {
        format: CHECKPOINT_FORMAT.to_string(),
        head,
        target: TargetRef {
            fingerprint: setup.identity.fingerprint.clone(),
            converted_from: setup.identity.converted_from.clone(),
            dir: setup.target.path.display().to_string(),
            hidden_size: c.hidden_size,
            vocab_size: c.vocab_size,
        },
        draft_vocab: draft.map(|d| d.d2t.clone()),
        step,
        weights_sha256: String::new(),
        weight_storage: WeightStorage::F32,
    }
}

fn train(
    setup: &Setup,
    args: &TrainArgs,
    objective: &mut dyn Objective,
    head: HeadKind,
    draft: Option<&DraftVocab>,
    hooks: &Hooks,
) -> anyhow::Result<()> {
    let device = setup.target.device;
    let group = args.distributed.join(device)?;
    let trainer = Trainer {
        features: &setup.features,
        settings: settings(args, &setup.features, device)?,
        out: args.out.clone(),
        device,
        checkpoint_config: Box::new(|step| checkpoint_config(setup, head.clone(), draft, step)),
        checkpoint_saved: &*hooks.checkpoint_saved,
        group: group.as_ref(),
    };
    let ranks = match &group {
        Some(g) => format!(" as rank {} of {}", g.rank, g.world),
        None => String::new(),
    };
    eprintln!(
        "training {} ({:.2} M parameters) for {} steps on {}{ranks}",
        head.name(),
        objective.params().numel() as f64 / 1e6,
        trainer.settings.total_steps,
        args.features.display()
    );
    let summary = trainer.run(objective, args.resume)?;
    let eval = &summary.eval;
    let training_seconds = summary.seconds - summary.checkpoint_seconds - summary.eval_seconds;
    let tokens_per_s = summary.tokens as f64 / training_seconds.max(1e-9);
    println!(
        "trained {} steps, {} tokens in {:.1} s: {tokens_per_s:.0} tokens/s training ({:.1} s of \
         checkpoint writes and {:.1} s of held-out evaluation not counted); checkpoint {}",
        summary.steps,
        summary.tokens,
        summary.seconds,
        summary.checkpoint_seconds,
        summary.eval_seconds,
        summary
            .checkpoint
            .as_ref()
            .map_or("(none)".into(), |p| p.display().to_string())
    );
    if group.as_ref().is_some_and(|g| g.rank != 0) {
        // Rank 0 evaluates and writes the figures.
        return Ok(());
    }
    println!("held-out: {}", summary_line(eval));
    if let Some(path) = &args.json {
        let figures = serde_json::json!({
            "head": head.name(),
            "steps": summary.steps,
            "tokens": summary.tokens,
            "seconds": summary.seconds,
            "checkpoint_seconds": summary.checkpoint_seconds,
            "eval_seconds": summary.eval_seconds,
            "tokens_per_s": tokens_per_s,
            "parameters": objective.params().numel(),
            "held_out": eval.means(),
        });
        write_figures(path, &figures)?;
    }
    Ok(())
}

/// Writes a command's figures as pretty JSON, atomically (a bench reading it never sees half).
fn write_figures(path: &Path, figures: &serde_json::Value) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(figures)? + "\n";
    headway_model::files::write_bytes_atomically(path, text.as_bytes())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

pub fn run_medusa(args: MedusaArgs, hooks: &Hooks) -> anyhow::Result<()> {
    let setup = setup(&args.common.target_args(), &args.common.features)?;
    let (heads, draft, config) = match initial_head(&setup, &args.common, "medusa")? {
        Some((DraftHead::Medusa(heads), draft, HeadKind::Medusa(config))) => (heads, draft, config),
        Some(_) => anyhow::bail!("--init: a Medusa checkpoint of another shape"),
        None => {
            let draft = draft_vocab(&setup, args.common.draft_vocab)?;
            let lm_head = lm_head_rows(&setup.target, draft.as_ref());
            let config = MedusaConfig {
                num_heads: args.heads,
                num_layers: args.layers,
                hidden_size: setup.target.model.config().hidden_size,
                vocab_size: lm_head.size()[0] as usize,
                shared_lm_head: args.shared_lm_head,
            };
            (MedusaHeads::new(config.clone(), &lm_head)?, draft, config)
        }
    };
    let mut objective = MedusaObjective::new(
        heads,
        args.decay,
        draft.clone(),
        setup.target.model.config().vocab_size,
        setup.target.cpu.batch(),
    );
    train(
        &setup,
        &args.common,
        &mut objective,
        HeadKind::Medusa(config),
        draft.as_ref(),
        hooks,
    )
}

pub fn run_eagle(args: EagleArgs, hooks: &Hooks) -> anyhow::Result<()> {
    let setup = setup(&args.common.target_args(), &args.common.features)?;
    let (head, draft, kind) = match initial_head(&setup, &args.common, "eagle")? {
        Some((DraftHead::Eagle(head), draft, kind)) => {
            if let HeadKind::Eagle { taps, .. } = &kind {
                anyhow::ensure!(
                    args.taps.is_empty() || &args.taps == taps,
                    "--taps {:?}: the head --init names fuses taps {taps:?}",
                    args.taps
                );
                tap_columns(&setup.features, taps)?;
            }
            (head, draft, kind)
        }
        Some(_) => anyhow::bail!("--init: an EAGLE checkpoint of another shape"),
        None => fresh_eagle(&setup, &args)?,
    };
    let mut objective = EagleObjective::new(
        head,
        args.noise,
        args.classification_weight,
        usize::from(args.unroll),
        setup.target.cpu.batch(),
    );
    train(
        &setup,
        &args.common,
        &mut objective,
        kind,
        draft.as_ref(),
        hooks,
    )
}

/// A newly initialised EAGLE head of the shape `args` asks for.
fn fresh_eagle(
    setup: &Setup,
    args: &EagleArgs,
) -> anyhow::Result<(EagleHead, Option<DraftVocab>, HeadKind)> {
    // Before the draft-vocabulary count, which reads every shard.
    tap_columns(&setup.features, &args.taps)?;
    let draft = draft_vocab(setup, args.common.draft_vocab)?;
    tch::manual_seed(args.common.seed as i64);
    let layers = usize::from(args.layers);
    let trunk = &setup.target.model.model;
    let embed_scale = match args.embed_scale {
        EmbedScale::Auto => balanced_embed_scale(trunk.embed_tokens(), trunk.final_norm_weight()),
        EmbedScale::Factor(factor) => factor,
    };
    eprintln!("embedding scale before fc: {embed_scale:.3}");
    let head = EagleHead::new(
        EagleConfig::for_target(setup.target.model.config(), layers)
            .with_taps(args.taps.clone())
            .with_embed_scale(embed_scale)
            .with_fc_bias(args.fc_bias),
        trunk.embedding(),
        &lm_head_rows(&setup.target, draft.as_ref()),
    )?;
    let kind = HeadKind::Eagle {
        layers,
        taps: args.taps.clone(),
        embed_scale,
        fc_bias: args.fc_bias,
    };
    Ok((head, draft, kind))
}

pub fn run_eagle3(args: Eagle3Args, hooks: &Hooks) -> anyhow::Result<()> {
    let setup = setup(&args.common.target_args(), &args.common.features)?;
    let target = &setup.target;
    let (head, draft, taps) = match initial_head(&setup, &args.common, "eagle3")? {
        Some((DraftHead::Eagle3(head), Some(draft), HeadKind::Eagle3 { taps })) => {
            anyhow::ensure!(
                args.taps.is_empty() || args.taps == taps,
                "--taps {:?}: the head --init names fuses taps {taps:?}",
                args.taps
            );
            tap_columns(&setup.features, &taps)?;
            (head, draft, taps)
        }
        Some(_) => anyhow::bail!("--init: an EAGLE-3 checkpoint of another shape"),
        None => fresh_eagle3(&setup, &args)?,
    };
    let mut objective = Eagle3Objective::new(
        head,
        &draft,
        target.model.lm_head.weight(),
        usize::from(args.ttt),
        args.decay,
        target.cpu.batch(),
    );
    let kind = HeadKind::Eagle3 { taps };
    train(
        &setup,
        &args.common,
        &mut objective,
        kind,
        Some(&draft),
        hooks,
    )
}

/// A newly initialised EAGLE-3 head of the shape `args` asks for, and its taps.
fn fresh_eagle3(
    setup: &Setup,
    args: &Eagle3Args,
) -> anyhow::Result<(Eagle3Head, DraftVocab, Vec<usize>)> {
    let target = &setup.target;
    let taps = match args.taps.is_empty() {
        true => Eagle3Config::default_taps(target.model.config().num_hidden_layers),
        false => args.taps.clone(),
    };
    // Before the draft-vocabulary count, which reads every shard.
    tap_columns(&setup.features, &taps)?;
    let vocab = target.model.config().vocab_size;
    let size = args
        .common
        .draft_vocab
        .unwrap_or(EAGLE3_DRAFT_VOCAB.min(vocab));
    let draft = draft_vocab(setup, Some(size))?.expect("a size was given");
    tch::manual_seed(args.common.seed as i64);
    let config = Eagle3Config::for_target(target.model.config(), taps.clone(), draft.len());
    let head = Eagle3Head::new(
        config,
        target.model.model.embedding(),
        &lm_head_rows(target, Some(&draft)),
    )?;
    Ok((head, draft, taps))
}

pub fn run_eval(args: EvalArgs) -> anyhow::Result<()> {
    let setup = setup(&args.target, &args.features)?;
    let LoadedHead {
        head,
        draft_vocab: draft,
        checkpoint,
        ..
    } = load_head(&args.heads, &setup.target)?;
    let cpu = setup.target.cpu.batch();
    let mut objective: Box<dyn Objective> = match head {
        DraftHead::Medusa(heads) => Box::new(MedusaObjective::new(
            heads,
            0.8,
            draft,
            setup.target.model.config().vocab_size,
            cpu,
        )),
        DraftHead::Eagle(head) => Box::new(EagleObjective::new(head, 0.0, 0.1, 1, cpu)),
        DraftHead::Eagle3(head) => {
            let draft = draft.context("an EAGLE-3 checkpoint without its draft vocabulary")?;
            let lm_head = setup.target.model.lm_head.weight();
            Box::new(Eagle3Objective::new(
                head,
                &draft,
                lm_head,
                EVAL_ROUNDS,
                0.8,
                cpu,
            ))
        }
    };
    let metrics = evaluate(
        &setup.features,
        objective.as_mut(),
        args.batch_tokens,
        setup.target.device,
    )?;
    println!(
        "{} ({} at step {}), held-out split of {}:",
        checkpoint.dir.display(),
        checkpoint.config.head.name(),
        checkpoint.config.step,
        args.features.display()
    );
    for (name, value) in metrics.means() {
        println!("  {name:<20} {value:.4}");
    }
    if let Some(path) = &args.json {
        let figures = serde_json::json!({
            "head": checkpoint.config.head.name(),
            "checkpoint": checkpoint.dir,
            "step": checkpoint.config.step,
            "held_out": metrics.means(),
        });
        write_figures(path, &figures)?;
    }
    Ok(())
}
