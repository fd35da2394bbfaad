//! `headway-serve bench`: decoding speed over Spec-Bench prompts.
//!
//! Prompt selection is shared with `scripts/bench_transformers.py` so both measure the same
//! work: `--prompts N` takes the first turn of every (480 / N)-th question, i.e. one per block of
//! the file (the file is grouped by category), rendered with the target's chat template.

use std::io::BufRead;
use std::path::Path;

use headway_model::{Message, Target};
use serde::{Deserialize, Serialize};

use crate::error::{Result, ServeError};
use headway_model::generate;
use headway_model::{Sampler, SamplingParams};

/// One Spec-Bench row.
#[derive(Debug, Clone, Deserialize)]
pub struct Question {
    pub question_id: u64,
    pub category: String,
    pub turns: Vec<String>,
}

/// Reads a Spec-Bench `question.jsonl`; a malformed line is reported with its number.
pub fn load_questions(path: &Path) -> Result<Vec<Question>> {
    let file = std::fs::File::open(path).map_err(|e| ServeError::file(path, e))?;
    let mut questions = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| ServeError::file(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let question: Question = serde_json::from_str(&line)
            .map_err(|e| ServeError::file(path, format!("line {}: {e}", number + 1)))?;
        if question.turns.is_empty() {
            return Err(ServeError::file(
                path,
                format!("line {}: no turns", number + 1),
            ));
        }
        questions.push(question);
    }
    Ok(questions)
}

/// `count` questions evenly spaced through the file (every `len / count`-th, starting at 0).
pub fn spread(questions: &[Question], count: usize) -> Vec<Question> {
    if count == 0 || questions.is_empty() {
        return Vec::new();
    }
    let stride = (questions.len() / count).max(1);
    questions
        .iter()
        .step_by(stride)
        .take(count)
        .cloned()
        .collect()
}

/// Figures for one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct PromptResult {
    pub question_id: u64,
    pub category: String,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Seconds from the start to the last token, prompt forward included.
    pub seconds: f64,
    /// Seconds of the prompt forward (time to first token).
    pub prefill_seconds: f64,
    pub text: String,
    pub token_ids: Vec<u32>,
}

/// Totals over all prompts. `tokens_per_s` = all new tokens / all generation seconds (prompt
/// forwards included, as transformers' `generate()` is timed); `decode_tokens_per_s` leaves the
/// prompt forwards out (tokens after the first / seconds after the first).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub method: String,
    pub target: String,
    pub device: String,
    pub dtype: String,
    /// CPU inference threads (see `headway_model::linear`).
    pub threads: usize,
    pub prompts: usize,
    pub max_new_tokens: usize,
    pub new_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub prefill_seconds: f64,
    pub decode_tokens_per_s: f64,
    pub per_prompt: Vec<PromptResult>,
}

/// Plain decoding (`ar`) of the first turn of each question; one untimed warm-up generation first
/// so one-off allocations do not count.
pub fn bench_autoregressive(
    target: &Target,
    questions: &[Question],
    max_new_tokens: usize,
    sampling: SamplingParams,
    mut progress: impl FnMut(&PromptResult),
) -> Result<BenchReport> {
    let prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let text = target.chat_prompt(&[Message::new("user", &q.turns[0])])?;
            Ok(target.tokenizer.encode(&text, false)?)
        })
        .collect::<Result<_>>()?;
    if let Some(first) = prompts.first() {
        generate(target, first, 8, &mut Sampler::new(sampling), &mut |_| {})?;
    }
    let mut per_prompt = Vec::with_capacity(questions.len());
    for (question, prompt) in questions.iter().zip(&prompts) {
        let out = generate(
            target,
            prompt,
            max_new_tokens,
            &mut Sampler::new(sampling),
            &mut |_| {},
        )?;
        let result = PromptResult {
            question_id: question.question_id,
            category: question.category.clone(),
            prompt_tokens: prompt.len(),
            new_tokens: out.tokens.len(),
            seconds: out.seconds,
            prefill_seconds: out.prefill_seconds,
            text: out.text,
            token_ids: out.tokens,
        };
        progress(&result);
        per_prompt.push(result);
    }
    let new_tokens = per_prompt.iter().map(|r| r.new_tokens).sum();
    let seconds: f64 = per_prompt.iter().map(|r| r.seconds).sum();
    let prefill_seconds: f64 = per_prompt.iter().map(|r| r.prefill_seconds).sum();
    let decoded = new_tokens - per_prompt.iter().filter(|r| r.new_tokens > 0).count();
    Ok(BenchReport {
        method: "ar".into(),
        target: target.dir.display().to_string(),
        device: format!("{:?}", target.device),
        dtype: format!("{:?}", target.kind),
        threads: headway_model::linear::cpu_inference_threads(),
        prompts: per_prompt.len(),
        max_new_tokens,
        new_tokens,
        seconds,
        tokens_per_s: new_tokens as f64 / seconds.max(f64::MIN_POSITIVE),
        prefill_seconds,
        decode_tokens_per_s: decoded as f64 / (seconds - prefill_seconds).max(f64::MIN_POSITIVE),
        per_prompt,
    })
}
