//! `headway-train prepare` and `verify` as a user runs them: a killed run resumes to the same
//! files, and verification names what is wrong.

use std::path::Path;
use std::process::Output;

use headway_model::testing::write_tiny_model;
use headway_tests::{
    dir_files, headway_train, headway_train_killed, run, run_aborting_child, shard_files, stderr,
    stdout, AbortAfter,
};

fn write_corpus(path: &Path) {
    let lines: Vec<String> = (0..16)
        .map(|i| {
            serde_json::json!({"id": i, "messages": [
                {"role": "user", "content": format!("Tell me about number {i}.")},
                {"role": "assistant", "content": format!("{i} is {}", "a fine number. ".repeat(i % 4 + 1))},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n")).unwrap();
}

/// A directory holding the tiny target (`target/`) and the corpus (`chats.jsonl`) the tests
/// prepare.
fn target_and_corpus() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(&dir.path().join("target"), 3).unwrap();
    write_corpus(&dir.path().join("chats.jsonl"));
    dir
}

/// `headway-train prepare` of the corpus under `root` into `out`; with `abort_after`, killed
/// after that many shards.
fn prepare(root: &Path, out: &Path, abort_after: Option<usize>) -> Output {
    prepare_with(root, out, &[], abort_after)
}

/// [`prepare`] with `extra` options.
fn prepare_with(root: &Path, out: &Path, extra: &[&str], abort_after: Option<usize>) -> Output {
    let data = root.join("chats.jsonl");
    let target = root.join("target");
    let mut args = vec![
        "prepare",
        "--data",
        data.to_str().unwrap(),
        "--target",
        target.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-len",
        "64",
        "--shard-tokens",
        "150",
        "--batch-tokens",
        "128",
        "--layers",
        "1",
        "--dtype",
        "bf16",
        "--held-out",
        "0.2",
    ];
    args.extend(extra);
    match abort_after {
        Some(n) => headway_train_killed("killed_prepare_child", &args, AbortAfter::Shards(n)),
        None => headway_train(&args),
    }
}

/// Not a test: the child process of the kill tests here (see `headway_train_killed`).
#[test]
#[ignore = "run by the kill tests as their child process"]
fn killed_prepare_child() {
    run_aborting_child();
}

#[test]
fn a_killed_prepare_resumes_to_byte_identical_files() {
    let dir = target_and_corpus();
    let root = dir.path();
    let out = root.join("features");

    let clean = prepare(root, &out, None);
    assert!(clean.status.success(), "{}", stderr(&clean));
    let summary = stdout(&clean);
    assert!(
        summary.contains("16 sequences") && summary.contains("assistant tokens"),
        "{summary}"
    );
    let expected = dir_files(&out);
    assert!(
        expected
            .keys()
            .filter(|k| k.ends_with(".safetensors"))
            .count()
            >= 4,
        "{expected:?}"
    );
    std::fs::remove_dir_all(&out).unwrap();

    let killed = prepare(root, &out, Some(2));
    assert!(
        !killed.status.success(),
        "the abort hook did not stop the run"
    );
    let partial = dir_files(&out);
    assert_eq!(
        partial
            .keys()
            .filter(|k| k.ends_with(".safetensors"))
            .count(),
        2
    );
    let verify = run(
        "headway-train",
        &["verify", "--features", out.to_str().unwrap()],
    );
    assert!(!verify.status.success());
    assert!(
        stderr(&verify).contains("did not finish (2 of"),
        "{}",
        stderr(&verify)
    );

    let resumed = prepare(root, &out, None);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(
        stdout(&resumed).contains("2 kept from an earlier run"),
        "{}",
        stdout(&resumed)
    );
    assert!(
        dir_files(&out) == expected,
        "resumed files differ from an uninterrupted run's"
    );

    let verify = run(
        "headway-train",
        &["verify", "--features", out.to_str().unwrap()],
    );
    assert!(verify.status.success(), "{}", stderr(&verify));
    assert!(
        stdout(&verify).contains("shards verified"),
        "{}",
        stdout(&verify)
    );
}

#[test]
fn verify_names_each_bad_shard_and_a_foreign_target() {
    let dir = target_and_corpus();
    let root = dir.path();
    write_tiny_model(&root.join("other"), 4).unwrap();
    let out = root.join("features");
    assert!(prepare(root, &out, None).status.success());
    let features = out.to_str().unwrap();

    for name in ["train-00001.safetensors", "held_out-00000.safetensors"] {
        let path = out.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
    }
    let verify = run("headway-train", &["verify", "--features", features]);
    assert!(!verify.status.success());
    let report = stderr(&verify);
    assert!(
        report.contains("BAD train-00001.safetensors") && report.contains("checksum mismatch"),
        "{report}"
    );
    assert!(
        report.contains("BAD held_out-00000.safetensors"),
        "{report}"
    );
    assert!(report.contains("2 of "), "{report}");
    assert!(!report.contains("BAD train-00000"), "{report}");

    let other = root.join("other");
    let verify = run(
        "headway-train",
        &[
            "verify",
            "--features",
            features,
            "--target",
            other.to_str().unwrap(),
        ],
    );
    assert!(!verify.status.success());
    assert!(
        stderr(&verify).contains("were extracted from target sha256:"),
        "{}",
        stderr(&verify)
    );
}

#[test]
fn three_prepare_slices_merge_into_the_single_runs_directory() {
    let dir = target_and_corpus();
    let root = dir.path();
    let whole = root.join("whole");
    let out = prepare(root, &whole, None);
    assert!(out.status.success(), "{}", stderr(&out));
    let slices: Vec<String> = (0..3)
        .map(|i| {
            let slice = root.join(format!("slice-{i}"));
            let shard = format!("{i}/3");
            let out = prepare_with(root, &slice, &["--shard", &shard], None);
            assert!(out.status.success(), "{}", stderr(&out));
            assert!(
                stdout(&out).contains(&format!("slice {i}/3:")),
                "{}",
                stdout(&out)
            );
            slice.to_str().unwrap().to_string()
        })
        .collect();
    let train_on_slice = run(
        "headway-train",
        &[
            "eagle",
            "--features",
            &slices[0],
            "--target",
            root.join("target").to_str().unwrap(),
            "--out",
            root.join("eagle").to_str().unwrap(),
            "--steps",
            "1",
        ],
    );
    assert!(!train_on_slice.status.success());
    assert!(
        stderr(&train_on_slice).contains("merge-features"),
        "{}",
        stderr(&train_on_slice)
    );
    let merged = root.join("merged");
    let mut args = vec!["merge-features", "--out", merged.to_str().unwrap()];
    args.extend(slices.iter().rev().map(String::as_str));
    let out = run("headway-train", &args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("merged 3 slices"), "{}", stdout(&out));
    let verify = run(
        "headway-train",
        &["verify", "--features", merged.to_str().unwrap()],
    );
    assert!(verify.status.success(), "{}", stderr(&verify));
    assert!(
        shard_files(&merged) == shard_files(&whole),
        "merged shards differ from the single run's"
    );
    let bad = run(
        "headway-train",
        &["prepare", "--data", "x", "--out", "y", "--shard", "3/3"],
    );
    assert!(stderr(&bad).contains("0 ≤ I < N"), "{}", stderr(&bad));
}

#[test]
fn a_layer_named_twice_is_refused_before_anything_is_written() {
    let dir = target_and_corpus();
    let root = dir.path();
    let out = root.join("features");
    // `prepare_with` already asks for tap 1.
    let twice = prepare_with(root, &out, &["--layers", "1"], None);
    assert!(
        !twice.status.success() && stderr(&twice).contains("--layers names tap 1 twice"),
        "{}",
        stderr(&twice)
    );
    assert!(!out.exists(), "refused, yet {} was made", out.display());
}

/// Features from a target spread over two devices (`--device cpu,cpu`, the code path of
/// `cuda:0,cuda:1`) are the single device's, byte for byte.
#[test]
fn features_from_a_target_spread_over_devices_are_the_same() {
    let dir = target_and_corpus();
    let root = dir.path();
    let (one, two) = (root.join("one"), root.join("two"));
    let single = prepare_with(root, &one, &["--device", "cpu"], None);
    assert!(single.status.success(), "{}", stderr(&single));
    let spread = prepare_with(root, &two, &["--device", "cpu,cpu"], None);
    assert!(spread.status.success(), "{}", stderr(&spread));
    assert!(shard_files(&one) == shard_files(&two), "the shards differ");
}
