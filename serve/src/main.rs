//! `headway-serve`: run a target model — plain or speculative generation, Spec-Bench benchmarks
//! and their comparison, the OpenAI-compatible HTTP server and its load test.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use headway_model::{Message, Sampler, SamplingArgs, TargetArgs};
use headway_serve::bench::{
    differing_prompts, load_questions, markdown, report, run_question, spread, tuning_questions,
    warm_up, BenchOptions, BenchReport, MethodRun, PromptResult,
};
use headway_serve::drafters::NoDrafter;
use headway_serve::engine::generate_speculative;
use headway_serve::http::load::LoadArgs;
use headway_serve::http::HttpArgs;
use headway_serve::methods::{DraftArgs, DraftResources, Method};
use headway_serve::plot::svg;

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
    /// Measure a decoding method over Spec-Bench questions against plain decoding: τ, acceptance
    /// per depth, tokens/s and speedup, per category and overall.
    Bench(BenchArgs),
    /// Serve the target (with speculative decoding) behind an OpenAI-compatible HTTP API:
    /// /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.
    Http(HttpArgs),
    /// A bounded load run against a running server: latency and time-to-first-token
    /// percentiles, tokens/s and errors.
    Load(LoadArgs),
    /// List the prompts whose outputs differ between two `bench --json` reports (a losslessness
    /// check: greedy speculative decoding must match `ar` exactly). Exits 1 if any differ.
    Compare(CompareArgs),
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
    #[command(flatten)]
    draft: DraftArgs,
}

#[derive(clap::Args)]
struct BenchArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    draft: DraftArgs,
    /// Spec-Bench questions (JSON lines with `question_id`, `category`, `turns`).
    #[arg(long, default_value = "../shared/data/spec_bench/question.jsonl")]
    questions: PathBuf,
    /// How many questions: every (rows / N)-th of the category-ordered file, so a subset covers
    /// every category (0: all).
    #[arg(long, alias = "prompts", default_value_t = 0)]
    limit: usize,
    /// Turns asked per question; later turns see the model's own earlier answers.
    #[arg(long, default_value_t = 2)]
    turns: usize,
    /// New tokens per prompt (fewer when the model ends its turn first).
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Skip the `ar` baseline (no speedup figures).
    #[arg(long)]
    no_baseline: bool,
    /// Write the report here as JSON, with a markdown table (.md) and an SVG chart (.svg) of
    /// acceptance per depth and speedup per category beside it.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(clap::Args)]
struct CompareArgs {
    /// A `bench --json` report.
    first: PathBuf,
    /// Another report over the same prompts.
    second: PathBuf,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
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
        Command::Compare(args) => run_compare(args),
        Command::Http(args) => headway_serve::http::run(args),
        Command::Load(args) => headway_serve::http::load::run(args),
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
    let mut resources = DraftResources::load(&args.draft, &target)?;
    resources.tune(&args.draft, &target, std::slice::from_ref(&prompt_ids))?;
    if let Some(tuned) = &resources.tuned {
        eprint!("{}", tuned.describe());
    }
    let capacity = prompt_ids.len() + args.max_new_tokens + 1;
    let mut drafter = resources.drafter(&args.draft, &target, capacity)?;
    let mut stdout = std::io::stdout();
    let out = generate_speculative(
        &target,
        drafter.as_mut(),
        &prompt_ids,
        args.max_new_tokens,
        args.draft.acceptance(),
        &mut Sampler::new(sampling),
        &mut |piece| {
            // A closed stdout (e.g. piped into `head`) must not abort generation with a panic.
            let _ = stdout
                .write_all(piece.as_bytes())
                .and_then(|()| stdout.flush());
            true
        },
    )?;
    println!();
    let g = &out.generation;
    eprintln!(
        "{} tokens in {:.2} s: {:.1} tokens/s (prompt {} tokens, time to first token {:.3} s, stop: {:?}; {} {} target forwards, τ {:.2})",
        g.tokens.len(),
        g.seconds,
        g.tokens.len() as f64 / g.seconds,
        prompt_ids.len(),
        g.prefill_seconds,
        g.stop_reason,
        args.draft.label(),
        out.steps.len() + 1,
        out.tau(),
    );
    Ok(())
}

fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    let sampling = args.sampling.params()?;
    let all = load_questions(&args.questions)?;
    let questions = if args.limit == 0 {
        all
    } else {
        spread(&all, args.limit)
    };
    let target = args.target.load()?;
    let mut resources = DraftResources::load(&args.draft, &target)?;
    let tuning_prompts: Vec<Vec<u32>> = tuning_questions(&questions)
        .into_iter()
        .map(|q| target.chat_prompt_ids(&[Message::new("user", &q.turns[0])]))
        .collect::<Result<_, _>>()?;
    resources.tune(&args.draft, &target, &tuning_prompts)?;
    if let Some(tuned) = &resources.tuned {
        eprint!("{}", tuned.describe());
    }
    let options = BenchOptions {
        max_new_tokens: args.max_new_tokens,
        turns: args.turns,
        sampling,
        acceptance: args.draft.acceptance(),
    };
    let longest = questions
        .iter()
        .flat_map(|q| &q.turns)
        .map(String::len)
        .sum::<usize>();
    // Room for the longest conversation: generous, the cache is allocated once per prompt.
    let capacity = (longest + args.turns * args.max_new_tokens + 64)
        .min(target.model.config().max_position_embeddings);
    let method = args.draft.method;
    let label = args.draft.label();
    if args.draft.typical && !sampling.is_greedy() {
        eprintln!("warning: --typical is lossy: sampled outputs no longer follow the target's distribution");
    }
    eprintln!(
        "bench {}: {} questions × up to {} turns, {} new tokens each, {:?} {:?}, {} threads",
        label,
        questions.len(),
        args.turns,
        args.max_new_tokens,
        target.device,
        target.kind,
        headway_model::linear::cpu_inference_threads()
    );
    let progress = |name: String| {
        move |r: &PromptResult| {
            eprintln!(
                "  {name:<6} question {:>3} turn {} {:<15} {:>4} prompt + {:>4} new tokens {:>6.2} s {:>6.1} tok/s τ {:.2}",
                r.question_id,
                r.turn + 1,
                r.category,
                r.prompt_tokens,
                r.new_tokens,
                r.seconds,
                r.new_tokens as f64 / r.seconds,
                r.new_tokens as f64 / r.target_forwards as f64,
            )
        }
    };
    let mut drafter = resources.drafter(&args.draft, &target, capacity)?;
    let mut plain = NoDrafter;
    let compare = method != Method::Ar && !args.no_baseline;
    if let Some(first) = questions.first() {
        if compare {
            warm_up(&target, &mut plain, first, &options)?;
        }
        warm_up(&target, drafter.as_mut(), first, &options)?;
    }
    let (mut ar_progress, mut method_progress) = (progress("ar".into()), progress(label.clone()));
    let (mut baseline, mut run) = (MethodRun::default(), MethodRun::default());
    // Plain decoding and the method alternate question by question, so that the host's drifting
    // speed (shared machines) weighs on both alike.
    for question in &questions {
        if compare {
            run_question(
                &target,
                &mut plain,
                question,
                &options,
                &mut baseline,
                &mut ar_progress,
            )?;
        }
        run_question(
            &target,
            drafter.as_mut(),
            question,
            &options,
            &mut run,
            &mut method_progress,
        )?;
    }
    let baseline = compare.then_some(baseline);
    let settings = serde_json::json!({
        "target": target.dir.display().to_string(),
        "heads": args.draft.heads.as_ref().map(|p| p.display().to_string()),
        "draft_model": args.draft.draft_model.as_ref().map(|p| p.display().to_string()),
        "device": format!("{:?}", target.device),
        "dtype": format!("{:?}", target.kind),
        "threads": headway_model::linear::cpu_inference_threads(),
        "questions": questions.len(),
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "temperature": sampling.temperature,
        "top_k": sampling.top_k,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "depth": args.draft.depth,
        "tree_top_k": args.draft.tree_top_k,
        "tree_tokens": args.draft.tree_tokens.to_string(),
        "auto_tuned": resources.tuned.as_ref().map(|t| serde_json::json!({
            "chosen": t.best,
            "predicted_tokens_per_s": t.best.tokens_per_s,
            "predicted_tau": 1.0 + t.best.accepted,
            "predicted_ar_tokens_per_s": t.ar_tokens_per_s,
            "ranking": t.ranking,
        })),
        "draft_tokens": args.draft.draft_tokens,
        "with_lookup": args.draft.with_lookup,
        "tree": args.draft.tree.as_ref().map(|p| p.display().to_string()),
        "acceptance": args.draft.acceptance(),
        "seconds_drafting": run.draft_seconds,
        "seconds_verifying": run.verify_seconds,
        "steps": run.steps,
    });
    let report = report(&label, settings, &run, baseline.as_ref());
    let mut table = markdown(&report);
    if let Some(tuned) = &resources.tuned {
        table.push_str(&format!(
            "\nAuto-tuned tree: {}{}; predicted τ {:.2}, {:.1} tokens/s; measured τ {:.2}, {:.1} tokens/s.\n",
            tuned.best.description,
            if args.draft.with_lookup {
                " (the model's tree, predicted with the lookup chain)"
            } else {
                ""
            },
            1.0 + tuned.best.accepted,
            tuned.best.tokens_per_s,
            report.tau,
            report.tokens_per_s
        ));
    }
    println!("{table}");
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        write_file(path, text.as_bytes())?;
        write_file(&path.with_extension("md"), table.as_bytes())?;
        write_file(&path.with_extension("svg"), svg(&report)?.as_bytes())?;
    }
    Ok(())
}

fn run_compare(args: CompareArgs) -> anyhow::Result<()> {
    let read = |path: &PathBuf| -> anyhow::Result<BenchReport> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a bench report", path.display()))
    };
    let (first, second) = (read(&args.first)?, read(&args.second)?);
    let differing = differing_prompts(&first, &second);
    for line in &differing {
        println!("{line}");
    }
    println!(
        "{} of {} prompts identical ({} vs {})",
        first.per_prompt.len() - differing.len().min(first.per_prompt.len()),
        first.per_prompt.len(),
        first.method,
        second.method
    );
    if differing.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!("{} prompts differ", differing.len()))
    }
}

/// Writes `bytes` to `path` atomically (temp file beside it, then rename).
fn write_file(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    headway_model::files::write_bytes_atomically(path, bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
