//! What ships and travels: the committed heads in Q8_0 storage, the tracked tree small enough for a
//! device call, the GPU campaign's CPU dry run (issue 48's first step) and the CPU campaign's pieces.

use std::path::{Path, PathBuf};
use std::process::Command;

use headway_tests::{binary, run, stderr, stdout};

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A device call carries the tracked tree plus what it names, 64 MiB in all: the tree must leave
/// room for the GGUF's chunks and the binaries.
const TRACKED_BYTES_MAX: u64 = 30_000_000;

#[test]
fn committed_heads_are_q8_0_and_come_back_byte_for_byte_through_f32() {
    let dir = tempfile::tempdir().unwrap();
    for head in ["smollm2-135m-eagle", "smollm2-135m-eagle3"] {
        let committed = repository().join("pretrained").join(head);
        let config = std::fs::read_to_string(committed.join("config.json")).unwrap();
        assert!(config.contains("\"weight_storage\": \"q8_0\""), "{head}");
        let (f32_dir, q8_dir) = (
            dir.path().join(format!("{head}-f32")),
            dir.path().join(head),
        );
        for (from, to, storage) in [(&committed, &f32_dir, "f32"), (&f32_dir, &q8_dir, "q8_0")] {
            let output = run(
                "headway-train",
                &[
                    "pack",
                    "--heads",
                    from.to_str().unwrap(),
                    "--out",
                    to.to_str().unwrap(),
                    "--storage",
                    storage,
                ],
            );
            assert!(output.status.success(), "{}", stderr(&output));
        }
        let bytes = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
        assert!(bytes(&f32_dir).len() > 3 * bytes(&committed).len());
        assert!(
            bytes(&q8_dir) == bytes(&committed),
            "{head}: Q8_0 → f32 → Q8_0 changed the blocks"
        );
    }
}

#[test]
fn pack_names_a_directory_that_is_not_a_checkpoint_and_an_unknown_storage() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "keep me").unwrap();
    let head = repository().join("pretrained/smollm2-135m-eagle");
    let head = head.to_str().unwrap();
    let out = dir.path().to_str().unwrap();
    let output = run("headway-train", &["pack", "--heads", head, "--out", out]);
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("is not a checkpoint"),
        "{}",
        stderr(&output)
    );
    assert!(dir.path().join("notes.txt").exists(), "nothing is lost");
    let output = run(
        "headway-train",
        &["pack", "--heads", head, "--out", out, "--storage", "q4"],
    );
    assert!(
        stderr(&output).contains("unknown weight storage \"q4\""),
        "{}",
        stderr(&output)
    );
}

#[test]
fn the_tracked_tree_leaves_a_device_call_room() {
    let output = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(repository())
        .output()
        .expect("git lists the tracked files (the tests run in a git checkout)");
    assert!(output.status.success(), "{}", stderr(&output));
    let mut sizes: Vec<(u64, String)> = stdout(&output)
        .split('\0')
        .filter(|name| !name.is_empty())
        .filter_map(|name| {
            let meta = std::fs::metadata(repository().join(name)).ok()?;
            Some((meta.len(), name.to_string()))
        })
        .collect();
    let total: u64 = sizes.iter().map(|(size, _)| size).sum();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    assert!(
        total <= TRACKED_BYTES_MAX,
        "tracked files take {total} bytes, over {TRACKED_BYTES_MAX}; largest: {:?}",
        &sizes[..5.min(sizes.len())]
    );
}

/// `scripts/gpu_campaign.sh` at toy sizes on the CPU: every step of the campaign (replies, the
/// slices' features, EAGLE-3 per slice, EAGLE-1, Medusa, evaluation, packing, the results split
/// for a device call's return) runs with the binaries under test.
#[test]
fn the_campaign_dry_run_passes_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let (work, out) = (dir.path().join("work"), dir.path().join("out"));
    let bin = binary("headway-train");
    let output = Command::new("bash")
        .arg(repository().join("scripts/gpu_campaign.sh"))
        .arg(&out)
        .current_dir(repository())
        .env("DEVICE", "cpu")
        .env("SCALE", "dry")
        .env("WORK", &work)
        .env("BIN", bin.parent().unwrap())
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("running bash");
    assert!(
        output.status.success(),
        "{}\n{}",
        stdout(&output),
        stderr(&output)
    );
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    let rows = summary
        .lines()
        .filter(|l| l.starts_with("| eagle") || l.starts_with("| medusa"));
    assert_eq!(rows.count(), 5, "{summary}");
    assert!(out.join("results.tar.part-00").exists());
    for part in std::fs::read_dir(&out).unwrap() {
        let size = part.unwrap().metadata().unwrap().len();
        assert!(size <= 16 * 1024 * 1024, "a returned file of {size} bytes");
    }
}

/// `scripts/cpu_campaign.sh` at toy sizes: a `replies` piece regenerates every reply and writes
/// the journal to its state; a `train` piece on a fresh scratch directory (another machine) takes
/// the journal back, sets the evaluation aside, trains the head further, leaves it in HEAD for the
/// next piece and logs both pieces; a second `replies` piece finds nothing left to do; a second
/// `train` piece larger than what is left of the pass fills its chunk from the next pass.
#[test]
fn the_cpu_campaign_pieces_resume_from_the_committed_state() {
    let dir = tempfile::tempdir().unwrap();
    let (state, head) = (dir.path().join("state"), dir.path().join("head"));
    let shipped = repository().join("pretrained/smollm2-135m-eagle3");
    std::fs::create_dir(&head).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(shipped.join(file), head.join(file)).unwrap();
    }
    let bin = binary("headway-train");
    let piece_of = |name: &str, work: &str, chunk: &str| {
        let output = Command::new("bash")
            .arg(repository().join("scripts/cpu_campaign.sh"))
            .arg(name)
            .current_dir(repository())
            .env("STATE", &state)
            .env("HEAD", &head)
            .env("WORK", dir.path().join(work))
            .env("BIN", bin.parent().unwrap())
            .env("GGUF", headway_model::testing::real_gguf_path())
            .envs([
                ("MAX_SEQS", "24"),
                ("REPLY_TOKENS", "12"),
                ("CHUNK", chunk),
                ("EVAL", "4"),
                ("HELD_OUT", "0.3"),
                ("MINUTES", "5"),
            ])
            .env_remove("LD_LIBRARY_PATH")
            .output()
            .expect("running bash");
        assert!(
            output.status.success(),
            "{name}: {}\n{}",
            stdout(&output),
            stderr(&output)
        );
        stdout(&output)
    };
    let piece = |name: &str, work: &str| piece_of(name, work, "8");
    let replies = piece("replies", "work-a");
    assert!(
        replies.contains("24 of 24 conversations (24 in this piece)"),
        "{replies}"
    );
    let trained = piece("train", "work-b");
    assert!(
        trained.contains("trained on 8 conversations of pass 1"),
        "{trained}"
    );
    let again = piece("replies", "work-b");
    assert!(
        again.contains("24 of 24 conversations (0 in this piece)"),
        "{again}"
    );
    let read = |file: &str| std::fs::read_to_string(state.join(file)).unwrap();
    assert_eq!(read("replies-total.txt").trim(), "24");
    assert_eq!(read("eval-ids.txt").lines().count(), 4);
    assert_eq!(read("progress.txt"), "1 8\n");
    // 20 conversations train (24 less the 4 evaluated): 12 are left of pass 1, and pass 2's
    // first ones fill the chunk of 16.
    let rolled = piece_of("train", "work-c", "16");
    assert!(
        rolled.contains("pass 1: 16 conversations, 0 left"),
        "{rolled}"
    );
    let progress = read("progress.txt");
    let (pass, done) = progress.trim().split_once(' ').unwrap();
    assert_eq!(pass, "2", "{progress}");
    assert!(
        (4..=16).contains(&done.parse::<usize>().unwrap()),
        "{progress}"
    );
    let log = read("pieces.md");
    assert!(log.contains("16 conversations"), "{log}");
    assert_eq!(
        log.lines().filter(|l| l.contains("| replies |")).count(),
        2,
        "{log}"
    );
    assert_eq!(
        log.lines().filter(|l| l.contains("| train |")).count(),
        2,
        "{log}"
    );
    let config = std::fs::read_to_string(head.join("config.json")).unwrap();
    assert!(config.contains("\"weight_storage\": \"q8_0\""), "{config}");
    assert!(
        config.contains("Q4_1.gguf"),
        "the trained head names the GGUF: {config}"
    );
    let weights = |dir: &std::path::Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert_ne!(
        weights(&head),
        weights(&shipped),
        "the next piece continues from the trained head"
    );
}
