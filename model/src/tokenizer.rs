//! Text ↔ token ids through a HuggingFace `tokenizer.json`, plus incremental decoding for
//! streaming.

use std::path::Path;

use crate::{ModelError, Result};

/// Byte range `(start, end)` in the encoded text of each token, in token order.
pub type TokenOffsets = Vec<(usize, usize)>;

/// A loaded `tokenizer.json`.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

fn tokenizer_error(context: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{context}: {e}"))
}

impl TextTokenizer {
    /// Loads `path` (a `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(ModelError::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer file not found"),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        // JSON errors first, with their line: the tokenizers crate unwraps some of them inside
        // its own deserialisers (0.22: a control character in a decoder's string panics).
        serde_json::from_str::<serde::de::IgnoredAny>(&text).map_err(|source| {
            ModelError::Json {
                path: path.to_path_buf(),
                source,
            }
        })?;
        // Valid JSON it still cannot take may panic there too: a fault of this file, not ours.
        let parsed = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>()).map_err(
            |panic| {
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                let message = format!("the tokenizers crate cannot read it ({what})");
                tokenizer_error(&path.display().to_string(), message)
            },
        )?;
        let inner = parsed.map_err(|e| tokenizer_error(&path.display().to_string(), e))?;
        Ok(Self { inner })
    }

    /// Wraps a tokenizer built in memory (from a GGUF file's vocabulary).
    pub fn from_tokenizer(inner: tokenizers::Tokenizer) -> Self {
        Self { inner }
    }

    /// The tokenizer as `tokenizer.json` text.
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| tokenizer_error("serialising the tokenizer", e))
    }

    /// Token ids of `text`; special-token strings in `text` (e.g. `<|im_end|>`) map to their ids.
    /// `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS token).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| tokenizer_error("encode", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// As [`Self::encode`], plus each token's byte range `(start, end)` in `text` (special tokens
    /// included; a token added by the post-processor, such as a BOS, gets an empty range).
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, TokenOffsets)> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| tokenizer_error("encode", e))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().to_vec()))
    }

    /// Text of `ids`, keeping or dropping special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| tokenizer_error("decode", e))
    }

    /// Id of the token whose text is exactly `token` (added/special tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Number of ids the tokenizer can produce, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// An incremental decoder: feed ids one at a time, get text as soon as it is complete UTF-8.
    pub fn stream(&self, skip_special_tokens: bool) -> TokenStream<'_> {
        TokenStream {
            inner: self.inner.decode_stream(skip_special_tokens),
        }
    }
}

/// Incremental detokenizer (a multi-byte character split across tokens is emitted once whole).
pub struct TokenStream<'a> {
    inner: tokenizers::DecodeStream<
        'a,
        tokenizers::ModelWrapper,
        tokenizers::NormalizerWrapper,
        tokenizers::PreTokenizerWrapper,
        tokenizers::PostProcessorWrapper,
        tokenizers::DecoderWrapper,
    >,
}

impl TokenStream<'_> {
    /// Text newly completed by `id`, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.inner
            .step(id)
            .map_err(|e| tokenizer_error("decode", e))
    }
}
