//! `headway-serve bench`: decoding methods measured the way Spec-Bench does.
//!
//! Every question is asked turn by turn: the second turn's prompt holds the model's own first
//! answer. τ counts every new token per target forward, the bonus token and the prompt forward's
//! token included, so plain decoding has τ = 1. Speedups compare with `ar` measured in the same
//! run on the same prompts, the two alternating question by question.

mod curve;
mod host;
mod plot;
mod questions;
mod report;

use std::path::{Path, PathBuf};

use anyhow::Context;
use headway_engine::acceptance::Acceptance;
use headway_engine::autotune::Tuning;
use headway_engine::drafters::{Drafter, NoDrafter};
use headway_engine::engine::{generate_speculative, SpecGeneration};
use headway_model::{Message, Sampler, SamplingArgs, SamplingParams, Target, TargetArgs};

pub use curve::RowsCurve;
use host::resident_bytes;
pub use host::HostFigures;
pub use questions::{
    load_questions, spec_bench_category, spread, tuning_questions, Question, QuestionId,
};
pub use report::{
    differing_prompts, markdown, predicted_speedup, report, BenchReport, Comparison, DepthStats,
    MethodRun, PromptResult, Summary,
};

use crate::options::DraftArgs;
use plot::svg;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    draft: DraftArgs,
    /// Spec-Bench questions (JSON lines with `question_id` (a number or a string), `category`,
    /// `turns`).
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

/// Options of a run.
#[derive(Debug, Clone, Copy)]
pub struct BenchOptions {
    pub max_new_tokens: usize,
    /// Turns asked per question (Spec-Bench's multi-turn rows have 2).
    pub turns: usize,
    pub sampling: SamplingParams,
    pub acceptance: Acceptance,
}

/// Runs the benchmark `args` describe and prints (and writes) its report.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let options = BenchOptions {
        max_new_tokens: args.max_new_tokens,
        turns: args.turns,
        sampling: args.sampling.params()?,
        acceptance: args.draft.acceptance(),
    };
    let all = load_questions(&args.questions)?;
    let questions = match args.limit {
        0 => all,
        limit => spread(&all, limit),
    };
    let target = headway_gguf::load_target(&args.target)?;
    let target_rss = resident_bytes();
    let tuning_prompts: Vec<Vec<u32>> = tuning_questions(&questions)
        .into_iter()
        .map(|q| target.chat_prompt_ids(&[Message::new("user", &q.turns[0])]))
        .collect::<Result<_, _>>()?;
    let (plan, tuning) = args.draft.plan(&target, &tuning_prompts)?;
    if let Some(tuning) = &tuning {
        eprint!("{}", tuning.describe());
    }
    let label = plan.label();
    if args.draft.typical && !options.sampling.is_greedy() {
        eprintln!("warning: --typical is lossy: sampled outputs no longer follow the target's distribution");
    }
    eprintln!(
        "bench {label}: {} questions × up to {} turns, {} new tokens each, {:?}, weights {:?}, \
         activations {:?}, {} threads",
        questions.len(),
        args.turns,
        args.max_new_tokens,
        target.device,
        target.weight_kind,
        target.kind,
        target.cpu.count()
    );
    let longest = questions
        .iter()
        .flat_map(|q| &q.turns)
        .map(String::len)
        .sum::<usize>();
    // Room for the longest conversation: generous, the cache is allocated once per prompt.
    let capacity = (longest + args.turns * args.max_new_tokens + 64)
        .min(target.model.config().max_position_embeddings);
    let mut drafter = plan.drafter(&target, capacity)?;
    let mut host = HostFigures::measure(target.cpu.count(), &target.model);
    (host.target_rss_bytes, host.with_drafter_rss_bytes) = (target_rss, resident_bytes());
    let baseline = !plan.is_ar() && !args.no_baseline;
    let (run, ar) = alternate(
        &target,
        drafter.as_mut(),
        &label,
        &questions,
        &options,
        baseline,
        &mut host,
    )?;
    let settings = settings(&args, &target, &questions, &options, tuning.as_ref(), &run);
    host.record_memory();
    let curve = RowsCurve::measure(&target, &host)?;
    let mut report = report(&label, settings, &run, ar.as_ref());
    report.host = Some(host);
    report.rows_curve = Some(curve);
    let mut table = markdown(&report);
    if let Some(tuning) = &tuning {
        // Decoding against decoding: the tuner predicts steps after the prompt, not prefills.
        let measured = &report.overall;
        let ratio = |rate: f64, ar: f64| rate / ar.max(f64::MIN_POSITIVE);
        let measured_ratio = measured.ar.as_ref().map_or(String::new(), |ar| {
            format!(
                " ({:.2}× ar's {:.1})",
                ratio(measured.method.decode_tokens_per_s, ar.decode_tokens_per_s),
                ar.decode_tokens_per_s
            )
        });
        table.push_str(&format!(
            "\nAuto-tuned tree: {}{}; predicted τ {:.2}, decoding {:.1} tokens/s ({:.2}× its plain \
             decoding's {:.1}); measured τ {:.2}, decoding {:.1} tokens/s{measured_ratio}.\n",
            tuning.best.description,
            if args.draft.with_lookup {
                " (the model's tree, predicted with the lookup chain)"
            } else {
                ""
            },
            1.0 + tuning.best.accepted,
            tuning.best.tokens_per_s,
            ratio(tuning.best.tokens_per_s, tuning.ar_tokens_per_s),
            tuning.ar_tokens_per_s,
            report.tau,
            measured.method.decode_tokens_per_s,
        ));
    }
    println!("{table}");
    if let (Some(identical), true) = (report.identical_to_ar, options.sampling.is_greedy()) {
        println!(
            "{identical} of {} prompts identical to plain decoding",
            report.per_prompt.len()
        );
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        write_file(path, text.as_bytes())?;
        write_file(&path.with_extension("md"), table.as_bytes())?;
        write_file(&path.with_extension("svg"), svg(&report)?.as_bytes())?;
    }
    Ok(())
}

/// Runs every question with `drafter` and, with `baseline`, with plain decoding before it: the
/// two alternate question by question, so that the host's drifting speed (shared machines)
/// weighs on both alike; `host` probes the read rate after each question. Returns the method's
/// run and plain decoding's.
fn alternate(
    target: &Target,
    drafter: &mut dyn Drafter,
    label: &str,
    questions: &[Question],
    options: &BenchOptions,
    baseline: bool,
    host: &mut HostFigures,
) -> anyhow::Result<(MethodRun, Option<MethodRun>)> {
    let mut plain = NoDrafter;
    if let Some(first) = questions.first() {
        if baseline {
            warm_up(target, &mut plain, first, options)?;
        }
        warm_up(target, drafter, first, options)?;
    }
    let (mut ar_progress, mut method_progress) = (progress("ar"), progress(label));
    let (mut ar, mut run) = (MethodRun::default(), MethodRun::default());
    for question in questions {
        if baseline {
            run_question(
                target,
                &mut plain,
                question,
                options,
                &mut ar,
                &mut ar_progress,
            )?;
        }
        run_question(
            target,
            drafter,
            question,
            options,
            &mut run,
            &mut method_progress,
        )?;
        host.probe(&target.model);
    }
    Ok((run, baseline.then_some(ar)))
}

/// A line per prompt on stderr.
fn progress(name: &str) -> impl FnMut(&PromptResult) + '_ {
    move |r: &PromptResult| {
        eprintln!(
            "  {name:<6} question {:>3} turn {} {:<15} {:>4} prompt + {:>4} new tokens {:>6.2} s {:>6.1} tok/s τ {:.2}",
            r.question_id.to_string(),
            r.turn + 1,
            r.category,
            r.prompt_tokens,
            r.new_tokens,
            r.seconds,
            r.new_tokens as f64 / r.seconds,
            r.new_tokens as f64 / r.target_forwards as f64,
        )
    }
}

/// The report's `settings`: what the run was asked to do and how its time split.
fn settings(
    args: &BenchArgs,
    target: &Target,
    questions: &[Question],
    options: &BenchOptions,
    tuning: Option<&Tuning>,
    run: &MethodRun,
) -> serde_json::Value {
    let sampling = &options.sampling;
    let draft = &args.draft;
    serde_json::json!({
        "target": target.path.display().to_string(),
        "heads": draft.heads.as_ref().map(|p| p.display().to_string()),
        "draft_model": draft.draft_model.as_ref().map(|p| p.display().to_string()),
        "device": format!("{:?}", target.device),
        "dtype": format!("{:?}", target.weight_kind),
        "activation_dtype": format!("{:?}", target.kind),
        "kv_dtype": format!("{:?}", target.kv_kind),
        "threads": target.cpu.count(),
        "questions": questions.len(),
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "temperature": sampling.temperature(),
        "top_k": sampling.top_k(),
        "top_p": sampling.top_p(),
        "min_p": sampling.min_p(),
        "seed": sampling.seed(),
        "depth": draft.depth,
        "tree_top_k": draft.tree_top_k,
        "tree_tokens": draft.tree_tokens.to_string(),
        "auto_tuned": tuning.map(|t| serde_json::json!({
            "chosen": t.best,
            "predicted_tokens_per_s": t.best.tokens_per_s,
            "predicted_tau": 1.0 + t.best.accepted,
            "predicted_ar_tokens_per_s": t.ar_tokens_per_s,
            "ranking": t.ranking,
            "latency": t.latency,
        })),
        "draft_tokens": draft.draft_tokens,
        "head_format": format!("{:?}", draft.head_format.drafting_format(target)),
        "with_lookup": draft.with_lookup,
        "tree": draft.tree.as_ref().map(|p| p.display().to_string()),
        "acceptance": options.acceptance,
        "seconds_drafting": run.draft_seconds,
        "seconds_verifying": run.verify_seconds,
        "seconds_accepting": run.accept_seconds,
        "steps": run.steps,
    })
}

/// One short untimed generation, so that first-call costs (allocations, lazy set-up) stay out of
/// the figures.
pub fn warm_up(
    target: &Target,
    drafter: &mut dyn Drafter,
    question: &Question,
    options: &BenchOptions,
) -> anyhow::Result<()> {
    let ids = target.chat_prompt_ids(&[Message::new("user", &question.turns[0])])?;
    let mut sampler = Sampler::new(options.sampling);
    generate_speculative(
        target,
        drafter,
        &ids,
        8,
        options.acceptance,
        &mut sampler,
        &mut |_| true,
    )?;
    Ok(())
}

/// Runs `question` turn by turn with `drafter` (a later turn follows the model's own answer),
/// adding every turn's figures to `run`.
pub fn run_question(
    target: &Target,
    drafter: &mut dyn Drafter,
    question: &Question,
    options: &BenchOptions,
    run: &mut MethodRun,
    progress: &mut dyn FnMut(&PromptResult),
) -> anyhow::Result<()> {
    let mut messages = Vec::new();
    for (turn, text) in question.turns.iter().take(options.turns).enumerate() {
        messages.push(Message::new("user", text));
        let ids = target.chat_prompt_ids(&messages)?;
        // The same seed for a prompt whatever the method, so sampled runs stay comparable.
        let seed = options.sampling.seed() ^ (question.question_id.seed_bits() << 8 | turn as u64);
        let mut sampler = Sampler::new(options.sampling.with_seed(seed));
        let out = generate_speculative(
            target,
            drafter,
            &ids,
            options.max_new_tokens,
            options.acceptance,
            &mut sampler,
            &mut |_| true,
        )?;
        let result = prompt_result(question, turn, ids.len(), &out);
        messages.push(Message::new("assistant", &result.text));
        progress(&result);
        run.add(&out, result);
    }
    Ok(())
}

fn prompt_result(
    question: &Question,
    turn: usize,
    prompt_tokens: usize,
    out: &SpecGeneration,
) -> PromptResult {
    let generation = &out.generation;
    PromptResult {
        question_id: question.question_id.clone(),
        category: question.category.clone(),
        turn,
        prompt_tokens,
        new_tokens: generation.tokens.len(),
        seconds: generation.seconds,
        prefill_seconds: generation.prefill_seconds,
        target_forwards: out.steps.len() + 1,
        accepted_tokens: out.accepted_tokens(),
        text: generation.text.clone(),
        token_ids: generation.tokens.clone(),
    }
}

/// Writes `bytes` to `path` atomically (temp file beside it, then rename).
fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    headway_model::files::write_bytes_atomically(path, bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[derive(clap::Args)]
pub struct CompareArgs {
    /// A `bench --json` report.
    first: PathBuf,
    /// Another report over the same prompts.
    second: PathBuf,
}

/// `compare`: lists the prompts whose outputs differ between two reports; an error when any do.
pub fn compare(args: CompareArgs) -> anyhow::Result<()> {
    let read = |path: &PathBuf| -> anyhow::Result<BenchReport> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a bench report", path.display()))
    };
    let (first, second) = (read(&args.first)?, read(&args.second)?);
    let differing = differing_prompts(&first.per_prompt, &second.per_prompt);
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
    anyhow::ensure!(differing.is_empty(), "{} prompts differ", differing.len());
    Ok(())
}
