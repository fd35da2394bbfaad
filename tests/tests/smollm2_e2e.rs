//! The embedded default end to end: a chat answer from the converted SmolLM2 through the binary.

use headway_model::testing::real_target_dir;
use headway_tests::{run, stderr, stdout};

#[test]
fn the_default_target_answers_a_chat_prompt_greedily() {
    let target = real_target_dir();
    let out = run(
        "headway-serve",
        &[
            "generate",
            "--target",
            target.to_str().unwrap(),
            "--chat",
            "--prompt",
            "What is 2+2?",
            "--max-new-tokens",
            "24",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains('4'), "answer: {}", stdout(&out));
    assert!(
        stderr(&out).contains("stop: Eos"),
        "a short answer ends its turn: {}",
        stderr(&out)
    );
}
