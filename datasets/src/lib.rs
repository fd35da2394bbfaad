//! Training data for draft heads: chat corpora (ShareGPT, JSONL chat, Spec-Bench turns, plain
//! text) rendered with the target's chat template, loss masks over assistant tokens, and the
//! cached target hidden states the heads learn from.
//!
//! Design choices:
//! - **One shape for every corpus.** Readers ([`corpus`], [`sharegpt`]) turn each format into
//!   [`Conversation`]s of [`Turn`]s with three cleaned [`Role`]s, and report what they read, kept
//!   and dropped ([`ReadReport`]); the format is always named or detected up front
//!   ([`CorpusFormat`]), never guessed by trying parsers in turn.
//! - **Recover, but say so.** The public ShareGPT file is cut short; the reader keeps every whole
//!   record and reports the partial one and the bytes it ignored, while a malformed *whole*
//!   record is an error naming it.
//! - **Stable splits.** Train / held-out membership is a pure function of a conversation's id
//!   (or content), through a hash written out in [`split`], so it survives reordering, growth
//!   and Rust upgrades.
//! - **One tokenization.** [`ChatFormatter`] renders a whole conversation with the target's
//!   template, tokenizes it once, and derives the loss mask from byte offsets, so the ids are
//!   exactly the target's and the mask cannot drift from them.
//!
//! - **Features are checked, never trusted.** Shards carry checksums in the manifest and the
//!   manifest carries the target's fingerprint ([`features`]); readers verify both and name the
//!   bad shard or the mismatched model.

pub mod chat_format;
pub mod conversation;
pub mod corpus;
pub mod error;
pub mod features;
pub mod regenerate;
pub mod sharegpt;
pub mod split;
pub mod torch_file;

pub use chat_format::{end_of_turn_token, ChatFormatter, ChatSequence};
pub use conversation::{dedupe, Conversation, Role, Turn};
pub use corpus::{
    parse_jsonl_chat, parse_plain_text, parse_spec_bench, read_corpus, Corpus, CorpusFormat,
    ReadReport, Truncation,
};
pub use error::{DatasetError, Result};
pub use sharegpt::parse_sharegpt;
pub use split::{split, split_of, split_of_id, Split};
pub use torch_file::TorchFile;
