//! llama.cpp GGUF files: conversion into an HF-style model directory that transformers loads too
//! (`config.json`, `model.safetensors`, `tokenizer.json` and `tokenizer_config.json`), and
//! opening one as a target directly ([`open_target`], quantised matrices kept as stored).
//!
//! The reference for every output is what transformers makes of the same GGUF
//! (`from_pretrained(dir, gguf_file=..)`): the same dequantised weights in HF names and layout,
//! the same tokenizer. Parsing and dequantisation are candle-core's; this module maps names,
//! checks shapes against the metadata, undoes llama.cpp's Q/K row permutation and writes the
//! files.
//!
//! Everything that can be validated is validated before the first file is written, and each file
//! is written to a temporary name in the output directory and renamed into place, so a failure or
//! crash never leaves a half-written file under a final name.

mod file;
mod hf_config;
mod native;
mod tensors;
mod tokenizer;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

pub use native::{load_target, open_target, open_target_placed, target_parts};

use file::GgufFile;
use headway_model::files::{write_atomically, write_bytes_atomically};
use headway_model::fingerprint::{write_conversion_record, CONVERSION_RECORD_FILE};
use headway_model::{Dtype, ModelError, Result};
use hf_config::GgufArchitecture;

/// What a conversion produced.
#[derive(Debug, Clone)]
pub struct ConvertSummary {
    /// The HF architecture written to `config.json` (`LlamaForCausalLM`).
    pub architecture: String,
    /// Number of tensors in `model.safetensors`.
    pub tensors: usize,
    /// Number of weight values in `model.safetensors` (a tied `lm_head` is not counted twice).
    pub parameters: usize,
    /// Total size of the written files.
    pub bytes_written: u64,
    /// How many source tensors had each GGML type (`Q4_1` → 210).
    pub source_types: BTreeMap<String, usize>,
    /// Tokens in the tokenizer, added tokens included.
    pub vocab_size: usize,
    /// The files written, in `out_dir`.
    pub files: Vec<PathBuf>,
}

const CONFIG_FILE: &str = "config.json";
const WEIGHTS_FILE: &str = "model.safetensors";
const TOKENIZER_FILE: &str = "tokenizer.json";
const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Converts the GGUF file `gguf` into an HF model directory `out_dir` (created if needed; files
/// already there under the same names are replaced), with a record of the file it came from
/// ([`CONVERSION_RECORD_FILE`]: heads made on one serve on the other).
///
/// Errors name the file and the metadata key or tensor at fault: [`ModelError::Gguf`] for
/// unreadable or truncated files, missing or ill-typed metadata, tensor shapes that contradict the
/// metadata and tensor types the converter cannot dequantise; [`ModelError::MissingWeight`] for
/// absent tensors; [`ModelError::UnsupportedArchitecture`] for architectures other than llama,
/// qwen2 and qwen3.
pub fn convert_gguf(gguf: &Path, out_dir: &Path, dtype: Dtype) -> Result<ConvertSummary> {
    let mut file = GgufFile::open(gguf)?;
    let arch = GgufArchitecture::from_file(&file)?;
    let config = hf_config::build(&mut file, arch, dtype)?;
    let tokenizer = tokenizer::build(&file, config.max_position_embeddings)?;
    let plans = tensors::plan(&file, arch, &config)?;
    tracing::info!(
        "converting {} tensors of {} ({}) to {dtype:?}",
        plans.len(),
        gguf.display(),
        arch.hf_class()
    );
    let converted = tensors::convert(&mut file, &plans, dtype)?;
    let mut written = write_outputs(out_dir, &config, &tokenizer, &converted.tensors)?;
    // Last, so that a record exists only beside a complete conversion.
    write_conversion_record(out_dir, gguf)?;
    let record = out_dir.join(CONVERSION_RECORD_FILE);
    let record_bytes = std::fs::metadata(&record)
        .map_err(|e| ModelError::io(&record, e))?
        .len();
    written.push((record, record_bytes));
    Ok(ConvertSummary {
        architecture: arch.hf_class().to_string(),
        tensors: converted.tensors.len(),
        parameters: converted.parameters,
        bytes_written: written.iter().map(|(_, bytes)| bytes).sum(),
        source_types: converted.source_types,
        vocab_size: tokenizer.tokenizer.get_vocab_size(true),
        files: written.into_iter().map(|(path, _)| path).collect(),
    })
}

/// Writes the four output files, each atomically; returns each path with its size.
fn write_outputs(
    out_dir: &Path,
    config: &hf_config::ConfigJson,
    tokenizer: &tokenizer::TokenizerFiles,
    tensors: &BTreeMap<String, tensors::OutputTensor>,
) -> Result<Vec<(PathBuf, u64)>> {
    std::fs::create_dir_all(out_dir).map_err(|e| ModelError::io(out_dir, e))?;
    let tokenizer_json = tokenizer
        .tokenizer
        .to_string(false)
        .map_err(|e| ModelError::Tokenizer(format!("cannot serialise the tokenizer: {e}")))?;
    let [config_path, tokenizer_config_path, tokenizer_path, weights_path] = [
        CONFIG_FILE,
        TOKENIZER_CONFIG_FILE,
        TOKENIZER_FILE,
        WEIGHTS_FILE,
    ]
    .map(|name| out_dir.join(name));
    let config_bytes = write_json(&config_path, config)?;
    let tokenizer_config_bytes = write_json(&tokenizer_config_path, &tokenizer.config)?;
    let tokenizer_bytes = write_bytes_atomically(&tokenizer_path, tokenizer_json.as_bytes())?;
    check_tokenizer_reloads(&tokenizer_path, &tokenizer_json)?;
    let weights_bytes = write_safetensors(&weights_path, tensors)?;
    Ok(vec![
        (config_path, config_bytes),
        (tokenizer_config_path, tokenizer_config_bytes),
        (tokenizer_path, tokenizer_bytes),
        (weights_path, weights_bytes),
    ])
}

/// Loads the written `tokenizer.json` back with `tokenizers` and checks it is the tokenizer that
/// was built, so a file only the writer understands is caught here rather than at serving time.
fn check_tokenizer_reloads(path: &Path, written: &str) -> Result<()> {
    let reloaded = tokenizers::Tokenizer::from_file(path).map_err(|e| {
        ModelError::Tokenizer(format!("{}: does not load back: {e}", path.display()))
    })?;
    let reserialised = reloaded
        .to_string(false)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
    if reserialised != written {
        return Err(ModelError::Tokenizer(format!(
            "{}: loads back as a different tokenizer",
            path.display()
        )));
    }
    Ok(())
}

fn write_json(path: &Path, value: &impl Serialize) -> Result<u64> {
    write_atomically(path, |out, _| {
        let mut writer = BufWriter::new(out);
        serde_json::to_writer_pretty(&mut writer, value).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        writer
            .write_all(b"\n")
            .map_err(|e| ModelError::io(path, e))?;
        writer.flush().map_err(|e| ModelError::io(path, e))
    })
}

fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, tensors::OutputTensor>,
) -> Result<u64> {
    // transformers refuses safetensors files whose `format` is not one of its frameworks. One key
    // only: the safetensors header lists metadata in HashMap order, so a second key would make
    // the file's bytes (and the target fingerprint that heads are tied to) vary between runs.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_atomically(path, |_, temp_path| {
        safetensors::serialize_to_file(tensors, Some(metadata), temp_path).map_err(|e| {
            ModelError::Safetensors {
                path: path.to_path_buf(),
                message: e.to_string(),
            }
        })
    })
}
