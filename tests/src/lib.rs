//! End-to-end tests of the Headway binaries (in `tests/`): they run `headway-train` and
//! `headway-serve` as a user would, on tiny random models and on the real SmolLM2.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use clap::Parser;
use headway_model::testing::write_tiny_model;
use headway_train::{Cli, Hooks};

/// Path of a workspace binary in the directory above this test executable's `deps/`: `make test`
/// builds them (`cargo build --release --workspace --bins`) before `cargo test`, which builds only
/// the binaries of packages with integration tests of their own.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executables live in <target>/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo build --workspace --bins` (make test does)",
        path.display()
    );
    path
}

/// Runs `name` with `args`; returns its output (stdout, stderr, status).
pub fn run(name: &str, args: &[&str]) -> Output {
    Command::new(binary(name))
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("spawning the binary")
}

/// Runs `headway-train args` as a kill test's uninterrupted run does: no inherited target or
/// library path.
pub fn headway_train(args: &[&str]) -> Output {
    Command::new(binary("headway-train"))
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("HEADWAY_TARGET")
        .output()
        .expect("spawning headway-train")
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The moment a killed `headway-train` run aborts at.
#[derive(Debug, Clone, Copy)]
pub enum AbortAfter {
    /// `prepare`: after this many shards of the run are written.
    Shards(usize),
    /// Training: after the checkpoint of this step is saved.
    Step(u64),
}

const CHILD_ARGS: &str = "HEADWAY_KILL_TEST_ARGS";
const CHILD_ABORT: &str = "HEADWAY_KILL_TEST_ABORT";

/// Runs `headway-train args` in a child process that aborts, as a kill would, at `abort`. The
/// child is this test executable run again on `child_test`, an ignored test that calls
/// [`run_aborting_child`]: the hook is injected there, in test code, not read by the binary.
pub fn headway_train_killed(child_test: &str, args: &[&str], abort: AbortAfter) -> Output {
    let abort = match abort {
        AbortAfter::Shards(n) => format!("shards:{n}"),
        AbortAfter::Step(n) => format!("step:{n}"),
    };
    let exe = std::env::current_exe().expect("test executable path");
    Command::new(exe)
        .args(["--ignored", "--exact", child_test, "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD_ARGS, serde_json::to_string(args).expect("JSON"))
        .env(CHILD_ABORT, abort)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("HEADWAY_TARGET")
        .output()
        .expect("spawning the test executable")
}

/// The child's side of [`headway_train_killed`]: runs the command in this process with hooks
/// that abort where the parent asked. Does nothing when not run as such a child.
pub fn run_aborting_child() {
    let (Ok(args), Ok(abort)) = (std::env::var(CHILD_ARGS), std::env::var(CHILD_ABORT)) else {
        return;
    };
    let args: Vec<String> = serde_json::from_str(&args).expect("the parent's JSON");
    let (point, n) = abort.split_once(':').expect("point:n");
    let (point, n): (String, u64) = (point.to_string(), n.parse().expect("a count"));
    let abort_at = move |at: &str, count: u64| {
        if at == point && count == n {
            eprintln!("aborting after {at} {count}, as a kill would");
            std::process::abort();
        }
    };
    let at_shard = abort_at.clone();
    let hooks = Hooks {
        shard_written: Box::new(move |shards| at_shard("shards", shards as u64)),
        checkpoint_saved: Box::new(move |step| abort_at("step", step)),
    };
    let cli = Cli::parse_from(std::iter::once("headway-train".to_string()).chain(args));
    headway_train::run(cli, &hooks).expect("the child's command");
}

/// A tiny target and features of 40 short chats (a quarter held out).
pub fn features(root: &Path) {
    write_tiny_model(&root.join("target"), 5).unwrap();
    let lines: Vec<String> = (0..40)
        .map(|i| {
            serde_json::json!({"id": i, "messages": [
                {"role": "user", "content": format!("Count to {}.", i % 7 + 2)},
                {"role": "assistant", "content": (1..=(i % 7 + 2)).map(|n| n.to_string()).collect::<Vec<_>>().join(", ")},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(root.join("chats.jsonl"), lines.join("\n")).unwrap();
    let args = prepare_args(root, &root.join("chats.jsonl"), &root.join("features"));
    let out = headway_train(&as_strs(&args));
    assert!(out.status.success(), "{}", stderr(&out));
}

/// `headway-train prepare` of the chats in `data` for the tiny target under `root` into `out`:
/// f32 features of tap 1, a quarter held out.
pub fn prepare_args(root: &Path, data: &Path, out: &Path) -> Vec<String> {
    let path = |p: &Path| p.to_str().unwrap().to_string();
    let mut args = vec!["prepare".to_string(), "--data".into(), path(data)];
    args.extend(["--target".into(), path(&root.join("target"))]);
    args.extend(["--out".into(), path(out)]);
    for flag in ["--dtype", "f32", "--held-out", "0.25", "--layers", "1"] {
        args.push(flag.into());
    }
    args
}

/// `headway-train HEAD` on the features [`features`] wrote under `root`, 6 steps of 128-token
/// batches (checkpoints at steps 3 and 6), with `extra` options.
pub fn train_args<'a>(
    head: &'a str,
    root: &'a Path,
    out: &'a str,
    extra: &[&'a str],
) -> Vec<String> {
    let mut args: Vec<String> = [
        head,
        "--features",
        root.join("features").to_str().unwrap(),
        "--target",
        root.join("target").to_str().unwrap(),
        "--out",
        out,
        "--steps",
        "6",
        "--save-every",
        "3",
        "--batch-tokens",
        "128",
        "--warmup",
        "2",
        "--lr",
        "1e-3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `headway-train eval` of the checkpoint in `heads` on the features [`features`] wrote under
/// `root`.
pub fn eval_heads(heads: &Path, root: &Path) -> Output {
    run(
        "headway-train",
        &[
            "eval",
            "--heads",
            heads.to_str().unwrap(),
            "--features",
            root.join("features").to_str().unwrap(),
            "--target",
            root.join("target").to_str().unwrap(),
        ],
    )
}

pub fn as_strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// `headway-train export` of the checkpoint in `heads` as `format` into `out`, for the target in
/// `target`, with `extra` options.
pub fn export_head(
    heads: &Path,
    format: &str,
    out: &Path,
    target: &Path,
    extra: &[&str],
) -> Output {
    let mut args = vec![
        "export",
        "--heads",
        heads.to_str().unwrap(),
        "--format",
        format,
        "--out",
        out.to_str().unwrap(),
        "--target",
        target.to_str().unwrap(),
    ];
    args.extend(extra);
    run("headway-train", &args)
}

/// `headway-train import` of the head in `from` (layout `format`) into the checkpoint `out`.
pub fn import_head(from: &Path, format: &str, out: &Path, target: &Path) -> Output {
    run(
        "headway-train",
        &[
            "import",
            "--from",
            from.to_str().unwrap(),
            "--format",
            format,
            "--out",
            out.to_str().unwrap(),
            "--target",
            target.to_str().unwrap(),
        ],
    )
}

/// Every file directly in `dir`, by name: its bytes.
pub fn dir_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

/// The shard files of a feature directory (`*.safetensors`), by name.
pub fn shard_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    dir_files(dir)
        .into_iter()
        .filter(|(name, _)| name.ends_with(".safetensors"))
        .collect()
}
