//! Corpus formats and their readers.
//!
//! | format | file | becomes |
//! |---|---|---|
//! | [`CorpusFormat::ShareGpt`] | JSON array of `{"id", "conversations": [{"from", "value"}]}` | one conversation per record |
//! | [`CorpusFormat::JsonlChat`] | one `{"messages": [{"role", "content"}], "id"?}` per line | one conversation per line |
//! | [`CorpusFormat::SpecBench`] | one `{"question_id", "category", "turns": [text]}` per line | user-only conversations (prompts) |
//! | [`CorpusFormat::PlainText`] | documents separated by blank lines | one single-turn *assistant* conversation per document |
//!
//! A plain-text document becomes one [`Role::Assistant`] turn because the loss mask covers
//! assistant turns only: text the heads should learn to draft is text the target "says". With a
//! chat template the document is rendered as a reply with no question, which is the same
//! position the target is in when it continues its own text.
//!
//! The format is always chosen explicitly — by the caller, or by [`CorpusFormat::detect`] from
//! the file name and first bytes — and a reader never falls back to another format when parsing
//! fails.
//!
//! Training corpora (ShareGPT, JSONL chat) keep only conversations with an assistant turn;
//! Spec-Bench prompts are user-only by design. Every reader drops whitespace-only turns and counts
//! what it dropped in a [`ReadReport`].

use std::fmt;
use std::io::{BufRead, Read};
use std::path::Path;
use std::str::FromStr;

use serde::Deserialize;

use crate::conversation::{clean_turns, Conversation, Role};
use crate::error::{DatasetError, Result};
use crate::sharegpt::parse_sharegpt;

/// The layout of a corpus file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CorpusFormat {
    ShareGpt,
    JsonlChat,
    SpecBench,
    PlainText,
}

impl CorpusFormat {
    pub const ALL: [Self; 4] = [
        Self::ShareGpt,
        Self::JsonlChat,
        Self::SpecBench,
        Self::PlainText,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::ShareGpt => "sharegpt",
            Self::JsonlChat => "jsonl-chat",
            Self::SpecBench => "spec-bench",
            Self::PlainText => "text",
        }
    }

    /// The format of `path`, from its extension and first bytes:
    /// - `.json` whose first non-space byte is `[` → ShareGPT;
    /// - `.jsonl` whose first non-blank line is an object with `messages` → JSONL chat, with
    ///   `turns` → Spec-Bench (an object with both or neither is an error);
    /// - `.txt`, `.md` → plain text.
    ///
    /// Any other name is an error asking for the format to be named.
    pub fn detect(path: &Path) -> Result<Self> {
        let extension = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
        match extension.as_deref() {
            Some("json") => {
                let mut head = [0u8; 256];
                let mut file = std::fs::File::open(path).map_err(|e| DatasetError::io(path, e))?;
                let n = file
                    .read(&mut head)
                    .map_err(|e| DatasetError::io(path, e))?;
                match head[..n].iter().find(|b| !b.is_ascii_whitespace()) {
                    Some(b'[') => Ok(Self::ShareGpt),
                    _ => Err(DatasetError::format(
                        path,
                        "a .json corpus must be a ShareGPT array starting with '['",
                    )),
                }
            }
            Some("jsonl") => detect_jsonl(path),
            Some("txt" | "md") => Ok(Self::PlainText),
            _ => Err(DatasetError::format(
                path,
                format!(
                    "cannot tell the corpus format from the file name (.json, .jsonl, .txt, .md); \
                     name it: {}",
                    names.join(", ")
                ),
            )),
        }
    }
}

fn detect_jsonl(path: &Path) -> Result<CorpusFormat> {
    let file = std::fs::File::open(path).map_err(|e| DatasetError::io(path, e))?;
    for (index, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| DatasetError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        let object: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&line)
            .map_err(|source| DatasetError::Line {
                path: path.to_path_buf(),
                line: index + 1,
                source,
            })?;
        return match (
            object.contains_key("messages"),
            object.contains_key("turns"),
        ) {
            (true, false) => Ok(CorpusFormat::JsonlChat),
            (false, true) => Ok(CorpusFormat::SpecBench),
            _ => Err(DatasetError::format(
                path,
                format!(
                    "line {}: expected exactly one of \"messages\" (JSONL chat) or \"turns\" \
                     (Spec-Bench)",
                    index + 1
                ),
            )),
        };
    }
    Err(DatasetError::format(path, "empty .jsonl file"))
}

impl FromStr for CorpusFormat {
    type Err = DatasetError;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|f| f.name()).collect();
                DatasetError::Argument(format!(
                    "unknown corpus format {s:?}: use one of {}",
                    names.join(", ")
                ))
            })
    }
}

impl fmt::Display for CorpusFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a file that should have ended with a closing bracket stopped instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Truncation {
    /// Records begun but cut off by the end of the file (0 or 1).
    pub partial_records: usize,
    /// Bytes after the last whole record (and its comma) that were ignored.
    pub bytes_dropped: usize,
}

/// What a reader read, kept and dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadReport {
    /// Whole records (array elements, non-blank lines, documents) parsed.
    pub records_read: usize,
    /// Conversations returned.
    pub kept: usize,
    /// Records skipped because a turn's role is not one [`Role::from_corpus_name`] knows.
    pub skipped_unknown_role: usize,
    /// Records skipped because no assistant turn was left (training corpora only).
    pub skipped_no_assistant: usize,
    /// Records skipped because no turn was left at all (prompt corpora).
    pub skipped_empty: usize,
    /// Whitespace-only turns dropped from records.
    pub empty_turns_dropped: usize,
    /// `Some` when the file was cut short (ShareGPT only).
    pub truncation: Option<Truncation>,
}

impl ReadReport {
    /// Counts `conversation` as kept (pushing it) or skipped.
    pub(crate) fn admit(
        &mut self,
        conversation: Conversation,
        needs_assistant: bool,
        out: &mut Vec<Conversation>,
    ) {
        if conversation.turns.is_empty() && !needs_assistant {
            self.skipped_empty += 1;
        } else if needs_assistant && !conversation.has_assistant_turn() {
            self.skipped_no_assistant += 1;
        } else {
            self.kept += 1;
            out.push(conversation);
        }
    }
}

impl fmt::Display for ReadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} records read, {} kept; skipped: {} unknown role, {} without an assistant turn, \
             {} empty; {} empty turns dropped",
            self.records_read,
            self.kept,
            self.skipped_unknown_role,
            self.skipped_no_assistant,
            self.skipped_empty,
            self.empty_turns_dropped
        )?;
        if let Some(t) = self.truncation {
            write!(
                f,
                "; file cut short: {} partial record(s), {} trailing bytes dropped",
                t.partial_records, t.bytes_dropped
            )?;
        }
        Ok(())
    }
}

/// The conversations of one corpus file and the report of reading it.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub conversations: Vec<Conversation>,
    pub report: ReadReport,
}

/// Reads `path` as `format`.
pub fn read_corpus(path: &Path, format: CorpusFormat) -> Result<Corpus> {
    let text = || std::fs::read_to_string(path).map_err(|e| DatasetError::io(path, e));
    match format {
        CorpusFormat::ShareGpt => {
            let bytes = std::fs::read(path).map_err(|e| DatasetError::io(path, e))?;
            parse_sharegpt(&bytes, path)
        }
        CorpusFormat::JsonlChat => parse_jsonl_chat(&text()?, path),
        CorpusFormat::SpecBench => parse_spec_bench(&text()?, path),
        CorpusFormat::PlainText => Ok(parse_plain_text(&text()?)),
    }
}

/// Non-blank lines of `text` parsed as `T`, with their 1-based line numbers.
fn jsonl_records<'t, T: Deserialize<'t>>(
    text: &'t str,
    path: &'t Path,
) -> impl Iterator<Item = Result<T>> + 't {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(move |(index, line)| {
            serde_json::from_str(line).map_err(|source| DatasetError::Line {
                path: path.to_path_buf(),
                line: index + 1,
                source,
            })
        })
}

/// An id given as a string or a number.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawId {
    Text(String),
    Number(serde_json::Number),
}

impl RawId {
    fn into_string(self) -> String {
        match self {
            Self::Text(s) => s,
            Self::Number(n) => n.to_string(),
        }
    }
}

#[derive(Deserialize)]
struct ChatLine {
    id: Option<RawId>,
    messages: Vec<ChatMessage>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: String,
}

/// JSONL chat: one `{"messages": [{"role", "content"}]}` object per line, with an optional `id`
/// (string or number). Blank lines are ignored; a line that is not such an object is an error
/// naming the line. Roles are cleaned as in ShareGPT.
pub fn parse_jsonl_chat(text: &str, path: &Path) -> Result<Corpus> {
    let mut report = ReadReport::default();
    let mut conversations = Vec::new();
    for line in jsonl_records::<ChatLine>(text, path) {
        let line = line?;
        report.records_read += 1;
        let roles: Option<Vec<(Role, String)>> = line
            .messages
            .into_iter()
            .map(|m| Role::from_corpus_name(&m.role).map(|role| (role, m.content)))
            .collect();
        let Some(roles) = roles else {
            report.skipped_unknown_role += 1;
            continue;
        };
        let turns = clean_turns(roles, &mut report.empty_turns_dropped);
        let id = line.id.map(RawId::into_string).unwrap_or_default();
        report.admit(
            Conversation {
                id,
                turns,
                split_group: None,
            },
            true,
            &mut conversations,
        );
    }
    Ok(Corpus {
        conversations,
        report,
    })
}

#[derive(Deserialize)]
struct SpecBenchLine {
    question_id: RawId,
    turns: Vec<String>,
}

/// Spec-Bench `question.jsonl`: one `{"question_id", "category", "turns": [text]}` per line;
/// every turn becomes a user turn, and the id is `question_id` as text.
pub fn parse_spec_bench(text: &str, path: &Path) -> Result<Corpus> {
    let mut report = ReadReport::default();
    let mut conversations = Vec::new();
    for line in jsonl_records::<SpecBenchLine>(text, path) {
        let line = line?;
        report.records_read += 1;
        let turns = clean_turns(
            line.turns.into_iter().map(|t| (Role::User, t)),
            &mut report.empty_turns_dropped,
        );
        let id = line.question_id.into_string();
        report.admit(
            Conversation {
                id,
                turns,
                split_group: None,
            },
            false,
            &mut conversations,
        );
    }
    Ok(Corpus {
        conversations,
        report,
    })
}

/// Plain text: documents are runs of non-blank lines (a blank line holds only whitespace); each
/// becomes a conversation with an empty id (so it is split by content) and one assistant turn
/// holding the document's lines joined by `\n`.
pub fn parse_plain_text(text: &str) -> Corpus {
    let mut conversations = Vec::new();
    let mut document: Vec<&str> = Vec::new();
    let mut flush = |document: &mut Vec<&str>| {
        if !document.is_empty() {
            conversations.push(Conversation {
                id: String::new(),
                turns: vec![crate::Turn::new(Role::Assistant, document.join("\n"))],
                split_group: None,
            });
            document.clear();
        }
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            flush(&mut document);
        } else {
            document.push(line);
        }
    }
    flush(&mut document);
    let n = conversations.len();
    Corpus {
        conversations,
        report: ReadReport {
            records_read: n,
            kept: n,
            ..ReadReport::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "corpus.jsonl";

    #[test]
    fn jsonl_chat_reads_ids_roles_and_skips_blank_lines() {
        let text = "{\"id\": 7, \"messages\": [{\"role\": \"user\", \"content\": \"q\"}, \
                    {\"role\": \"assistant\", \"content\": \"a\"}]}\n\n\
                    {\"messages\": [{\"role\": \"system\", \"content\": \"s\"}, \
                    {\"role\": \"human\", \"content\": \"q\"}, {\"role\": \"gpt\", \"content\": \"a\"}]}\n\
                    {\"messages\": [{\"role\": \"user\", \"content\": \"only a question\"}]}\n";
        let corpus = parse_jsonl_chat(text, Path::new(PATH)).unwrap();
        assert_eq!(corpus.report.records_read, 3);
        assert_eq!(corpus.report.skipped_no_assistant, 1);
        assert_eq!(corpus.conversations.len(), 2);
        assert_eq!(corpus.conversations[0].id, "7");
        assert_eq!(corpus.conversations[1].id, "");
        let roles: Vec<Role> = corpus.conversations[1]
            .turns
            .iter()
            .map(|t| t.role)
            .collect();
        assert_eq!(roles, [Role::System, Role::User, Role::Assistant]);
    }

    #[test]
    fn a_bad_jsonl_line_is_an_error_naming_its_line_number() {
        let good = r#"{"messages": [{"role": "user", "content": "q"}]}"#;
        let text = format!("{good}\n\n{good}\n{{\"messages\": [{{\"role\": \"user\"}}]}}\n");
        let err = parse_jsonl_chat(&text, Path::new(PATH)).unwrap_err();
        assert!(matches!(err, DatasetError::Line { line: 4, .. }), "{err}");
        assert!(err.to_string().starts_with("corpus.jsonl:4: "), "{err}");
        let err = parse_jsonl_chat("{not json\n", Path::new(PATH)).unwrap_err();
        assert!(matches!(err, DatasetError::Line { line: 1, .. }), "{err}");
    }

    #[test]
    fn spec_bench_lines_become_user_only_conversations() {
        let text =
            "{\"question_id\": 81, \"category\": \"writing\", \"turns\": [\"one\", \"two\"]}\n\
                    {\"question_id\": \"x\", \"category\": \"qa\", \"turns\": [\" \"]}\n";
        let corpus = parse_spec_bench(text, Path::new(PATH)).unwrap();
        assert_eq!(corpus.conversations.len(), 1);
        assert_eq!(corpus.report.skipped_empty, 1);
        let c = &corpus.conversations[0];
        assert_eq!(c.id, "81");
        assert_eq!(
            c.turns,
            [
                crate::Turn::new(Role::User, "one"),
                crate::Turn::new(Role::User, "two")
            ]
        );
    }

    #[test]
    fn plain_text_paragraphs_become_single_assistant_turn_documents() {
        let corpus = parse_plain_text("\n  \nFirst line\nsecond line\n\t\nThird\n\n\n");
        let texts: Vec<&str> = corpus
            .conversations
            .iter()
            .map(|c| c.turns[0].content.as_str())
            .collect();
        assert_eq!(texts, ["First line\nsecond line", "Third"]);
        assert!(corpus
            .conversations
            .iter()
            .all(|c| c.id.is_empty() && c.turns.len() == 1 && c.turns[0].role == Role::Assistant));
        assert_eq!(corpus.report.kept, 2);
    }

    #[test]
    fn formats_are_detected_from_name_and_first_bytes_only() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let detect = |name: &str, text: &str| CorpusFormat::detect(&write(name, text));
        assert_eq!(detect("a.json", "\n [{").unwrap(), CorpusFormat::ShareGpt);
        assert_eq!(
            detect("b.jsonl", "\n{\"messages\": []}\n").unwrap(),
            CorpusFormat::JsonlChat
        );
        assert_eq!(
            detect("c.jsonl", "{\"question_id\": 1, \"turns\": []}").unwrap(),
            CorpusFormat::SpecBench
        );
        assert_eq!(detect("d.txt", "x").unwrap(), CorpusFormat::PlainText);
        assert!(detect("e.json", "{}").is_err());
        assert!(detect("f.jsonl", "{\"other\": 1}").is_err());
        assert!(detect("g.csv", "a,b").is_err());
        for format in CorpusFormat::ALL {
            assert_eq!(format.name().parse::<CorpusFormat>().unwrap(), format);
        }
        assert!("parquet".parse::<CorpusFormat>().is_err());
    }
}
