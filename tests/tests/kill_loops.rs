//! Kill loops (issue 23): `prepare`, the three trainers and `export`, each killed with SIGKILL at
//! seeded random moments and run again until a run finishes (training with `--resume` once a
//! checkpoint exists). Every finished directory must hold exactly the files of an uninterrupted
//! run, byte for byte — so nothing partial is ever taken for whole and no temporary file or
//! directory is left behind.
//!
//! `HEADWAY_KILLS` sets the kills per command (default 8, what `make test` runs; the figures in
//! docs/reliability.md come from 200).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use headway_tests::{binary, features, prepare_args, train_args};
use rand::{Rng, SeedableRng};

fn kills_per_command() -> usize {
    std::env::var("HEADWAY_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

/// Every file under `dir` by relative path, with its bytes. TensorBoard logs are left out: each
/// run (a resumed one too) starts its own events file, by design.
fn files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(at) = pending.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            let relative = path.strip_prefix(dir).unwrap().to_path_buf();
            if relative == Path::new("logs") {
                continue;
            }
            if path.is_dir() {
                pending.push(path);
            } else {
                found.insert(relative, std::fs::read(&path).unwrap());
            }
        }
    }
    found
}

/// The arguments of a command's next run, given its output directory.
type NextArgs = Box<dyn Fn(&Path) -> Vec<String>>;

/// One command under the kill loop.
struct Subject {
    name: &'static str,
    args: NextArgs,
    out: PathBuf,
}

/// Runs `subject` once to the end; returns how long that took.
fn run_to_end(subject: &Subject, log: &Path) -> Duration {
    let started = Instant::now();
    let status = spawn(subject, log).wait().unwrap();
    assert!(
        status.success(),
        "{}: {}",
        subject.name,
        std::fs::read_to_string(log).unwrap_or_default()
    );
    started.elapsed()
}

fn spawn(subject: &Subject, log: &Path) -> std::process::Child {
    Command::new(binary("headway-train"))
        .args((subject.args)(&subject.out))
        .env_remove("LD_LIBRARY_PATH")
        .stdout(Stdio::null())
        .stderr(File::create(log).unwrap())
        .spawn()
        .unwrap()
}

/// The moments a kill may land at: from most of the process's start-up (loading libtorch,
/// parsing arguments: nothing written yet) to the end of an uninterrupted run, so that most kills
/// land while the command works and writes.
#[derive(Clone, Copy)]
struct Window {
    from: Duration,
    to: Duration,
}

/// How long `headway-train --help` takes: the start-up every run pays before its work.
fn startup() -> Duration {
    let started = Instant::now();
    let status = Command::new(binary("headway-train"))
        .arg("--help")
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    started.elapsed()
}

/// From an empty output directory, runs `subject` again and again, killing each run at a moment
/// drawn from `window` while `budget` kills remain, until a run finishes. Returns the kills.
fn run_until_finished(
    subject: &Subject,
    window: Window,
    budget: usize,
    rng: &mut impl Rng,
    log: &Path,
) -> usize {
    let _ = std::fs::remove_dir_all(&subject.out);
    let mut kills = 0;
    loop {
        let mut child = spawn(subject, log);
        if kills < budget {
            let deadline = Instant::now() + rng.random_range(window.from..window.to);
            while Instant::now() < deadline && child.try_wait().unwrap().is_none() {
                std::thread::sleep(Duration::from_millis(2));
            }
            if child.try_wait().unwrap().is_none() {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                kills += 1;
                continue;
            }
        }
        let status = child.wait().unwrap();
        assert!(
            status.success(),
            "{} after {kills} kills: {}",
            subject.name,
            std::fs::read_to_string(log).unwrap_or_default()
        );
        return kills;
    }
}

/// Kills `subject` `kills` times over as many killed-and-finished sequences as that takes; each
/// finished directory must equal the uninterrupted run's. Prints the figures.
fn kill_loop(subject: &Subject, kills: usize, seed: u64, scratch: &Path) {
    let log = scratch.join(format!("{}.log", subject.name));
    let _ = std::fs::remove_dir_all(&subject.out);
    let whole = run_to_end(subject, &log);
    let window = Window {
        from: startup().mul_f64(0.8).min(whole / 2),
        to: whole,
    };
    let reference = files(&subject.out);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut done, mut sequences) = (0, 0);
    let started = Instant::now();
    while done < kills {
        done += run_until_finished(subject, window, kills - done, &mut rng, &log);
        sequences += 1;
        let finished = files(&subject.out);
        let names = |m: &BTreeMap<PathBuf, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            names(&finished),
            names(&reference),
            "{}: other files than an uninterrupted run's after {done} kills",
            subject.name
        );
        for (path, bytes) in &finished {
            assert!(
                bytes == &reference[path],
                "{}: {} differs from an uninterrupted run's after {done} kills",
                subject.name,
                path.display()
            );
        }
    }
    eprintln!(
        "{}: {done} kills over {sequences} finished sequences in {:.0} s (an uninterrupted run {:.2} s): every result identical, no file left over",
        subject.name,
        started.elapsed().as_secs_f64(),
        whole.as_secs_f64()
    );
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Ten times the chats of [`features`], so that `prepare` writes for a while (over 100 shards).
fn write_long_corpus(root: &Path) -> PathBuf {
    let chats = std::fs::read_to_string(root.join("chats.jsonl")).unwrap();
    let path = root.join("chats-long.jsonl");
    let lines: Vec<String> = (0..10)
        .flat_map(|copy| {
            chats.lines().map(move |line| {
                let mut chat: serde_json::Value = serde_json::from_str(line).unwrap();
                chat["id"] = format!("{copy}-{}", chat["id"]).into();
                chat.to_string()
            })
        })
        .collect();
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn prepare_subject(root: &Path) -> Subject {
    let out = root.join("features-killed");
    let mut args = prepare_args(root, &write_long_corpus(root), &out);
    args.extend(["--shard-tokens".into(), "64".into()]);
    Subject {
        name: "prepare",
        args: Box::new(move |_| args.clone()),
        out,
    }
}

/// Training resumes once a checkpoint exists, as a user would rerun it. 40 steps with a
/// checkpoint every 2, so that kills land in steps and in checkpoint writes alike.
fn training_subject(root: &Path, head: &'static str, extra: &[&str]) -> Subject {
    let out = root.join(format!("{head}-killed"));
    let mut args = train_args(head, root, out.to_str().unwrap(), extra);
    for (flag, value) in [("--steps", "40"), ("--save-every", "2")] {
        let at = args.iter().position(|a| a == flag).unwrap();
        args[at + 1] = value.to_string();
    }
    Subject {
        name: head,
        args: Box::new(move |out| {
            let mut args = args.clone();
            if out.join("latest").exists() {
                args.push("--resume".into());
            }
            args
        }),
        out,
    }
}

fn export_subject(root: &Path) -> Subject {
    let out = root.join("export-killed");
    let args = strings(&[
        "export",
        "--heads",
        root.join("eagle-killed").to_str().unwrap(),
        "--format",
        "eagle",
        "--target",
        root.join("target").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    Subject {
        name: "export",
        args: Box::new(move |_| args.clone()),
        out,
    }
}

#[test]
fn killed_commands_finish_with_an_uninterrupted_runs_files() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    features(root);
    let kills = kills_per_command();
    let subjects = [
        prepare_subject(root),
        training_subject(root, "eagle", &[]),
        training_subject(root, "medusa", &["--heads", "2", "--draft-vocab", "64"]),
        training_subject(
            root,
            "eagle3",
            &["--taps", "1", "--ttt", "2", "--draft-vocab", "64"],
        ),
        // Last: it exports the EAGLE head the loop above left finished.
        export_subject(root),
    ];
    for (seed, subject) in subjects.iter().enumerate() {
        kill_loop(subject, kills, seed as u64, root);
    }
}
