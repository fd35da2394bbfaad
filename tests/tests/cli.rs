//! The binaries as a user runs them: help, generation, benchmark JSON, conversion and its errors.

use headway_model::testing::write_tiny_model;
use headway_tests::{run, stderr, stdout};

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

#[test]
fn bench_writes_the_documented_json_fields() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), 3).unwrap();
    let questions = dir.path().join("q.jsonl");
    let rows: Vec<String> = (0..6)
        .map(|i| {
            format!(
                r#"{{"question_id": {i}, "category": "c{}", "turns": ["tell me about the {i}"]}}"#,
                i / 2
            )
        })
        .collect();
    std::fs::write(&questions, rows.join("\n")).unwrap();
    let json = dir.path().join("out.json");
    let out = run(
        "headway-serve",
        &[
            "bench",
            "--target",
            dir.path().to_str().unwrap(),
            "--method",
            "ar",
            "--questions",
            questions.to_str().unwrap(),
            "--limit",
            "3",
            "--max-new-tokens",
            "5",
            "--json",
            json.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
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
