//! `headway-train`: make a target usable (convert), prepare and verify its features, train draft
//! heads on them, evaluate, export and import them. The binary is [`Cli`] parsed and [`run`];
//! tests run the same commands in-process with [`Hooks`] of their own.

mod autocast;
mod data;
mod distributed;
mod heads_cmd;
mod interop;
mod objective;
mod optim;
mod prepare;
mod torch_save;
mod trainer;
mod vocab_loss;

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, Subcommand};
use headway_checkpoints::{CheckpointConfig, WeightStorage};
use headway_gguf::convert_gguf;
use headway_model::target::default_target_dir;
use headway_model::Dtype;

#[derive(Parser)]
#[command(
    name = "headway-train",
    version,
    about = "Convert target models and train draft heads for speculative decoding."
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Observers the commands call at the moments where a kill must leave their outputs resumable:
/// what the kill tests hook into (the binary's do nothing).
pub struct Hooks {
    /// `prepare`: after the n-th shard of this run is written and listed in the manifest.
    pub shard_written: Box<dyn Fn(usize)>,
    /// Head training: after the checkpoint of this step is saved and `latest` names it.
    pub checkpoint_saved: Box<dyn Fn(u64)>,
}

impl Default for Hooks {
    fn default() -> Self {
        Self {
            shard_written: Box::new(|_| {}),
            checkpoint_saved: Box::new(|_| {}),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Convert a llama.cpp GGUF file (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16, BF16 or F32 tensors) into
    /// an HF-style directory: config.json, model.safetensors, tokenizer.json,
    /// tokenizer_config.json (with the GGUF's chat template).
    Convert(ConvertArgs),
    /// Turn a chat corpus into training features: render each conversation with the target's
    /// chat template, mask the assistant tokens, optionally regenerate the replies with the target
    /// (self-distillation), and store the target's hidden states in checksummed safetensors shards
    /// with a manifest. Resumable: rerun the same command after an interruption.
    Prepare(prepare::PrepareArgs),
    /// Join the directories of a sharded `prepare --shard I/N` (slices 0 … N−1) into one feature
    /// directory equal to a single run's: same shards, same manifest but for its command line.
    MergeFeatures(prepare::MergeFeaturesArgs),
    /// Check a feature directory: its manifest, and every shard's size, checksum and contents.
    /// Exits non-zero naming each bad shard.
    Verify(prepare::VerifyArgs),
    /// Train Medusa-1 heads on prepared features (head k predicts the token k + 2 ahead).
    Medusa(heads_cmd::MedusaArgs),
    /// Train an EAGLE head (feature-level autoregression) on prepared features.
    Eagle(heads_cmd::EagleArgs),
    /// Train an EAGLE-3 head (low, middle and high target layers fused; trained on tokens with
    /// training-time test) on features prepared with those layers (`prepare --layers`).
    Eagle3(heads_cmd::Eagle3Args),
    /// Evaluate a head checkpoint on the held-out split: per-head top-1/top-5 (Medusa), top-1
    /// and chain acceptance alpha1..alpha5 (EAGLE).
    Eval(heads_cmd::EvalArgs),
    /// Write a head checkpoint in the Medusa repository's or EAGLE's (vLLM, SGLang) layout.
    Export(interop::ExportArgs),
    /// Read a head in the Medusa or EAGLE layout into a Headway checkpoint.
    Import(interop::ImportArgs),
    /// Write a head checkpoint as one directory (config.json and model.safetensors, no training
    /// state) with its weights stored as `--storage` says: `q8_0` keeps the matrices as Q8_0
    /// rows, ~28 % of f32's bytes (how pretrained/ ships its heads). Every command reads either.
    Pack(PackArgs),
}

#[derive(clap::Args)]
struct PackArgs {
    /// A head checkpoint (or a training output directory: its latest checkpoint).
    #[arg(long)]
    heads: PathBuf,
    /// The directory to write; a checkpoint already there is replaced.
    #[arg(long)]
    out: PathBuf,
    /// How model.safetensors stores the weights: q8_0 or f32.
    #[arg(long, default_value = "q8_0", value_parser = parse_storage)]
    storage: WeightStorage,
}

fn parse_storage(name: &str) -> Result<WeightStorage, String> {
    serde_json::from_value(serde_json::Value::String(name.to_string()))
        .map_err(|_| format!("unknown weight storage {name:?}: give q8_0 or f32"))
}

#[derive(clap::Args)]
struct ConvertArgs {
    /// The GGUF file to convert.
    #[arg(long)]
    gguf: PathBuf,
    /// Output directory (created if needed). Default: the embedded default target's directory,
    /// which every command uses when given no --target.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Dtype of the dequantised weights in model.safetensors.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
}

/// Runs one command.
pub fn run(cli: Cli, hooks: &Hooks) -> anyhow::Result<()> {
    match cli.command {
        Command::Convert(args) => run_convert(args),
        Command::Prepare(args) => prepare::run_prepare(args, hooks),
        Command::MergeFeatures(args) => prepare::run_merge_features(args),
        Command::Verify(args) => prepare::run_verify(args),
        Command::Medusa(args) => heads_cmd::run_medusa(args, hooks),
        Command::Eagle(args) => heads_cmd::run_eagle(args, hooks),
        Command::Eagle3(args) => heads_cmd::run_eagle3(args, hooks),
        Command::Eval(args) => heads_cmd::run_eval(args),
        Command::Export(args) => interop::run_export(args),
        Command::Import(args) => interop::run_import(args),
        Command::Pack(args) => run_pack(args),
    }
}

fn run_pack(args: PackArgs) -> anyhow::Result<()> {
    let checkpoint = headway_checkpoints::load(&args.heads)?;
    let config = CheckpointConfig {
        weight_storage: args.storage,
        ..checkpoint.config
    };
    let weights: Vec<(String, tch::Tensor)> = checkpoint.weights.into_iter().collect();
    let size = |dir: &std::path::Path| {
        std::fs::metadata(dir.join("model.safetensors")).map_or(0, |m| m.len()) as f64 / 1e6
    };
    let read = size(&checkpoint.dir);
    headway_checkpoints::save_as(&args.out, &config, &weights)?;
    println!(
        "packed {} ({read:.1} MB) → {} ({}, {:.1} MB)",
        checkpoint.dir.display(),
        args.out.display(),
        serde_json::to_value(args.storage)?
            .as_str()
            .unwrap_or_default(),
        size(&args.out)
    );
    Ok(())
}

fn run_convert(args: ConvertArgs) -> anyhow::Result<()> {
    let out = args.out.unwrap_or_else(default_target_dir);
    let start = Instant::now();
    let summary = convert_gguf(&args.gguf, &out, args.dtype)?;
    let types: Vec<String> = summary
        .source_types
        .iter()
        .map(|(kind, count)| format!("{count} {kind}"))
        .collect();
    println!(
        "converted {} → {}: {} ({} tensors from {}, {:.1} M parameters, {} tokens), {:.1} MB written in {:.1} s",
        args.gguf.display(),
        out.display(),
        summary.architecture,
        summary.tensors,
        types.join(", "),
        summary.parameters as f64 / 1e6,
        summary.vocab_size,
        summary.bytes_written as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
