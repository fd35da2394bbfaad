//! The one in-memory shape every corpus is read into, role cleaning, and deduplication.

use std::collections::HashSet;

use headway_model::hash::{fnv1a64, mix64};

/// Who speaks a turn. Corpora use many names for these; [`Role::from_corpus_name`] maps them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    /// The role a corpus name stands for (ASCII case and surrounding spaces ignored):
    /// `system`; `human`, `user`; `gpt`, `chatgpt`, `bard`, `bing`, `assistant`. `None` for
    /// anything else — readers skip such records and count them rather than guess.
    pub fn from_corpus_name(name: &str) -> Option<Self> {
        let name = name.trim().to_ascii_lowercase();
        match name.as_str() {
            "system" => Some(Self::System),
            "human" | "user" => Some(Self::User),
            "gpt" | "chatgpt" | "bard" | "bing" | "assistant" => Some(Self::Assistant),
            _ => None,
        }
    }

    /// The role name chat templates expect (`system`, `user`, `assistant`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
        }
    }

    fn tag(self) -> u8 {
        match self {
            Self::System => 0,
            Self::User => 1,
            Self::Assistant => 2,
        }
    }
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    pub role: Role,
    pub content: String,
}

impl Turn {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }
}

/// A conversation (or a plain-text document, see [`crate::corpus`]) as read from a corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conversation {
    /// The corpus's own id, or empty when the corpus has none; the train / held-out split hashes
    /// the id, or the content when the id is empty ([`crate::split`]).
    pub id: String,
    /// Never empty, and no turn is empty or whitespace-only (readers drop those).
    pub turns: Vec<Turn>,
    /// Conversations sharing a group always land on the same side of the train / held-out split:
    /// ShareGPT cuts one long chat into records `X_0`, `X_1`, …, and splitting those apart would
    /// leak held-out text into training. `None`: the id (or content) alone decides.
    pub split_group: Option<String>,
}

impl Conversation {
    /// Whether any turn is the assistant's (training needs one: the loss mask covers only those).
    pub fn has_assistant_turn(&self) -> bool {
        self.turns.iter().any(|t| t.role == Role::Assistant)
    }

    /// A stable 64-bit hash of the turns (roles and contents, not the id): FNV-1a 64 over, per
    /// turn, a role byte, the content's length as 8 little-endian bytes and its UTF-8 bytes (the
    /// length prefix keeps `["ab","c"]` apart from `["a","bc"]`), finished with [`mix64`].
    pub fn content_hash(&self) -> u64 {
        let mut bytes = Vec::new();
        for turn in &self.turns {
            bytes.push(turn.role.tag());
            bytes.extend_from_slice(&(turn.content.len() as u64).to_le_bytes());
            bytes.extend_from_slice(turn.content.as_bytes());
        }
        mix64(fnv1a64(&bytes))
    }
}

/// Builds a conversation from `(role, content)` pairs: whitespace-only turns are dropped (counted
/// in `empty_turns`); the caller decides what an empty result means.
pub(crate) fn clean_turns(
    turns: impl IntoIterator<Item = (Role, String)>,
    empty_turns: &mut usize,
) -> Vec<Turn> {
    turns
        .into_iter()
        .filter_map(|(role, content)| {
            if content.trim().is_empty() {
                *empty_turns += 1;
                None
            } else {
                Some(Turn { role, content })
            }
        })
        .collect()
}

/// Drops every conversation whose turns equal an earlier one's (ids are ignored: the same chat
/// under two ids is still a duplicate), keeping the first. Returns the kept conversations, in
/// order, and how many were dropped. Equality is by [`Conversation::content_hash`]; with 64 bits,
/// the chance that a million distinct conversations lose one to a collision is about 3e-8.
pub fn dedupe(conversations: Vec<Conversation>) -> (Vec<Conversation>, usize) {
    let mut seen = HashSet::with_capacity(conversations.len());
    let before = conversations.len();
    let kept: Vec<Conversation> = conversations
        .into_iter()
        .filter(|c| seen.insert(c.content_hash()))
        .collect();
    let dropped = before - kept.len();
    (kept, dropped)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A conversation `id` of `turns` (also for the other modules' tests).
    pub(crate) fn conv(id: &str, turns: &[(Role, &str)]) -> Conversation {
        Conversation {
            id: id.to_string(),
            turns: turns.iter().map(|&(r, c)| Turn::new(r, c)).collect(),
            split_group: None,
        }
    }

    #[test]
    fn corpus_role_names_map_to_three_roles_and_unknown_names_to_none() {
        assert_eq!(Role::from_corpus_name("human"), Some(Role::User));
        assert_eq!(Role::from_corpus_name(" User "), Some(Role::User));
        assert_eq!(Role::from_corpus_name("gpt"), Some(Role::Assistant));
        assert_eq!(Role::from_corpus_name("ChatGPT"), Some(Role::Assistant));
        assert_eq!(Role::from_corpus_name("bard"), Some(Role::Assistant));
        assert_eq!(Role::from_corpus_name("bing"), Some(Role::Assistant));
        assert_eq!(Role::from_corpus_name("system"), Some(Role::System));
        assert_eq!(Role::from_corpus_name("tool"), None);
        assert_eq!(Role::from_corpus_name(""), None);
    }

    #[test]
    fn dedupe_keeps_the_first_of_identical_conversations_whatever_their_ids() {
        let a = conv("1", &[(Role::User, "hi"), (Role::Assistant, "hello")]);
        let b = conv("2", &[(Role::User, "hi"), (Role::Assistant, "hello")]);
        let c = conv("3", &[(Role::User, "hi"), (Role::Assistant, "hello!")]);
        let d = conv("4", &[(Role::Assistant, "hi"), (Role::Assistant, "hello")]);
        let (kept, dropped) = dedupe(vec![a.clone(), b, c.clone(), d.clone(), a.clone()]);
        assert_eq!(dropped, 2);
        assert_eq!(kept, vec![a, c, d]);
    }

    #[test]
    fn content_hash_separates_turn_boundaries() {
        let x = conv("", &[(Role::User, "ab"), (Role::User, "c")]);
        let y = conv("", &[(Role::User, "a"), (Role::User, "bc")]);
        assert_ne!(x.content_hash(), y.content_hash());
    }
}
