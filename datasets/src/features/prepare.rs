//! `prepare`: corpus → (optional self-distillation) → chat tokens → target features in shards.
//!
//! The run is a pure function of its [`Settings`]: conversations are taken in corpus order
//! (deduplicated, the first `max_seqs`), split by hash, formatted, and packed in that order into
//! shards of about `shard_tokens` tokens, train shards first. Each shard is written to a temporary
//! file and renamed, then the manifest is rewritten listing it with its checksum. Rerunning the
//! same command after a kill keeps every listed shard whose checksum still holds and redoes the
//! rest, so the finished directory is byte-identical to an uninterrupted run's.
//!
//! With a [`ShardSlice`] (`--shard I/N`) a run plans the whole corpus as above but extracts only
//! its slice of the planned shards; [`crate::features::merge`] joins N such directories into the
//! single run's.

use std::path::{Path, PathBuf};
use std::time::Instant;

use headway_model::files::{remove_stale_temp_files, write_bytes_atomically};
use headway_model::fingerprint::{bytes_sha256, file_sha256, target_fingerprint};
use headway_model::tokenizer::TextTokenizer;
use headway_model::{ChatTemplate, ModelConfig, Target};
use tch::Tensor;

use crate::chat_format::{end_of_turn_token, ChatFormatter, ChatSequence};
use crate::conversation::{dedupe, Conversation};
use crate::corpus::{read_corpus, CorpusFormat};
use crate::error::{DatasetError, Result};
use crate::features::extract::{length_buckets, ExtractedFeatures, FeatureExtractor};
use crate::features::feature_set::shard_file_matches;
use crate::features::manifest::{
    CorpusInfo, Counts, ExtractionSettings, Manifest, Settings, ShardEntry, ShardSlice, ShardSplit,
    TargetInfo, FEATURES_FORMAT,
};
use crate::features::shard::ShardData;
use crate::regenerate::{dedupe_for_regeneration, regenerate, replay_journal};
use crate::split::{split_of, Split};

/// File of the self-distillation journal inside the output directory.
pub const REGENERATED_FILE: &str = "regenerated.jsonl";

/// What `prepare` should do: which corpus, where to, and how.
#[derive(Debug, Clone)]
pub struct PrepareOptions {
    pub data: PathBuf,
    pub format: CorpusFormat,
    pub out: PathBuf,
    pub settings: ExtractionSettings,
    /// A regeneration journal (another run's `regenerated.jsonl`) whose replies replace the
    /// corpus's: only the conversations it records are used (`--replies`).
    pub replies: Option<PathBuf>,
    /// Extract only this slice of the planned shards (`--shard I/N`); `None`: all of them.
    pub slice: Option<ShardSlice>,
    /// Recorded in the manifest.
    pub command: Vec<String>,
}

/// The extraction work once sequences are planned.
#[derive(Debug, Clone)]
pub struct ExtractionPlan {
    pub sequences: usize,
    pub tokens: usize,
    pub shards: usize,
    /// Already finished by an earlier run (kept).
    pub done_shards: usize,
    pub done_sequences: usize,
    pub done_tokens: usize,
    /// Bytes all shards will take.
    pub estimated_bytes: u64,
}

/// Hooks for progress display; every method has a no-op default.
pub trait PrepareObserver {
    /// A line worth showing the user (what was read, skipped, resumed).
    fn message(&mut self, _text: &str) {}
    fn regeneration_started(&mut self, _conversations: usize) {}
    fn conversation_regenerated(&mut self, _new_tokens: usize) {}
    fn extraction_started(&mut self, _plan: &ExtractionPlan) {}
    fn batch_extracted(&mut self, _sequences: usize, _tokens: usize) {}
    fn shard_written(&mut self, _entry: &ShardEntry) {}
}

/// An observer that shows nothing.
pub struct Quiet;
impl PrepareObserver for Quiet {}

/// What a run did.
#[derive(Debug, Clone)]
pub struct PrepareSummary {
    pub manifest: Manifest,
    pub shards_written: usize,
    pub shards_kept: usize,
    /// Tokens run through the target in this run, and the seconds that took.
    pub tokens_extracted: usize,
    pub extraction_seconds: f64,
    pub seconds: f64,
}

pub(crate) struct PlannedSequence {
    pub id: String,
    pub split: ShardSplit,
    pub sequence: ChatSequence,
}

struct PlannedShard {
    file: String,
    split: ShardSplit,
    /// Indices into the planned sequences, in corpus order.
    members: Vec<usize>,
}

/// Runs (or resumes) `prepare` into `options.out` with `target`.
pub fn prepare(
    target: &Target,
    options: &PrepareOptions,
    observer: &mut dyn PrepareObserver,
) -> Result<PrepareSummary> {
    let start = Instant::now();
    check_options(target, options)?;
    let settings = settings(target, options)?;
    let previous = open_output(&options.out, &settings, options.slice, observer)?;
    let (conversations, mut counts) = read_conversations(options, observer)?;
    let conversations = match &settings.extraction.regenerate {
        Some(regen) => {
            // The manifest goes first, so the journal is tied to these settings.
            if previous.is_none() {
                empty_manifest(&settings, &counts, options.slice, &options.command)
                    .write(&options.out)?;
            }
            observer.regeneration_started(conversations.len());
            regenerate(
                target,
                &conversations,
                options.settings.max_len,
                regen,
                &options.out.join(REGENERATED_FILE),
                &mut |_, tokens| observer.conversation_regenerated(tokens),
            )?
        }
        None => conversations,
    };
    let sequences = format_all(target, &conversations, options, &mut counts, observer)?;
    let mut source = TargetStates {
        target,
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

/// Creates `out` (removing an interrupted run's temporary files) and returns the manifest already
/// there, refused when it was made with other settings or for another slice.
pub(crate) fn open_output(
    out: &Path,
    settings: &Settings,
    slice: Option<ShardSlice>,
    observer: &mut dyn PrepareObserver,
) -> Result<Option<Manifest>> {
    std::fs::create_dir_all(out).map_err(|e| DatasetError::io(out, e))?;
    let stale = remove_stale_temp_files(out)?;
    if stale > 0 {
        observer.message(&format!(
            "removed {stale} temporary file(s) of an interrupted run"
        ));
    }
    let previous = Manifest::read(out)?;
    if let Some(previous) = &previous {
        check_same_settings(out, &previous.settings, settings)?;
        check_same_slice(out, previous.slice, slice)?;
    }
    Ok(previous)
}

/// A run whose sequences are known: what remains is to plan its shards, keep those an earlier
/// run finished, and write the rest with hidden states from a [`StateSource`].
pub(crate) struct PlannedRun<'a> {
    pub out: &'a Path,
    pub settings: Settings,
    pub counts: Counts,
    pub sequences: Vec<PlannedSequence>,
    /// The manifest an earlier run left in `out` (checked by [`open_output`]).
    pub previous: Option<Manifest>,
    pub slice: Option<ShardSlice>,
    pub command: Vec<String>,
}

impl PlannedRun<'_> {
    /// Plans, resumes and writes the shards; `start` is when the run began (for its summary).
    pub(crate) fn extract(
        self,
        source: &mut dyn StateSource,
        observer: &mut dyn PrepareObserver,
        start: Instant,
    ) -> Result<PrepareSummary> {
        let out = self.out;
        let plan: Vec<PlannedShard> =
            plan_shards(&self.sequences, self.settings.extraction.shard_tokens)
                .into_iter()
                .enumerate()
                .filter(|&(position, _)| self.slice.is_none_or(|slice| slice.holds(position)))
                .map(|(_, shard)| shard)
                .collect();
        let mut manifest = Manifest {
            planned_shards: plan.len(),
            ..empty_manifest(&self.settings, &self.counts, self.slice, &self.command)
        };
        manifest.shards = reusable_shards(out, self.previous.as_ref(), &plan)?;
        let shards_kept = manifest.shards.len();
        if shards_kept > 0 {
            observer.message(&format!(
                "resuming: {shards_kept} of {} shards already done and verified",
                plan.len()
            ));
        }
        manifest.write(out)?;
        observer.extraction_started(&extraction_plan(
            &self.sequences,
            &plan,
            shards_kept,
            &self.settings,
        ));
        let extract_start = Instant::now();
        let mut tokens_extracted = 0;
        for shard in &plan[shards_kept..] {
            let entry = write_shard(
                source,
                &self.settings,
                out,
                shard,
                &self.sequences,
                observer,
            )?;
            tokens_extracted += entry.tokens;
            manifest.shards.push(entry);
            manifest.write(out)?;
            observer.shard_written(manifest.shards.last().expect("just pushed"));
        }
        let extraction_seconds = extract_start.elapsed().as_secs_f64();
        manifest.complete = true;
        manifest.write(out)?;
        Ok(PrepareSummary {
            shards_written: plan.len() - shards_kept,
            shards_kept,
            tokens_extracted,
            extraction_seconds,
            seconds: start.elapsed().as_secs_f64(),
            manifest,
        })
    }
}

/// Where a shard's hidden states come from: the target run over the tokens, or files another
/// engine captured ([`crate::features::specforge`]).
pub(crate) trait StateSource {
    /// The features of `members` (indices into `sequences`), in that order; reports progress to
    /// `observer` as it goes.
    fn states(
        &mut self,
        sequences: &[PlannedSequence],
        members: &[usize],
        observer: &mut dyn PrepareObserver,
    ) -> Result<Vec<ExtractedFeatures>>;
}

/// The target's forwards over length-bucketed batches.
struct TargetStates<'a> {
    target: &'a Target,
    settings: ExtractionSettings,
}

impl StateSource for TargetStates<'_> {
    fn states(
        &mut self,
        sequences: &[PlannedSequence],
        members: &[usize],
        observer: &mut dyn PrepareObserver,
    ) -> Result<Vec<ExtractedFeatures>> {
        let ids: Vec<&[u32]> = members
            .iter()
            .map(|&i| sequences[i].sequence.input_ids.as_slice())
            .collect();
        let e = &self.settings;
        let extractor = FeatureExtractor {
            model: &self.target.model.model,
            device: self.target.device,
            taps: &e.taps,
            batch_tokens: e.batch_tokens,
            output_kind: e.dtype.kind(),
            cpu: self.target.cpu.batch(),
        };
        let lengths: Vec<usize> = ids.iter().map(|s| s.len()).collect();
        let mut features: Vec<Option<ExtractedFeatures>> = (0..ids.len()).map(|_| None).collect();
        for batch in length_buckets(&lengths, e.batch_tokens) {
            let extracted = extractor.run_batch(&ids, &batch)?;
            observer.batch_extracted(batch.len(), batch.iter().map(|&i| lengths[i]).sum());
            for (i, f) in batch.into_iter().zip(extracted) {
                features[i] = Some(f);
            }
        }
        Ok(features
            .into_iter()
            .map(|f| f.expect("every member is in a batch"))
            .collect())
    }
}

fn check_options(target: &Target, options: &PrepareOptions) -> Result<()> {
    let invalid = |m: String| Err(DatasetError::Argument(m));
    let o = &options.settings;
    o.check(target.model.config().num_hidden_layers, "--layers")?;
    if o.batch_tokens == 0 {
        return invalid("--batch-tokens must be at least 1".into());
    }
    if o.regenerate
        .is_some_and(|r| r.batch == 0 || r.max_turns == Some(0))
    {
        return invalid("--regen-batch and --regen-turns must be at least 1".into());
    }
    if o.regenerate.is_some() && options.replies.is_some() {
        return invalid(
            "--replies takes the replies of a regeneration made before, --regenerate makes one \
             (resuming from OUT/regenerated.jsonl): give one of them"
                .into(),
        );
    }
    if o.regenerate.is_some() && options.slice.is_some() {
        // Regenerated replies decide every sequence's length and so where shards close: each
        // slice would have to regenerate the whole corpus to plan its part.
        return invalid(
            "--shard with --regenerate: regeneration decides the whole run's shard plan; \
             regenerate in one run, or split the corpus into files and prepare each"
                .into(),
        );
    }
    Ok(())
}

fn settings(target: &Target, options: &PrepareOptions) -> Result<Settings> {
    if target.chat_template.is_none() {
        return Err(DatasetError::Argument(format!(
            "target {} has no chat template; prepare renders conversations with it",
            target.path.display()
        )));
    }
    if end_of_turn_token(&target.tokenizer).is_none() {
        return Err(DatasetError::Argument(
            "the target's tokenizer has no <|im_end|> or <|eot_id|>".into(),
        ));
    }
    let replies = match &options.replies {
        Some(journal) => Some(file_info(journal, "regeneration-journal")?),
        None => None,
    };
    Ok(Settings {
        target: target_info(
            &target.path,
            target.model.config(),
            &target.tokenizer,
            target.chat_template.as_ref(),
        )?,
        corpus: file_info(&options.data, options.format.name())?,
        replies,
        extraction: options.settings.clone(),
        device_type: if target.device.is_cuda() {
            "cuda"
        } else {
            "cpu"
        }
        .to_string(),
    })
}

/// What a manifest records of the input file at `path`, read as `format`.
fn file_info(path: &Path, format: &str) -> Result<CorpusInfo> {
    let bytes = std::fs::metadata(path)
        .map_err(|e| DatasetError::io(path, e))?
        .len();
    Ok(CorpusInfo {
        path: path.display().to_string(),
        format: format.to_string(),
        bytes,
        sha256: file_sha256(path)?,
    })
}

/// What a manifest records of the target at `path` (a model directory or a GGUF file) with
/// `config`, `tokenizer` and `template` (`None`: the template's hash is recorded as `none`).
pub fn target_info(
    path: &Path,
    config: &ModelConfig,
    tokenizer: &TextTokenizer,
    template: Option<&ChatTemplate>,
) -> Result<TargetInfo> {
    // A GGUF target's tokenizer is built from its metadata: hash it as `convert` writes it.
    let tokenizer_sha256 = match path.is_file() {
        true => bytes_sha256(tokenizer.to_json()?.as_bytes()),
        false => file_sha256(&path.join("tokenizer.json"))?,
    };
    Ok(TargetInfo {
        dir: path.display().to_string(),
        fingerprint: target_fingerprint(path)?,
        architecture: format!("{:?}", config.architecture),
        hidden_size: config.hidden_size,
        num_hidden_layers: config.num_hidden_layers,
        vocab_size: config.vocab_size,
        tokenizer_sha256,
        chat_template_sha256: template.map_or("none".to_string(), |t| {
            bytes_sha256(t.identity().as_bytes())
        }),
        end_of_turn: end_of_turn_token(tokenizer).unwrap_or_default().to_string(),
    })
}

fn check_same_settings(out: &Path, previous: &Settings, settings: &Settings) -> Result<()> {
    let differences = previous.differences(settings, ("in the directory", "now"));
    if differences.is_empty() {
        return Ok(());
    }
    Err(DatasetError::features(
        out,
        format!(
            "the directory holds features made with other settings ({}); use another --out or \
             delete it",
            differences.join("; ")
        ),
    ))
}

fn check_same_slice(
    out: &Path,
    previous: Option<ShardSlice>,
    slice: Option<ShardSlice>,
) -> Result<()> {
    if previous == slice {
        return Ok(());
    }
    let name =
        |s: Option<ShardSlice>| s.map_or("all shards".to_string(), |s| format!("--shard {s}"));
    Err(DatasetError::features(
        out,
        format!(
            "the directory holds {} and this run asks for {}; use another --out",
            name(previous),
            name(slice)
        ),
    ))
}

fn empty_manifest(
    settings: &Settings,
    counts: &Counts,
    slice: Option<ShardSlice>,
    command: &[String],
) -> Manifest {
    Manifest {
        format: FEATURES_FORMAT.to_string(),
        complete: false,
        settings: settings.clone(),
        counts: counts.clone(),
        planned_shards: 0,
        shards: Vec::new(),
        command: command.to_vec(),
        slice,
    }
}

/// Reads, dedupes (when regenerating, also by what the target will be asked), puts in the
/// replies of `--replies` (keeping only the conversations it records) and selects the
/// conversations.
fn read_conversations(
    options: &PrepareOptions,
    observer: &mut dyn PrepareObserver,
) -> Result<(Vec<Conversation>, Counts)> {
    let corpus = read_corpus(&options.data, options.format)?;
    observer.message(&format!("{}: {}", options.data.display(), corpus.report));
    let (unique, mut duplicates_dropped) = dedupe(corpus.conversations);
    let mut unique = match &options.settings.regenerate {
        Some(regen) => {
            let (kept, dropped) = dedupe_for_regeneration(unique, regen.max_turns);
            duplicates_dropped += dropped;
            kept
        }
        None => match &options.replies {
            Some(journal) => replay_journal(unique, journal)?,
            None => unique,
        },
    };
    unique.truncate(options.settings.max_seqs.unwrap_or(usize::MAX));
    let counts = Counts {
        corpus: corpus.report,
        duplicates_dropped,
        conversations_used: unique.len(),
        ..Counts::default()
    };
    Ok((unique, counts))
}

/// Formats every conversation; skips (and counts) those that fail or keep no assistant token.
fn format_all(
    target: &Target,
    conversations: &[Conversation],
    options: &PrepareOptions,
    counts: &mut Counts,
    observer: &mut dyn PrepareObserver,
) -> Result<Vec<PlannedSequence>> {
    let template = target
        .chat_template
        .as_ref()
        .expect("checked in settings()");
    let end_of_turn = end_of_turn_token(&target.tokenizer).expect("checked in settings()");
    let formatter = ChatFormatter::new(template, &target.tokenizer, end_of_turn)?;
    let mut sequences = Vec::new();
    for conversation in conversations {
        let sequence = match formatter.format(conversation, options.settings.max_len) {
            Ok(sequence) => sequence,
            Err(e) => {
                if counts.format_errors < 3 {
                    observer.message(&format!("skipped: {e}"));
                }
                counts.format_errors += 1;
                continue;
            }
        };
        let split = split_of(conversation, options.settings.held_out_fraction)?;
        admit(&mut sequences, counts, &conversation.id, split, sequence);
    }
    Ok(sequences)
}

/// Plans `sequence` (counting it) unless it has no assistant token left (counted as skipped).
pub(crate) fn admit(
    sequences: &mut Vec<PlannedSequence>,
    counts: &mut Counts,
    id: &str,
    split: Split,
    sequence: ChatSequence,
) {
    let assistant_tokens = sequence.loss_mask.iter().filter(|&&m| m == 1).count();
    if assistant_tokens == 0 {
        counts.no_assistant_tokens += 1;
        return;
    }
    counts.sequences += 1;
    let split = match split {
        Split::Train => {
            counts.train_sequences += 1;
            ShardSplit::Train
        }
        Split::HeldOut => {
            counts.held_out_sequences += 1;
            ShardSplit::HeldOut
        }
    };
    counts.tokens += sequence.input_ids.len();
    counts.assistant_tokens += assistant_tokens;
    counts.truncated += usize::from(sequence.truncated());
    sequences.push(PlannedSequence {
        id: id.to_string(),
        split,
        sequence,
    });
}

/// Train shards then held-out shards, each closed once it holds `shard_tokens` tokens.
fn plan_shards(sequences: &[PlannedSequence], shard_tokens: usize) -> Vec<PlannedShard> {
    let mut plan = Vec::new();
    for split in [ShardSplit::Train, ShardSplit::HeldOut] {
        let mut members = Vec::new();
        let mut tokens = 0;
        let mut index = 0;
        let mut close = |members: &mut Vec<usize>, plan: &mut Vec<PlannedShard>| {
            plan.push(PlannedShard {
                file: format!("{}-{index:05}.safetensors", split.name()),
                split,
                members: std::mem::take(members),
            });
            index += 1;
        };
        for (i, planned) in sequences
            .iter()
            .enumerate()
            .filter(|(_, s)| s.split == split)
        {
            members.push(i);
            tokens += planned.sequence.input_ids.len();
            if tokens >= shard_tokens {
                close(&mut members, &mut plan);
                tokens = 0;
            }
        }
        if !members.is_empty() {
            close(&mut members, &mut plan);
        }
    }
    plan
}

/// The leading shards of `previous` that match the plan and whose files still verify.
fn reusable_shards(
    out: &Path,
    previous: Option<&Manifest>,
    plan: &[PlannedShard],
) -> Result<Vec<ShardEntry>> {
    let mut kept = Vec::new();
    let Some(previous) = previous else {
        return Ok(kept);
    };
    for (entry, planned) in previous.shards.iter().zip(plan) {
        let intact = entry.file == planned.file
            && entry.sequences == planned.members.len()
            && shard_file_matches(out, entry)?;
        if !intact {
            break;
        }
        kept.push(entry.clone());
    }
    Ok(kept)
}

fn extraction_plan(
    sequences: &[PlannedSequence],
    plan: &[PlannedShard],
    done_shards: usize,
    settings: &Settings,
) -> ExtractionPlan {
    let tokens_of = |shards: &[PlannedShard]| -> usize {
        shards
            .iter()
            .flat_map(|s| &s.members)
            .map(|&i| sequences[i].sequence.input_ids.len())
            .sum()
    };
    let tokens = tokens_of(plan);
    let planned_sequences: usize = plan.iter().map(|s| s.members.len()).sum();
    // Per token: ids (4) + mask (1) + hidden and taps; per sequence: one offset (8).
    let e = &settings.extraction;
    let per_token = 5 + settings.target.hidden_size * (1 + e.taps.len()) * e.dtype.bytes();
    ExtractionPlan {
        sequences: planned_sequences,
        tokens,
        shards: plan.len(),
        done_shards,
        done_sequences: plan[..done_shards].iter().map(|s| s.members.len()).sum(),
        done_tokens: tokens_of(&plan[..done_shards]),
        estimated_bytes: (tokens * per_token + planned_sequences * 8) as u64,
    }
}

/// Extracts, writes (atomically) and describes one shard.
fn write_shard(
    source: &mut dyn StateSource,
    settings: &Settings,
    out: &Path,
    shard: &PlannedShard,
    sequences: &[PlannedSequence],
    observer: &mut dyn PrepareObserver,
) -> Result<ShardEntry> {
    let features = source.states(sequences, &shard.members, observer)?;
    let members: Vec<&ChatSequence> = shard
        .members
        .iter()
        .map(|&i| &sequences[i].sequence)
        .collect();
    let e = &settings.extraction;
    let data = assemble(shard, sequences, &members, &features, e.taps.len());
    let path = out.join(&shard.file);
    let bytes = data.to_bytes(&e.taps, &path)?;
    let written = write_bytes_atomically(&path, &bytes)?;
    Ok(ShardEntry {
        file: shard.file.clone(),
        split: shard.split,
        sequences: members.len(),
        tokens: members.iter().map(|s| s.input_ids.len()).sum(),
        assistant_tokens: members
            .iter()
            .map(|s| s.loss_mask.iter().filter(|&&m| m == 1).count())
            .sum(),
        bytes: written,
        sha256: bytes_sha256(&bytes),
    })
}

/// Concatenates a shard's sequences and their features in plan order.
fn assemble(
    shard: &PlannedShard,
    sequences: &[PlannedSequence],
    members: &[&ChatSequence],
    features: &[ExtractedFeatures],
    taps: usize,
) -> ShardData {
    let mut offsets = vec![0i64];
    let mut ids: Vec<i32> = Vec::new();
    let mut mask: Vec<u8> = Vec::new();
    for sequence in members {
        ids.extend(sequence.input_ids.iter().map(|&t| t as i32));
        mask.extend(&sequence.loss_mask);
        offsets.push(ids.len() as i64);
    }
    let cat = |pick: &dyn Fn(&ExtractedFeatures) -> &Tensor| {
        Tensor::cat(&features.iter().map(pick).collect::<Vec<_>>(), 0)
    };
    ShardData {
        sequence_ids: shard
            .members
            .iter()
            .map(|&i| sequences[i].id.clone())
            .collect(),
        offsets,
        input_ids: Tensor::from_slice(&ids),
        loss_mask: Tensor::from_slice(&mask),
        hidden: cat(&|f| &f.hidden),
        taps: (0..taps).map(|k| cat(&|f| &f.taps[k])).collect(),
    }
}
