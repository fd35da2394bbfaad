//! Self-distillation: replace each assistant turn with the target's own reply, so draft heads
//! learn what the target actually says (as Medusa-2 and EAGLE-3 train).
//!
//! Replies are generated turn by turn: assistant turn `i` is regenerated from the conversation up
//! to it, earlier replies already replaced. A reply stops at the target's end of turn, at
//! `max_new_tokens`, or where the conversation would pass `max_len` tokens (later turns are then
//! dropped: training truncates there anyway). Sampling is seeded per conversation (from the seed
//! and the conversation's id and content), so a resumed run regenerates exactly what an
//! uninterrupted one would.
//!
//! Progress is a journal, one JSONL-chat line per finished conversation, appended and flushed as
//! it goes; a killed run resumes after the last whole line (a torn last line is cut off). The
//! journal is itself a JSONL chat corpus.

use std::io::Write;
use std::path::Path;

use headway_model::{generate, Message, Sampler, SamplingParams, Target};
use serde::{Deserialize, Serialize};

use crate::conversation::{Conversation, Role, Turn};
use crate::error::{DatasetError, Result};
use crate::features::manifest::RegenerateSettings;
use crate::split::{fnv1a64, mix64};

#[derive(Serialize, Deserialize)]
struct JournalLine {
    id: String,
    messages: Vec<JournalMessage>,
}

#[derive(Serialize, Deserialize)]
struct JournalMessage {
    role: String,
    content: String,
}

/// Regenerates the assistant turns of `conversations` with `target`, resuming from `journal`.
/// `on_done(conversation_index, new_tokens)` is called after each conversation (also for those
/// read back from the journal, with 0 new tokens). Returns the regenerated conversations, in
/// order, with their ids and split groups kept.
pub fn regenerate(
    target: &Target,
    conversations: &[Conversation],
    max_len: usize,
    settings: &RegenerateSettings,
    journal: &Path,
    on_done: &mut dyn FnMut(usize, usize),
) -> Result<Vec<Conversation>> {
    let mut done = read_journal(journal, conversations)?;
    for i in 0..done.len() {
        on_done(i, 0);
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(journal)
        .map_err(|e| DatasetError::io(journal, e))?;
    for (index, conversation) in conversations.iter().enumerate().skip(done.len()) {
        let (regenerated, new_tokens) = regenerate_one(target, conversation, max_len, settings)?;
        let mut line = serde_json::to_string(&to_line(&regenerated)).expect("journal serialises");
        line.push('\n');
        file.write_all(line.as_bytes())
            .and_then(|()| file.flush())
            .map_err(|e| DatasetError::io(journal, e))?;
        done.push(regenerated);
        on_done(index, new_tokens);
    }
    file.sync_all().map_err(|e| DatasetError::io(journal, e))?;
    Ok(done)
}

/// The conversations already in `journal` (cutting off a torn last line); each must be the
/// regeneration of the conversation at the same index.
fn read_journal(journal: &Path, conversations: &[Conversation]) -> Result<Vec<Conversation>> {
    let text = match std::fs::read_to_string(journal) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DatasetError::io(journal, e)),
    };
    let whole = text.rfind('\n').map_or(0, |i| i + 1);
    if whole < text.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(journal)
            .map_err(|e| DatasetError::io(journal, e))?;
        file.set_len(whole as u64)
            .map_err(|e| DatasetError::io(journal, e))?;
    }
    text[..whole]
        .lines()
        .enumerate()
        .map(|(i, line)| {
            let parsed: JournalLine =
                serde_json::from_str(line).map_err(|source| DatasetError::Line {
                    path: journal.to_path_buf(),
                    line: i + 1,
                    source,
                })?;
            let original = conversations
                .get(i)
                .filter(|c| c.id == parsed.id)
                .ok_or_else(|| {
                    DatasetError::format(
                        journal,
                        format!(
                        "line {} regenerates conversation {:?}, but conversation {i} of this run \
                         is {:?}: the journal belongs to another corpus or selection",
                        i + 1,
                        parsed.id,
                        conversations.get(i).map(|c| c.id.as_str()).unwrap_or("(none)")
                    ),
                    )
                })?;
            from_line(parsed, original, journal, i + 1)
        })
        .collect()
}

fn to_line(conversation: &Conversation) -> JournalLine {
    JournalLine {
        id: conversation.id.clone(),
        messages: conversation
            .turns
            .iter()
            .map(|t| JournalMessage {
                role: t.role.as_str().to_string(),
                content: t.content.clone(),
            })
            .collect(),
    }
}

fn from_line(
    line: JournalLine,
    original: &Conversation,
    journal: &Path,
    number: usize,
) -> Result<Conversation> {
    let turns = line
        .messages
        .into_iter()
        .map(|m| {
            Role::from_corpus_name(&m.role)
                .map(|role| Turn::new(role, m.content))
                .ok_or_else(|| {
                    DatasetError::format(
                        journal,
                        format!("line {number}: unknown role {:?}", m.role),
                    )
                })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Conversation {
        id: line.id,
        turns,
        split_group: original.split_group.clone(),
    })
}

/// One conversation with its assistant turns replaced; returns it and the tokens generated.
fn regenerate_one(
    target: &Target,
    conversation: &Conversation,
    max_len: usize,
    settings: &RegenerateSettings,
) -> Result<(Conversation, usize)> {
    let seed =
        mix64(settings.seed ^ fnv1a64(conversation.id.as_bytes()) ^ conversation.content_hash());
    let mut sampler = Sampler::new(SamplingParams {
        temperature: settings.temperature,
        top_k: settings.top_k,
        top_p: settings.top_p,
        seed,
    });
    let context = target.model.config().max_position_embeddings.min(max_len);
    let mut turns: Vec<Turn> = Vec::new();
    let mut new_tokens = 0;
    for turn in &conversation.turns {
        if turn.role != Role::Assistant {
            turns.push(turn.clone());
            continue;
        }
        let messages: Vec<Message> = turns
            .iter()
            .map(|t| Message::new(t.role.as_str(), t.content.as_str()))
            .collect();
        let prompt_ids = target.chat_prompt_ids(&messages)?;
        let budget = settings
            .max_new_tokens
            .min(context.saturating_sub(prompt_ids.len()));
        if budget == 0 {
            break;
        }
        let reply = generate(target, &prompt_ids, budget, &mut sampler, &mut |_| {})?;
        new_tokens += reply.tokens.len();
        if reply.text.trim().is_empty() {
            break;
        }
        turns.push(Turn::new(Role::Assistant, reply.text));
    }
    Ok((
        Conversation {
            id: conversation.id.clone(),
            turns,
            split_group: conversation.split_group.clone(),
        },
        new_tokens,
    ))
}
