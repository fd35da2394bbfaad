//! Greedy generation on the real SmolLM2 equals transformers' `generate(do_sample=False)` token
//! for token (fixture written by `scripts/make_fixtures.py`).

use headway_model::generate;
use headway_model::testing::{fixture_path, real_target};
use headway_model::Message;
use headway_model::{Sampler, SamplingParams};
use serde::Deserialize;

#[derive(Deserialize)]
struct GreedyFixture {
    max_new_tokens: usize,
    cases: Vec<GreedyCase>,
}

#[derive(Deserialize)]
struct GreedyCase {
    messages: Vec<Message>,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
}

#[test]
fn greedy_64_tokens_match_transformers_on_three_chat_prompts() {
    let target = real_target();
    let text = std::fs::read_to_string(fixture_path("greedy_reference.json")).unwrap();
    let fixture: GreedyFixture = serde_json::from_str(&text).unwrap();
    assert!(fixture.cases.len() >= 3 && fixture.max_new_tokens >= 64);
    for case in &fixture.cases {
        let prompt_ids = target.chat_prompt_ids(&case.messages).unwrap();
        assert_eq!(
            prompt_ids, case.prompt_ids,
            "prompt ids of {:?}",
            case.messages[0].content
        );
        let mut sampler = Sampler::new(SamplingParams::default());
        let out = generate(
            &target,
            &prompt_ids,
            fixture.max_new_tokens,
            &mut sampler,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(
            out.tokens, case.generated_ids,
            "greedy tokens for {:?}",
            case.messages[0].content
        );
    }
}
