//! Training data for draft heads: chat corpora (ShareGPT, JSONL chat, Spec-Bench turns, plain
//! text) rendered with the target's chat template, loss masks over assistant tokens, and the
//! cached target hidden states the heads learn from.
//!
//! Empty until feature extraction arrives (issue 3).
