//! `prepare` on a tiny random target: stored features equal a fresh forward, resumes keep what is
//! intact, and every kind of damage is named.

use std::path::{Path, PathBuf};

use headway_datasets::features::{
    merge, prepare, ExtractionSettings, FeatureSet, Manifest, PrepareOptions, Quiet,
    RegenerateSettings, ShardSlice, ShardSplit,
};
use headway_datasets::{CorpusFormat, DatasetError};
use headway_model::mask::positions;
use headway_model::testing::write_tiny_model;
use headway_model::{
    generate, CpuThreads, Dtype, ForwardInput, Message, Sampler, SamplingParams, Target,
};
use tch::{Device, Kind, Tensor};

/// Twelve chats of varied length (two with a system prompt, one multi-turn).
fn write_corpus(dir: &Path) -> PathBuf {
    let mut lines = Vec::new();
    for i in 0..12 {
        let mut messages = Vec::new();
        if i % 5 == 0 {
            messages.push(serde_json::json!({"role": "system", "content": "Be brief."}));
        }
        messages.push(serde_json::json!({"role": "user", "content": format!("Question {i}: {}", "why? ".repeat(i % 4 + 1))}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("Answer {i}. {}", "because it is so. ".repeat(i % 3 + 1))}));
        if i == 7 {
            messages.push(serde_json::json!({"role": "user", "content": "And then?"}));
            messages.push(serde_json::json!({"role": "assistant", "content": "Then nothing."}));
        }
        lines
            .push(serde_json::json!({"id": format!("chat-{i}"), "messages": messages}).to_string());
    }
    let path = dir.join("chats.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

fn options(data: &Path, out: &Path) -> PrepareOptions {
    PrepareOptions {
        data: data.to_path_buf(),
        format: CorpusFormat::JsonlChat,
        out: out.to_path_buf(),
        settings: ExtractionSettings {
            max_seqs: None,
            max_len: 96,
            held_out_fraction: 0.25,
            regenerate: None,
            taps: vec![0, 1],
            dtype: Dtype::F32,
            shard_tokens: 250,
            batch_tokens: 200,
        },
        replies: None,
        slice: None,
        command: vec!["test".into()],
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    target: Target,
    data: PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    write_tiny_model(&root.join("target"), 7).unwrap();
    let target = Target::load(
        &root.join("target"),
        Kind::Float,
        Device::Cpu,
        CpuThreads::new(2),
    )
    .unwrap();
    let data = write_corpus(&root);
    Fixture {
        _dir: dir,
        root,
        target,
        data,
    }
}

/// Final hidden state and taps 0 and 1 of `ids` run alone (no batching, no padding).
fn forward_alone(target: &Target, ids: &Tensor) -> (Tensor, Vec<Tensor>) {
    let _guard = tch::no_grad_guard();
    let ids = ids.to_kind(Kind::Int64).unsqueeze(0);
    let len = ids.size()[1] as usize;
    let out = target
        .model
        .model
        .forward(
            &ForwardInput {
                input_ids: &ids,
                positions: &positions(0, len, Device::Cpu),
                mask: None,
                taps: &[0, 1],
                cpu: &target.cpu.batch(),
            },
            None,
        )
        .unwrap();
    (
        out.hidden.squeeze_dim(0),
        out.taps.iter().map(|t| t.squeeze_dim(0)).collect(),
    )
}

/// Every shard file of `dir` by name, with its bytes.
fn shard_files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

#[test]
fn stored_features_equal_a_fresh_forward_of_each_sequence() {
    let f = fixture();
    let out = f.root.join("features");
    let summary = prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let manifest = &summary.manifest;
    assert!(manifest.complete);
    assert!(
        manifest.shards.len() >= 3,
        "{} shards",
        manifest.shards.len()
    );
    assert_eq!(manifest.counts.sequences, 12);
    let set = FeatureSet::open(&out).unwrap();
    let (mut sequences, mut tokens) = (0, 0);
    let mut splits = Vec::new();
    for (index, entry) in manifest.shards.iter().enumerate() {
        splits.push(entry.split);
        let shard = set.load_shard(index).unwrap();
        for i in 0..shard.len() {
            let seq = shard.sequence(i);
            let (hidden, taps) = forward_alone(&f.target, &seq.input_ids);
            assert!(
                max_diff(&seq.hidden, &hidden) < 1e-4,
                "{} hidden",
                shard.sequence_ids[i]
            );
            for (stored, fresh) in seq.taps.iter().zip(&taps) {
                assert!(
                    max_diff(stored, fresh) < 1e-4,
                    "{} tap",
                    shard.sequence_ids[i]
                );
            }
            // Taps differ from each other and from the output: they are really other layers.
            assert!(max_diff(&seq.taps[0], &seq.taps[1]) > 1e-3);
            let masked = i64::try_from(seq.loss_mask.sum(Kind::Int64)).unwrap();
            assert!(masked > 0);
            sequences += 1;
            tokens += seq.input_ids.size()[0] as usize;
        }
    }
    assert_eq!(
        (sequences, tokens),
        (manifest.counts.sequences, manifest.counts.tokens)
    );
    // Train shards come first, then held-out ones; both are present at a 25% held-out fraction.
    let first_held_out = splits
        .iter()
        .position(|&s| s == ShardSplit::HeldOut)
        .unwrap();
    assert!(
        first_held_out > 0
            && splits[first_held_out..]
                .iter()
                .all(|&s| s == ShardSplit::HeldOut)
    );
    // Tap 0 is the embedding: exactly the embedding rows of the ids.
    let shard = set.load_shard(0).unwrap();
    let seq = shard.sequence(0);
    let embedded = f
        .target
        .model
        .model
        .embed_tokens()
        .index_select(0, &seq.input_ids.to_kind(Kind::Int64));
    assert!(max_diff(&seq.taps[0], &embedded) < 1e-6);
}

#[test]
fn real_smollm2_features_equal_a_fresh_forward_in_padded_batches() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("docs.txt");
    let docs = [
        "The quick brown fox jumps over the lazy dog.",
        "Rust is a systems programming language.\nIt is fast and memory safe, and it has a helpful compiler.",
        "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    ];
    std::fs::write(&data, docs.join("\n\n")).unwrap();
    let target = Target::load(
        &headway_model::testing::real_target_dir(),
        Kind::Float,
        Device::Cpu,
        CpuThreads::new(2),
    )
    .unwrap();
    let out = dir.path().join("features");
    let mut opts = PrepareOptions {
        format: CorpusFormat::PlainText,
        ..options(&data, &out)
    };
    opts.settings.held_out_fraction = 0.0;
    opts.settings.taps = vec![0, 1];
    opts.settings.batch_tokens = 128;
    prepare(&target, &opts, &mut Quiet).unwrap();
    let set = FeatureSet::open(&out).unwrap();
    let shard = set.load_shard(0).unwrap();
    assert_eq!(shard.len(), 3);
    for i in 0..shard.len() {
        let seq = shard.sequence(i);
        let (hidden, _) = forward_alone(&target, &seq.input_ids);
        let scale = hidden.abs().max().double_value(&[]);
        let diff = max_diff(&seq.hidden, &hidden);
        assert!(
            diff <= 1e-5 * scale,
            "sequence {i}: max |diff| {diff}, scale {scale}"
        );
    }
}

#[test]
fn a_rerun_keeps_intact_shards_and_redoes_damaged_ones_to_the_same_bytes() {
    let f = fixture();
    let out = f.root.join("features");
    let first = prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let files: Vec<String> = first
        .manifest
        .shards
        .iter()
        .map(|s| s.file.clone())
        .collect();
    let original: Vec<Vec<u8>> = files
        .iter()
        .map(|n| std::fs::read(out.join(n)).unwrap())
        .collect();
    let manifest_text = std::fs::read(out.join("manifest.json")).unwrap();

    let again = prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    assert_eq!((again.shards_kept, again.shards_written), (files.len(), 0));

    // Damage shard 1: it and every later shard are redone; the result is byte-identical.
    let mut bytes = original[1].clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(out.join(&files[1]), bytes).unwrap();
    std::fs::write(
        out.join(".train-00009.safetensors.abc.tmp"),
        b"half a shard",
    )
    .unwrap();
    let redo = prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    assert_eq!(redo.shards_kept, 1);
    assert_eq!(redo.shards_written, files.len() - 1);
    for (name, bytes) in files.iter().zip(&original) {
        assert!(
            std::fs::read(out.join(name)).unwrap() == *bytes,
            "{name} differs"
        );
    }
    assert_eq!(
        std::fs::read(out.join("manifest.json")).unwrap(),
        manifest_text
    );
    assert!(!out.join(".train-00009.safetensors.abc.tmp").exists());
}

#[test]
fn other_settings_in_the_same_directory_are_refused_by_name() {
    let f = fixture();
    let out = f.root.join("features");
    prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let mut other = options(&f.data, &out);
    other.settings.max_len = 64;
    other.settings.dtype = Dtype::Bf16;
    let err = prepare(&f.target, &other, &mut Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("max_len: 96 in the directory, 64 now"),
        "{err}"
    );
    assert!(
        err.contains("dtype: \"f32\" in the directory, \"bf16\" now"),
        "{err}"
    );
}

#[test]
fn a_corrupt_shard_and_another_target_are_named() {
    let f = fixture();
    let out = f.root.join("features");
    let summary = prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let set = FeatureSet::open(&out).unwrap();
    assert!(set.verify().is_empty());

    let name = &summary.manifest.shards[2].file;
    let path = out.join(name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[200] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let err = set.load_shard(2).unwrap_err().to_string();
    assert!(
        err.contains(name.as_str()) && err.contains("checksum mismatch"),
        "{err}"
    );
    let problems = set.verify();
    assert_eq!(problems.len(), 1);
    assert_eq!(&problems[0].file, name);
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = set.load_shard(2).unwrap_err().to_string();
    assert!(
        err.contains(name.as_str()) && err.contains("truncated"),
        "{err}"
    );

    let other = f.root.join("other-target");
    write_tiny_model(&other, 8).unwrap();
    let fingerprint = headway_model::fingerprint::target_fingerprint(&other).unwrap();
    let err = set.check_target(&fingerprint, &other).unwrap_err();
    assert!(matches!(err, DatasetError::TargetMismatch { .. }));
    let text = err.to_string();
    assert!(
        text.contains(&fingerprint) && text.contains("other-target"),
        "{text}"
    );
    assert!(
        text.contains(&summary.manifest.settings.target.fingerprint),
        "{text}"
    );
}

/// Property test (issue 23): seeded truncations and bit flips of the manifest and of a shard of
/// each split, each opened as the trainer opens features (the manifest, then every shard). Every
/// error names the file; nothing loads corrupted (a shard's size and SHA-256 are in the manifest,
/// the manifest carries its own SHA-256).
#[test]
fn corrupted_features_give_named_errors_never_panics() {
    use headway_model::testing::corruption_trial;
    use rand::SeedableRng;
    let f = fixture();
    let out = f.root.join("features");
    let summary = prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let first_of = |split| {
        summary
            .manifest
            .shards
            .iter()
            .find(|s| s.split == split)
            .unwrap()
            .file
            .clone()
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(23);
    let open = || -> Result<(), DatasetError> {
        let set = FeatureSet::open(&out)?;
        for index in 0..set.manifest.shards.len() {
            set.load_shard(index)?;
        }
        Ok(())
    };
    for file in [
        "manifest.json".to_string(),
        first_of(ShardSplit::Train),
        first_of(ShardSplit::HeldOut),
    ] {
        // A flip in the manifest may make a shard's recorded size or checksum wrong: the error
        // then names the shard and says the manifest disagrees.
        let named = |message: &str| message.contains(&file) || message.contains("manifest");
        let tally = corruption_trial(&out.join(&file), usize::MAX, 300, &mut rng, open, named);
        eprintln!("{file}: {tally:?}");
        assert_eq!(tally.opened, 0, "{file}: checksummed, never read corrupted");
    }
}

#[test]
fn an_unfinished_directory_is_not_opened_as_features() {
    let f = fixture();
    let out = f.root.join("features");
    prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let mut manifest = Manifest::read(&out).unwrap().unwrap();
    manifest.complete = false;
    manifest.write(&out).unwrap();
    let err = FeatureSet::open(&out).err().unwrap().to_string();
    assert!(
        err.contains("did not finish") && err.contains("resume"),
        "{err}"
    );
    let err = FeatureSet::open(&f.root).err().unwrap().to_string();
    assert!(err.contains("no manifest.json"), "{err}");
}

/// A manifest written by a newer format is refused by name, not half read (issue 19).
#[test]
fn a_manifest_with_keys_this_version_does_not_know_is_refused() {
    let f = fixture();
    let out = f.root.join("features");
    prepare(&f.target, &options(&f.data, &out), &mut Quiet).unwrap();
    let path = out.join("manifest.json");
    let mut original: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    // An edit under the manifest's own checksum is damage; without one (a manifest written before
    // the checksum, or edited by hand) the keys are what is checked.
    let mut edited = original.clone();
    edited["settings"]["rope"] = 1.into();
    std::fs::write(&path, edited.to_string()).unwrap();
    let err = FeatureSet::open(&out).err().unwrap().to_string();
    assert!(err.contains("manifest.json is damaged"), "{err}");
    original.as_object_mut().unwrap().remove("sha256").unwrap();
    for (edit, key) in [
        (
            &(|v: &mut serde_json::Value| v["settings"]["rope"] = 1.into())
                as &dyn Fn(&mut serde_json::Value),
            "settings.rope",
        ),
        (
            &|v: &mut serde_json::Value| v["shards"][0]["crc"] = 1.into(),
            "shards[0].crc",
        ),
        (
            &|v: &mut serde_json::Value| v["settings"]["target"]["dtype"] = "bf16".into(),
            "settings.target.dtype",
        ),
    ] {
        let mut value = original.clone();
        edit(&mut value);
        std::fs::write(&path, value.to_string()).unwrap();
        let err = FeatureSet::open(&out).err().unwrap().to_string();
        assert!(err.contains(&format!("unknown key `{key}`")), "{err}");
    }
    let mut newer = original.clone();
    newer["format"] = "headway-features/2".into();
    newer["extra"] = 1.into();
    std::fs::write(&path, newer.to_string()).unwrap();
    let err = FeatureSet::open(&out).err().unwrap().to_string();
    assert!(err.contains("headway-features/2"), "{err}");
    std::fs::write(&path, original.to_string()).unwrap();
    assert!(FeatureSet::open(&out).is_ok());
}

#[test]
fn regeneration_uses_the_targets_own_replies_and_resumes_after_a_torn_line() {
    let f = fixture();
    let out = f.root.join("features");
    let mut opts = options(&f.data, &out);
    opts.settings.max_seqs = Some(3);
    opts.settings.regenerate = Some(RegenerateSettings {
        sampling: SamplingParams::default(),
        max_new_tokens: 12,
        batch: 2,
        max_turns: None,
    });
    prepare(&f.target, &opts, &mut Quiet).unwrap();
    let journal_path = out.join("regenerated.jsonl");
    let journal = std::fs::read_to_string(&journal_path).unwrap();
    let lines: Vec<serde_json::Value> = journal
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    // The first regenerated reply is what greedy generation gives for its prompt: the corpus's
    // turns before its first reply.
    let first = lines
        .iter()
        .find(|l| !l["replies"].as_array().unwrap().is_empty())
        .expect("a conversation with a regenerated reply");
    let corpus: Vec<serde_json::Value> = std::fs::read_to_string(&f.data)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let asked = corpus
        .iter()
        .find(|c| c["id"] == first["id"])
        .expect("the journal names a corpus conversation");
    let prompt: Vec<Message> = asked["messages"]
        .as_array()
        .unwrap()
        .iter()
        .take_while(|m| m["role"] != "assistant")
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    let ids = f.target.chat_prompt_ids(&prompt).unwrap();
    let mut sampler = Sampler::new(SamplingParams::default());
    let reply = generate(&f.target, &ids, 12, &mut sampler, &mut |_| {}).unwrap();
    assert_eq!(first["replies"][0].as_str().unwrap(), reply.text);
    assert!(
        !reply.text.starts_with("Answer"),
        "the corpus reply was kept"
    );

    // Tear the journal after one and a half lines and rerun: the same journal and shards.
    let shards = shard_files(&out);
    let cut =
        journal.find('\n').unwrap() + 1 + journal[journal.find('\n').unwrap() + 1..].len() / 2;
    std::fs::write(&journal_path, &journal[..cut]).unwrap();
    std::fs::remove_file(out.join("manifest.json")).unwrap();
    for entry in std::fs::read_dir(&out).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            std::fs::remove_file(path).unwrap();
        }
    }
    prepare(&f.target, &opts, &mut Quiet).unwrap();
    assert_eq!(std::fs::read_to_string(&journal_path).unwrap(), journal);
    assert!(
        shard_files(&out) == shards,
        "regenerated shards differ after the resume"
    );
}

/// A journal made by one run (here a regeneration of every turn) replayed by another with
/// `--replies` gives the regenerating run's shards byte for byte; a selection of it takes the
/// first conversations in corpus order; a journal of another corpus is refused by line.
#[test]
fn a_journal_of_replies_replays_the_regeneration_it_recorded() {
    let f = fixture();
    let regenerated = f.root.join("regenerated");
    let mut opts = options(&f.data, &regenerated);
    opts.settings.regenerate = Some(RegenerateSettings {
        sampling: SamplingParams::default(),
        max_new_tokens: 10,
        batch: 4,
        max_turns: None,
    });
    prepare(&f.target, &opts, &mut Quiet).unwrap();
    let journal = f.root.join("journal.jsonl");
    std::fs::copy(regenerated.join("regenerated.jsonl"), &journal).unwrap();
    let text = std::fs::read_to_string(&journal).unwrap();
    assert!(
        text.contains(r#"","replies":[""#) && !text.contains("Answer"),
        "the journal records the target's replies: {text}"
    );

    let replayed = f.root.join("replayed");
    let replay = PrepareOptions {
        replies: Some(journal.clone()),
        ..options(&f.data, &replayed)
    };
    let summary = prepare(&f.target, &replay, &mut Quiet).unwrap();
    assert_eq!(shard_files(&replayed), shard_files(&regenerated));
    let recorded = summary.manifest.settings.replies.as_ref().unwrap();
    assert_eq!(recorded.format, "regeneration-journal");

    let mut first_five = PrepareOptions {
        replies: Some(journal.clone()),
        ..options(&f.data, &f.root.join("five"))
    };
    first_five.settings.max_seqs = Some(5);
    let summary = prepare(&f.target, &first_five, &mut Quiet).unwrap();
    assert_eq!(summary.manifest.counts.conversations_used, 5);

    // A journal that is not this corpus's: the error names the line and the conversation.
    let refusal = |name: &str, journal: String| {
        let path = f.root.join(format!("{name}.jsonl"));
        std::fs::write(&path, journal).unwrap();
        let opts = PrepareOptions {
            replies: Some(path),
            ..options(&f.data, &f.root.join(name))
        };
        prepare(&f.target, &opts, &mut Quiet)
            .err()
            .unwrap()
            .to_string()
    };
    let err = refusal(
        "foreign",
        format!("{text}{{\"id\":\"chat-99\",\"replies\":[\"hi\"]}}\n"),
    );
    assert!(err.contains("line 13") && err.contains("chat-99"), "{err}");
    let err = refusal(
        "too_many",
        "{\"id\":\"chat-1\",\"replies\":[\"a\",\"b\"]}\n".to_string(),
    );
    assert!(
        err.contains("more replies") && err.contains("chat-1"),
        "{err}"
    );
}

/// [`options`] with small shards (several per slice), extracting `slice`.
fn sliced_options(data: &Path, out: &Path, slice: Option<ShardSlice>) -> PrepareOptions {
    let mut opts = PrepareOptions {
        slice,
        ..options(data, out)
    };
    opts.settings.shard_tokens = 100;
    opts
}

/// `prepare --shard I/count` of the fixture's corpus into directories `slice-I`.
fn prepare_slices(f: &Fixture, count: usize) -> Vec<PathBuf> {
    (0..count)
        .map(|index| {
            let dir = f.root.join(format!("slice-{index}"));
            let opts = sliced_options(&f.data, &dir, Some(ShardSlice { index, count }));
            prepare(&f.target, &opts, &mut Quiet).unwrap();
            dir
        })
        .collect()
}

#[test]
fn three_slices_merged_equal_one_run() {
    let f = fixture();
    let whole = f.root.join("whole");
    let single = prepare(
        &f.target,
        &sliced_options(&f.data, &whole, None),
        &mut Quiet,
    )
    .unwrap();
    assert!(
        single.manifest.shards.len() >= 5,
        "enough shards to deal out"
    );
    let slices = prepare_slices(&f, 3);
    for (index, dir) in slices.iter().enumerate() {
        let m = Manifest::read(dir).unwrap().unwrap();
        assert_eq!(m.slice, Some(ShardSlice { index, count: 3 }));
        let expected: Vec<&str> = single
            .manifest
            .shards
            .iter()
            .skip(index)
            .step_by(3)
            .map(|s| s.file.as_str())
            .collect();
        let files: Vec<&str> = m.shards.iter().map(|s| s.file.as_str()).collect();
        assert_eq!(
            files, expected,
            "slice {index} holds every third planned shard"
        );
    }
    // Any order of the slices.
    let merged_dir = f.root.join("merged");
    let given = [slices[2].clone(), slices[0].clone(), slices[1].clone()];
    let summary = merge(&given, &merged_dir, vec!["merge".into()]).unwrap();
    assert_eq!(
        summary.linked + summary.copied,
        single.manifest.shards.len()
    );
    let merged = FeatureSet::open(&merged_dir).unwrap();
    assert!(merged.verify().is_empty());
    assert_eq!(
        Manifest {
            command: single.manifest.command.clone(),
            ..merged.manifest.clone()
        },
        single.manifest,
        "the merged manifest is the single run's but for the command line"
    );
    assert_eq!(
        shard_files(&merged_dir),
        shard_files(&whole),
        "byte-identical shards"
    );
    // Same sequence ids, same split, same tensors, read back through the feature set.
    let whole_set = FeatureSet::open(&whole).unwrap();
    for i in 0..whole_set.manifest.shards.len() {
        let (a, b) = (
            whole_set.load_shard(i).unwrap(),
            merged.load_shard(i).unwrap(),
        );
        assert_eq!(a.sequence_ids, b.sequence_ids);
        assert!(a.hidden.equal(&b.hidden) && a.input_ids.equal(&b.input_ids));
    }
    // A rerun of a finished merge changes nothing.
    let again = merge(&given, &merged_dir, vec!["merge".into()]).unwrap();
    assert_eq!(again.kept, single.manifest.shards.len());
}

#[test]
fn merging_refuses_what_is_not_one_runs_slices() {
    let f = fixture();
    let slices = prepare_slices(&f, 3);
    let out = f.root.join("merged");
    let error = |given: &[PathBuf]| merge(given, &out, vec![]).unwrap_err().to_string();
    let missing = error(&slices[..2]);
    assert!(
        missing.contains("slices 2..3 of 3 are missing"),
        "{missing}"
    );
    let gap = error(&[slices[0].clone(), slices[2].clone()]);
    assert!(gap.contains("slice 1/3 is missing"), "{gap}");
    let twice = error(&[slices[0].clone(), slices[1].clone(), slices[1].clone()]);
    assert!(twice.contains("a slice given twice"), "{twice}");
    // A slice of another run: other --max-len.
    let other = f.root.join("other-2");
    let mut opts = sliced_options(&f.data, &other, Some(ShardSlice { index: 2, count: 3 }));
    opts.settings.max_len = 64;
    prepare(&f.target, &opts, &mut Quiet).unwrap();
    let foreign = error(&[slices[0].clone(), slices[1].clone(), other.clone()]);
    assert!(
        foreign.contains("another run") && foreign.contains("max_len"),
        "{foreign}"
    );
    // A whole run is not a slice.
    let whole = f.root.join("whole");
    prepare(
        &f.target,
        &sliced_options(&f.data, &whole, None),
        &mut Quiet,
    )
    .unwrap();
    let not_slice = error(&[whole]);
    assert!(not_slice.contains("not a slice"), "{not_slice}");
    // A damaged shard of a slice is named.
    let manifest = Manifest::read(&slices[1]).unwrap().unwrap();
    let shard = slices[1].join(&manifest.shards[0].file);
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let damaged = error(&slices);
    assert!(
        damaged.contains(&manifest.shards[0].file) && damaged.contains("checksum"),
        "{damaged}"
    );
    assert!(
        !out.join("manifest.json").exists(),
        "no manifest for a failed merge"
    );
    // A directory resumed with another slice is refused.
    let opts = sliced_options(&f.data, &slices[0], Some(ShardSlice { index: 1, count: 3 }));
    let resumed = prepare(&f.target, &opts, &mut Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        resumed.contains("--shard 0/3") && resumed.contains("--shard 1/3"),
        "{resumed}"
    );
}

#[test]
fn shard_slices_parse_as_i_of_n() {
    assert_eq!(
        "1/3".parse::<ShardSlice>(),
        Ok(ShardSlice { index: 1, count: 3 })
    );
    for bad in ["3/3", "1", "a/3", "1/0", "-1/2"] {
        assert!(bad.parse::<ShardSlice>().is_err(), "{bad}");
    }
}
