//! Heads in the layouts other tools load, proven with those tools' own code (installed from PyPI
//! by `make interop-env` under `$HEADWAY_HOME/interop`, run with the Headway venv's python that
//! `make test` puts on PATH): SpecForge's EAGLE-3 draft model, the EAGLE repository's EAGLE-1
//! model and the Medusa repository's heads load Headway's exports and compute what Headway
//! computes, and heads they initialised and trained import into Headway with the same
//! predictions; and hidden states SpecForge's offline pipeline captured become Headway features.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use headway_checkpoints::{load_head, DraftHead};
use headway_datasets::features::FeatureSet;
use headway_heads::{Eagle3Head, FeatureHead, FeatureModules};
use headway_model::safetensors_io::from_safetensors_bytes;
use headway_model::target::headway_home;
use headway_model::testing::write_safetensors;
use headway_model::{CpuThreads, Target};
use headway_tests::{
    as_strs, export_head, features, headway_train_killed, import_head, prepare_args,
    run_aborting_child, shard_files, stderr, stdout, train_args, AbortAfter,
};
use tch::{Device, Kind, Tensor};

/// Logits may differ by this much (f32, different summation orders).
const TOLERANCE: f64 = 1e-4;
const ROUNDS: usize = 3;
const LENGTH: i64 = 9;

/// Which transformers a reference runs with.
#[derive(Clone, Copy)]
enum Transformers {
    /// The venv's (5): SpecForge.
    Current,
    /// 4, kept beside the packages: the EAGLE and Medusa repositories' 2023 model code.
    Four,
}

/// Runs a script of `scripts/interop/` with the reference packages importable; panics with the
/// command that installs them when they are missing, since a skipped interop check proves
/// nothing.
fn reference_script(script: &str, transformers: Transformers, args: &[&str]) -> String {
    let packages = headway_home().join("interop");
    let hf4 = packages.join("hf4");
    assert!(
        ["specforge", "eagle", "medusa", "hf4/transformers"]
            .iter()
            .all(|p| packages.join(p).is_dir()),
        "{} lacks the reference packages: run `make interop-env`",
        packages.display()
    );
    let python_path = match transformers {
        Transformers::Current => packages.into_os_string(),
        Transformers::Four => std::env::join_paths([hf4, packages]).unwrap(),
    };
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts/interop")
        .join(script);
    let output = Command::new("python")
        .arg(&path)
        .args(args)
        .env("PYTHONPATH", &python_path)
        .output()
        .expect("python from the Headway venv (make test puts it on PATH)");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{script} {args:?}:\n{text}");
    text
}

/// Random inputs for `ROUNDS` rounds of an EAGLE-3 head of `target`: the three fused layers'
/// hidden states and each round's next tokens.
struct Cases {
    taps: Vec<Tensor>,
    ids: Vec<Tensor>,
}

impl Cases {
    fn new(target: &Target) -> Self {
        tch::manual_seed(17);
        let config = target.model.config();
        let shape = [1, LENGTH, config.hidden_size as i64];
        Self {
            taps: (0..3)
                .map(|_| Tensor::randn(shape, (Kind::Float, Device::Cpu)))
                .collect(),
            ids: (0..ROUNDS)
                .map(|_| {
                    Tensor::randint(
                        config.vocab_size as i64,
                        [1, LENGTH],
                        (Kind::Int64, Device::Cpu),
                    )
                })
                .collect(),
        }
    }

    /// Headway's logits of `head` on these inputs, round after round.
    fn logits(&self, head: &Eagle3Head, target: &Target) -> Vec<Tensor> {
        let modules = head.modules(target.cpu.decode()).unwrap();
        let features = modules.fuse(&self.taps[0], &self.taps).unwrap();
        let positions = Tensor::arange(LENGTH, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        tch::no_grad(|| {
            modules
                .unroll(&features, &self.ids, &positions)
                .iter()
                .map(|out| modules.logits(out))
                .collect()
        })
    }

    /// The cases file of `scripts/interop/eagle3_specforge.py`, with `logits` when given.
    fn write(&self, path: &Path, target: &Target, logits: &[Tensor]) {
        let mut tensors = vec![
            (
                "embed".to_string(),
                target.model.model.embed_tokens().to_kind(Kind::Float),
            ),
            ("taps".to_string(), Tensor::cat(&self.taps, -1)),
        ];
        for (r, ids) in self.ids.iter().enumerate() {
            tensors.push((format!("ids_{r}"), ids.shallow_clone()));
        }
        for (r, l) in logits.iter().enumerate() {
            tensors.push((format!("logits_{r}"), l.shallow_clone()));
        }
        write_safetensors(path, &tensors).unwrap();
    }
}

fn eagle3_head(dir: &Path, target: &Target) -> Eagle3Head {
    match load_head(dir, target).unwrap().head {
        DraftHead::Eagle3(head) => head,
        other => panic!("{} holds a {} head", dir.display(), other.name()),
    }
}

/// `headway-train export --format FORMAT` of the checkpoint in `heads` into `out`.
fn export(heads: &Path, format: &str, out: &Path, target_dir: &Path) {
    let output = export_head(heads, format, out, target_dir, &[]);
    assert!(output.status.success(), "{}", stderr(&output));
}

/// `headway-train import --format FORMAT` of the head in `from` into `out`.
fn import(from: &Path, format: &str, out: &Path, target_dir: &Path) {
    let output = import_head(from, format, out, target_dir);
    assert!(output.status.success(), "{}", stderr(&output));
    println!("{}", stdout(&output));
}

/// A head trained briefly by `headway-train HEAD` with `extra` options on the tiny features.
fn train(root: &Path, head: &str, extra: &[&str]) -> PathBuf {
    let out = root.join(format!("{head}-trained"));
    let args = train_args(head, root, out.to_str().unwrap(), extra);
    let output = headway_tests::headway_train(&as_strs(&args));
    assert!(output.status.success(), "{}", stderr(&output));
    out
}

/// One tensor of a safetensors file.
fn read_tensor(path: &Path, name: &str) -> Tensor {
    let bytes = std::fs::read(path).unwrap();
    let (mut tensors, _) = from_safetensors_bytes(&bytes, path).unwrap();
    tensors.remove(name).unwrap()
}

fn max_difference(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

#[test]
fn specforge_loads_headways_eagle3_export_and_headway_imports_specforges_head() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let target_dir = root.join("target");
    let target = Target::load(&target_dir, Kind::Float, Device::Cpu, CpuThreads::new(1)).unwrap();
    let cases = Cases::new(&target);
    let cases_file = root.join("cases.safetensors");
    let text = |p: &Path| p.to_str().unwrap().to_string();

    // Headway → SpecForge: a briefly trained head, exported, loaded by SpecForge's class.
    let trained = train(
        root,
        "eagle3",
        &["--taps", "1,1,1", "--ttt", "3", "--draft-vocab", "64"],
    );
    let exported = root.join("exported");
    export(&trained, "eagle3", &exported, &target_dir);
    let ours = cases.logits(&eagle3_head(&trained, &target), &target);
    cases.write(&cases_file, &target, &ours);
    let report = reference_script(
        "eagle3_specforge.py",
        Transformers::Current,
        &[
            "check-export",
            "--export",
            &text(&exported),
            "--cases",
            &text(&cases_file),
            "--tolerance",
            &TOLERANCE.to_string(),
        ],
    );
    println!("{report}");

    // SpecForge → Headway: a head SpecForge initialised and trained, imported.
    let theirs = root.join("specforge-head");
    cases.write(&cases_file, &target, &[]);
    reference_script(
        "eagle3_specforge.py",
        Transformers::Current,
        &[
            "write-head",
            "--target",
            &text(&target_dir),
            "--cases",
            &text(&cases_file),
            "--out",
            &text(&theirs),
        ],
    );
    let imported = root.join("imported");
    import(&theirs, "eagle3", &imported, &target_dir);
    let ours = cases.logits(&eagle3_head(&imported, &target), &target);
    for (r, logits) in ours.iter().enumerate() {
        let reference = read_tensor(
            &theirs.join("reference_logits.safetensors"),
            &format!("logits_{r}"),
        );
        let difference = max_difference(logits, &reference);
        println!("SpecForge's head in Headway, round {r}: max |Δlogit| {difference:.2e}");
        assert!(difference <= TOLERANCE, "round {r}: {difference:.2e}");
    }
}

/// Headway's outputs (the features its LM head reads) of the EAGLE-1 head in `dir` for the
/// target's final hidden states `hidden` and next tokens `ids`, one causal pass.
fn eagle_outputs(dir: &Path, target: &Target, hidden: &Tensor, ids: &Tensor) -> Tensor {
    let head = match load_head(dir, target).unwrap().head {
        DraftHead::Eagle(head) => head,
        other => panic!("{} holds a {} head", dir.display(), other.name()),
    };
    let modules = FeatureHead::modules(&head, target.cpu.decode()).unwrap();
    let positions = Tensor::arange(LENGTH, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    tch::no_grad(|| {
        let features = modules.fuse(hidden, &[]).unwrap();
        modules
            .forward(&features, ids, &positions, None, None)
            .unwrap()
    })
}

#[test]
fn the_eagle_repository_loads_headways_eagle_export_and_headway_imports_its_head() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let target_dir = root.join("target");
    let target = Target::load(&target_dir, Kind::Float, Device::Cpu, CpuThreads::new(1)).unwrap();
    tch::manual_seed(23);
    let c = target.model.config();
    let hidden = Tensor::randn(
        [1, LENGTH, c.hidden_size as i64],
        (Kind::Float, Device::Cpu),
    );
    let ids = Tensor::randint(c.vocab_size as i64, [1, LENGTH], (Kind::Int64, Device::Cpu));
    let cases_file = root.join("cases.safetensors");
    let write_cases = |outputs: Option<&Tensor>| {
        let mut tensors = vec![
            (
                "embed".to_string(),
                target.model.model.embed_tokens().to_kind(Kind::Float),
            ),
            ("hidden".to_string(), hidden.shallow_clone()),
            ("ids".to_string(), ids.shallow_clone()),
        ];
        tensors.extend(outputs.map(|o| ("outputs".to_string(), o.shallow_clone())));
        write_safetensors(&cases_file, &tensors).unwrap();
    };
    let text = |p: &Path| p.to_str().unwrap().to_string();

    // Headway → EAGLE repository: fc without a bias (the default) and a scaled embedding, which
    // the export folds into fc.
    let trained = train(root, "eagle", &["--embed-scale", "4"]);
    let exported = root.join("exported");
    export(&trained, "eagle", &exported, &target_dir);
    write_cases(Some(&eagle_outputs(&trained, &target, &hidden, &ids)));
    let report = reference_script(
        "eagle1_eagle_repo.py",
        Transformers::Four,
        &[
            "check-export",
            "--export",
            &text(&exported),
            "--cases",
            &text(&cases_file),
            "--tolerance",
            &TOLERANCE.to_string(),
        ],
    );
    println!("{report}");

    // EAGLE repository → Headway: its published layout (pytorch_model.bin with the embedding,
    // fc with a bias).
    let theirs = root.join("eagle-repo-head");
    write_cases(None);
    reference_script(
        "eagle1_eagle_repo.py",
        Transformers::Four,
        &[
            "write-head",
            "--target",
            &text(&target_dir),
            "--cases",
            &text(&cases_file),
            "--out",
            &text(&theirs),
        ],
    );
    let imported = root.join("imported");
    import(&theirs, "eagle", &imported, &target_dir);
    let reference = read_tensor(&theirs.join("reference_outputs.safetensors"), "outputs");
    let difference = max_difference(
        &eagle_outputs(&imported, &target, &hidden, &ids),
        &reference,
    );
    println!("the EAGLE repository's head in Headway: max |Δ| {difference:.2e}");
    assert!(difference <= TOLERANCE, "{difference:.2e}");
}

/// Headway's logits per head of the Medusa heads in `dir` for the target's final hidden states.
fn medusa_logits(dir: &Path, target: &Target, hidden: &Tensor) -> Vec<Tensor> {
    let heads = match load_head(dir, target).unwrap().head {
        DraftHead::Medusa(heads) => heads,
        other => panic!("{} holds a {} head", dir.display(), other.name()),
    };
    tch::no_grad(|| heads.forward(hidden, &target.cpu.decode()).unwrap())
}

#[test]
fn the_medusa_repository_loads_headways_medusa_export_and_headway_imports_its_heads() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let target_dir = root.join("target");
    let target = Target::load(&target_dir, Kind::Float, Device::Cpu, CpuThreads::new(1)).unwrap();
    tch::manual_seed(29);
    let hidden = Tensor::randn(
        [1, LENGTH, target.model.config().hidden_size as i64],
        (Kind::Float, Device::Cpu),
    );
    let cases_file = root.join("cases.safetensors");
    let write_cases = |logits: &[Tensor]| {
        let mut tensors = vec![("hidden".to_string(), hidden.shallow_clone())];
        for (k, l) in logits.iter().enumerate() {
            tensors.push((format!("logits_{k}"), l.shallow_clone()));
        }
        write_safetensors(&cases_file, &tensors).unwrap();
    };
    let text = |p: &Path| p.to_str().unwrap().to_string();

    // Headway → Medusa repository: three heads with their own LM heads, briefly trained.
    let trained = train(root, "medusa", &["--heads", "3"]);
    let exported = root.join("exported");
    export(&trained, "medusa", &exported, &target_dir);
    write_cases(&medusa_logits(&trained, &target, &hidden));
    let report = reference_script(
        "medusa_repo.py",
        Transformers::Four,
        &[
            "check-export",
            "--export",
            &text(&exported),
            "--target",
            &text(&target_dir),
            "--cases",
            &text(&cases_file),
            "--tolerance",
            &TOLERANCE.to_string(),
        ],
    );
    println!("{report}");

    // Medusa repository → Headway: heads it initialised and trained, in its layout.
    let theirs = root.join("medusa-repo-heads");
    reference_script(
        "medusa_repo.py",
        Transformers::Four,
        &[
            "write-head",
            "--export-config",
            &text(&exported),
            "--target",
            &text(&target_dir),
            "--cases",
            &text(&cases_file),
            "--out",
            &text(&theirs),
        ],
    );
    let imported = root.join("imported");
    import(&theirs, "medusa", &imported, &target_dir);
    let reference_path = theirs.join("reference_logits.safetensors");
    for (k, logits) in medusa_logits(&imported, &target, &hidden)
        .iter()
        .enumerate()
    {
        let reference = read_tensor(&reference_path, &format!("logits_{k}"));
        let difference = max_difference(logits, &reference);
        println!("the Medusa repository's head {k} in Headway: max |Δlogit| {difference:.2e}");
        assert!(difference <= TOLERANCE, "head {k}: {difference:.2e}");
    }
}

/// `headway-train prepare --from DIR` of the tiny target under `root` with `extra` options.
fn prepare_from_args(root: &Path, capture: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let mut args = vec!["prepare".to_string(), "--from".into(), path(capture)];
    args.extend(["--target".into(), path(&root.join("target"))]);
    args.extend([
        "--out".into(),
        path(out),
        "--held-out".into(),
        "0.25".into(),
    ]);
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn prepare_from(root: &Path, capture: &Path, out: &Path, extra: &[&str]) -> Output {
    headway_tests::headway_train(&as_strs(&prepare_from_args(root, capture, out, extra)))
}

/// Not a test: the child process of the kill test here (see `headway_train_killed`).
#[test]
#[ignore = "run by prepare_from's kill test as its child process"]
fn killed_import_child() {
    run_aborting_child();
}

/// Every sequence of a feature directory by id: its token ids, loss mask, final hidden state and
/// taps (f32).
fn sequences_by_id(dir: &Path) -> BTreeMap<String, Vec<Tensor>> {
    let set = FeatureSet::open(dir).unwrap();
    assert!(set.verify().is_empty(), "{} does not verify", dir.display());
    let mut sequences = BTreeMap::new();
    for index in 0..set.manifest.shards.len() {
        let shard = set.load_shard(index).unwrap();
        for (i, id) in shard.sequence_ids.iter().enumerate() {
            let s = shard.sequence(i);
            let mut tensors = vec![s.input_ids, s.loss_mask, s.hidden];
            tensors.extend(s.taps);
            let tensors = tensors.iter().map(|t| t.to_kind(Kind::Float)).collect();
            sequences.insert(id.clone(), tensors);
        }
    }
    sequences
}

/// SpecForge's capture (`scripts/interop/specforge_capture.py`: its eagle3 capture layout and
/// `torch.save`, read back by its own offline reader) of the sequences in `features`, into `out`.
fn specforge_capture(root: &Path, features: &Path, out: &Path, extra: &[&str]) {
    let text = |p: &Path| p.to_str().unwrap().to_string();
    let (target, features, out) = (text(&root.join("target")), text(features), text(out));
    let mut args = vec![
        "write",
        "--target",
        &target,
        "--features",
        &features,
        "--out",
        &out,
    ];
    args.extend(extra);
    println!(
        "{}",
        reference_script("specforge_capture.py", Transformers::Current, &args)
    );
}

#[test]
fn prepare_from_turns_specforges_offline_capture_into_the_same_features() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    // Headway's own extraction of two taps: the reference the imports must equal.
    let ours = root.join("ours");
    let mut args = prepare_args(root, &root.join("chats.jsonl"), &ours);
    let layers = args.iter().position(|a| a == "--layers").unwrap();
    args[layers + 1] = "0,1".into();
    let output = headway_tests::headway_train(&as_strs(&args));
    assert!(output.status.success(), "{}", stderr(&output));
    let reference = sequences_by_id(&ours);
    // SpecForge's sequence i is Headway's i-th in manifest order.
    let mut order = Vec::new();
    let set = FeatureSet::open(&ours).unwrap();
    for index in 0..set.manifest.shards.len() {
        order.extend(set.load_shard(index).unwrap().sequence_ids);
    }
    let capture_id = |i: usize| format!("rows_0-2000/data_{i}");

    // f32 capture, f32 features: the states equal Headway's up to transformers' arithmetic.
    let capture = root.join("capture");
    specforge_capture(root, &ours, &capture, &[]);
    let imported = root.join("imported");
    let output = prepare_from(
        root,
        &capture,
        &imported,
        &["--layers", "0,1", "--dtype", "f32"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    println!("{}", stdout(&output));
    let from_capture = sequences_by_id(&imported);
    assert_eq!(from_capture.len(), reference.len());
    let mut worst = 0.0f64;
    for (i, id) in order.iter().enumerate() {
        let (ours, theirs) = (&reference[id], &from_capture[&capture_id(i)]);
        assert!(
            ours[0].equal(&theirs[0]) && ours[1].equal(&theirs[1]),
            "{id}: tokens"
        );
        for (a, b) in ours[2..].iter().zip(&theirs[2..]) {
            let scale = a.abs().max().double_value(&[]).max(1.0);
            worst = worst.max(max_difference(a, b) / scale);
        }
    }
    println!("imported states vs Headway's own: max |Δ| / max(1, max |x|) = {worst:.2e}");
    assert!(worst <= TOLERANCE, "{worst:.2e}");

    // Killed after its first shard, the same command resumes to the same shards.
    let resumed = root.join("resumed");
    let args = prepare_from_args(
        root,
        &capture,
        &resumed,
        &["--layers", "0,1", "--dtype", "f32"],
    );
    let killed = headway_train_killed(
        "killed_import_child",
        &as_strs(&args),
        AbortAfter::Shards(1),
    );
    assert!(!killed.status.success(), "{}", stderr(&killed));
    let output = headway_tests::headway_train(&as_strs(&args));
    assert!(
        output.status.success() && stdout(&output).contains("1 kept from an earlier run"),
        "{}",
        stdout(&output)
    );
    assert!(
        shard_files(&resumed) == shard_files(&imported),
        "resumed shards differ"
    );

    // Two slices of the import (two machines sharing a capture) merge into the single import.
    let mut slices = Vec::new();
    for i in 0..2 {
        let slice = root.join(format!("slice-{i}"));
        let shard = format!("{i}/2");
        let extra = ["--layers", "0,1", "--dtype", "f32", "--shard", &shard];
        let output = prepare_from(root, &capture, &slice, &extra);
        assert!(output.status.success(), "{}", stderr(&output));
        slices.push(slice.to_str().unwrap().to_string());
    }
    let merged = root.join("merged");
    let mut args = vec!["merge-features", "--out", merged.to_str().unwrap()];
    args.extend(slices.iter().map(String::as_str));
    let output = headway_tests::headway_train(&args);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(
        shard_files(&merged) == shard_files(&imported),
        "merged slices differ"
    );

    // bf16 gzip capture, default bf16 features: exactly the f32 capture's values rounded.
    let compressed = root.join("capture-gz");
    specforge_capture(
        root,
        &ours,
        &compressed,
        &["--dtype", "bfloat16", "--compress"],
    );
    let imported_bf16 = root.join("imported-bf16");
    let output = prepare_from(root, &compressed, &imported_bf16, &["--layers", "0,1"]);
    assert!(output.status.success(), "{}", stderr(&output));
    for (id, tensors) in sequences_by_id(&imported_bf16) {
        let f32_capture = &from_capture[&id];
        assert!(tensors[0].equal(&f32_capture[0]) && tensors[1].equal(&f32_capture[1]));
        for (a, b) in tensors[2..].iter().zip(&f32_capture[2..]) {
            let rounded = b.to_kind(Kind::BFloat16).to_kind(Kind::Float);
            assert!(
                a.equal(&rounded),
                "{id}: not the f32 capture rounded to bf16"
            );
        }
    }

    // The imported features train an EAGLE-3 head.
    let heads = root.join("eagle3-from-capture");
    let mut args = train_args("eagle3", root, heads.to_str().unwrap(), &[]);
    args[2] = imported.to_str().unwrap().to_string();
    args.extend(["--taps", "0,1,1", "--ttt", "2", "--draft-vocab", "64"].map(String::from));
    let output = headway_tests::headway_train(&as_strs(&args));
    assert!(output.status.success(), "{}", stderr(&output));

    // Bad captures are refused naming the file and the problem.
    let refused = |capture: &Path, extra: &[&str], expected: &str| {
        let out = root.join("refused");
        let output = prepare_from(root, capture, &out, extra);
        let text = stderr(&output);
        assert!(
            !output.status.success() && text.contains(expected),
            "{text}"
        );
        let _ = std::fs::remove_dir_all(&out);
    };
    refused(&capture, &["--layers", "1"], "aux_hidden_state has shape");
    refused(&capture, &["--layers", "1,1"], "--layers names tap 1 twice");
    refused(
        &capture,
        &["--layers", "0,2"],
        "--layers 2: the target has 2 layers",
    );
    refused(
        &capture,
        &[],
        "SpecForge's default capture layers give tap 2",
    );
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    refused(&empty, &[], "no SpecForge capture files");
    let first = capture.join("rows_0-2000/data_0.ckpt");
    let bytes = std::fs::read(&first).unwrap();
    std::fs::write(&first, &bytes[..bytes.len() / 2]).unwrap();
    refused(
        &capture,
        &["--layers", "0,1"],
        "data_0.ckpt: not a torch.save archive",
    );
    let first_gz = compressed.join("rows_0-2000/data_0.ckpt.gz");
    std::fs::write(&first_gz, b"not gzip").unwrap();
    refused(
        &compressed,
        &["--layers", "0,1"],
        "data_0.ckpt.gz: not a readable gzip file",
    );
}
