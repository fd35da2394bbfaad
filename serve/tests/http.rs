//! The real `headway-serve http` binary on a loopback port with the tiny random model.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{chat, post, post_raw, start, start_on, stream};
use headway_model::testing::{real_gguf_path, real_target_dir, write_tiny_model};
use serde_json::{json, Value};

#[test]
fn completions_chat_streaming_and_stop_strings() {
    let server = start(&[]);
    // A prompt the random model answers with some text (it may end its turn at once).
    let prompt = ["hello there", "count: 1 2 3", "abc abc abc", "tell me more"]
        .into_iter()
        .find(|p| {
            let (_, body) = post(&server, "/v1/chat/completions", &chat(p, 24));
            body["choices"][0]["message"]["content"]
                .as_str()
                .is_some_and(|t| t.chars().count() >= 4)
        })
        .expect("one of the prompts gets a text answer");
    let (status, body) = post(&server, "/v1/chat/completions", &chat(prompt, 24));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert!(body["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    assert!(body["speculative"]["tau"].as_f64().unwrap() >= 1.0);
    assert_eq!(body["speculative"]["method"], "lookup");

    // Streaming under greedy decoding gives the same text, chunk by chunk.
    let (streamed, last) = stream(&server, "/v1/chat/completions", &chat(prompt, 24));
    assert_eq!(streamed, text);
    assert_eq!(last["usage"], body["usage"]);
    assert!(last["choices"][0]["finish_reason"].is_string());

    // Completions, streamed and not.
    let request = json!({"prompt": "one two three", "max_tokens": 16, "temperature": 0});
    let (status, body) = post(&server, "/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    let completion = body["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(stream(&server, "/v1/completions", &request).0, completion);

    // A stop string taken from the middle of the greedy text cuts the text just before it.
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "greedy text {text:?} is too short to cut");
    let middle = chars.len() / 2;
    let stop: String = chars[middle..(middle + 2).min(chars.len())]
        .iter()
        .collect();
    let expected: String = text[..text.find(&stop).unwrap()].to_string();
    let mut request = chat(prompt, 24);
    request["stop"] = json!([stop]);
    let (_, body) = post(&server, "/v1/chat/completions", &request);
    assert_eq!(body["choices"][0]["message"]["content"], expected.as_str());
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        stream(&server, "/v1/chat/completions", &request).0,
        expected
    );

    let models = ureq::get(&format!("{}/v1/models", server.url))
        .call()
        .unwrap();
    let models: Value = serde_json::from_str(&models.into_string().unwrap()).unwrap();
    assert_eq!(models["data"][0]["object"], "model");
    let metrics = ureq::get(&format!("{}/metrics", server.url))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(
        metrics.contains("headway_requests_total{path=\"/v1/chat/completions\",status=\"200\"}")
    );
    assert!(metrics.contains("headway_tau_bucket"));
    assert!(metrics.contains("headway_time_to_first_token_seconds_count"));
}

/// Issue 21: `speculative.accepted_tokens` counted the drafts that the last target forward
/// accepted past `max_tokens`. The target drafting for itself has all four drafts of every
/// forward accepted, so after the prompt forward's token each forward emits five tokens, and a
/// reply of `n` tokens holds `n − 1 − ⌊(n − 1) / 5⌋` accepted drafts (the bonus tokens of the
/// forwards that were not cut are the rest).
#[test]
fn issue_21_accepted_tokens_count_only_emitted_drafts() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target");
    write_tiny_model(&target, 41).unwrap();
    let draft = target.to_str().unwrap().to_owned();
    let args = [
        "--method",
        "draft",
        "--draft-model",
        &draft,
        "--draft-tokens",
        "4",
    ];
    let server = start_on(&target, dir, &args);
    for max_tokens in 1..=12u64 {
        let request = json!({"prompt": "tell me more", "max_tokens": max_tokens, "temperature": 0});
        let (status, body) = post(&server, "/v1/completions", &request);
        assert_eq!(status, 200, "{body}");
        let completion = body["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(completion, max_tokens, "{body}");
        let emitted_drafts = completion - 1 - (completion - 1) / 5;
        assert_eq!(
            body["speculative"]["accepted_tokens"].as_u64().unwrap(),
            emitted_drafts,
            "max_tokens {max_tokens}: {body}"
        );
    }
}

#[test]
fn bad_requests_get_openai_errors_with_their_status() {
    let server = start(&["--max-context", "64", "--max-body-bytes", "4000"]);
    let chat_path = "/v1/chat/completions";
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "malformed JSON",
            b"{\"messages\": [".to_vec(),
            400,
            "invalid JSON",
        ),
        (
            "wrong type",
            br#"{"messages": [], "temperature": "hot"}"#.to_vec(),
            400,
            "temperature",
        ),
        (
            "negative max_tokens",
            chat_body(json!({"max_tokens": -5})),
            400,
            "max_tokens",
        ),
        (
            "absurd max_tokens",
            chat_body(json!({"max_tokens": 1_000_000_000})),
            400,
            "max_tokens",
        ),
        (
            "negative temperature",
            chat_body(json!({"temperature": -1})),
            400,
            "temperature",
        ),
        ("top_p zero", chat_body(json!({"top_p": 0.0})), 400, "top_p"),
        (
            "top_p above one",
            chat_body(json!({"top_p": 1.5})),
            400,
            "top_p",
        ),
        ("n = 2", chat_body(json!({"n": 2})), 400, "n = 2"),
        (
            "no messages",
            br#"{"messages": []}"#.to_vec(),
            400,
            "messages",
        ),
        (
            "prompt longer than the context",
            chat_body(json!({"messages": [{"role": "user", "content": "word ".repeat(200)}]})),
            400,
            "context",
        ),
        (
            "body over the limit",
            chat_body(json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]})),
            413,
            "limit",
        ),
        (
            "bad UTF-8",
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            "UTF-8",
        ),
    ];
    for (name, body, status, needle) in cases {
        let (got, error) = post_raw(&server, chat_path, &body, None);
        assert_eq!(got, status, "{name}: {error}");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(needle), "{name}: {message}");
        assert!(error["error"]["type"].is_string(), "{name}: {error}");
    }
    // The server is unharmed.
    assert_eq!(post(&server, chat_path, &chat("hi", 4)).0, 200);
}

fn chat_body(fields: Value) -> Vec<u8> {
    let mut body = chat("hi", 4);
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string().into_bytes()
}

#[test]
fn the_api_key_is_required_when_set() {
    let server = start(&["--api-key", "sesame"]);
    let body = chat("hi", 4).to_string();
    let path = "/v1/chat/completions";
    assert_eq!(post_raw(&server, path, body.as_bytes(), None).0, 401);
    let (status, error) = post_raw(&server, path, body.as_bytes(), Some("wrong"));
    assert_eq!(status, 401);
    assert_eq!(error["error"]["type"], "invalid_api_key");
    // A prefix, a longer key, another case: all refused.
    for wrong in ["sesam", "sesame!", "SESAME"] {
        assert_eq!(post_raw(&server, path, body.as_bytes(), Some(wrong)).0, 401);
    }
    assert_eq!(
        post_raw(&server, path, body.as_bytes(), Some("sesame")).0,
        200
    );
    // Every endpoint but /health, GETs included.
    for endpoint in ["/v1/models", "/metrics", "/no-such-path"] {
        let url = format!("{}{endpoint}", server.url);
        match ureq::get(&url).call() {
            Err(ureq::Error::Status(401, _)) => {}
            other => panic!("{endpoint} without a key: {other:?}"),
        }
        let keyed = ureq::get(&url).set("Authorization", "Bearer sesame").call();
        assert!(
            !matches!(keyed, Err(ureq::Error::Status(401, _))),
            "{endpoint} with the key"
        );
    }
    assert!(ureq::get(&format!("{}/health", server.url)).call().is_ok());
}

#[test]
fn a_client_that_disconnects_mid_stream_cancels_its_generation() {
    // The real model: the tiny one finishes 400 tokens before the server can notice that the
    // socket is gone.
    let server = start_on(&real_target_dir(), tempfile::tempdir().unwrap(), &[]);
    let mut body = chat("tell me a long story", 400);
    body["stream"] = json!(true);
    let response = ureq::post(&format!("{}/v1/chat/completions", server.url))
        .send_string(&body.to_string())
        .unwrap();
    let mut reader = BufReader::new(response.into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    drop(reader);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = ureq::get(&format!("{}/metrics", server.url))
            .call()
            .unwrap()
            .into_string()
            .unwrap();
        if metrics.contains("headway_cancelled_total 1") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no cancellation recorded:\n{metrics}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(post(&server, "/v1/chat/completions", &chat("hi", 4)).0, 200);
}

/// A counter or gauge of the server's `/metrics`.
fn metric(server: &common::Server, name: &str) -> f64 {
    let metrics = ureq::get(&format!("{}/metrics", server.url))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    let line = metrics.lines().find(|l| l.starts_with(&format!("{name} ")));
    let value = line.and_then(|l| l.split(' ').nth(1));
    value
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{metrics}"))
}

/// Continuous batching: sixteen clients at once are decoded together (far fewer engine steps
/// than tokens), and each gets the answer its request gets alone.
#[test]
fn sixteen_concurrent_clients_get_what_each_would_get_alone() {
    let server = start(&["--max-queue", "64"]);
    let prompt = |c: usize, r: usize| format!("client {c} request {r}: count with me");
    let alone: Vec<String> = (0..4)
        .map(|r| {
            let (_, body) = post(&server, "/v1/chat/completions", &chat(&prompt(0, r), 12));
            body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let steps_before = metric(&server, "headway_engine_steps_total");
    let tokens_before = metric(&server, "headway_generated_tokens_total");
    std::thread::scope(|scope| {
        for c in 0..16 {
            let server = &server;
            let alone = &alone;
            scope.spawn(move || {
                for r in 0..8 {
                    // Clients share four prompts, so every answer has a known solo reference.
                    let (status, body) =
                        post(server, "/v1/chat/completions", &chat(&prompt(0, r % 4), 12));
                    assert_eq!(status, 200, "client {c}: {body}");
                    assert_eq!(
                        body["choices"][0]["message"]["content"],
                        alone[r % 4].as_str()
                    );
                }
            });
        }
    });
    let steps = metric(&server, "headway_engine_steps_total") - steps_before;
    let tokens = metric(&server, "headway_generated_tokens_total") - tokens_before;
    assert!(
        3.0 * steps < tokens,
        "{steps} engine steps for {tokens} tokens: the clients were not batched"
    );
}

#[test]
fn a_full_queue_answers_429_and_the_rest_complete() {
    let server = start(&["--max-batch", "2", "--max-queue", "1"]);
    let statuses: Vec<u16> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let server = &server;
                scope.spawn(move || {
                    let (status, body) = post(
                        server,
                        "/v1/chat/completions",
                        &chat(&format!("busy {i}"), 200),
                    );
                    if status == 200 {
                        assert!(body["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
                    } else {
                        assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
                    }
                    status
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| [200, 429].contains(s)),
        "{statuses:?}"
    );
}

#[test]
fn sigterm_lets_the_running_request_finish_then_exits_zero() {
    let mut server = start(&[]);
    let url = server.url.clone();
    let request = std::thread::spawn(move || {
        let body = json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "temperature": 0});
        ureq::post(&format!("{url}/v1/chat/completions"))
            .send_string(&body.to_string())
            .unwrap()
            .into_string()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(100));
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let body: Value = serde_json::from_str(&request.join().unwrap()).unwrap();
    assert!(
        body["usage"]["completion_tokens"].as_u64().unwrap() >= 1,
        "{body}"
    );
    let status = server.child.wait().unwrap();
    assert!(status.success(), "exit status {status}");
    let log = server.log();
    assert!(log.contains("shut down"), "{log}");
}

#[test]
fn the_official_openai_python_client_works_against_the_server() {
    let server = start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/openai_client_check.py");
    let output = Command::new("python")
        .arg(&script)
        .args(["--base-url", &format!("{}/v1", server.url)])
        .output()
        .expect("python from the Headway venv (make test puts it on PATH)");
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn a_short_soak_mixes_every_kind_of_request_without_errors() {
    let server = start(&["--max-queue", "8"]);
    let plain = start(&["--method", "ar"]);
    let dir = tempfile::tempdir().unwrap();
    let questions = dir.path().join("questions.jsonl");
    let lines: Vec<String> = [
        "count to ten",
        "name a colour",
        "say hello",
        "the sea is",
        "why?",
    ]
    .iter()
    .enumerate()
    .map(|(i, turn)| json!({"question_id": i, "category": "soak", "turns": [turn]}).to_string())
    .collect();
    std::fs::write(&questions, lines.join("\n")).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_headway-serve"))
        .args([
            "load",
            "--mix",
            "--requests",
            "256",
            "--concurrency",
            "64",
            "--max-tokens",
            "24",
        ])
        .args(["--url", &server.url, "--reference-url", &plain.url])
        .args(["--server-pid", &server.child.id().to_string()])
        .arg("--questions")
        .arg(&questions)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    eprintln!("{report}");
    assert!(report.contains("256 ok, 0 errors"), "{report}");
    // 64 clients against a queue of 8: the server must have refused some, and they were retried.
    assert!(!report.contains(" 0 refusals"), "{report}");
    for kind in [
        "greedy whole",
        "greedy streamed",
        "sampled",
        "stop string",
        "cancelled",
    ] {
        assert!(report.contains(kind), "no {kind} request: {report}");
    }
    assert!(report.contains("identical to plain decoding's"), "{report}");
    assert!(!server.log().contains("panicked"), "{}", server.log());
}

/// A GGUF file serves as it runs elsewhere: the server reads the tokenizer and chat template the
/// file carries (it once read them only from a model directory), so its greedy answer is
/// `generate --chat`'s on the same file.
#[test]
fn the_server_runs_a_gguf_target() {
    let gguf = real_gguf_path();
    let question = "List the planets of the solar system, one per line.";
    let generated = Command::new(env!("CARGO_BIN_EXE_headway-serve"))
        .args([
            "generate",
            "--chat",
            "--max-new-tokens",
            "24",
            "--method",
            "ar",
        ])
        .args(["--prompt", question, "--target"])
        .arg(&gguf)
        .output()
        .unwrap();
    assert!(generated.status.success(), "{generated:?}");
    let server = start_on(&gguf, tempfile::tempdir().unwrap(), &[]);
    let (status, body) = post(&server, "/v1/chat/completions", &chat(question, 24));
    assert_eq!(status, 200, "{body}");
    let answer = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        answer,
        String::from_utf8_lossy(&generated.stdout).trim_end_matches('\n')
    );
    assert!(answer.contains("Mars"), "{body}");
}
