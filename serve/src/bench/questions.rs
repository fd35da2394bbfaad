//! Benchmark questions: Spec-Bench's `question.jsonl` and files of the same shape.

use std::io::BufRead;
use std::path::Path;

use anyhow::{bail, Context};
use headway_model::hash::fnv1a64;
use serde::{Deserialize, Serialize};

/// A question's id as its file gives it: Spec-Bench numbers them, other sets (HumanEval's
/// `HumanEval/0`, custom sets) name them. Reports keep it as given.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(untagged, expecting = "a question_id: a number or a string")]
pub enum QuestionId {
    Number(u64),
    Text(String),
}

impl QuestionId {
    /// 64 bits that stand for the id in seeds: the number itself (as before string ids were
    /// read, so numbered benchmarks draw the same samples), or a stable hash of the string.
    pub fn seed_bits(&self) -> u64 {
        match self {
            Self::Number(n) => *n,
            Self::Text(text) => fnv1a64(text.as_bytes()),
        }
    }
}

impl std::fmt::Display for QuestionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Number(n) => write!(f, "{n}"),
            Self::Text(text) => f.write_str(text),
        }
    }
}

/// One Spec-Bench row.
#[derive(Debug, Clone, Deserialize)]
pub struct Question {
    pub question_id: QuestionId,
    pub category: String,
    pub turns: Vec<String>,
}

/// Reads a Spec-Bench `question.jsonl`; a malformed line is reported with its number.
pub fn load_questions(path: &Path) -> anyhow::Result<Vec<Question>> {
    let file = std::fs::File::open(path).with_context(|| format!("{}", path.display()))?;
    let mut questions = Vec::new();
    for (number, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("{}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}: line {}", path.display(), number + 1);
        let question: Question = serde_json::from_str(&line).with_context(at)?;
        if question.turns.is_empty() {
            bail!("{}: no turns", at());
        }
        questions.push(question);
    }
    Ok(questions)
}

/// `count` questions evenly spaced through the file (every `len / count`-th, starting at 0), so
/// a subset still covers every category of the category-ordered file.
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

/// The questions `--tree-tokens auto` warms up on: the first of each Spec-Bench category, in file
/// order, so that the tuner's prediction weighs prompts that repeat their context (translation,
/// rag) beside those that do not (the file opens with ten MT-bench writing questions).
pub fn tuning_questions(questions: &[Question]) -> Vec<&Question> {
    let mut seen = Vec::new();
    questions
        .iter()
        .filter(|q| {
            let category = spec_bench_category(&q.category);
            let first = !seen.contains(&category);
            if first {
                seen.push(category);
            }
            first
        })
        .collect()
}

/// The Spec-Bench category a question's `category` belongs to: the 8 MT-bench categories
/// (10 questions each) form Spec-Bench's one "multi-turn conversation" category, `mt_bench`;
/// others are their own.
pub fn spec_bench_category(category: &str) -> &str {
    const MT_BENCH: [&str; 8] = [
        "writing",
        "roleplay",
        "reasoning",
        "math",
        "coding",
        "extraction",
        "stem",
        "humanities",
    ];
    if MT_BENCH.contains(&category) {
        "mt_bench"
    } else {
        category
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt_bench_categories_form_one_spec_bench_category() {
        for mt_bench in ["writing", "roleplay", "math", "coding", "humanities"] {
            assert_eq!(spec_bench_category(mt_bench), "mt_bench");
        }
        for own in [
            "translation",
            "summarization",
            "qa",
            "math_reasoning",
            "rag",
        ] {
            assert_eq!(spec_bench_category(own), own);
        }
    }

    #[test]
    fn tuning_takes_the_first_question_of_each_spec_bench_category() {
        let question = |id, category: &str| Question {
            question_id: QuestionId::Number(id),
            category: category.into(),
            turns: vec![String::new()],
        };
        let questions = [
            question(1, "writing"),
            question(2, "writing"),
            question(3, "coding"),
            question(4, "translation"),
            question(5, "rag"),
            question(6, "translation"),
        ];
        let ids: Vec<QuestionId> = tuning_questions(&questions)
            .iter()
            .map(|q| q.question_id.clone())
            .collect();
        assert_eq!(ids, [1, 4, 5].map(QuestionId::Number));
    }

    /// Regression (issue 19): HumanEval and custom sets name their questions.
    #[test]
    fn question_ids_may_be_numbers_or_strings_and_stay_as_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.jsonl");
        std::fs::write(
            &path,
            "{\"question_id\": \"HumanEval/0\", \"category\": \"coding\", \"turns\": [\"a\"]}\n\
             {\"question_id\": 81, \"category\": \"writing\", \"turns\": [\"b\"]}\n",
        )
        .unwrap();
        let questions = load_questions(&path).unwrap();
        let ids: Vec<&QuestionId> = questions.iter().map(|q| &q.question_id).collect();
        assert_eq!(
            ids,
            [
                &QuestionId::Text("HumanEval/0".into()),
                &QuestionId::Number(81)
            ]
        );
        assert_eq!(serde_json::to_string(ids[0]).unwrap(), "\"HumanEval/0\"");
        assert_eq!(serde_json::to_string(ids[1]).unwrap(), "81");
        assert_eq!(ids[0].to_string(), "HumanEval/0");
        // Numbered questions seed as they always did; named ones by a stable hash.
        assert_eq!(ids[1].seed_bits(), 81);
        assert_eq!(ids[0].seed_bits(), fnv1a64(b"HumanEval/0"));
        std::fs::write(
            &path,
            "{\"question_id\": [1], \"category\": \"x\", \"turns\": [\"a\"]}\n",
        )
        .unwrap();
        let err = format!("{:#}", load_questions(&path).unwrap_err());
        assert!(
            err.contains("line 1") && err.contains("a number or a string"),
            "{err}"
        );
    }
}
