//! `headway-serve generate`: one prompt, streamed to stdout, figures on stderr.

use std::io::Write;

use headway_engine::engine::generate_speculative;
use headway_model::{Message, Sampler, SamplingArgs, TargetArgs};

use crate::options::DraftArgs;

#[derive(clap::Args)]
pub struct GenerateArgs {
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

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let sampling = args.sampling.params()?;
    let target = headway_gguf::load_target(&args.target)?;
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
    let (plan, tuning) = args
        .draft
        .plan(&target, std::slice::from_ref(&prompt_ids))?;
    if let Some(tuning) = &tuning {
        eprint!("{}", tuning.describe());
    }
    let capacity = prompt_ids.len() + args.max_new_tokens + 1;
    let mut drafter = plan.drafter(&target, capacity)?;
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
        plan.label(),
        out.steps.len() + 1,
        out.tau(),
    );
    Ok(())
}
