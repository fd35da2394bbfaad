//! Head training as a user runs it, on features of a tiny random target: a resumed run ends with
//! the same weights as an uninterrupted one, and evaluation prints its table.

use std::path::Path;
use std::process::Output;

use headway_model::testing::write_tiny_model;
use headway_tests::{
    as_strs, eval_heads, export_head, features, headway_train_killed, import_head, run,
    run_aborting_child, stderr, stdout, train_args, AbortAfter,
};

/// `headway-train args`; with `abort_after_step`, killed after that step's checkpoint.
fn headway_train(args: &[&str], abort_after_step: Option<u64>) -> Output {
    match abort_after_step {
        Some(step) => headway_train_killed("killed_training_child", args, AbortAfter::Step(step)),
        None => headway_tests::headway_train(args),
    }
}

/// Not a test: the child process of the kill tests here (see `headway_train_killed`).
#[test]
#[ignore = "run by the kill tests as their child process"]
fn killed_training_child() {
    run_aborting_child();
}

#[test]
fn a_resumed_run_ends_with_the_same_weights_as_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    for (head, extra) in [
        // Unrolled steps (training-time test) of a head fusing a target tap, and bf16 autocast,
        // resume bit for bit too.
        ("eagle", &["--unroll", "2", "--taps", "1"][..]),
        (
            "medusa",
            &["--heads", "2", "--draft-vocab", "64", "--precision", "bf16"][..],
        ),
        // EAGLE-3: unrolled rounds over one tap, its own LM head over a draft vocabulary.
        (
            "eagle3",
            &["--taps", "1", "--ttt", "2", "--draft-vocab", "64"][..],
        ),
    ] {
        let whole = root.join(format!("{head}-whole"));
        let parts = root.join(format!("{head}-parts"));
        let args = train_args(head, root, whole.to_str().unwrap(), extra);
        let out = headway_train(&as_strs(&args), None);
        assert!(out.status.success(), "{head}: {}", stderr(&out));
        assert!(stdout(&out).contains("trained 6 steps"), "{}", stdout(&out));
        let args = train_args(head, root, parts.to_str().unwrap(), extra);
        let killed = headway_train(&as_strs(&args), Some(3));
        assert!(
            !killed.status.success(),
            "{head}: the abort hook did not stop training"
        );
        assert_eq!(
            std::fs::read_to_string(parts.join("latest")).unwrap(),
            "step-00000003"
        );
        let mut resume = args.clone();
        resume.push("--resume".into());
        let out = headway_train(&as_strs(&resume), None);
        assert!(out.status.success(), "{head} resume: {}", stderr(&out));
        let read = |dir: &Path| std::fs::read(dir.join("step-00000006/model.safetensors")).unwrap();
        assert!(
            read(&whole) == read(&parts),
            "{head}: resumed weights differ"
        );
        assert!(
            whole.join("logs").read_dir().unwrap().next().is_some(),
            "no tensorboard log"
        );

        let eval = eval_heads(&whole, root);
        assert!(eval.status.success(), "{}", stderr(&eval));
        let table = stdout(&eval);
        let wanted = match head {
            "eagle" => ["top1", "alpha5"],
            "eagle3" => ["acc_0", "acc_1"],
            _ => ["head0/top1", "head1/top5"],
        };
        for name in wanted {
            assert!(table.contains(name), "{head} eval lacks {name}: {table}");
        }
    }
    let export = export_head(
        &root.join("eagle-whole"),
        "eagle",
        &root.join("exported"),
        &root.join("target"),
        &[],
    );
    assert!(!export.status.success());
    assert!(
        stderr(&export).contains("fuses the target's taps [1]"),
        "{}",
        stderr(&export)
    );
}

/// `--init` trains a head further from a checkpoint's weights: at learning rate 0 its six steps
/// leave them as they were (a fresh head's would differ: the checkpoint trained six steps at
/// 1e-3); a head of another kind or draft vocabulary is refused by name.
#[test]
fn a_head_trained_further_starts_from_its_checkpoints_weights() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let weights = |dir: &Path| std::fs::read(dir.join("step-00000006/model.safetensors")).unwrap();
    for (head, extra) in [
        ("eagle", &["--taps", "1"][..]),
        ("medusa", &["--heads", "2", "--draft-vocab", "64"][..]),
        (
            "eagle3",
            &["--taps", "1", "--ttt", "2", "--draft-vocab", "64"][..],
        ),
    ] {
        let first = root.join(format!("{head}-first"));
        let out = headway_train(
            &as_strs(&train_args(head, root, first.to_str().unwrap(), extra)),
            None,
        );
        assert!(out.status.success(), "{head}: {}", stderr(&out));
        let further = root.join(format!("{head}-further"));
        let mut init = extra.to_vec();
        init.extend(["--init", first.to_str().unwrap()]);
        let mut args = train_args(head, root, further.to_str().unwrap(), &init);
        let lr = args.iter().position(|a| a == "--lr").unwrap();
        args[lr + 1] = "0".into();
        let out = headway_train(&as_strs(&args), None);
        assert!(out.status.success(), "{head} --init: {}", stderr(&out));
        assert!(stderr(&out).contains("starting from"), "{}", stderr(&out));
        assert!(
            weights(&first) == weights(&further),
            "{head}: --init did not start from the checkpoint's weights"
        );
    }
    let refused = |head: &str, extra: &[&str], wanted: &str| {
        let out = root.join(format!("{head}-refused"));
        let args = train_args(head, root, out.to_str().unwrap(), extra);
        let run = headway_train(&as_strs(&args), None);
        assert!(!run.status.success(), "{head} {extra:?} was accepted");
        assert!(stderr(&run).contains(wanted), "{}", stderr(&run));
    };
    let medusa = root.join("medusa-first");
    let eagle3 = root.join("eagle3-first");
    refused(
        "eagle3",
        &["--taps", "1", "--init", medusa.to_str().unwrap()],
        "a medusa head, and this command trains eagle3",
    );
    refused(
        "eagle3",
        &["--draft-vocab", "32", "--init", eagle3.to_str().unwrap()],
        "--draft-vocab 32: the head --init names drafts over 64 tokens",
    );
    refused(
        "eagle3",
        &["--taps", "0", "--init", eagle3.to_str().unwrap()],
        "--taps [0]: the head --init names fuses taps [1]",
    );
}

#[test]
fn bf16_training_keeps_f32_weights_and_computes_differently_from_f32() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let weights = |precision: &str| {
        let out = root.join(format!("eagle-{precision}"));
        let extra = ["--precision", precision];
        let args = train_args("eagle", root, out.to_str().unwrap(), &extra);
        let run = headway_train(&as_strs(&args), None);
        assert!(run.status.success(), "{precision}: {}", stderr(&run));
        std::fs::read(out.join("step-00000006/model.safetensors")).unwrap()
    };
    let (f32_weights, bf16_weights) = (weights("f32"), weights("bf16"));
    assert_eq!(
        f32_weights.len(),
        bf16_weights.len(),
        "same tensors, both f32"
    );
    assert!(
        f32_weights != bf16_weights,
        "bf16 training left the weights bit-identical to f32 training"
    );
}

#[test]
fn export_then_import_gives_back_the_same_head() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let target = root.join("target");
    // (run name, head, options, whether the weights come back bit for bit): a scaled embedding
    // is folded into fc on export, so that head comes back with other weights that compute the
    // same (a power-of-two scale folds exactly: `eval` prints the same figures).
    for (name, head, extra, same_bytes) in [
        (
            "eagle",
            "eagle",
            &["--layers", "2", "--embed-scale", "1", "--fc-bias"][..],
            true,
        ),
        ("eagle-scaled", "eagle", &["--embed-scale", "4"][..], false),
        ("medusa", "medusa", &["--heads", "2"][..], true),
        (
            "eagle3",
            "eagle3",
            &["--taps", "1,1,1", "--ttt", "3", "--draft-vocab", "64"][..],
            true,
        ),
    ] {
        let trained = root.join(format!("{name}-run"));
        let args = train_args(head, root, trained.to_str().unwrap(), extra);
        assert!(headway_train(&as_strs(&args), None).status.success());
        let exported = root.join(format!("{name}-exported"));
        // vLLM's EAGLE-1 model has no fc bias: such a head exports for the EAGLE repository.
        let engine: &[&str] = if extra.contains(&"--fc-bias") {
            &["--engine", "eagle-repo"]
        } else {
            &[]
        };
        let out = export_head(&trained, head, &exported, &target, engine);
        assert!(out.status.success(), "{}", stderr(&out));
        let expected_files: &[&str] = match head {
            "medusa" => &["medusa_lm_head.pt", "model.safetensors"],
            "eagle" => &["pytorch_model.bin", "model.safetensors"],
            _ => &["model.safetensors"],
        };
        for file in expected_files.iter().chain(&["config.json"]) {
            assert!(exported.join(file).exists(), "{name}: {file}");
        }
        let written = std::fs::read_to_string(exported.join("config.json")).unwrap();
        assert!(
            !written.contains(root.to_str().unwrap()),
            "{name}: a path of this machine in {written}"
        );
        let imported = root.join(format!("{name}-imported"));
        let out = import_head(&exported, head, &imported, &target);
        assert!(out.status.success(), "{}", stderr(&out));
        let original = std::fs::read(trained.join("step-00000006/model.safetensors")).unwrap();
        let back = std::fs::read(imported.join("step-00000000/model.safetensors")).unwrap();
        assert_eq!(
            original == back,
            same_bytes,
            "{name}: weights after the round trip"
        );
        let figures = |heads: &Path| {
            let eval = eval_heads(heads, root);
            assert!(eval.status.success(), "{}", stderr(&eval));
            // The first line names the checkpoint and its step.
            stdout(&eval).lines().skip(1).collect::<Vec<_>>().join("\n")
        };
        assert_eq!(figures(&trained), figures(&imported), "{name}: eval");
        let config = std::fs::read_to_string(imported.join("step-00000000/config.json")).unwrap();
        let original_config =
            std::fs::read_to_string(trained.join("step-00000006/config.json")).unwrap();
        let field = |text: &str, name: &str| {
            serde_json::from_str::<serde_json::Value>(text).unwrap()[name].clone()
        };
        assert_eq!(
            field(&config, "draft_vocab"),
            field(&original_config, "draft_vocab"),
            "{name}: draft vocabulary changed"
        );
        let mut original_head = field(&original_config, "head");
        if let Some(kind) = original_head.as_object_mut() {
            assert_eq!(kind.remove("embed_scale").is_some(), !same_bytes, "{name}");
        }
        assert_eq!(
            field(&config, "head"),
            original_head,
            "{name}: head changed"
        );
    }
    let wrong = export_head(
        &root.join("eagle-run"),
        "medusa",
        &root.join("x"),
        &target,
        &[],
    );
    assert!(
        !wrong.status.success() && stderr(&wrong).contains("eagle head"),
        "{}",
        stderr(&wrong)
    );
}

#[test]
fn features_of_another_target_and_a_corrupt_checkpoint_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    write_tiny_model(&root.join("other"), 6).unwrap();
    let out = root.join("run");
    let mut args = train_args("eagle", root, out.to_str().unwrap(), &[]);
    let target_index = args.iter().position(|a| a == "--target").unwrap() + 1;
    args[target_index] = root.join("other").to_str().unwrap().to_string();
    let refused = headway_train(&as_strs(&args), None);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("were extracted from target"),
        "{}",
        stderr(&refused)
    );

    let tapped = root.join("tapped");
    let args = train_args("eagle", root, tapped.to_str().unwrap(), &["--taps", "0,1"]);
    let refused = headway_train(&as_strs(&args), None);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("layer-0 tap") && stderr(&refused).contains("stores taps [1]"),
        "{}",
        stderr(&refused)
    );

    let args = train_args("eagle", root, out.to_str().unwrap(), &[]);
    assert!(headway_train(&as_strs(&args), None).status.success());
    let weights = out.join("step-00000006/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&weights, bytes).unwrap();
    let eval = eval_heads(&out, root);
    assert!(!eval.status.success());
    assert!(
        stderr(&eval).contains("step-00000006") && stderr(&eval).contains("corrupt"),
        "{}",
        stderr(&eval)
    );
}

#[test]
fn a_run_of_whole_epochs_reports_the_held_out_figures_of_its_final_weights() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let out_dir = root.join("eagle");
    let json = root.join("eagle.json");
    let mut args = train_args("eagle", root, out_dir.to_str().unwrap(), &[]);
    // Whole epochs instead of a step count: the run stops at the end of the last epoch.
    let steps = args.iter().position(|a| a == "--steps").unwrap();
    args.splice(steps..steps + 2, ["--epochs".to_string(), "2".to_string()]);
    args.extend(["--json".to_string(), json.to_str().unwrap().to_string()]);
    let out = headway_train(&as_strs(&args), None);
    assert!(out.status.success(), "{}", stderr(&out));
    let figures: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let reported = figures["held_out"]["loss"].as_f64().unwrap();
    let eval = eval_heads(&out_dir, root);
    assert!(eval.status.success(), "{}", stderr(&eval));
    let table = stdout(&eval);
    let measured: f64 = table
        .lines()
        .find_map(|l| l.trim().strip_prefix("loss "))
        .unwrap_or_else(|| panic!("no loss in {table}"))
        .trim()
        .parse()
        .unwrap();
    assert!(
        (reported - measured).abs() < 1e-3,
        "the run reported held-out loss {reported}, its final checkpoint evaluates to {measured}"
    );
}

/// What each loader needs, or a refusal naming why it cannot load the head: EAGLE-1's `fc` bias
/// and architecture per engine, a draft vocabulary no EAGLE-1 loader reads, EAGLE-3's three
/// taps, and a head imported as the wrong kind.
#[test]
fn exports_write_what_each_loader_reads_and_refuse_what_none_can() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let target = root.join("target");
    let train = |name: &str, head: &str, extra: &[&str]| {
        let out = root.join(name);
        let args = train_args(head, root, out.to_str().unwrap(), extra);
        let trained = headway_train(&as_strs(&args), None);
        assert!(trained.status.success(), "{name}: {}", stderr(&trained));
        out
    };
    let export = |heads: &Path, format: &str, name: &str, extra: &[&str]| {
        let out = root.join(name);
        (export_head(heads, format, &out, &target, extra), out)
    };
    let config = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    let tensor_names = |dir: &Path| {
        let path = dir.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        let (tensors, _) =
            headway_model::safetensors_io::from_safetensors_bytes(&bytes, &path).unwrap();
        let mut names: Vec<String> = tensors.into_keys().collect();
        names.sort();
        names
    };

    let reduced = train("eagle-reduced", "eagle", &["--draft-vocab", "50"]);
    let (out, vllm) = export(&reduced, "eagle", "eagle-vllm", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("drafts over all of them"),
        "{}",
        stderr(&out)
    );
    let written = config(&vllm);
    assert_eq!(written["bias"], false, "vLLM builds fc without a bias");
    assert_eq!(written["architectures"][0], "LlamaForCausalLM");
    assert!(written.get("draft_vocab_size").is_none());
    let names = tensor_names(&vllm);
    assert!(names.contains(&"fc.weight".to_string()));
    assert!(
        !names
            .iter()
            .any(|n| n == "fc.bias" || n == "d2t" || n == "t2d"),
        "{names:?}"
    );
    let (out, sglang) = export(&reduced, "eagle", "eagle-sglang", &["--engine", "sglang"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(config(&sglang)["architectures"][0], "LlamaForCausalLMEagle");

    let biased = train("eagle-biased", "eagle", &["--fc-bias"]);
    let (out, _) = export(&biased, "eagle", "eagle-biased-vllm", &[]);
    assert!(
        !out.status.success() && stderr(&out).contains("fc bias"),
        "{}",
        stderr(&out)
    );
    for engine in ["sglang", "eagle-repo"] {
        let (out, dir) = export(
            &biased,
            "eagle",
            &format!("eagle-biased-{engine}"),
            &["--engine", engine],
        );
        assert!(out.status.success(), "{engine}: {}", stderr(&out));
        assert_eq!(config(&dir)["bias"], true);
        assert!(tensor_names(&dir).contains(&"fc.bias".to_string()));
    }

    let one_tap = train("eagle3-one-tap", "eagle3", &["--taps", "1", "--ttt", "2"]);
    let (out, _) = export(&one_tap, "eagle3", "eagle3-one-tap-out", &[]);
    assert!(
        !out.status.success() && stderr(&out).contains("exactly three"),
        "{}",
        stderr(&out)
    );
    let eagle3 = train("eagle3", "eagle3", &["--taps", "1,1,1", "--ttt", "2"]);
    // Served through the front end, with a tuned tree: the same greedy text as plain decoding.
    let generate = |method: &[&str]| {
        let mut args = vec![
            "generate",
            "--target",
            target.to_str().unwrap(),
            "--prompt",
            "Count to 5.",
            "--max-new-tokens",
            "12",
        ];
        args.extend(method);
        let out = run("headway-serve", &args);
        assert!(out.status.success(), "{method:?}: {}", stderr(&out));
        stdout(&out)
    };
    let plain = generate(&["--method", "ar"]);
    // The tuner's warm-up decodes with lookup beside the head where the run will.
    for lookup in [&[][..], &["--with-lookup"][..]] {
        let tuned = [
            "--method",
            "eagle3",
            "--heads",
            eagle3.to_str().unwrap(),
            "--tree-tokens",
            "auto",
        ];
        assert_eq!(
            generate(&[&tuned[..], lookup].concat()),
            plain,
            "{lookup:?}"
        );
    }
    // Prompt lookup alone tunes its tokens after each match length the same way.
    assert_eq!(
        generate(&["--method", "lookup", "--tree-tokens", "auto"]),
        plain
    );
    let (out, exported) = export(&eagle3, "eagle3", "eagle3-out", &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let written = config(&exported);
    assert_eq!(written["architectures"][0], "LlamaForCausalLMEagle3");
    assert_eq!(written["tie_word_embeddings"], false);
    assert!(written["draft_vocab_size"].as_u64().is_some());
    let names = tensor_names(&exported);
    for name in ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] {
        assert!(names.contains(&name.to_string()), "{name} in {names:?}");
    }
    assert!(names.iter().any(|n| n.starts_with("midlayer.self_attn.")));
    assert!(!names.iter().any(|n| n == "fc.bias"));
    let import_as =
        |from: &Path, format: &str| import_head(from, format, &root.join("imported"), &target);
    let wrong = import_as(&exported, "eagle");
    assert!(
        !wrong.status.success() && stderr(&wrong).contains("EAGLE-3 head"),
        "{}",
        stderr(&wrong)
    );
    let wrong = import_as(&vllm, "eagle3");
    assert!(
        !wrong.status.success() && stderr(&wrong).contains("no EAGLE-3 head"),
        "{}",
        stderr(&wrong)
    );
}
