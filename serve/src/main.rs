//! `headway-serve`: run a target model — plain generation now, speculative decoding and serving
//! as the heads arrive.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use headway_model::generate;
use headway_model::{Message, TargetArgs};
use headway_model::{Sampler, SamplingArgs};
use headway_serve::bench::{bench_autoregressive, load_questions, spread};

#[derive(Parser)]
#[command(
    name = "headway-serve",
    version,
    about = "Run a target model: generate text and benchmark decoding."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to one prompt, streaming tokens to stdout, then print tokens, seconds and
    /// tokens/s on stderr.
    Generate(GenerateArgs),
    /// Measure decoding speed over Spec-Bench prompts and optionally write the figures as JSON.
    Bench(BenchArgs),
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the target's chat template (instruct models).
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message placed before the prompt.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Stop after this many new tokens (generation also stops at the model's end-of-turn token).
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// Decoding methods `bench` can measure; the speculative ones arrive with the trained heads.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Method {
    /// Plain autoregressive decoding, one target forward per token.
    Ar,
}

#[derive(clap::Args)]
struct BenchArgs {
    #[command(flatten)]
    target: TargetArgs,
    /// Decoding method to measure.
    #[arg(long, value_enum, default_value = "ar")]
    method: Method,
    /// Spec-Bench questions (JSON lines with `question_id`, `category`, `turns`).
    #[arg(long, default_value = "../shared/data/spec_bench/question.jsonl")]
    questions: PathBuf,
    /// How many prompts: the first turn of every (rows / N)-th question, one per block of the
    /// category-ordered file (8 matches scripts/bench_transformers.py).
    #[arg(long, default_value_t = 8)]
    prompts: usize,
    /// New tokens per prompt (fewer when the model ends its turn first).
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Also write the report (method, prompts, new_tokens, seconds, tokens_per_s, per prompt
    /// outputs) to this JSON file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Bench(args) => run_bench(args),
    }
}

fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    let sampling = args.sampling.params()?;
    let target = args.target.load()?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(Message::new("system", system));
        }
        messages.push(Message::new("user", &args.prompt));
        target.chat_prompt(&messages)?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = target.tokenizer.encode(&prompt, !args.chat)?;
    let mut stdout = std::io::stdout();
    let out = generate(
        &target,
        &prompt_ids,
        args.max_new_tokens,
        &mut Sampler::new(sampling),
        &mut |piece| {
            // A closed stdout (e.g. piped into `head`) must not abort generation with a panic.
            let _ = stdout
                .write_all(piece.as_bytes())
                .and_then(|()| stdout.flush());
        },
    )?;
    println!();
    eprintln!(
        "{} tokens in {:.2} s: {:.1} tokens/s (prompt {} tokens, time to first token {:.3} s, stop: {:?})",
        out.tokens.len(),
        out.seconds,
        out.tokens.len() as f64 / out.seconds,
        prompt_ids.len(),
        out.prefill_seconds,
        out.stop_reason,
    );
    Ok(())
}

fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let Method::Ar = args.method;
    let sampling = args.sampling.params()?;
    let questions = spread(&load_questions(&args.questions)?, args.prompts);
    let target = args.target.load()?;
    eprintln!(
        "bench ar: {} prompts, {} new tokens each, {:?} {:?}, {} threads",
        questions.len(),
        args.max_new_tokens,
        target.device,
        target.kind,
        headway_model::linear::cpu_inference_threads()
    );
    let report = bench_autoregressive(&target, &questions, args.max_new_tokens, sampling, |r| {
        eprintln!(
            "  question {:>3} {:<15} {:>4} prompt + {:>4} new tokens {:>6.2} s (prefill {:.2} s) {:>6.1} tok/s",
            r.question_id,
            r.category,
            r.prompt_tokens,
            r.new_tokens,
            r.seconds,
            r.prefill_seconds,
            r.new_tokens as f64 / r.seconds
        );
    })?;
    println!(
        "method ar: {} prompts, {} new tokens, {:.2} s, {:.1} tokens/s (prompt forwards {:.2} s; decoding alone {:.1} tokens/s)",
        report.prompts,
        report.new_tokens,
        report.seconds,
        report.tokens_per_s,
        report.prefill_seconds,
        report.decode_tokens_per_s
    );
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        write_atomically(path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Writes `bytes` to a temp file beside `path`, then renames it over `path`.
fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}
