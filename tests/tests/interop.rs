//! Heads in the layouts other tools load, proven with those tools' own code (installed from PyPI
//! by `make interop-env` under `$HEADWAY_HOME/interop`, run with the Headway venv's python that
//! `make test` puts on PATH): SpecForge's EAGLE-3 draft model loads Headway's export and computes
//! Headway's draft logits, and a head SpecForge initialised and trained imports into Headway with
//! SpecForge's logits.

use std::path::{Path, PathBuf};
use std::process::Command;

use headway_checkpoints::{load_head, DraftHead};
use headway_heads::{Eagle3Head, FeatureModules};
use headway_model::safetensors_io::from_safetensors_bytes;
use headway_model::target::headway_home;
use headway_model::testing::write_safetensors;
use headway_model::{CpuThreads, Target};
use headway_tests::{as_strs, features, run, stderr, stdout, train_args};
use tch::{Device, Kind, Tensor};

/// Logits may differ by this much (f32, different summation orders).
const TOLERANCE: f64 = 1e-4;
const ROUNDS: usize = 3;
const LENGTH: i64 = 9;

/// Runs a script of `scripts/interop/` with the reference packages importable; panics with the
/// command that installs them when they are missing, since a skipped interop check proves
/// nothing.
fn reference_script(script: &str, args: &[&str]) -> String {
    let packages = headway_home().join("interop");
    assert!(
        packages.join("specforge").is_dir(),
        "{} lacks the reference packages: run `make interop-env`",
        packages.display()
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../scripts/interop")
        .join(script);
    let output = Command::new("python")
        .arg(&path)
        .args(args)
        .env("PYTHONPATH", &packages)
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
    let path_str = |p: &PathBuf| p.to_str().unwrap().to_string();

    // Headway → SpecForge: a briefly trained head, exported, loaded by SpecForge's class.
    let trained = root.join("trained");
    let args = train_args(
        "eagle3",
        root,
        trained.to_str().unwrap(),
        &["--taps", "1,1,1", "--ttt", "3", "--draft-vocab", "64"],
    );
    let out = headway_tests::headway_train(&as_strs(&args));
    assert!(out.status.success(), "{}", stderr(&out));
    let exported = root.join("exported");
    let out = run(
        "headway-train",
        &[
            "export",
            "--heads",
            &path_str(&trained),
            "--format",
            "eagle3",
            "--out",
            &path_str(&exported),
            "--target",
            &path_str(&target_dir),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let ours = cases.logits(&eagle3_head(&trained, &target), &target);
    let cases_file = root.join("cases.safetensors");
    cases.write(&cases_file, &target, &ours);
    let report = reference_script(
        "eagle3_specforge.py",
        &[
            "check-export",
            "--export",
            &path_str(&exported),
            "--cases",
            &path_str(&cases_file),
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
        &[
            "write-head",
            "--target",
            &path_str(&target_dir),
            "--cases",
            &path_str(&cases_file),
            "--out",
            &path_str(&theirs),
        ],
    );
    let imported = root.join("imported");
    let out = run(
        "headway-train",
        &[
            "import",
            "--from",
            &path_str(&theirs),
            "--format",
            "eagle3",
            "--out",
            &path_str(&imported),
            "--target",
            &path_str(&target_dir),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    println!("{}", stdout(&out));
    let reference_path = theirs.join("reference_logits.safetensors");
    let bytes = std::fs::read(&reference_path).unwrap();
    let (reference, _) = from_safetensors_bytes(&bytes, &reference_path).unwrap();
    let ours = cases.logits(&eagle3_head(&imported, &target), &target);
    for (r, logits) in ours.iter().enumerate() {
        let difference = max_difference(logits, &reference[&format!("logits_{r}")]);
        println!("SpecForge's head in Headway, round {r}: max |Δlogit| {difference:.2e}");
        assert!(difference <= TOLERANCE, "round {r}: {difference:.2e}");
    }
}
