//! Plain autoregressive generation: one target forward per token, KV cache reused throughout.

use std::time::Instant;

use crate::mask::positions;
use crate::{ForwardInput, KvCache, Target};
use tch::Tensor;

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
    let mut cache = KvCache::new(
        target.model.config(),
        1,
        prompt_ids.len() + max_new_tokens,
        target.kind,
        target.device,
    )?;
    let mut stream = target.tokenizer.stream(true);
    let (mut tokens, mut text) = (Vec::new(), String::new());
    let mut prefill_seconds = 0.0;
    let mut input: Vec<u32> = prompt_ids.to_vec();
    let mut stop_reason = StopReason::Length;
    while tokens.len() < max_new_tokens {
        let logits = next_logits(target, &input, &mut cache)?;
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
fn next_logits(target: &Target, new_ids: &[u32], cache: &mut KvCache) -> Result<Tensor> {
    let ids: Vec<i64> = new_ids.iter().map(|&t| t as i64).collect();
    let input_ids = Tensor::from_slice(&ids)
        .unsqueeze(0)
        .to_device(target.device);
    let positions = positions(cache.len(), ids.len(), target.device);
    let input = ForwardInput {
        input_ids: &input_ids,
        positions: &positions,
        mask: None,
        taps: &[],
    };
    let hidden = target.model.model.forward(&input, Some(cache))?.hidden;
    let last = hidden.get(0).get(ids.len() as i64 - 1);
    Ok(target.model.lm_head.forward(&last))
}
