//! Plain autoregressive generation: one target forward per token, KV cache reused throughout.

use std::time::Instant;

use crate::cpu::CpuPolicy;
use crate::mask::TreeInput;
use crate::{ForwardInput, KvCache, Target};
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::sampling::Sampler;

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model emitted one of the target's stop tokens (kept in `tokens`, not in `text`).
    Eos,
    /// `max_new_tokens` were generated.
    Length,
    /// The caller stopped it (a stop string, a client that went away).
    Cancelled,
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated ids, the stop token included when there was one.
    pub tokens: Vec<u32>,
    /// Generated text, special tokens dropped.
    pub text: String,
    pub stop_reason: StopReason,
    /// Seconds for the prompt's forward (time to first token).
    pub prefill_seconds: f64,
    /// Seconds from the start to the last token.
    pub seconds: f64,
}

/// Generates up to `max_new_tokens` after `prompt_ids`, calling `on_text` with each newly complete
/// piece of text as soon as it is decoded.
pub fn generate(
    target: &Target,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    sampler: &mut Sampler,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    check_request(target, prompt_ids.len(), max_new_tokens)?;
    let _no_grad = tch::no_grad_guard();
    let start = Instant::now();
    let mut cache = target.new_cache(1, prompt_ids.len() + max_new_tokens)?;
    let mut stream = target.tokenizer.stream(true);
    let (mut tokens, mut text) = (Vec::new(), String::new());
    let mut prefill_seconds = 0.0;
    let mut input: Vec<u32> = prompt_ids.to_vec();
    let mut stop_reason = StopReason::Length;
    let cpu = target.cpu.decode();
    while tokens.len() < max_new_tokens {
        let logits = next_logits(target, &input, &mut cache, &cpu)?;
        if tokens.is_empty() {
            prefill_seconds = start.elapsed().as_secs_f64();
        }
        let token = sampler.next_token(&logits);
        tokens.push(token);
        if target.stop_ids.contains(&token) {
            stop_reason = StopReason::Eos;
            break;
        }
        if let Some(piece) = stream.step(token)? {
            on_text(&piece);
            text.push_str(&piece);
        }
        input = vec![token];
    }
    Ok(Generation {
        tokens,
        text,
        stop_reason,
        prefill_seconds,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Generates replies to several prompts at once: each prompt is prefilled alone (no padding
/// compute), then all decode together, one forward of one token per still-running sequence per
/// step. `max_new_tokens[i]` and `samplers[i]` belong to prompt `i`. Finished sequences are
/// dropped from the batch once they are a quarter of it. Each reply is what [`generate`] gives
/// for its prompt up to the last bits of floating point (batched products and padded attention
/// sum in another order), so greedy replies can differ where two logits all but tie.
pub fn generate_batch(
    target: &Target,
    prompts: &[Vec<u32>],
    max_new_tokens: &[usize],
    samplers: &mut [Sampler],
) -> Result<Vec<Generation>> {
    if prompts.len() != max_new_tokens.len() || prompts.len() != samplers.len() {
        return Err(ModelError::Invalid {
            field: "prompts",
            message: format!(
                "{} prompts, {} token budgets and {} samplers",
                prompts.len(),
                max_new_tokens.len(),
                samplers.len()
            ),
        });
    }
    for (prompt, &budget) in prompts.iter().zip(max_new_tokens) {
        check_request(target, prompt.len(), budget)?;
    }
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    let _no_grad = tch::no_grad_guard();
    let start = Instant::now();
    let cpu = target.cpu.decode();
    let (mut logits, mut cache, pads) = prefill_each(target, prompts, max_new_tokens, &cpu)?;
    let prefill_seconds = start.elapsed().as_secs_f64();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut stops = vec![StopReason::Length; prompts.len()];
    // `rows[r]`: the prompt in cache row `r`; `running[r]`: whether it still generates.
    let mut rows: Vec<usize> = (0..prompts.len()).collect();
    let mut running: Vec<bool> = max_new_tokens.iter().map(|&m| m > 0).collect();
    loop {
        let mut next = Vec::with_capacity(rows.len());
        for (r, &prompt) in rows.iter().enumerate() {
            let token = if running[r] {
                let token = samplers[prompt].next_token(&logits.get(r as i64));
                tokens[prompt].push(token);
                if target.stop_ids.contains(&token) {
                    stops[prompt] = StopReason::Eos;
                    running[r] = false;
                } else if tokens[prompt].len() == max_new_tokens[prompt] {
                    running[r] = false;
                }
                token
            } else {
                0
            };
            next.push(token as i64);
        }
        let live: Vec<usize> = (0..rows.len()).filter(|&r| running[r]).collect();
        if live.is_empty() {
            break;
        }
        if live.len() * 4 <= rows.len() * 3 {
            cache.retain_sequences(&live)?;
            next = live.iter().map(|&r| next[r]).collect();
            rows = live.iter().map(|&r| rows[r]).collect();
            running = vec![true; rows.len()];
        }
        let row_pads: Vec<usize> = rows.iter().map(|&p| pads[p]).collect();
        logits = decode_step(target, &next, &row_pads, &mut cache, &cpu)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    tokens
        .into_iter()
        .zip(stops)
        .map(|(tokens, stop_reason)| {
            let end = tokens.len() - usize::from(stop_reason == StopReason::Eos);
            Ok(Generation {
                text: streamed_text(target, &tokens[..end])?,
                tokens,
                stop_reason,
                prefill_seconds,
                seconds,
            })
        })
        .collect()
}

/// The text [`generate`] streams for `tokens` (an incomplete UTF-8 sequence at the end is left
/// out, as the stream holds it back).
fn streamed_text(target: &Target, tokens: &[u32]) -> Result<String> {
    let mut stream = target.tokenizer.stream(true);
    let mut text = String::new();
    for &token in tokens {
        if let Some(piece) = stream.step(token)? {
            text.push_str(&piece);
        }
    }
    Ok(text)
}

/// Runs each prompt through the target alone and stacks the caches right-aligned, with room for
/// the longest reply; returns the last-position logits `[prompts, vocab]`, the cache and each
/// prompt's count of leading pad positions.
fn prefill_each(
    target: &Target,
    prompts: &[Vec<u32>],
    max_new_tokens: &[usize],
    cpu: &CpuPolicy,
) -> Result<(Tensor, KvCache, Vec<usize>)> {
    let longest_prompt = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let longest_reply = max_new_tokens.iter().copied().max().unwrap_or(0);
    let mut caches = Vec::with_capacity(prompts.len());
    let mut logits = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        let mut cache = target.new_cache(1, prompt.len())?;
        logits.push(next_logits(target, prompt, &mut cache, cpu)?);
        caches.push(cache);
    }
    let (cache, pads) = KvCache::stack_right_aligned(&caches, longest_prompt + longest_reply)?;
    Ok((Tensor::stack(&logits, 0), cache, pads))
}

/// One decoding step of a right-aligned batch: `tokens[r]` follows sequence `r`, whose first
/// `pads[r]` cache positions are padding. Returns the logits `[rows, vocab]`.
fn decode_step(
    target: &Target,
    tokens: &[i64],
    pads: &[usize],
    cache: &mut KvCache,
    cpu: &CpuPolicy,
) -> Result<Tensor> {
    let device = target.device;
    let past = cache.len() as i64;
    let rows = tokens.len() as i64;
    let input_ids = Tensor::from_slice(tokens).view([rows, 1]).to_device(device);
    let pads: Vec<i64> = pads.iter().map(|&p| p as i64).collect();
    let pads = Tensor::from_slice(&pads).view([rows, 1]).to_device(device);
    let positions = -&pads + past;
    let columns = Tensor::arange(past + 1, (Kind::Int64, device)).view([1, past + 1]);
    let mask = columns.ge_tensor(&pads).view([rows, 1, 1, past + 1]);
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &positions,
        mask: Some(&mask),
        taps: &[],
        cpu,
    };
    let hidden = target.model.model.forward(&input, Some(cache))?.hidden;
    Ok(target.model.lm_head.forward(&hidden.view([rows, -1]), cpu))
}

/// Checks that a request fits `target`: a prompt with tokens, and room in the context for
/// `max_new_tokens` after it.
pub fn check_request(target: &Target, prompt_len: usize, max_new_tokens: usize) -> Result<()> {
    if prompt_len == 0 {
        return Err(ModelError::Invalid {
            field: "prompt",
            message: "the prompt has no tokens".into(),
        });
    }
    let max_context = target.model.config().max_position_embeddings;
    if prompt_len + max_new_tokens > max_context {
        return Err(ModelError::Invalid {
            field: "max_new_tokens",
            message: format!(
                "prompt ({prompt_len} tokens) + {max_new_tokens} new tokens exceed the model's context of {max_context}"
            ),
        });
    }
    Ok(())
}

/// Runs `new_ids` after the cached prefix and returns the logits (`[vocab]`) at the last one.
fn next_logits(
    target: &Target,
    new_ids: &[u32],
    cache: &mut KvCache,
    cpu: &CpuPolicy,
) -> Result<Tensor> {
    let input = TreeInput::causal(cache.len(), new_ids, target.device);
    let hidden = target
        .model
        .model
        .forward(&ForwardInput::new(&input, &[], cpu), Some(cache))?
        .hidden;
    let last = hidden.get(0).get(new_ids.len() as i64 - 1);
    Ok(target.model.lm_head.forward(&last, cpu))
}
