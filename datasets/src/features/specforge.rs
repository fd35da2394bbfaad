//! `prepare --from`: features from the hidden states SpecForge's offline pipeline captured, so a
//! target served tensor-parallel by SGLang (too large for one machine here) is run there and its
//! heads are trained here. The shards, manifest, split, resume and `--shard` slices are
//! `prepare`'s own; only the hidden states come from the files instead of a forward.
//!
//! SpecForge's `scripts/prepare_hidden_states.py` writes one `torch.save` file per sample,
//! `rows_<a>-<b>/data_<i>.ckpt` (`.ckpt.gz` with `--compress`), a dict of (its eagle3
//! `OfflineCaptureLayout`; SpecForge's `OfflineEagle3Dataset` reads the same keys):
//!
//! | key | shape | holds |
//! |---|---|---|
//! | `input_ids` | `[T]` i64 | the sample's tokens (its chat template, the target's tokenizer) |
//! | `loss_mask` | `[T]` i64 | 1 on assistant tokens |
//! | `hidden_state` | `[1, T, H]` | the final post-norm hidden state (what the LM head reads) |
//! | `aux_hidden_state` | `[1, T, k·H]` | residual streams entering its capture layers, side by side |
//!
//! SGLang captures the stream *entering* layer `l + 1` for SpecForge's layer id `l`: Headway's
//! tap `l + 1` (the stream after `l + 1` layers). The files do not say which layers they hold, so
//! `taps` names them; SpecForge's default ids `[1, L/2 − 1, L − 4]` are Headway's default EAGLE-3
//! taps. Pad positions of a batched capture (after the sequence, loss mask 0) are kept as stored.
//!
//! A file's sequence id is its path under the directory without the extension (the files are
//! taken in SpecForge's order: paths sorted); the split hashes that id. The corpus is identified
//! by a hash of the listing (paths and sizes): hashing every byte of a multi-terabyte capture to
//! name it would cost a full read, and each file's tensors are checked as they are read. Files are
//! read twice — tokens and masks to plan the shards, hidden states when writing each shard — and a
//! `.gz` file is decompressed each time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use headway_model::fingerprint::bytes_sha256;
use tch::Tensor;

use crate::chat_format::ChatSequence;
use crate::corpus::ReadReport;
use crate::error::{DatasetError, Result};
use crate::features::extract::ExtractedFeatures;
use crate::features::manifest::{
    CorpusInfo, Counts, ExtractionSettings, Settings, ShardSlice, TargetInfo,
};
use crate::features::prepare::{
    admit, open_output, PlannedRun, PlannedSequence, PrepareObserver, PrepareSummary, StateSource,
};
use crate::split::split_of_id;
use crate::torch_file::TorchFile;

/// The corpus format a manifest records for imported features (and its device type: the
/// kernels that computed them are SGLang's).
pub const SPECFORGE_FORMAT: &str = "specforge-offline";

const SUFFIXES: [&str; 2] = [".ckpt", ".ckpt.gz"];

/// What `prepare --from` should import, and how.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The directory SpecForge wrote (searched recursively, as its reader does).
    pub from: PathBuf,
    pub out: PathBuf,
    /// `taps`: the target layers `aux_hidden_state` holds, in its order; empty: `default_taps`
    /// when the files hold one, none otherwise. `regenerate` and `batch_tokens` do not apply.
    pub settings: ExtractionSettings,
    /// The taps assumed when `settings.taps` is empty and the files hold `aux_hidden_state`.
    pub default_taps: Vec<usize>,
    pub slice: Option<ShardSlice>,
    pub command: Vec<String>,
}

/// One capture file.
struct SourceFile {
    /// Its path under the directory, without the extension.
    id: String,
    path: PathBuf,
    bytes: u64,
}

/// Converts (or resumes converting) the SpecForge capture `options.from` of the target `target`
/// into Headway features in `options.out`.
pub fn import_specforge(
    target: &TargetInfo,
    options: &ImportOptions,
    observer: &mut dyn PrepareObserver,
) -> Result<PrepareSummary> {
    let start = Instant::now();
    if options.settings.regenerate.is_some() {
        return Err(DatasetError::Argument(
            "--from imports captured states: --regenerate does not apply".into(),
        ));
    }
    let files = list_files(&options.from)?;
    let taps = resolve_taps(&files[0], options)?;
    let settings = Settings {
        target: target.clone(),
        corpus: corpus_info(&options.from, &files),
        replies: None,
        extraction: ExtractionSettings {
            taps,
            batch_tokens: 0,
            ..options.settings.clone()
        },
        device_type: SPECFORGE_FORMAT.to_string(),
    };
    let taps_from = match options.settings.taps.is_empty() {
        true => "SpecForge's default capture layers give tap",
        false => "--layers",
    };
    settings
        .extraction
        .check(target.num_hidden_layers, taps_from)?;
    let previous = open_output(&options.out, &settings, options.slice, observer)?;
    let used = &files[..files
        .len()
        .min(settings.extraction.max_seqs.unwrap_or(usize::MAX))];
    observer.message(&format!(
        "{}: {} SpecForge capture files, reading {} of them",
        options.from.display(),
        files.len(),
        used.len()
    ));
    let (sequences, counts) = read_sequences(used, &settings)?;
    let mut source = CaptureStates {
        files: used.iter().map(|f| (f.id.as_str(), f)).collect(),
        hidden_size: target.hidden_size,
        settings: settings.extraction.clone(),
    };
    let run = PlannedRun {
        out: &options.out,
        settings,
        counts,
        sequences,
        previous,
        slice: options.slice,
        command: options.command.clone(),
    };
    run.extract(&mut source, observer, start)
}

/// The capture files under `dir`, in SpecForge's order (paths sorted); an error when there are
/// none.
fn list_files(dir: &Path) -> Result<Vec<SourceFile>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(folder) = pending.pop() {
        for entry in std::fs::read_dir(&folder).map_err(|e| DatasetError::io(&folder, e))? {
            let path = entry.map_err(|e| DatasetError::io(&folder, e))?.path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let relative = path.strip_prefix(dir).expect("under dir").to_string_lossy();
            let Some(id) = SUFFIXES.iter().find_map(|s| relative.strip_suffix(s)) else {
                continue;
            };
            let bytes = std::fs::metadata(&path)
                .map_err(|e| DatasetError::io(&path, e))?
                .len();
            files.push(SourceFile {
                id: id.to_string(),
                path,
                bytes,
            });
        }
    }
    files.sort_by(|a, b| a.path.cmp(&b.path));
    if files.is_empty() {
        return Err(DatasetError::features(
            dir,
            "no SpecForge capture files (*.ckpt or *.ckpt.gz, as scripts/prepare_hidden_states.py \
             writes them) under it",
        ));
    }
    Ok(files)
}

/// `options.settings.taps`, or when none are given the default taps if `first` holds
/// `aux_hidden_state`.
fn resolve_taps(first: &SourceFile, options: &ImportOptions) -> Result<Vec<usize>> {
    if !options.settings.taps.is_empty() {
        return Ok(options.settings.taps.clone());
    }
    let file = TorchFile::open(&first.path)?;
    Ok(match file.names().contains(&"aux_hidden_state") {
        true => options.default_taps.clone(),
        false => Vec::new(),
    })
}

fn corpus_info(dir: &Path, files: &[SourceFile]) -> CorpusInfo {
    let listing: String = files
        .iter()
        .map(|f| format!("{}\t{}\n", f.id, f.bytes))
        .collect();
    CorpusInfo {
        path: dir.display().to_string(),
        format: SPECFORGE_FORMAT.to_string(),
        bytes: files.iter().map(|f| f.bytes).sum(),
        sha256: bytes_sha256(listing.as_bytes()),
    }
}

/// Every file's tokens and loss mask, truncated to `max_len`, split and counted as `prepare`
/// counts formatted conversations.
fn read_sequences(
    files: &[SourceFile],
    settings: &Settings,
) -> Result<(Vec<PlannedSequence>, Counts)> {
    let mut counts = Counts {
        corpus: ReadReport {
            records_read: files.len(),
            kept: files.len(),
            ..ReadReport::default()
        },
        conversations_used: files.len(),
        ..Counts::default()
    };
    let mut sequences = Vec::with_capacity(files.len());
    let e = &settings.extraction;
    for file in files {
        let sequence = read_tokens(file, settings.target.vocab_size, e.max_len)?;
        let split = split_of_id(&file.id, e.held_out_fraction)?;
        admit(&mut sequences, &mut counts, &file.id, split, sequence);
    }
    Ok((sequences, counts))
}

/// The tokens and loss mask of one file, checked: equal lengths, ids in the vocabulary, mask
/// values 0 and 1.
fn read_tokens(file: &SourceFile, vocab_size: usize, max_len: usize) -> Result<ChatSequence> {
    let torch = TorchFile::open(&file.path)?;
    let bad = |message: String| DatasetError::format(&file.path, message);
    let ids = flat_integers(&torch, "input_ids")?;
    let mask = flat_integers(&torch, "loss_mask")?;
    if ids.len() != mask.len() {
        return Err(bad(format!(
            "input_ids has {} tokens but loss_mask {}",
            ids.len(),
            mask.len()
        )));
    }
    if let Some(id) = ids.iter().find(|&&id| id < 0 || id as usize >= vocab_size) {
        return Err(bad(format!(
            "input_ids holds {id}, outside the target's vocabulary of {vocab_size} (captured \
             with another tokenizer?)"
        )));
    }
    if let Some(value) = mask.iter().find(|&&m| m != 0 && m != 1) {
        return Err(bad(format!("loss_mask holds {value}; expected 0 or 1")));
    }
    let kept = ids.len().min(max_len);
    Ok(ChatSequence {
        input_ids: ids[..kept].iter().map(|&id| id as u32).collect(),
        loss_mask: mask[..kept].iter().map(|&m| m as u8).collect(),
        full_len: ids.len(),
        boundary_tokens: 0,
    })
}

/// Tensor `name` of `file` as integers: `[T]`, or `[1, T]` as some SpecForge versions store it.
fn flat_integers(file: &TorchFile, name: &str) -> Result<Vec<i64>> {
    let tensor = required(file, name)?;
    let size = tensor.size();
    if !matches!(size.as_slice(), [_] | [1, _]) || tensor.is_floating_point() {
        return Err(DatasetError::format(
            file.path(),
            format!(
                "{name} is a {:?} tensor of shape {size:?}; expected integers of shape [T]",
                tensor.kind()
            ),
        ));
    }
    Ok(Vec::<i64>::try_from(
        tensor.flatten(0, -1).to_kind(tch::Kind::Int64),
    )?)
}

/// Tensor `name` of `file`, or an error listing what the file holds.
fn required(file: &TorchFile, name: &str) -> Result<Tensor> {
    file.get(name)?.ok_or_else(|| {
        DatasetError::format(
            file.path(),
            format!(
                "no tensor {name}; the file holds {:?} (SpecForge's EAGLE-3 capture writes \
                 input_ids, loss_mask, hidden_state and aux_hidden_state; bool or int32 tensors \
                 are not read)",
                file.names()
            ),
        )
    })
}

/// Hidden states read from the capture files.
struct CaptureStates<'a> {
    /// The files by sequence id.
    files: HashMap<&'a str, &'a SourceFile>,
    hidden_size: usize,
    settings: ExtractionSettings,
}

impl CaptureStates<'_> {
    /// The final hidden state and the taps of `file`, whose first `len` of `full_len` positions
    /// are kept.
    fn read(&self, file: &SourceFile, len: usize, full_len: usize) -> Result<ExtractedFeatures> {
        let torch = TorchFile::open(&file.path)?;
        let kind = self.settings.dtype.kind();
        let rows = |name: &str, width: usize| -> Result<Tensor> {
            let tensor = required(&torch, name)?;
            let wanted = [full_len as i64, width as i64];
            let size = tensor.size();
            if size != wanted && size != [1, wanted[0], wanted[1]] {
                return Err(DatasetError::format(
                    &file.path,
                    format!(
                        "{name} has shape {size:?}; expected [1, {full_len}, {width}] ({} tokens, \
                         hidden size {}{})",
                        full_len,
                        self.hidden_size,
                        match width / self.hidden_size {
                            1 => String::new(),
                            n => format!(", {n} taps: --layers {:?}", self.settings.taps),
                        }
                    ),
                ));
            }
            Ok(tensor.view(wanted).narrow(0, 0, len as i64))
        };
        let hidden = rows("hidden_state", self.hidden_size)?.to_kind(kind);
        let taps = match self.settings.taps.len() {
            0 => Vec::new(),
            n => rows("aux_hidden_state", n * self.hidden_size)?
                .split(self.hidden_size as i64, 1)
                .iter()
                .map(|t| t.to_kind(kind).contiguous())
                .collect(),
        };
        Ok(ExtractedFeatures { hidden, taps })
    }
}

impl StateSource for CaptureStates<'_> {
    fn states(
        &mut self,
        sequences: &[PlannedSequence],
        members: &[usize],
        observer: &mut dyn PrepareObserver,
    ) -> Result<Vec<ExtractedFeatures>> {
        members
            .iter()
            .map(|&i| {
                let planned = &sequences[i];
                let file = self.files[planned.id.as_str()];
                let len = planned.sequence.input_ids.len();
                let features = self.read(file, len, planned.sequence.full_len)?;
                observer.batch_extracted(1, len);
                Ok(features)
            })
            .collect()
    }
}
