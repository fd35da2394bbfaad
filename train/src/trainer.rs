//! The training loop shared by both heads: streaming batches, gradient accumulation, clipping,
//! AdamW with warm-up + cosine, logs, held-out evaluation each epoch, and checkpoints that a
//! `--resume` continues bit for bit.
//!
//! Data parallel: with a [`ProcessGroup`] of W ranks, the `grad_accum` micro-batches of each
//! optimizer update (the global batch) are dealt out as they come, each to the rank with the
//! fewest padded tokens so far in the step (the lowest such rank on a tie), which evens out
//! micro-batches of different sizes without looking ahead; every rank walks the same batch stream
//! and so deals the same way, assembles only its own micro-batches, and the gradients are summed
//! over the ranks before clipping. The update is then the one a single process computes (up to
//! the order of the floating-point sums), so settings, checkpoints and data positions do not
//! depend on W. Rank 0 alone writes checkpoints and logs and evaluates the held-out split.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use headway_checkpoints::{CheckpointConfig, TrainingState};
use headway_datasets::features::{FeatureSet, ShardSplit};
use headway_model::hash::mix64;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind};
use tensorboard_rs::summary_writer::SummaryWriter;

use crate::autocast::with_autocast;
use crate::data::{BatchStream, DataPosition};
use crate::distributed::ProcessGroup;
use crate::objective::{Metrics, Objective};
use crate::optim::{clip_grad_norm, learning_rate, AdamW, AdamWConfig};

/// Everything that decides the optimisation (saved with checkpoints; a resume must match it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSettings {
    pub lr: f64,
    pub min_lr_ratio: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub grad_accum: usize,
    pub clip: f64,
    pub batch_tokens: usize,
    pub seed: u64,
    pub adamw: AdamWConfig,
    pub save_every: u64,
    /// Arithmetic of the training forward and backward (checkpoints before it existed: f32).
    #[serde(default)]
    pub precision: Precision,
}

/// How the heads' training steps compute; weights, optimizer moments and held-out evaluation
/// stay f32 whatever it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    /// Autocast to bf16: matrix products in bf16, softmaxes and losses in f32.
    Bf16,
}

/// What a checkpoint's `trainer_state.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    step: u64,
    position: DataPosition,
    settings: TrainSettings,
    /// Ranks that trained it (checkpoints before data parallelism: one).
    #[serde(default = "one_rank")]
    world_size: usize,
}

fn one_rank() -> usize {
    1
}

/// One training run.
pub struct Trainer<'a> {
    pub features: &'a FeatureSet,
    pub settings: TrainSettings,
    pub out: PathBuf,
    pub device: Device,
    /// Makes the checkpoint config for the current weights (step filled in by the trainer).
    pub checkpoint_config: Box<dyn Fn(u64) -> CheckpointConfig + 'a>,
    /// Called with the step after each checkpoint is saved (where a kill must leave a run
    /// that `--resume` continues).
    pub checkpoint_saved: &'a dyn Fn(u64),
    /// The data-parallel process group, when several ranks train together.
    pub group: Option<&'a ProcessGroup>,
}

/// How a run ended.
pub struct TrainSummary {
    pub steps: u64,
    pub tokens: usize,
    /// Wall time of the training loop, checkpoint writes and epoch evaluations included.
    pub seconds: f64,
    /// Of which writing checkpoints and evaluating the held-out split.
    pub checkpoint_seconds: f64,
    pub eval_seconds: f64,
    /// Held-out figures of the final weights.
    pub eval: Metrics,
    pub checkpoint: Option<PathBuf>,
}

impl Trainer<'_> {
    /// Trains `objective` to `settings.total_steps`; with `resume`, first restores the latest
    /// checkpoint in `out` (weights, optimizer, step, data position).
    pub fn run(&self, objective: &mut dyn Objective, resume: bool) -> anyhow::Result<TrainSummary> {
        let s = &self.settings;
        let (rank, world) = (self.rank(), self.world());
        anyhow::ensure!(
            s.grad_accum >= world,
            "--grad-accum {} is less than the {world} ranks: each optimizer update's \
             micro-batches are dealt out to the ranks, so give at least {world}",
            s.grad_accum
        );
        if rank == 0 {
            let unfinished = headway_checkpoints::remove_unfinished_saves(&self.out)?;
            if unfinished > 0 {
                eprintln!("removed {unfinished} unfinished checkpoint(s) of an interrupted run");
            }
        }
        let mut optimizer = AdamW::new(s.adamw, objective.params());
        let mut step = 0;
        let mut position = DataPosition::default();
        if resume {
            (step, position) = self.restore(objective, &mut optimizer)?;
        }
        if let Some(group) = self.group {
            group
                .broadcast_params(objective.params())
                .context("giving every rank rank 0's weights")?;
        }
        let mut stream = BatchStream::new(
            self.features,
            ShardSplit::Train,
            s.seed,
            true,
            s.batch_tokens,
            self.device,
            position,
        )?
        .with_taps(objective.taps())?;
        let mut log = Log::new(rank == 0, &self.out, s.total_steps, step);
        let start = Instant::now();
        let (mut tokens, mut last_eval, mut checkpoint) = (0usize, None::<(u64, Metrics)>, None);
        let (mut checkpoint_seconds, mut eval_seconds) = (0.0, 0.0);
        while step < s.total_steps {
            let mut metrics = Metrics::default();
            let mut step_tokens = 0;
            let mut dealt = vec![0usize; world];
            let mut micro = 0;
            while micro < s.grad_accum {
                let Some(slot) = stream.next_slot()? else {
                    if rank == 0 {
                        let eval =
                            self.logged_evaluation(objective, &mut log, step, &mut eval_seconds)?;
                        log.line(&format!(
                            "epoch {} done at step {step}: held-out {}",
                            stream.position.epoch,
                            summary_line(&eval)
                        ));
                        last_eval = Some((step, eval));
                    }
                    continue;
                };
                let owner = (0..world)
                    .min_by_key(|&r| dealt[r])
                    .expect("at least one rank");
                dealt[owner] += slot.padded_tokens;
                if owner == rank {
                    let batch = stream.assemble_slot(&slot);
                    // Noise and any other randomness depend only on (seed, step, micro-batch).
                    tch::manual_seed(mix64(
                        s.seed ^ mix64(step * s.grad_accum as u64 + micro as u64),
                    ) as i64);
                    let scale = Some(1.0 / s.grad_accum as f64);
                    metrics.merge(&self.in_precision(|| objective.run(&batch, scale))??);
                    step_tokens += batch.tokens;
                }
                micro += 1;
            }
            self.sum_over_ranks(objective, &mut metrics, &mut step_tokens, step)?;
            tokens += step_tokens;
            let grad_norm = clip_grad_norm(objective.params(), s.clip);
            let lr = learning_rate(step, s.total_steps, s.warmup_steps, s.lr, s.min_lr_ratio);
            optimizer.update(objective.params(), lr);
            step += 1;
            let training_seconds =
                start.elapsed().as_secs_f64() - checkpoint_seconds - eval_seconds;
            let rate = tokens as f64 / training_seconds.max(1e-9);
            log.step(step, &metrics, lr, grad_norm, rate);
            if rank == 0 && (step % s.save_every == 0 || step == s.total_steps) {
                let save_start = Instant::now();
                checkpoint = Some(self.save(objective, &optimizer, step, stream.position)?);
                checkpoint_seconds += save_start.elapsed().as_secs_f64();
                (self.checkpoint_saved)(step);
            }
        }
        // A run of whole epochs stops before it asks for the batch that would end the last one.
        let eval = match last_eval {
            Some((at, eval)) if at == step => eval,
            _ if rank != 0 => Metrics::default(),
            _ => self.logged_evaluation(objective, &mut log, step, &mut eval_seconds)?,
        };
        log.finish();
        Ok(TrainSummary {
            steps: step,
            tokens,
            seconds: start.elapsed().as_secs_f64(),
            checkpoint_seconds,
            eval_seconds,
            eval,
            checkpoint,
        })
    }

    /// Sums this step's gradients, figures and token count over the ranks (a single process
    /// has nothing to do).
    fn sum_over_ranks(
        &self,
        objective: &dyn Objective,
        metrics: &mut Metrics,
        tokens: &mut usize,
        step: u64,
    ) -> anyhow::Result<()> {
        let Some(group) = self.group else {
            return Ok(());
        };
        let failed = || {
            format!(
                "rank {} of {}, step {}: summing over the ranks failed (did another rank stop? \
                 its own output says why)",
                group.rank,
                group.world,
                step + 1
            )
        };
        group
            .all_reduce_gradients(objective.params())
            .with_context(failed)?;
        group
            .all_reduce_metrics(metrics, tokens)
            .with_context(failed)
    }

    /// This process's rank, and how many train together.
    fn rank(&self) -> usize {
        self.group.map_or(0, |g| g.rank)
    }

    fn world(&self) -> usize {
        self.group.map_or(1, |g| g.world)
    }

    /// Figures of `objective` over the whole held-out split.
    pub fn evaluate(&self, objective: &mut dyn Objective) -> anyhow::Result<Metrics> {
        evaluate(
            self.features,
            objective,
            self.settings.batch_tokens,
            self.device,
        )
    }

    /// `f()` computed in the run's precision.
    fn in_precision<T>(&self, f: impl FnOnce() -> T) -> anyhow::Result<T> {
        match self.settings.precision {
            Precision::F32 => Ok(f()),
            Precision::Bf16 => with_autocast(self.device, Kind::BFloat16, f),
        }
    }

    /// [`Self::evaluate`], its figures logged at `step` and its time added to `seconds`.
    fn logged_evaluation(
        &self,
        objective: &mut dyn Objective,
        log: &mut Log,
        step: u64,
        seconds: &mut f64,
    ) -> anyhow::Result<Metrics> {
        let start = Instant::now();
        let eval = self.evaluate(objective)?;
        *seconds += start.elapsed().as_secs_f64();
        log.metrics("eval", &eval, step);
        Ok(eval)
    }

    fn save(
        &self,
        objective: &dyn Objective,
        optimizer: &AdamW,
        step: u64,
        position: DataPosition,
    ) -> anyhow::Result<PathBuf> {
        let weights: Vec<(String, tch::Tensor)> = objective
            .params()
            .iter()
            .map(|(n, t)| (n.clone(), t.detach()))
            .collect();
        let state = TrainerState {
            step,
            position,
            settings: self.settings.clone(),
            world_size: self.world(),
        };
        let training = TrainingState {
            optimizer: optimizer.state_tensors(),
            trainer: serde_json::to_value(&state)?,
        };
        Ok(headway_checkpoints::save(
            &self.out,
            &(self.checkpoint_config)(step),
            &weights,
            Some(&training),
        )?)
    }

    fn restore(
        &self,
        objective: &mut dyn Objective,
        optimizer: &mut AdamW,
    ) -> anyhow::Result<(u64, DataPosition)> {
        let checkpoint = headway_checkpoints::load(&self.out).with_context(|| {
            format!(
                "--resume: no checkpoint to resume in {}",
                self.out.display()
            )
        })?;
        let (moments, state) = headway_checkpoints::load_training_state(&checkpoint.dir)?;
        let state: TrainerState = serde_json::from_value(state).context("trainer_state.json")?;
        anyhow::ensure!(
            state.settings == self.settings,
            "--resume: {} was trained with other settings ({:?}); resume with the same options",
            checkpoint.dir.display(),
            state.settings
        );
        anyhow::ensure!(
            state.world_size == self.world(),
            "--resume: {} was trained by {} rank(s), this run has {} (WORLD_SIZE / \
             --world-size); resume with {} rank(s)",
            checkpoint.dir.display(),
            state.world_size,
            self.world(),
            state.world_size
        );
        objective.params_mut().load(&checkpoint.weights)?;
        optimizer.load_state(&moments, state.step)?;
        Ok((state.step, state.position))
    }
}

/// Figures over the whole held-out split of `features`.
pub fn evaluate(
    features: &FeatureSet,
    objective: &mut dyn Objective,
    batch_tokens: usize,
    device: Device,
) -> anyhow::Result<Metrics> {
    let mut stream = BatchStream::new(
        features,
        ShardSplit::HeldOut,
        0,
        false,
        batch_tokens,
        device,
        DataPosition::default(),
    )?
    .with_taps(objective.taps())?;
    let mut metrics = Metrics::default();
    while let Some(batch) = stream.next_batch()? {
        metrics.merge(&objective.evaluate(&batch)?);
    }
    Ok(metrics)
}

/// `loss 1.234 top1 0.56 …` from the figures that matter most.
pub fn summary_line(metrics: &Metrics) -> String {
    metrics
        .means()
        .iter()
        .filter(|(k, _)| {
            k.as_str() == "loss"
                || k.ends_with("top1")
                || k.starts_with("alpha")
                || k.starts_with("acc_")
        })
        .map(|(k, v)| format!("{k} {v:.3}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a run shows and records: tensorboard scalars and a progress bar (a line every tenth of
/// the run without a terminal), on rank 0 only.
struct Log {
    writer: Option<SummaryWriter>,
    bar: ProgressBar,
    total_steps: u64,
}

impl Log {
    fn new(leader: bool, out: &std::path::Path, total_steps: u64, step: u64) -> Self {
        if !leader {
            return Self {
                writer: None,
                bar: ProgressBar::hidden(),
                total_steps,
            };
        }
        let bar = ProgressBar::new(total_steps).with_position(step);
        bar.set_style(
            ProgressStyle::with_template("training [{bar:30}] {pos}/{len} steps (ETA {eta}) {msg}")
                .expect("valid progress template")
                .progress_chars("=> "),
        );
        bar.reset_eta();
        Self {
            writer: Some(SummaryWriter::new(out.join("logs"))),
            bar,
            total_steps,
        }
    }

    fn scalar(&mut self, name: &str, value: f64, step: u64) {
        if let Some(writer) = &mut self.writer {
            writer.add_scalar(name, value as f32, step as usize);
        }
    }

    fn metrics(&mut self, prefix: &str, metrics: &Metrics, step: u64) {
        for (name, value) in metrics.means() {
            self.scalar(&format!("{prefix}/{name}"), value, step);
        }
    }

    /// A line above the bar.
    fn line(&self, text: &str) {
        match self.writer.is_some() && self.bar.is_hidden() {
            // A hidden bar (no terminal) drops println: write the line directly.
            true => eprintln!("{text}"),
            false => self.bar.println(text),
        }
    }

    /// The figures of a finished step: scalars and the bar's message (without a terminal, a
    /// line every tenth of the run).
    fn step(&mut self, step: u64, metrics: &Metrics, lr: f64, grad_norm: f64, tokens_per_s: f64) {
        self.metrics("train", metrics, step);
        self.scalar("train/lr", lr, step);
        self.scalar("train/grad_norm", grad_norm, step);
        self.scalar("train/tokens_per_s", tokens_per_s, step);
        let text = format!(
            "{} | lr {lr:.2e} | {tokens_per_s:.0} tok/s",
            summary_line(metrics)
        );
        self.bar.set_position(step);
        let tenth = step.is_multiple_of(self.total_steps.div_ceil(10)) || step == self.total_steps;
        if self.writer.is_some() && self.bar.is_hidden() && tenth {
            eprintln!("step {step}/{}: {text}", self.total_steps);
        }
        self.bar.set_message(text);
    }

    fn finish(&mut self) {
        self.bar.finish();
        if let Some(writer) = &mut self.writer {
            writer.flush();
        }
    }
}
