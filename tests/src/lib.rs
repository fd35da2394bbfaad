//! End-to-end tests of the Headway binaries (in `tests/`): they run `headway-train` and
//! `headway-serve` as a user would, on tiny random models and on the real SmolLM2.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Path of a workspace binary; `cargo test --workspace` builds every package's binaries into the
/// directory above this test executable's `deps/`.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("test executables live in <target>/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is not built: run `cargo test --workspace`",
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

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}
