//! The binaries as a user runs them: help, generation, benchmark JSON, conversion and its errors.

use std::path::{Path, PathBuf};

use headway_model::testing::write_tiny_model;
use headway_tests::{run, stderr, stdout};

/// `rows` (one JSON question each) as the question file `q.jsonl` in `dir`.
fn write_questions(dir: &Path, rows: &[String]) -> PathBuf {
    let questions = dir.join("q.jsonl");
    std::fs::write(&questions, rows.join("\n")).unwrap();
    questions
}

/// `headway-serve bench` of `target` over `questions` with `args`, writing its report to `json`;
/// the report, once the run has succeeded.
fn bench_report(target: &str, questions: &Path, args: &[&str], json: &Path) -> serde_json::Value {
    let files = [
        "--target",
        target,
        "--questions",
        questions.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ];
    let out = run("headway-serve", &[&["bench"], &files[..], args].concat());
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

#[test]
fn every_subcommand_explains_its_flags() {
    for (bin, sub, flags) in [
        (
            "headway-serve",
            "generate",
            &[
                "--prompt",
                "--chat",
                "--max-new-tokens",
                "--temperature",
                "--top-k",
                "--top-p",
                "--min-p",
                "--seed",
                "--target",
                "--threads",
            ][..],
        ),
        (
            "headway-serve",
            "bench",
            &[
                "--method",
                "--heads",
                "--questions",
                "--limit",
                "--turns",
                "--tree-tokens",
                "--with-lookup",
                "--json",
            ][..],
        ),
        (
            "headway-serve",
            "http",
            &[
                "--method",
                "--host",
                "--port",
                "--api-key",
                "--max-batch",
                "--max-queue",
                "--max-context",
            ][..],
        ),
        ("headway-serve", "compare", &["<FIRST>", "<SECOND>"][..]),
        (
            "headway-train",
            "convert",
            &["--gguf", "--out", "--dtype"][..],
        ),
        (
            "headway-train",
            "prepare",
            &[
                "--data",
                "--out",
                "--target",
                "--max-seqs",
                "--max-len",
                "--regenerate",
                "--regen-min-p",
                "--layers",
                "--dtype",
                "--device",
                "--batch-tokens",
                "--json",
            ][..],
        ),
        ("headway-train", "verify", &["--features", "--target"][..]),
    ] {
        let out = run(bin, &[sub, "--help"]);
        assert!(out.status.success(), "{bin} {sub} --help failed");
        let help = stdout(&out);
        for flag in flags {
            assert!(
                help.contains(flag),
                "{bin} {sub} --help lacks {flag}:\n{help}"
            );
        }
    }
}

#[test]
fn generate_streams_text_and_ends_with_figures_without_ld_library_path() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let target = dir.path().to_str().unwrap();
    let out = run(
        "headway-serve",
        &[
            "generate",
            "--target",
            target,
            "--prompt",
            "the theory",
            "--chat",
            "--max-new-tokens",
            "12",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let figures = stderr(&out);
    assert!(
        figures.contains("tokens in") && figures.contains("tokens/s"),
        "{figures}"
    );
}

#[test]
fn sampling_with_a_seed_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let target = dir.path().to_str().unwrap();
    let args = [
        "generate",
        "--target",
        target,
        "--prompt",
        "in the",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--seed",
    ];
    let generate = |seed: &str| {
        let mut all = args.to_vec();
        all.push(seed);
        let out = run("headway-serve", &all);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(generate("7"), generate("7"));
}

#[test]
fn bad_sampling_values_are_refused_with_the_field_name() {
    let out = run(
        "headway-serve",
        &["generate", "--prompt", "x", "--temperature=-1"],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("temperature"), "{}", stderr(&out));
    let out = run(
        "headway-serve",
        &["generate", "--prompt", "x", "--min-p", "1.5"],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("min_p"), "{}", stderr(&out));
}

/// `prepare --regenerate` checks its sampling options as every front end does (it did not).
#[test]
fn bad_regeneration_sampling_is_refused_with_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(&dir.path().join("target"), 3).unwrap();
    let data = dir.path().join("chats.jsonl");
    std::fs::write(
        &data,
        r#"{"id": 1, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}"#,
    )
    .unwrap();
    for (flag, value) in [
        ("--regen-top-p", "1.5"),
        ("--regen-min-p", "-0.5"),
        ("--regen-temperature", "-1"),
    ] {
        let out = dir.path().join(format!("features{flag}"));
        let refused = run(
            "headway-train",
            &[
                "prepare",
                "--data",
                data.to_str().unwrap(),
                "--target",
                dir.path().join("target").to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--regenerate",
                &format!("{flag}={value}"),
            ],
        );
        assert!(!refused.status.success(), "{flag} {value} was accepted");
        assert!(
            stderr(&refused).contains(flag),
            "{flag}: {}",
            stderr(&refused)
        );
        assert!(
            !out.join("manifest.json").exists(),
            "{flag}: a manifest was written"
        );
    }
}

#[test]
fn with_lookup_needs_a_model_drafter() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let target = dir.path().to_str().unwrap();
    for method in ["ar", "lookup"] {
        let out = run(
            "headway-serve",
            &[
                "generate",
                "--target",
                target,
                "--prompt",
                "x",
                "--method",
                method,
                "--with-lookup",
            ],
        );
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains(&format!("not --method {method} --with-lookup")),
            "{}",
            stderr(&out)
        );
    }
}

/// Steps past the 64 rows verified exactly are refused up front, naming the flags; 64 rows run.
#[test]
fn plans_past_the_exact_rows_are_refused_naming_their_flags() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let target = dir.path().to_str().unwrap();
    let generate = |flags: &[&str]| {
        let args = [
            &[
                "generate",
                "--target",
                target,
                "--prompt",
                "x",
                "--max-new-tokens",
                "4",
            ][..],
            flags,
        ];
        run("headway-serve", &args.concat())
    };
    for flags in [
        &["--method", "lookup", "--draft-tokens", "64"][..],
        &[
            "--method",
            "draft",
            "--draft-model",
            target,
            "--draft-tokens",
            "64",
        ][..],
    ] {
        let out = generate(flags);
        assert!(!out.status.success(), "{flags:?} was accepted");
        let error = stderr(&out);
        assert!(
            error.contains("--draft-tokens 64") && error.contains("65 rows"),
            "{flags:?}: {error}"
        );
    }
    let out = generate(&["--method", "lookup", "--draft-tokens", "63"]);
    assert!(out.status.success(), "64 rows: {}", stderr(&out));
}

/// More threads than cores are refused (999 spinning workers on 2 cores took minutes a token),
/// and a missing GGUF is named as a file.
#[test]
fn too_many_threads_and_a_missing_gguf_are_named() {
    let out = run(
        "headway-serve",
        &["generate", "--prompt", "x", "--threads", "999"],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--threads: 999 is more than the"),
        "{}",
        stderr(&out)
    );
    let out = run(
        "headway-serve",
        &["generate", "--prompt", "x", "--target", "/nonexistent.gguf"],
    );
    assert!(!out.status.success());
    let error = stderr(&out);
    assert!(
        error.contains("/nonexistent.gguf: no such GGUF file"),
        "{error}"
    );
    assert!(!error.contains("directory"), "{error}");
}

#[test]
fn bench_writes_the_documented_json_fields() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let rows: Vec<String> = (0..6)
        .map(|i| {
            format!(
                r#"{{"question_id": {i}, "category": "c{}", "turns": ["tell me about the {i}"]}}"#,
                i / 2
            )
        })
        .collect();
    let questions = write_questions(dir.path(), &rows);
    let report = bench_report(
        dir.path().to_str().unwrap(),
        &questions,
        &["--method", "ar", "--limit", "3", "--max-new-tokens", "5"],
        &dir.path().join("out.json"),
    );
    for key in [
        "method",
        "tau",
        "tokens_per_s",
        "speedup_vs_ar",
        "per_category",
    ] {
        assert!(report.get(key).is_some(), "missing {key} in {report}");
    }
    assert_eq!(report["overall"]["prompts"], 3);
    assert_eq!(report["tau"], 1.0);
    let ids: Vec<u64> = report["per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["question_id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, vec![0, 2, 4], "one prompt per block of the file");
    let curve = &report["rows_curve"];
    let rows: Vec<u64> = serde_json::from_value(curve["rows"].clone()).unwrap();
    let seconds: Vec<f64> = serde_json::from_value(curve["seconds"].clone()).unwrap();
    assert_eq!(rows[..3], [1, 2, 3], "{curve}");
    assert_eq!(
        (rows.len(), rows.last()),
        (seconds.len(), Some(&64)),
        "{curve}"
    );
    assert!(seconds.iter().all(|&s| s > 0.0), "{curve}");
    assert!(
        curve["int8_macs_per_s"].is_null(),
        "dense weights have no int8 roof"
    );
}

/// Regression (issue 19): `bench --questions` took only numeric ids; HumanEval's are strings.
#[test]
fn bench_takes_string_question_ids_and_keeps_them() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let questions = write_questions(
        dir.path(),
        &[
            r#"{"question_id": "HumanEval/0", "category": "coding", "turns": ["def f():"]}"#.into(),
            r#"{"question_id": 7, "category": "coding", "turns": ["def g():"]}"#.into(),
        ],
    );
    let json = dir.path().join("out.json");
    let bench = |json: &Path| {
        let sampling = ["--temperature", "0.8", "--min-p", "0.05"];
        let args = [
            &["--method", "lookup", "--max-new-tokens", "5"],
            &sampling[..],
        ]
        .concat();
        bench_report(dir.path().to_str().unwrap(), &questions, &args, json)
    };
    let report = bench(&json);
    let ids: Vec<&serde_json::Value> = report["per_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| &p["question_id"])
        .collect();
    assert_eq!(
        ids,
        [&serde_json::json!("HumanEval/0"), &serde_json::json!(7)]
    );
    assert_eq!(report["settings"]["min_p"], 0.05);
    // A named question's sampling seed is stable: the same run samples the same tokens.
    let again = bench(&dir.path().join("again.json"));
    let compare = run(
        "headway-serve",
        &[
            "compare",
            json.to_str().unwrap(),
            dir.path().join("again.json").to_str().unwrap(),
        ],
    );
    assert!(compare.status.success(), "{}", stdout(&compare));
    assert!(
        stdout(&compare).contains("2 of 2 prompts identical"),
        "{}",
        stdout(&compare)
    );
    assert_eq!(again["per_prompt"][0]["question_id"], "HumanEval/0");
}

#[test]
fn a_malformed_question_file_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let questions = dir.path().join("q.jsonl");
    std::fs::write(
        &questions,
        "{\"question_id\": 1, \"category\": \"a\", \"turns\": [\"x\"]}\nnot json\n",
    )
    .unwrap();
    let out = run(
        "headway-serve",
        &["bench", "--questions", questions.to_str().unwrap()],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("line 2"), "{}", stderr(&out));
}

#[test]
fn convert_names_a_missing_or_corrupt_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.gguf");
    let out_dir = dir.path().join("out");
    let out = run(
        "headway-train",
        &[
            "convert",
            "--gguf",
            missing.to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("nope.gguf"), "{}", stderr(&out));

    let corrupt = dir.path().join("corrupt.gguf");
    std::fs::write(&corrupt, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let out = run(
        "headway-train",
        &[
            "convert",
            "--gguf",
            corrupt.to_str().unwrap(),
            "--out",
            out_dir.to_str().unwrap(),
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("corrupt.gguf"), "{}", stderr(&out));
    assert!(
        !out_dir.join("model.safetensors").exists(),
        "nothing is written for a bad file"
    );
}

/// `--device cpu,cpu` spreads the layers over two devices through the code that spreads them over
/// GPUs (`cuda:0,cuda:1`); the hidden states move between them, and nothing else changes.
#[test]
fn a_target_spread_over_devices_decodes_as_on_one() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let target = dir.path().to_str().unwrap();
    let generate = |device: &str| {
        let args = [
            "generate",
            "--target",
            target,
            "--prompt",
            "the theory",
            "--chat",
        ];
        let out = run(
            "headway-serve",
            &[&args[..], &["--max-new-tokens", "24", "--device", device]].concat(),
        );
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    assert_eq!(generate("cpu,cpu"), generate("cpu"));

    // Speculative decoding on the spread target: tree verification and cache compaction.
    let rows: Vec<String> = (0..3)
        .map(|i| {
            format!(
                r#"{{"question_id": {i}, "category": "c{i}", "turns": ["the the the theory {i}"]}}"#
            )
        })
        .collect();
    let questions = write_questions(dir.path(), &rows);
    let args = [
        "--device",
        "cpu,cpu,cpu",
        "--method",
        "lookup",
        "--limit",
        "3",
    ];
    let report = bench_report(
        target,
        &questions,
        &[&args[..], &["--max-new-tokens", "24"]].concat(),
        &dir.path().join("lookup.json"),
    );
    assert_eq!(report["identical_to_ar"], 3, "{report}");

    let mixed = run(
        "headway-serve",
        &[
            "generate", "--target", target, "--prompt", "x", "--device", "cpu,cuda",
        ],
    );
    assert!(!mixed.status.success() && stderr(&mixed).contains("cuda"));
}
