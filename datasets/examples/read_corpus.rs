//! Reads a corpus and prints what was read, kept and dropped, and how long it took; with a target
//! directory, also formats every unique conversation with its chat template and tokenizer.
//!
//! `cargo run --release -p headway-datasets --example read_corpus -- FILE [FORMAT [TARGET_DIR]]`
//! (FORMAT: sharegpt, jsonl-chat, spec-bench, text, or `detect` to tell it from the file name).

use std::path::PathBuf;
use std::time::Instant;

use headway_datasets::{dedupe, end_of_turn_token, read_corpus, ChatFormatter, CorpusFormat};
use headway_model::{ChatTemplate, TextTokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args_os().skip(1);
    let usage = "usage: read_corpus FILE [FORMAT [TARGET_DIR]]";
    let path = PathBuf::from(args.next().ok_or(usage)?);
    let format = match args.next() {
        Some(name) if name != "detect" => name.to_string_lossy().parse()?,
        _ => CorpusFormat::detect(&path)?,
    };
    let start = Instant::now();
    let corpus = read_corpus(&path, format)?;
    let read_s = start.elapsed().as_secs_f64();
    let (unique, duplicates) = dedupe(corpus.conversations);
    println!("{} ({format}): {}", path.display(), corpus.report);
    println!(
        "{duplicates} duplicates dropped, {} unique; read {read_s:.2} s, read + dedupe {:.2} s",
        unique.len(),
        start.elapsed().as_secs_f64()
    );
    let Some(target) = args.next().map(PathBuf::from) else {
        return Ok(());
    };
    let tokenizer = TextTokenizer::from_file(&target.join("tokenizer.json"))?;
    let template = ChatTemplate::from_dir(&target)?.ok_or("the target has no chat template")?;
    let end_of_turn = end_of_turn_token(&tokenizer).ok_or("no known end-of-turn token")?;
    let formatter = ChatFormatter::new(&template, &tokenizer, end_of_turn)?;
    let start = Instant::now();
    let (mut tokens, mut masked, mut boundary, mut failed) = (0usize, 0usize, 0usize, 0usize);
    for conversation in &unique {
        match formatter.format(conversation, usize::MAX) {
            Ok(seq) => {
                tokens += seq.input_ids.len();
                masked += seq.loss_mask.iter().map(|&m| usize::from(m)).sum::<usize>();
                boundary += seq.boundary_tokens;
            }
            Err(e) => {
                if failed < 5 {
                    eprintln!("{e}");
                }
                failed += 1;
            }
        }
    }
    println!(
        "formatted {} conversations in {:.1} s: {tokens} tokens, {masked} masked, {boundary} \
         boundary tokens; {failed} failed",
        unique.len() - failed,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
