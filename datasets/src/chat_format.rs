//! Conversations → token ids plus a loss mask over the assistant's tokens.
//!
//! The whole conversation is rendered once with the target's chat template and tokenized once;
//! the ids are exactly what the target sees for that text, with no seams where separately
//! tokenized pieces meet. The mask is then computed on that single tokenization from the byte
//! ranges of the assistant turns in the rendered text.
//!
//! Locating assistant turn `i` (template-agnostic, no parsing of the template's output):
//! 1. render `messages[..=i]`, and again with turn `i`'s content replaced by one character that
//!    differs from the content's first character; the longest common prefix of the two renders
//!    ends exactly where the template puts the content (role headers, BOS, default system prompts
//!    and everything else before it are outside the span);
//! 2. the span runs from there to the end of the last end-of-turn token (`<|im_end|>` for ChatML)
//!    in the rest of that render, so the end-of-turn token is in the span and the template's
//!    separator after it (ChatML's `\n`) is not;
//! 3. the full render must start with the render of `messages[..=i]` (templates that rewrite
//!    earlier turns once later ones follow are rejected, not guessed at).
//!
//! A token is masked when its byte range overlaps a span. A token that also covers bytes outside
//! one (e.g. ChatML's header `\n` merged with a reply that starts with `\n`) is still masked and
//! counted in [`ChatSequence::boundary_tokens`]. Each span must end in a token that *is* the
//! end-of-turn token, which checks that the tokenizer knows it as a special token.

use std::ops::Range;

use headway_model::{ChatTemplate, Message, TextTokenizer};

use crate::conversation::{Conversation, Role};
use crate::error::{DatasetError, Result};

/// The end-of-turn token of the tokenizer's chat format: `<|im_end|>` (ChatML: SmolLM2, Qwen) or
/// `<|eot_id|>` (Llama 3), whichever is in the vocabulary, checked in that order (the same pair
/// the target stops at). `None` when neither is.
pub fn end_of_turn_token(tokenizer: &TextTokenizer) -> Option<&'static str> {
    ["<|im_end|>", "<|eot_id|>"]
        .into_iter()
        .find(|t| tokenizer.token_id(t).is_some())
}

/// A conversation ready for the target: ids and the mask of positions the heads learn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatSequence {
    pub input_ids: Vec<u32>,
    /// Same length as `input_ids`: 1 on assistant tokens (end-of-turn token included), 0 on
    /// system and user turns and on template scaffolding.
    pub loss_mask: Vec<u8>,
    /// Token count before truncation to `max_len` (equal to `input_ids.len()` when not truncated).
    pub full_len: usize,
    /// Masked tokens that reach outside an assistant span (see the module docs); 0 normally.
    pub boundary_tokens: usize,
}

impl ChatSequence {
    pub fn truncated(&self) -> bool {
        self.full_len > self.input_ids.len()
    }
}

/// Renders and tokenizes conversations for one target.
pub struct ChatFormatter<'a> {
    template: &'a ChatTemplate,
    tokenizer: &'a TextTokenizer,
    end_of_turn: String,
    end_of_turn_id: u32,
}

impl<'a> ChatFormatter<'a> {
    /// `end_of_turn` is the token that closes an assistant turn in `template` (see
    /// [`end_of_turn_token`]); an error when `tokenizer` has no such token.
    pub fn new(
        template: &'a ChatTemplate,
        tokenizer: &'a TextTokenizer,
        end_of_turn: &str,
    ) -> Result<Self> {
        let end_of_turn_id = tokenizer.token_id(end_of_turn).ok_or_else(|| {
            DatasetError::Argument(format!(
                "end-of-turn token {end_of_turn:?} is not in the tokenizer's vocabulary"
            ))
        })?;
        Ok(Self {
            template,
            tokenizer,
            end_of_turn: end_of_turn.to_string(),
            end_of_turn_id,
        })
    }

    /// The rendered conversation and the byte range of every assistant turn in it, end-of-turn
    /// token included (module docs).
    pub fn render_with_spans(
        &self,
        conversation: &Conversation,
    ) -> Result<(String, Vec<Range<usize>>)> {
        let fail = |message: String| DatasetError::Conversation {
            id: conversation.id.clone(),
            message,
        };
        let messages: Vec<Message> = conversation
            .turns
            .iter()
            .map(|t| Message::new(t.role.as_str(), t.content.as_str()))
            .collect();
        let text = self.template.render(&messages, false)?;
        let mut spans = Vec::new();
        for (i, turn) in conversation.turns.iter().enumerate() {
            if turn.role != Role::Assistant {
                continue;
            }
            let upto = self.template.render(&messages[..=i], false)?;
            if !text.starts_with(&upto) {
                return Err(fail(format!(
                    "the chat template renders turns 0..={i} differently once later turns \
                     follow, so assistant turn {i} cannot be located"
                )));
            }
            let mut probe = messages[..=i].to_vec();
            probe[i].content = if turn.content.starts_with('x') {
                "y"
            } else {
                "x"
            }
            .to_string();
            let probe = self.template.render(&probe, false)?;
            let start = common_prefix_len(&upto, &probe);
            let reply = &upto[start..];
            let end = reply.rfind(&self.end_of_turn).ok_or_else(|| {
                fail(format!(
                    "assistant turn {i} is not closed by {:?} in the rendered text",
                    self.end_of_turn
                ))
            })?;
            if !reply[..end].contains(turn.content.trim()) {
                return Err(fail(format!(
                    "assistant turn {i}: the located span does not hold the turn's content"
                )));
            }
            spans.push(start..start + end + self.end_of_turn.len());
        }
        Ok((text, spans))
    }

    /// Ids and loss mask of `conversation`, truncated to the first `max_len` tokens (`max_len` ≥
    /// 1). Errors name the conversation; they come from templates that reject it (e.g. role
    /// order), templates this method cannot follow (module docs), or the tokenizer.
    pub fn format(&self, conversation: &Conversation, max_len: usize) -> Result<ChatSequence> {
        if max_len == 0 {
            return Err(DatasetError::Argument("max_len must be at least 1".into()));
        }
        let (text, spans) = self.render_with_spans(conversation)?;
        // Templates write BOS themselves when they want one; no post-processor tokens on top
        // (as transformers' `apply_chat_template(tokenize=True)`).
        let (mut input_ids, offsets) = self.tokenizer.encode_with_offsets(&text, false)?;
        let mut loss_mask = vec![0u8; input_ids.len()];
        let mut boundary_tokens = 0;
        let mut closed = 0;
        for (k, &(start, end)) in offsets.iter().enumerate() {
            let Some(span) = spans.iter().find(|s| start < s.end && end > s.start) else {
                continue;
            };
            loss_mask[k] = 1;
            if start < span.start || end > span.end {
                boundary_tokens += 1;
            }
            if end == span.end && input_ids[k] == self.end_of_turn_id {
                closed += 1;
            }
        }
        if closed != spans.len() {
            return Err(DatasetError::Conversation {
                id: conversation.id.clone(),
                message: format!(
                    "{} of {} assistant turns end in the {:?} token after tokenization",
                    closed,
                    spans.len(),
                    self.end_of_turn
                ),
            });
        }
        let full_len = input_ids.len();
        input_ids.truncate(max_len);
        loss_mask.truncate(max_len);
        Ok(ChatSequence {
            input_ids,
            loss_mask,
            full_len,
            boundary_tokens,
        })
    }
}

/// Length in bytes of the longest common prefix of `a` and `b`, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or_else(|| a.len().min(b.len()), |((i, _), _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::Turn;

    fn chat(turns: &[(Role, &str)]) -> Conversation {
        Conversation {
            id: "test".into(),
            turns: turns.iter().map(|&(r, c)| Turn::new(r, c)).collect(),
            split_group: None,
        }
    }

    /// System, two user questions and two assistant replies (one with a leading space and a
    /// multi-byte character, one with a newline inside).
    fn five_turns() -> Conversation {
        chat(&[
            (Role::System, "You are terse."),
            (Role::User, "What is the capital of France?"),
            (Role::Assistant, "Paris, of course — the city of light."),
            (Role::User, "And of Italy?"),
            (Role::Assistant, "Rome.\nThe eternal city."),
        ])
    }

    /// Decoded text of each maximal run of masked tokens, plus the masked-token count.
    fn masked_runs(tokenizer: &TextTokenizer, seq: &ChatSequence) -> (Vec<String>, usize) {
        let mut runs = Vec::new();
        let mut run = Vec::new();
        for (&id, &m) in seq.input_ids.iter().zip(&seq.loss_mask) {
            if m == 1 {
                run.push(id);
            } else if !run.is_empty() {
                runs.push(tokenizer.decode(&run, false).unwrap());
                run.clear();
            }
        }
        if !run.is_empty() {
            runs.push(tokenizer.decode(&run, false).unwrap());
        }
        let count = seq.loss_mask.iter().filter(|&&m| m == 1).count();
        (runs, count)
    }

    fn assert_masks_exactly_the_replies(template: &ChatTemplate, tokenizer: &TextTokenizer) {
        let formatter = ChatFormatter::new(template, tokenizer, "<|im_end|>").unwrap();
        let conversation = five_turns();
        let seq = formatter.format(&conversation, 4096).unwrap();
        let (text, _) = formatter.render_with_spans(&conversation).unwrap();
        assert_eq!(seq.input_ids, tokenizer.encode(&text, false).unwrap());
        assert_eq!(seq.loss_mask.len(), seq.input_ids.len());
        assert!(!seq.truncated());
        assert_eq!(seq.boundary_tokens, 0);
        let (runs, masked) = masked_runs(tokenizer, &seq);
        assert_eq!(
            runs,
            [
                "Paris, of course — the city of light.<|im_end|>",
                "Rome.\nThe eternal city.<|im_end|>"
            ]
        );
        // Nothing else is masked: the runs account for every masked token.
        let run_tokens: usize = runs
            .iter()
            .map(|r| tokenizer.encode(r, false).unwrap().len())
            .sum();
        assert_eq!(masked, run_tokens);
        // The unmasked tokens are the rest of the rendered text: scaffolding, system and user.
        let unmasked: Vec<u32> = seq
            .input_ids
            .iter()
            .zip(&seq.loss_mask)
            .filter(|(_, &m)| m == 0)
            .map(|(&id, _)| id)
            .collect();
        let rest = tokenizer.decode(&unmasked, false).unwrap();
        assert!(rest.contains("<|im_start|>assistant\n"), "{rest}");
        assert!(
            rest.contains("What is the capital of France?<|im_end|>"),
            "{rest}"
        );
        assert!(!rest.contains("Paris") && !rest.contains("Rome"), "{rest}");
    }

    fn tiny_model() -> (tempfile::TempDir, ChatTemplate, TextTokenizer) {
        let dir = tempfile::tempdir().unwrap();
        headway_model::testing::write_tiny_model(dir.path(), 0).unwrap();
        let template = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        let tokenizer = TextTokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
        (dir, template, tokenizer)
    }

    #[test]
    fn the_mask_covers_exactly_each_assistant_reply_and_its_im_end_on_the_tiny_chatml_model() {
        let (_dir, template, tokenizer) = tiny_model();
        assert_eq!(end_of_turn_token(&tokenizer), Some("<|im_end|>"));
        assert_masks_exactly_the_replies(&template, &tokenizer);
    }

    #[test]
    fn the_mask_covers_exactly_each_assistant_reply_with_the_real_smollm2_template() {
        let dir = headway_model::testing::real_target_dir();
        let template = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        assert_masks_exactly_the_replies(&template, &tokenizer);
        // SmolLM2 adds a default system prompt when there is none, also before a document that
        // is a lone assistant turn: the span must still start at the content.
        let formatter = ChatFormatter::new(&template, &tokenizer, "<|im_end|>").unwrap();
        let document = chat(&[(Role::Assistant, "A plain document.")]);
        let seq = formatter.format(&document, 4096).unwrap();
        let (runs, _) = masked_runs(&tokenizer, &seq);
        assert_eq!(runs, ["A plain document.<|im_end|>"]);
        let text = tokenizer.decode(&seq.input_ids, false).unwrap();
        assert!(
            text.starts_with("<|im_start|>system\nYou are a helpful"),
            "{text}"
        );
        // SmolLM2 merges newlines: the header's `\n` and a reply's leading `\n` become one token,
        // which is masked and counted as reaching outside the span.
        let conversation = chat(&[(Role::User, "q"), (Role::Assistant, "\n\nanswer")]);
        let seq = formatter.format(&conversation, 4096).unwrap();
        let (runs, _) = masked_runs(&tokenizer, &seq);
        assert_eq!(runs, ["\n\n\nanswer<|im_end|>"]);
        assert_eq!(seq.boundary_tokens, 1);
    }

    #[test]
    fn truncation_keeps_the_first_max_len_ids_and_mask_entries() {
        let (_dir, template, tokenizer) = tiny_model();
        let formatter = ChatFormatter::new(&template, &tokenizer, "<|im_end|>").unwrap();
        let full = formatter.format(&five_turns(), 4096).unwrap();
        let cut = formatter.format(&five_turns(), 40).unwrap();
        assert!(cut.truncated());
        assert_eq!(cut.full_len, full.input_ids.len());
        assert_eq!(cut.input_ids, full.input_ids[..40]);
        assert_eq!(cut.loss_mask, full.loss_mask[..40]);
        assert!(formatter.format(&five_turns(), 0).is_err());
    }

    #[test]
    fn a_reply_starting_with_newlines_is_masked_whole() {
        let (_dir, template, tokenizer) = tiny_model();
        let formatter = ChatFormatter::new(&template, &tokenizer, "<|im_end|>").unwrap();
        let conversation = chat(&[(Role::User, "q"), (Role::Assistant, "\n\nanswer")]);
        let seq = formatter.format(&conversation, 4096).unwrap();
        let (runs, _) = masked_runs(&tokenizer, &seq);
        assert_eq!(runs, ["\n\nanswer<|im_end|>"]);
        assert_eq!(seq.boundary_tokens, 0);
    }

    #[test]
    fn a_template_that_rewrites_earlier_turns_is_rejected_naming_the_conversation() {
        let (_dir, _, tokenizer) = tiny_model();
        // Renders only the last message, so earlier renders are not prefixes of the whole.
        let template = ChatTemplate::new(
            "{{ messages[-1]['content'] }}<|im_end|>".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let formatter = ChatFormatter::new(&template, &tokenizer, "<|im_end|>").unwrap();
        let err = formatter.format(&five_turns(), 4096).unwrap_err();
        assert!(
            err.to_string().starts_with("conversation \"test\": "),
            "{err}"
        );
        assert!(ChatFormatter::new(&template, &tokenizer, "<|eot_id|>").is_err());
    }

    #[test]
    fn common_prefix_stops_on_a_character_boundary() {
        assert_eq!(common_prefix_len("abé", "abè"), 2);
        assert_eq!(common_prefix_len("abc", "ab"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}
