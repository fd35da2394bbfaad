//! `tokenizer.json` and `tokenizer_config.json` from a GGUF's `tokenizer.*` metadata.
//!
//! The reference is what transformers builds from the same file (`AutoTokenizer.from_pretrained(
//! dir, gguf_file=..)`, `integrations/gguf/gguf_tokenizer_mapping.py`), so a model converted here
//! tokenizes exactly as the Python stack does when it loads the GGUF:
//! - byte-level BPE over the file's vocabulary and merges, tokens respelled into the byte alphabet
//!   when the file stores them as raw text;
//! - a `Split` on the regex llama.cpp's `tokenizer.ggml.pre` names, followed by a regex-free
//!   byte-level step, or GPT-2's own byte-level split for pre-tokenizers transformers does not
//!   list (SmolLM's `smollm` among them);
//! - control tokens (type 3) as special added tokens, user-defined ones (type 4) as plain added
//!   tokens, then any named bos/eos/unk/pad token not added yet as a special one;
//! - a template post-processor that adds bos/eos as the file's `add_bos_token`/`add_eos_token`
//!   say.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = gpt2`) files are supported.

use serde::Serialize;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::file::GgufFile;
use headway_model::{ModelError, Result};

/// GGUF token types (llama.cpp's `llama_token_type`) that become added tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The built tokenizer and its `tokenizer_config.json`.
pub(super) struct TokenizerFiles {
    pub tokenizer: Tokenizer,
    pub config: TokenizerConfigJson,
}

/// `tokenizer_config.json`: the special tokens as strings plus the generation-time switches.
#[derive(Debug, Serialize)]
pub(super) struct TokenizerConfigJson {
    tokenizer_class: &'static str,
    add_bos_token: bool,
    add_eos_token: bool,
    bos_token: Option<String>,
    eos_token: Option<String>,
    unk_token: Option<String>,
    pad_token: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    chat_template: Option<String>,
    model_max_length: usize,
    /// transformers' GGUF tokenizer leaves decoded text as is; so must a reload of this directory.
    clean_up_tokenization_spaces: bool,
}

/// The GGUF's vocabulary metadata, read once.
struct GgufVocab<'a> {
    tokens: Vec<&'a str>,
    token_types: Option<Vec<i64>>,
    merges: Vec<&'a str>,
    pre: Option<&'a str>,
}

/// The tokenizer the metadata of `file` describes; an error names the file (a vocabulary the
/// tokenizers crate refuses is a fault of this file, not of the machine).
pub(super) fn build(file: &GgufFile, model_max_length: usize) -> Result<TokenizerFiles> {
    build_files(file, model_max_length).map_err(|e| match e {
        ModelError::Tokenizer(message) => file.error(format!("tokenizer: {message}")),
        other => other,
    })
}

fn build_files(file: &GgufFile, model_max_length: usize) -> Result<TokenizerFiles> {
    let model = file.string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(file.error(format!(
            "tokenizer.ggml.model is {model:?}; only byte-level BPE (\"gpt2\") tokenizers can be \
             converted"
        )));
    }
    let vocab = read_vocab(file)?;
    let special = NamedSpecialTokens::read(file, &vocab.tokens)?;
    let add_bos_token = file
        .optional_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let add_eos_token = file
        .optional_bool("tokenizer.ggml.add_eos_token")?
        .unwrap_or(false);

    let mut tokenizer = Tokenizer::new(build_bpe(&vocab)?);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(vocab.pre)?));
    // GPT-2's decoder settings (prefix space, offset trimming) are ByteLevel's defaults.
    tokenizer.with_decoder(Some(ByteLevel::default()));
    add_tokens(&mut tokenizer, &vocab, &special);
    tokenizer.with_post_processor(Some(post_processor(
        &special,
        add_bos_token,
        add_eos_token,
    )?));

    let config = TokenizerConfigJson {
        tokenizer_class: "PreTrainedTokenizerFast",
        add_bos_token,
        add_eos_token,
        bos_token: special.bos.map(|(token, _)| token),
        eos_token: special.eos.map(|(token, _)| token),
        unk_token: special.unk.map(|(token, _)| token),
        pad_token: special.pad.map(|(token, _)| token),
        chat_template: file
            .optional_string("tokenizer.chat_template")?
            .map(String::from),
        model_max_length,
        clean_up_tokenization_spaces: false,
    };
    Ok(TokenizerFiles { tokenizer, config })
}

fn read_vocab(file: &GgufFile) -> Result<GgufVocab<'_>> {
    let tokens = file.strings("tokenizer.ggml.tokens")?;
    let token_types = match file.optional("tokenizer.ggml.token_type") {
        Some(_) => Some(file.integers("tokenizer.ggml.token_type")?),
        None => None,
    };
    if let Some(types) = &token_types {
        if types.len() != tokens.len() {
            return Err(file.error(format!(
                "tokenizer.ggml.token_type has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
    }
    Ok(GgufVocab {
        tokens,
        token_types,
        merges: file.strings("tokenizer.ggml.merges")?,
        pre: file.optional_string("tokenizer.ggml.pre")?,
    })
}

/// GPT-2's reversible byte-to-character table: printable bytes stand for themselves, the rest
/// are shifted to code points from 256 up so that every token is visible text.
pub(super) fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut alphabet = ['\0'; 256];
    let mut shifted = 256u32;
    for byte in 0..=255u8 {
        alphabet[usize::from(byte)] = if printable(byte) {
            char::from(byte)
        } else {
            let c = char::from_u32(shifted).unwrap_or(char::REPLACEMENT_CHARACTER);
            shifted += 1;
            c
        };
    }
    alphabet
}

/// The token as the byte-level model spells it: unchanged when already in the byte alphabet,
/// else its UTF-8 bytes mapped through it (files sometimes store added tokens as raw text).
pub(super) fn byte_level_spelling(token: &str, alphabet: &[char; 256]) -> String {
    if token.chars().all(|c| alphabet.contains(&c)) {
        token.to_string()
    } else {
        token.bytes().map(|b| alphabet[usize::from(b)]).collect()
    }
}

fn build_bpe(vocab: &GgufVocab<'_>) -> Result<BPE> {
    let alphabet = byte_alphabet();
    let mut token_ids = Vocab::with_capacity(vocab.tokens.len());
    for (id, token) in vocab.tokens.iter().enumerate() {
        let id = u32::try_from(id)
            .map_err(|_| ModelError::Tokenizer(format!("token id {id} does not fit in u32")))?;
        // A later token with the same spelling wins, as in transformers' dict comprehension.
        token_ids.insert(byte_level_spelling(token, &alphabet), id);
    }
    let merges = vocab
        .merges
        .iter()
        .enumerate()
        .map(|(index, merge)| {
            merge
                .split_once(' ')
                .map(|(left, right)| (left.to_string(), right.to_string()))
                .ok_or_else(|| {
                    ModelError::Tokenizer(format!(
                        "tokenizer.ggml.merges[{index}] = {merge:?} is not two tokens separated by \
                         a space"
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    BPE::builder()
        .vocab_and_merges(token_ids, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .build()
        .map_err(|e| ModelError::Tokenizer(format!("cannot build the BPE model: {e}")))
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The split regex for a `tokenizer.ggml.pre` value, as transformers' GGUF_PRE_TOKENIZER_SPLITS
/// lists them; `None` means GPT-2's byte-level split.
fn split_regex(pre: &str) -> Option<&'static str> {
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => Some(LLAMA3_SPLIT),
        "tekken" => Some(TEKKEN_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => Some(QWEN2_SPLIT),
        "qwen35" => Some(QWEN35_SPLIT),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => Some(GPT4O_SPLIT),
        _ => None,
    }
}

fn pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper> {
    let Some(regex) = pre.and_then(split_regex) else {
        return Ok(ByteLevel::new(false, true, true).into());
    };
    let split = Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| ModelError::Tokenizer(format!("split regex for pre-tokenizer {pre:?}: {e}")))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ])
    .into())
}

/// bos/eos/unk/pad as (token text, id), from the `tokenizer.ggml.*_token_id` keys.
struct NamedSpecialTokens {
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
    unk: Option<(String, u32)>,
    pad: Option<(String, u32)>,
}

impl NamedSpecialTokens {
    fn read(file: &GgufFile, tokens: &[&str]) -> Result<Self> {
        let lookup = |key: &str| -> Result<Option<(String, u32)>> {
            let Some(id) = file.optional_u32(key)? else {
                return Ok(None);
            };
            let token = tokens.get(id as usize).ok_or_else(|| {
                file.error(format!(
                    "{key} = {id} is outside the {}-token vocabulary",
                    tokens.len()
                ))
            })?;
            Ok(Some((token.to_string(), id)))
        };
        Ok(Self {
            bos: lookup("tokenizer.ggml.bos_token_id")?,
            eos: lookup("tokenizer.ggml.eos_token_id")?,
            unk: lookup("tokenizer.ggml.unknown_token_id")?,
            pad: lookup("tokenizer.ggml.padding_token_id")?,
        })
    }

    fn texts(&self) -> impl Iterator<Item = &str> {
        [&self.bos, &self.eos, &self.unk, &self.pad]
            .into_iter()
            .flatten()
            .map(|(token, _)| token.as_str())
    }
}

/// Adds control, user-defined and named special tokens in transformers' order, so that ids of
/// tokens missing from the vocabulary come out the same.
fn add_tokens(tokenizer: &mut Tokenizer, vocab: &GgufVocab<'_>, special: &NamedSpecialTokens) {
    let alphabet = byte_alphabet();
    let in_alphabet = |token: &str| token.chars().all(|c| alphabet.contains(&c));
    let typed = |wanted: i64| {
        let types = vocab.token_types.as_deref().unwrap_or_default();
        vocab
            .tokens
            .iter()
            .zip(types)
            .filter(move |&(_, &token_type)| token_type == wanted)
            .map(|(token, _)| *token)
    };
    // A control token outside the byte alphabet is a llama.cpp mislabel; adding it would grow
    // the vocabulary past the embedding (transformers skips it too).
    let control: Vec<AddedToken> = typed(TOKEN_TYPE_CONTROL)
        .filter(|token| in_alphabet(token))
        .map(|token| AddedToken::from(token, true))
        .collect();
    tokenizer.add_special_tokens(&control);
    let known = tokenizer.get_vocab(true);
    let user_defined: Vec<AddedToken> = typed(TOKEN_TYPE_USER_DEFINED)
        .filter(|token| known.contains_key(*token))
        .map(|token| AddedToken::from(token, false).normalized(false))
        .collect();
    tokenizer.add_tokens(&user_defined);
    let mut added: Vec<String> = tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .map(|token| token.content)
        .collect();
    let mut named = Vec::new();
    for token in special.texts() {
        if !added.iter().any(|existing| existing == token) {
            added.push(token.to_string());
            named.push(AddedToken::from(token, true));
        }
    }
    tokenizer.add_tokens(&named);
}

/// transformers' `update_post_processor`: `[bos] $A [eos]` for one sequence, and the same around
/// `$B` for pairs.
fn post_processor(
    special: &NamedSpecialTokens,
    add_bos_token: bool,
    add_eos_token: bool,
) -> Result<TemplateProcessing> {
    let bos = special.bos.as_ref().filter(|_| add_bos_token);
    let eos = special.eos.as_ref().filter(|_| add_eos_token);
    let sequence = |name: &str, type_id: u8| {
        let mut pieces = Vec::new();
        if let Some((token, _)) = bos {
            pieces.push(format!("{token}:{type_id}"));
        }
        pieces.push(format!("${name}:{type_id}"));
        if let Some((token, _)) = eos {
            pieces.push(format!("{token}:{type_id}"));
        }
        pieces.join(" ")
    };
    let single = sequence("A", 0);
    let pair = format!("{single} {}", sequence("B", 1));
    let special_tokens: Vec<(String, u32)> = bos.into_iter().chain(eos).cloned().collect();
    let template_error = |e: String| ModelError::Tokenizer(format!("post-processor template: {e}"));
    let mut builder = TemplateProcessing::builder();
    builder
        .try_single(single.as_str())
        .map_err(template_error)?;
    builder.try_pair(pair.as_str()).map_err(template_error)?;
    builder.special_tokens(special_tokens);
    builder
        .build()
        .map_err(|e| ModelError::Tokenizer(format!("post-processor: {e}")))
}
