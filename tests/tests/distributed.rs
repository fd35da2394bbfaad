//! Data-parallel head training over torch.distributed's Gloo backend, on loopback, launched as
//! torchrun launches (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): two ranks train the weights
//! one process trains, a killed rank stops the other with a clear error, and a resume with
//! another world size is refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use headway_model::safetensors_io::from_safetensors_bytes;
use headway_tests::{as_strs, binary, eval_heads, features, stderr};

/// `headway-train HEAD` on the fixture's features: `steps` steps of two 64-token micro-batches
/// (the global batch), one thread, checkpoints every `save_every`.
fn train_args(head: &str, root: &Path, out: &Path, steps: u64, save_every: u64) -> Vec<String> {
    train_args_accumulating(head, root, out, steps, save_every, 2)
}

/// [`train_args`] with `accum` micro-batches per step.
fn train_args_accumulating(
    head: &str,
    root: &Path,
    out: &Path,
    steps: u64,
    save_every: u64,
    accum: usize,
) -> Vec<String> {
    let root_path = |p: &str| root.join(p).to_str().unwrap().to_string();
    let mut args: Vec<String> = vec![head.into(), "--features".into(), root_path("features")];
    args.extend(["--target".into(), root_path("target")]);
    args.extend(["--out".into(), out.to_str().unwrap().into()]);
    for (flag, value) in [
        ("--steps", steps.to_string()),
        ("--save-every", save_every.to_string()),
        ("--grad-accum", accum.to_string()),
        ("--batch-tokens", "64".into()),
        ("--warmup", "2".into()),
        ("--lr", "1e-3".into()),
        ("--threads", "1".into()),
        // A mismatch between the ranks fails within a minute instead of hanging a test run.
        ("--dist-timeout", "60".into()),
    ] {
        args.extend([flag.to_string(), value]);
    }
    if head == "eagle3" {
        args.extend(["--taps", "1", "--ttt", "2", "--draft-vocab", "64"].map(String::from));
    }
    args
}

/// A port nothing listens on now, below the kernel's ephemeral range (32768 on): a port the
/// kernel hands out to another test's connection in the meantime cannot be this one.
fn free_port() -> u16 {
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let mut state = u64::from(nanos)
        ^ (u64::from(std::process::id()) << 32)
        ^ CALLS
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    loop {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let port = 20_000 + (state >> 33) as u16 % 10_000;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Rank `rank` of `world` running `headway-train args`, meeting the others at `port`.
fn spawn_rank(args: &[String], rank: usize, world: usize, port: u16) -> Child {
    Command::new(binary("headway-train"))
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("HEADWAY_TARGET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning headway-train")
}

/// Runs `args` as `world` ranks and waits for all of them.
fn run_ranks(args: &[String], world: usize) -> Vec<Output> {
    let port = free_port();
    let children: Vec<Child> = (0..world)
        .map(|rank| spawn_rank(args, rank, world, port))
        .collect();
    children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

/// A checkpoint's weights, by name.
fn weights(checkpoint: &Path) -> BTreeMap<String, tch::Tensor> {
    let path = checkpoint.join("model.safetensors");
    let (tensors, _) = from_safetensors_bytes(&std::fs::read(&path).unwrap(), &path).unwrap();
    tensors.into_iter().collect()
}

fn max_difference(a: &Path, b: &Path) -> f64 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|((name_a, x), (name_b, y))| {
            assert_eq!(name_a, name_b);
            (x - y).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

#[test]
fn two_ranks_over_gloo_train_the_weights_of_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    // With 2 micro-batches per step each rank sums one; with 5 the ranks deal them by size and
    // the sums run in another order than one process's.
    for (head, accum) in [("eagle", 2), ("medusa", 2), ("eagle3", 2), ("eagle", 5)] {
        let args = |out: &Path| train_args_accumulating(head, root, out, 20, 10, accum);
        let single = root.join(format!("{head}-{accum}-1"));
        let out = headway_tests::headway_train(&as_strs(&args(&single)));
        assert!(out.status.success(), "{head}: {}", stderr(&out));
        let double = root.join(format!("{head}-{accum}-2"));
        let outputs = run_ranks(&args(&double), 2);
        for (rank, out) in outputs.iter().enumerate() {
            assert!(out.status.success(), "{head} rank {rank}: {}", stderr(out));
            assert!(
                stderr(out).contains(&format!("as rank {rank} of 2")),
                "{}",
                stderr(out)
            );
        }
        let step = |run: &Path| run.join("step-00000020");
        let difference = max_difference(&step(&single), &step(&double));
        eprintln!(
            "{head}, {accum} micro-batches per step: max |Δ| between 1 and 2 ranks after 20 \
             steps: {difference:e}"
        );
        assert!(difference <= 1e-6, "{head}: {difference}");
        // The optimizer's step count and data position are the single run's too.
        let state =
            |run: &Path| std::fs::read_to_string(step(run).join("training/trainer_state.json"));
        let single_state: serde_json::Value =
            serde_json::from_str(&state(&single).unwrap()).unwrap();
        let double_state: serde_json::Value =
            serde_json::from_str(&state(&double).unwrap()).unwrap();
        assert_eq!(single_state["position"], double_state["position"]);
        assert_eq!(double_state["world_size"], 2);
    }
}

/// Waits for `child` to exit, at most `limit`.
fn wait_at_most(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

fn read_stderr(child: &mut Child) -> String {
    let mut text = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    text
}

#[test]
fn a_killed_rank_stops_the_others_with_a_clear_error_and_the_checkpoint_survives() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    for killed in [1, 0] {
        let out: PathBuf = root.join(format!("killed-{killed}"));
        let args = train_args("eagle", root, &out, 100_000, 2);
        let port = free_port();
        let mut ranks: Vec<Child> = (0..2).map(|r| spawn_rank(&args, r, 2, port)).collect();
        let start = Instant::now();
        while !out.join("step-00000004").exists() {
            assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint");
            std::thread::sleep(Duration::from_millis(20));
        }
        ranks[killed].kill().unwrap();
        ranks[killed].wait().unwrap();
        let survivor = &mut ranks[1 - killed];
        let status = wait_at_most(survivor, Duration::from_secs(60));
        let Some(status) = status else {
            survivor.kill().unwrap();
            panic!(
                "rank {} still runs 60 s after rank {killed} died",
                1 - killed
            );
        };
        let message = read_stderr(survivor);
        assert!(!status.success());
        assert!(
            message.contains("summing over the ranks failed"),
            "rank {}: {message}",
            1 - killed
        );
        // The last checkpoint `latest` names loads whole (checksums checked).
        let eval = eval_heads(&out, root);
        assert!(eval.status.success(), "{}", stderr(&eval));
    }
}

#[test]
fn a_resume_with_another_world_size_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let out = root.join("eagle");
    let args = train_args("eagle", root, &out, 4, 2);
    let first = headway_tests::headway_train(&as_strs(&args));
    assert!(first.status.success(), "{}", stderr(&first));
    let mut resume = args.clone();
    resume.push("--resume".into());
    for output in run_ranks(&resume, 2) {
        assert!(!output.status.success());
        let message = stderr(&output);
        assert!(
            message.contains("was trained by 1 rank(s), this run has 2"),
            "{message}"
        );
    }
}

#[test]
fn nccl_on_cpu_ranks_is_refused_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let mut args = train_args("eagle", root, &root.join("eagle"), 4, 2);
    args.extend(["--dist-backend".into(), "nccl".into()]);
    for output in run_ranks(&args, 2) {
        let message = stderr(&output);
        assert!(
            !output.status.success()
                && message.contains("--dist-backend nccl sums CUDA tensors")
                && message.contains("--dist-backend gloo"),
            "{message}"
        );
    }
}
