//! Parity with transformers on the real SmolLM2-135M-Instruct (fixtures written by
//! `scripts/make_fixtures.py` from the same GGUF): logits, tokenizer ids and chat rendering.

use headway_model::testing::{fixture_path, real_target, real_target_dir, reference_logits};
use headway_model::{ChatTemplate, ForwardInput, Message, TextTokenizer, TreeInput};
use serde::Deserialize;
use tch::Device;

#[test]
fn logits_match_transformers_within_1e_3_at_every_position() {
    let target = real_target();
    let cpu = target.cpu.decode();
    let prompts = reference_logits();
    assert!(
        prompts.len() >= 3,
        "the fixture must hold at least 3 prompts"
    );
    let _no_grad = tch::no_grad_guard();
    for (i, (ids, expected)) in prompts.into_iter().enumerate() {
        let tokens = TreeInput::causal(0, &ids, Device::Cpu);
        let input = ForwardInput::new(&tokens, &[], &cpu);
        let hidden = target.model.model.forward(&input, None).unwrap().hidden;
        let logits = target.model.lm_head.forward(&hidden.squeeze_dim(0), &cpu);
        let per_position = (logits - expected).abs().amax(&[1i64][..], false);
        let worst = per_position.max().double_value(&[]);
        assert!(
            worst <= 1e-3,
            "prompt {i}: max |Δlogit| {worst} > 1e-3 (per position {:?})",
            Vec::<f32>::try_from(&per_position).unwrap()
        );
    }
}

#[derive(Deserialize)]
struct TokenizerFixture {
    cases: Vec<TokenizerCase>,
}

#[derive(Deserialize)]
struct TokenizerCase {
    name: String,
    text: String,
    ids: Vec<u32>,
    decoded: Option<String>,
}

fn read_fixture<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let text = std::fs::read_to_string(fixture_path(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn tokenizer_ids_match_transformers_on_spec_bench_and_edge_cases() {
    let tokenizer = TextTokenizer::from_file(&real_target_dir().join("tokenizer.json")).unwrap();
    let fixture: TokenizerFixture = read_fixture("tokenizer_ids.json");
    let spec_bench = fixture
        .cases
        .iter()
        .filter(|c| c.name.starts_with("spec_bench/"))
        .count();
    assert!(
        spec_bench >= 480,
        "expected every Spec-Bench prompt, found {spec_bench}"
    );
    let mut mismatches = Vec::new();
    for case in &fixture.cases {
        let ids = tokenizer.encode(&case.text, false).unwrap();
        if ids != case.ids {
            mismatches.push(format!(
                "{}: {:?} vs {:?}",
                case.name,
                &ids[..ids.len().min(12)],
                &case.ids[..case.ids.len().min(12)]
            ));
        }
        if let Some(decoded) = &case.decoded {
            assert_eq!(
                &tokenizer.decode(&case.ids, false).unwrap(),
                decoded,
                "decode of {}",
                case.name
            );
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} cases differ:\n{}",
        mismatches.len(),
        fixture.cases.len(),
        mismatches.join("\n")
    );
}

#[derive(Deserialize)]
struct ChatFixture {
    cases: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct ChatCase {
    name: String,
    messages: Vec<Message>,
    add_generation_prompt: bool,
    text: String,
    ids: Vec<u32>,
}

#[test]
fn chat_template_renders_and_tokenizes_like_transformers() {
    let dir = real_target_dir();
    let template = ChatTemplate::from_dir(&dir)
        .unwrap()
        .expect("SmolLM2 has a chat template");
    let tokenizer = TextTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let fixture: ChatFixture = read_fixture("chat_template.json");
    for case in &fixture.cases {
        let text = template
            .render(&case.messages, case.add_generation_prompt)
            .unwrap();
        assert_eq!(text, case.text, "rendering of {}", case.name);
        assert_eq!(
            tokenizer.encode(&text, false).unwrap(),
            case.ids,
            "ids of {}",
            case.name
        );
    }
}
