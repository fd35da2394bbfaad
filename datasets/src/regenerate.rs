//! Self-distillation: replace each assistant turn with the target's own reply, so draft heads
//! learn what the target actually says (as Medusa-2 and EAGLE-3 train).
//!
//! Replies are generated turn by turn: assistant turn `i` is regenerated from the conversation up
//! to it, earlier replies already replaced. A reply stops at the target's end of turn, at
//! `max_new_tokens`, or where the conversation would pass `max_len` tokens (later turns are then
//! dropped: training truncates there anyway); `max_turns` keeps only the first replies.
//! Conversations are generated shortest opening first, in chunks of `batch` (the `r`-th replies
//! of a chunk in one batched generation: similar prompt lengths, little padding). Sampling is
//! seeded per conversation (from the seed and the conversation's id and content), so a resumed
//! run regenerates exactly what an uninterrupted one would.
//!
//! Progress is a journal, one line per finished conversation in generation order, appended and
//! flushed a chunk at a time; a killed run resumes after the last whole chunk (a torn chunk is
//! cut off). A line records only the conversation's id and its replies (`{"id": …, "replies":
//! […]}`): the rest is the corpus's, so [`replay_journal`] rebuilds the regenerated
//! conversations from the corpus and a journal made elsewhere (a GPU, an earlier session), at a
//! fifth of the bytes a line of whole conversations took.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use headway_model::{generate_batch, Message, Sampler, SamplingParams, Target};
use serde::{Deserialize, Serialize};

use crate::conversation::{Conversation, Role, Turn};
use crate::error::{DatasetError, Result};
use crate::features::manifest::RegenerateSettings;
use headway_model::hash::{fnv1a64, mix64};

/// One regenerated conversation: its corpus id and the target's replies, in order.
#[derive(Serialize, Deserialize)]
struct JournalLine {
    id: String,
    replies: Vec<String>,
}

impl JournalLine {
    /// Line `number` of `journal`.
    fn parse(text: &str, journal: &Path, number: usize) -> Result<Self> {
        serde_json::from_str(text).map_err(|source| DatasetError::Line {
            path: journal.to_path_buf(),
            line: number,
            source,
        })
    }
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
    let batch = settings.batch;
    let order = generation_order(conversations);
    let queue: Vec<&Conversation> = order.iter().map(|&i| &conversations[i]).collect();
    let mut done = read_journal(journal, &queue, batch)?;
    for &index in &order[..done.len()] {
        on_done(index, 0);
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(journal)
        .map_err(|e| DatasetError::io(journal, e))?;
    for chunk_start in (done.len()..queue.len()).step_by(batch) {
        let chunk = &queue[chunk_start..(chunk_start + batch).min(queue.len())];
        let regenerated = regenerate_chunk(target, chunk, max_len, settings)?;
        // One write per chunk: a kill leaves whole chunks and at most one torn one, which the
        // next run cuts off and regenerates in the same company.
        let mut lines = String::new();
        for (conversation, _) in &regenerated {
            lines.push_str(&serde_json::to_string(&to_line(conversation)).expect("serialises"));
            lines.push('\n');
        }
        file.write_all(lines.as_bytes())
            .and_then(|()| file.flush())
            .map_err(|e| DatasetError::io(journal, e))?;
        for (offset, (conversation, new_tokens)) in regenerated.into_iter().enumerate() {
            done.push(conversation);
            on_done(order[chunk_start + offset], new_tokens);
        }
    }
    file.sync_all().map_err(|e| DatasetError::io(journal, e))?;
    let mut in_corpus_order: Vec<Option<Conversation>> = vec![None; conversations.len()];
    for (conversation, &index) in done.into_iter().zip(&order) {
        in_corpus_order[index] = Some(conversation);
    }
    Ok(in_corpus_order.into_iter().flatten().collect())
}

/// Drops conversations whose regeneration would repeat an earlier one's: what the target is
/// asked (the turns other than replies, from the first user turn, up to the `max_turns`-th reply)
/// decides the regenerated conversation, so corpus duplicates under different replies (split
/// chats' "continue" parts, say) would otherwise come out identical, in both splits. Returns the
/// kept conversations, in order, and the number dropped.
pub fn dedupe_for_regeneration(
    conversations: Vec<Conversation>,
    max_turns: Option<usize>,
) -> (Vec<Conversation>, usize) {
    let asked = |c: &Conversation| -> u64 {
        let first_user = c.turns.iter().position(|t| t.role == Role::User);
        let mut hash = fnv1a64(b"regeneration");
        let mut replies = 0;
        for turn in &c.turns[first_user.unwrap_or(c.turns.len())..] {
            if turn.role == Role::Assistant {
                replies += 1;
                if max_turns.is_some_and(|max| replies >= max) {
                    break;
                }
                continue;
            }
            hash = mix64(hash ^ fnv1a64(turn.role.as_str().as_bytes()));
            hash = mix64(hash ^ fnv1a64(turn.content.as_bytes()));
        }
        hash
    };
    let mut seen = std::collections::HashSet::with_capacity(conversations.len());
    let before = conversations.len();
    let kept: Vec<Conversation> = conversations
        .into_iter()
        .filter(|c| seen.insert(asked(c)))
        .collect();
    let dropped = before - kept.len();
    (kept, dropped)
}

/// Indices of `conversations`, shortest opening (the text before the first reply) first: chunks
/// of similar prompt lengths waste little attention on padding. Ties keep corpus order.
fn generation_order(conversations: &[Conversation]) -> Vec<usize> {
    let opening_chars = |c: &Conversation| -> usize {
        let asked = c.turns.iter().position(|t| t.role == Role::User);
        let prompt = asked.map_or(&c.turns[..0], |u| &c.turns[..=u]);
        prompt
            .iter()
            .filter(|t| t.role != Role::Assistant)
            .map(|t| t.content.len())
            .sum()
    };
    let mut order: Vec<usize> = (0..conversations.len()).collect();
    order.sort_by_key(|&i| opening_chars(&conversations[i]));
    order
}

/// The conversations already in `journal`, cut back to whole chunks of `batch` (a torn chunk is
/// removed from the file); line `i` must regenerate `conversations[i]` (generation order).
fn read_journal(
    journal: &Path,
    conversations: &[&Conversation],
    batch: usize,
) -> Result<Vec<Conversation>> {
    let text = match std::fs::read_to_string(journal) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(DatasetError::io(journal, e)),
    };
    let line_ends: Vec<usize> = text.match_indices('\n').map(|(i, _)| i + 1).collect();
    let whole_lines = line_ends.len() / batch * batch;
    let keep = whole_lines.checked_sub(1).map_or(0, |last| line_ends[last]);
    if keep < text.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(journal)
            .map_err(|e| DatasetError::io(journal, e))?;
        file.set_len(keep as u64)
            .map_err(|e| DatasetError::io(journal, e))?;
    }
    text[..keep]
        .lines()
        .enumerate()
        .map(|(i, line)| {
            let parsed = JournalLine::parse(line, journal, i + 1)?;
            let original = conversations
                .get(i)
                .copied()
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
        replies: conversation
            .turns
            .iter()
            .filter(|t| t.role == Role::Assistant)
            .map(|t| t.content.clone())
            .collect(),
    }
}

fn from_line(
    line: JournalLine,
    original: &Conversation,
    journal: &Path,
    number: usize,
) -> Result<Conversation> {
    replay(original, line.replies).ok_or_else(|| {
        DatasetError::format(
            journal,
            format!(
                "line {number} records more replies than conversation {:?} asks for: the \
                 journal belongs to another corpus",
                original.id
            ),
        )
    })
}

/// `original` as regeneration leaves it when the target replied `replies`; `None` when it asks
/// for fewer replies.
fn replay(original: &Conversation, replies: Vec<String>) -> Option<Conversation> {
    let mut state = InProgress::new(original, Sampler::new(SamplingParams::default()));
    for reply in replies {
        state.next_prompt(None)?;
        state.answer(reply);
    }
    Some(state.into_conversation())
}

/// The conversations a regeneration journal (`OUT/regenerated.jsonl` of a `prepare
/// --regenerate` run, finished or not) recorded, rebuilt from `conversations` (the same corpus)
/// and its replies, in corpus order. A line whose conversation `conversations` lacks, or an id
/// recorded twice, is an error: the journal belongs to another corpus.
pub fn replay_journal(
    conversations: Vec<Conversation>,
    journal: &Path,
) -> Result<Vec<Conversation>> {
    let text = std::fs::read_to_string(journal).map_err(|e| DatasetError::io(journal, e))?;
    let mut recorded: HashMap<String, (usize, Vec<String>)> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = JournalLine::parse(line, journal, i + 1)?;
        if let Some((first, _)) = recorded.insert(line.id.clone(), (i + 1, line.replies)) {
            return Err(DatasetError::format(
                journal,
                format!(
                    "lines {first} and {} both record conversation {:?}",
                    i + 1,
                    line.id
                ),
            ));
        }
    }
    let mut replayed = Vec::with_capacity(recorded.len());
    for conversation in &conversations {
        if let Some((number, replies)) = recorded.remove(&conversation.id) {
            let line = JournalLine {
                id: conversation.id.clone(),
                replies,
            };
            replayed.push(from_line(line, conversation, journal, number)?);
        }
    }
    if let Some((id, (number, _))) = recorded.iter().min_by_key(|(_, (number, _))| *number) {
        return Err(DatasetError::format(
            journal,
            format!(
                "line {number} records conversation {id:?}, which the corpus does not hold (after \
                 deduplication): the journal belongs to another corpus"
            ),
        ));
    }
    Ok(replayed)
}

/// A conversation being regenerated: the turns so far, where it is in the original, and its own
/// seeded sampler.
struct InProgress<'a> {
    original: &'a Conversation,
    turns: Vec<Turn>,
    next_turn: usize,
    replies: usize,
    new_tokens: usize,
    finished: bool,
    sampler: Sampler,
}

impl<'a> InProgress<'a> {
    fn new(original: &'a Conversation, sampler: Sampler) -> Self {
        Self {
            original,
            turns: Vec::new(),
            next_turn: 0,
            replies: 0,
            new_tokens: 0,
            finished: false,
            sampler,
        }
    }

    /// Takes `reply` as the answer to the prompt [`Self::next_prompt`] returned.
    fn answer(&mut self, reply: String) {
        self.turns.push(Turn::new(Role::Assistant, reply));
        self.next_turn += 1;
        self.replies += 1;
    }

    /// The conversation so far, ending at its last reply: turns after it would only add tokens
    /// that nothing trains on (and a journal line, which records replies, could not restore them).
    fn into_conversation(self) -> Conversation {
        let mut turns = self.turns;
        let end = turns
            .iter()
            .rposition(|t| t.role == Role::Assistant)
            .map_or(0, |last| last + 1);
        turns.truncate(end);
        Conversation {
            id: self.original.id.clone(),
            turns,
            split_group: self.original.split_group.clone(),
        }
    }

    /// Copies the turns before the next assistant turn; returns the prompt for that turn, or
    /// `None` (and finishes) when there is none left to regenerate.
    fn next_prompt(&mut self, max_turns: Option<usize>) -> Option<Vec<Message>> {
        let room = max_turns.is_none_or(|max| self.replies < max);
        while let Some(turn) = self.original.turns.get(self.next_turn).filter(|_| room) {
            let asked = self.turns.iter().any(|t| t.role == Role::User);
            if turn.role == Role::Assistant && !asked {
                // A reply to nothing (corpora split long chats, so parts can open with the
                // assistant): the target would answer an empty chat, the same text every time.
                self.next_turn += 1;
                continue;
            }
            if turn.role == Role::Assistant {
                let messages = self
                    .turns
                    .iter()
                    .map(|t| Message::new(t.role.as_str(), t.content.as_str()))
                    .collect();
                return Some(messages);
            }
            self.turns.push(turn.clone());
            self.next_turn += 1;
        }
        self.finished = true;
        None
    }
}

/// Regenerates `chunk` together: round `r` generates the `r`-th assistant reply of every
/// conversation that has one, in one batch. Returns each conversation with its replies replaced
/// and the tokens generated for it.
fn regenerate_chunk(
    target: &Target,
    chunk: &[&Conversation],
    max_len: usize,
    settings: &RegenerateSettings,
) -> Result<Vec<(Conversation, usize)>> {
    let context = target.model.config().max_position_embeddings.min(max_len);
    let mut states: Vec<InProgress> = chunk
        .iter()
        .map(|&original| InProgress::new(original, Sampler::new(sampling(settings, original))))
        .collect();
    loop {
        let mut asking = Vec::new();
        let (mut prompts, mut budgets) = (Vec::new(), Vec::new());
        for (index, state) in states.iter_mut().enumerate().filter(|(_, s)| !s.finished) {
            let Some(messages) = state.next_prompt(settings.max_turns) else {
                continue;
            };
            let prompt_ids = target.chat_prompt_ids(&messages)?;
            let budget = settings
                .max_new_tokens
                .min(context.saturating_sub(prompt_ids.len()));
            if budget == 0 {
                state.finished = true;
                continue;
            }
            asking.push(index);
            prompts.push(prompt_ids);
            budgets.push(budget);
        }
        if asking.is_empty() {
            break;
        }
        let mut samplers: Vec<Sampler> = asking
            .iter()
            .map(|&i| std::mem::replace(&mut states[i].sampler, Sampler::new(Default::default())))
            .collect();
        let replies = generate_batch(target, &prompts, &budgets, &mut samplers)?;
        for ((&index, reply), sampler) in asking.iter().zip(replies).zip(samplers) {
            let state = &mut states[index];
            state.sampler = sampler;
            state.new_tokens += reply.tokens.len();
            if reply.text.trim().is_empty() {
                state.finished = true;
                continue;
            }
            state.answer(reply.text);
        }
    }
    Ok(states
        .into_iter()
        .map(|state| {
            let new_tokens = state.new_tokens;
            (state.into_conversation(), new_tokens)
        })
        .collect())
}

/// Sampling for `conversation`, seeded from the run's seed and the conversation itself.
fn sampling(settings: &RegenerateSettings, conversation: &Conversation) -> SamplingParams {
    let run = settings.sampling;
    run.with_seed(mix64(
        run.seed() ^ fnv1a64(conversation.id.as_bytes()) ^ conversation.content_hash(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::tests::conv;

    /// Replaying recorded replies rebuilds what regeneration left: the corpus's turns with its
    /// replies replaced, a leading reply to nothing skipped, nothing after the last reply.
    #[test]
    fn replay_puts_recorded_replies_where_the_corpus_had_its_own() {
        use Role::{Assistant as A, System as S, User as U};
        let replies = |r: &[&str]| r.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let chat = conv(
            "c",
            &[
                (A, "a reply to nothing"),
                (S, "be brief"),
                (U, "hi"),
                (A, "hello"),
                (U, "and?"),
            ],
        );
        let replayed = replay(&chat, replies(&["hey"])).unwrap();
        assert_eq!(
            replayed,
            conv("c", &[(S, "be brief"), (U, "hi"), (A, "hey")])
        );
        let two = conv("d", &[(U, "hi"), (A, "hello"), (U, "more"), (A, "fine")]);
        let replayed = replay(&two, replies(&["x", "y"])).unwrap();
        assert_eq!(
            replayed,
            conv("d", &[(U, "hi"), (A, "x"), (U, "more"), (A, "y")])
        );
        assert_eq!(replay(&two, replies(&[])).unwrap(), conv("d", &[]));
        assert!(replay(&two, replies(&["x", "y", "z"])).is_none());
    }

    #[test]
    fn regeneration_dedupes_by_what_the_target_is_asked() {
        use Role::{Assistant as A, User as U};
        let a = conv(
            "a",
            &[(A, "part 2 of a chat"), (U, "continue"), (A, "more text")],
        );
        let b = conv("b", &[(A, "part 3"), (U, "continue"), (A, "other text")]);
        let c = conv(
            "c",
            &[(U, "hi"), (A, "hello"), (U, "how are you?"), (A, "fine")],
        );
        let d = conv(
            "d",
            &[(U, "hi"), (A, "hey"), (U, "what time is it?"), (A, "noon")],
        );
        let all = vec![a.clone(), b, c.clone(), d.clone()];
        let (kept, dropped) = dedupe_for_regeneration(all.clone(), None);
        assert_eq!((kept, dropped), (vec![a.clone(), c.clone(), d], 1));
        let (kept, dropped) = dedupe_for_regeneration(all, Some(1));
        assert_eq!((kept, dropped), (vec![a, c], 2));
    }
}
