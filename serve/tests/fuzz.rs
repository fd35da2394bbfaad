//! A fuzzer over every endpoint of the real server (issue 23): seeded property-test cases of
//! random methods, paths, headers and bodies (JSON of every shape, invalid UTF-8, huge numbers,
//! deep nesting, oversized and truncated bodies, wrong framing), written raw to a loopback socket,
//! while another client keeps sending a valid request; and slow clients holding connections open.
//! The server must never panic or hang, must answer every well-framed request with a non-5xx
//! status and 4xx with OpenAI's error body, and must keep answering the valid request exactly.
//!
//! `HEADWAY_FUZZ_CASES` sets the number of cases (default 5,000, what `make test` runs).

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{chat, post, start, Server};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde_json::{json, Value};

/// Any request longer than this is a hang.
const HANG: Duration = Duration::from_secs(30);
/// The server's `--max-body-bytes` in these tests (small, so oversized bodies are cheap).
const MAX_BODY: usize = 64 * 1024;
const ENDPOINTS: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
];
/// Every field either endpoint reads, so that mutations hit the validation code.
const FIELDS: [&str; 16] = [
    "messages",
    "prompt",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "role",
    "content",
];

/// One fuzzed request as it goes on the wire.
#[derive(Clone)]
struct Case {
    method: String,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
    framing: Framing,
}

/// How the body's length is announced; all but `Exact` and `Chunked` mis-frame the request.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    Exact,
    Chunked,
    Missing,
    Short,
    Long,
    BadChunks,
}

/// Bytes shown as text (a failing case must be readable), long ones shortened.
impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = |bytes: &[u8]| {
            let text = String::from_utf8_lossy(bytes);
            match text.char_indices().nth(400) {
                Some((end, _)) => format!("{}… ({} bytes)", &text[..end], bytes.len()),
                None => text.into_owned(),
            }
        };
        let headers: Vec<(&str, String)> = self
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), text(value)))
            .collect();
        f.debug_struct("Case")
            .field("method", &self.method)
            .field("path", &text(self.path.as_bytes()))
            .field("headers", &headers)
            .field("body", &text(&self.body))
            .field("framing", &self.framing)
            .finish()
    }
}

impl Case {
    /// Whether this is a well-formed HTTP/1.1 request, which the application must answer (a
    /// mis-framed one may also be refused by the HTTP layer with an empty 400 or a closed
    /// connection).
    fn well_framed(&self) -> bool {
        let token = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        };
        let value_ok = |v: &[u8]| v.iter().all(|&b| b == b'\t' || (b >= 0x20 && b != 0x7f));
        // RFC 3986's characters for a path and query (no fragment in a request).
        let path_ok = self.path.starts_with('/')
            && self
                .path
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?%".contains(&b))
            && self.path.len() < 8000;
        // CONNECT takes an authority (`host:port`), not a path.
        matches!(self.framing, Framing::Exact | Framing::Chunked)
            && token(&self.method)
            && self.method != "CONNECT"
            && path_ok
            && self
                .headers
                .iter()
                .all(|(name, value)| token(name) && value_ok(value))
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n",
            self.method, self.path
        )
        .into_bytes();
        for (name, value) in &self.headers {
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        }
        let length = |n: usize| format!("Content-Length: {n}\r\n\r\n").into_bytes();
        match self.framing {
            Framing::Exact => out.extend(length(self.body.len())),
            Framing::Short => out.extend(length(self.body.len() / 2)),
            Framing::Long => out.extend(length(self.body.len() + 10)),
            Framing::Missing => out.extend_from_slice(b"\r\n"),
            Framing::Chunked | Framing::BadChunks => {
                out.extend_from_slice(b"Transfer-Encoding: chunked\r\n\r\n");
                for piece in self.body.chunks(97) {
                    out.extend(format!("{:x}\r\n", piece.len()).into_bytes());
                    out.extend_from_slice(piece);
                    out.extend_from_slice(b"\r\n");
                }
                if self.framing == Framing::BadChunks {
                    out.extend_from_slice(b"zz\r\n");
                }
                out.extend_from_slice(b"0\r\n\r\n");
                return out;
            }
        }
        out.extend_from_slice(&self.body);
        out
    }
}

/// A parsed response: status, lower-cased headers, decoded body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What came back for a case: an answer, a connection closed without one, or nothing in time.
enum Outcome {
    Answered(Answer),
    Closed,
    Hung,
}

/// Sends `case` on a fresh connection and reads until the server closes it.
fn send(server: &Server, case: &Case) -> Outcome {
    let address = server.url.trim_start_matches("http://");
    let mut socket = TcpStream::connect(address).expect("connect");
    socket.set_read_timeout(Some(HANG)).unwrap();
    // The server may answer and close before reading everything (an oversized body): a failed
    // write is not the server's fault.
    let _ = socket.write_all(&case.to_bytes());
    if case.framing == Framing::Long {
        // The server waits for the body bytes announced but never sent, as it should for a slow
        // client: end the request. (Only then: the server, like hyper's default, closes a
        // half-closed connection without answering.)
        let _ = socket.shutdown(Shutdown::Write);
    }
    let start = Instant::now();
    let mut raw = Vec::new();
    let mut buffer = [0u8; 16 * 1024];
    loop {
        match socket.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(_) => return Outcome::Hung,
        }
        if start.elapsed() > HANG {
            return Outcome::Hung;
        }
    }
    match parse_answer(&raw) {
        Some(answer) => Outcome::Answered(answer),
        None => Outcome::Closed,
    }
}

fn parse_answer(raw: &[u8]) -> Option<Answer> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut answer = Answer {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    };
    if answer.header("transfer-encoding") == Some("chunked") {
        answer.body = dechunk(&answer.body)?;
    }
    Some(answer)
}

fn dechunk(mut raw: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = raw.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&raw[..line_end]).ok()?, 16).ok()?;
        if size == 0 {
            return Some(body);
        }
        let data = raw.get(line_end + 2..line_end + 2 + size)?;
        body.extend_from_slice(data);
        raw = raw.get(line_end + 4 + size..)?;
    }
}

/// Counts of what the fuzzer saw, printed at the end.
#[derive(Debug, Default)]
struct Tally {
    cases: usize,
    well_framed: usize,
    ok: usize,
    client_errors: std::collections::BTreeMap<u16, usize>,
    closed_without_answer: usize,
    empty_http_layer_4xx: usize,
}

/// Checks one outcome against the rules; `Err` describes the violation.
fn judge(case: &Case, outcome: Outcome, tally: &Mutex<Tally>) -> Result<(), String> {
    let mut tally = tally.lock().unwrap();
    tally.cases += 1;
    tally.well_framed += usize::from(case.well_framed());
    let answer = match outcome {
        Outcome::Hung => return Err(format!("no answer within {HANG:?}")),
        Outcome::Closed if !case.well_framed() => {
            tally.closed_without_answer += 1;
            return Ok(());
        }
        Outcome::Closed => return Err("connection closed without an answer".into()),
        Outcome::Answered(answer) => answer,
    };
    let body = String::from_utf8_lossy(&answer.body);
    match answer.status {
        200..=299 => {
            tally.ok += 1;
            check_success(case, &answer)
        }
        400..=499 if answer.body.is_empty() && (case.method == "HEAD" || !case.well_framed()) => {
            tally.empty_http_layer_4xx += 1;
            Ok(())
        }
        status @ 400..=499 => {
            *tally.client_errors.entry(status).or_default() += 1;
            let error: Value = serde_json::from_slice(&answer.body)
                .map_err(|_| format!("{status} without a JSON body: {body:?}"))?;
            let shaped =
                error["error"]["message"].is_string() && error["error"]["type"].is_string();
            shaped
                .then_some(())
                .ok_or_else(|| format!("{status} without OpenAI's error body: {body}"))
        }
        status => Err(format!("status {status}: {body}")),
    }
}

/// A 2xx must be complete: a stream ends with `[DONE]`, a generation has its choices.
fn check_success(case: &Case, answer: &Answer) -> Result<(), String> {
    let body = String::from_utf8_lossy(&answer.body);
    let generation =
        case.method == "POST" && case.path.starts_with("/v1/") && case.path.contains("completions");
    if !generation {
        return Ok(());
    }
    if answer.header("content-type") == Some("text/event-stream") {
        return body
            .trim_end()
            .ends_with("data: [DONE]")
            .then_some(())
            .ok_or_else(|| format!("a stream that does not end with [DONE]: {body}"));
    }
    let value: Value = serde_json::from_str(&body).map_err(|e| format!("{e}: {body}"))?;
    value["choices"][0]
        .is_object()
        .then_some(())
        .ok_or_else(|| format!("a 2xx without choices: {body}"))
}

/// JSON of every shape: every scalar kind (huge, tiny, negative, non-ASCII, control characters),
/// nested arrays and objects whose keys are often the fields Headway reads.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-3i64..300).prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        (0.0f64..2.0).prop_map(Value::from),
        any::<String>().prop_map(Value::from),
        "[a-z ]{0,40}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(&FIELDS[..]).prop_map(str::to_string),
        1 => any::<String>(),
    ]
}

/// A valid request of either endpoint, streamed or not.
fn valid_body() -> impl Strategy<Value = Value> {
    (any::<bool>(), any::<bool>(), 1i64..6).prop_map(|(is_chat, stream, max_tokens)| {
        let mut body = if is_chat {
            json!({"messages": [{"role": "user", "content": "hello there"}]})
        } else {
            json!({"prompt": "once upon a time"})
        };
        body["max_tokens"] = json!(max_tokens);
        body["temperature"] = json!(0);
        body["stream"] = json!(stream);
        body
    })
}

/// Bodies: valid ones with a field replaced, removed or nested wrongly; arbitrary JSON; raw bytes
/// (often invalid UTF-8); truncated JSON; deep nesting; number literals no float holds; bodies
/// over the limit.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let mutated = (
        valid_body(),
        prop::sample::select(&FIELDS[..]),
        json_value(),
    )
        .prop_map(|(mut body, field, value)| {
            body[field] = value;
            body.to_string().into_bytes()
        });
    let in_message = (
        valid_body(),
        prop::sample::select(&FIELDS[..]),
        json_value(),
    )
        .prop_map(|(mut body, field, value)| {
            body["messages"] = json!([Value::Object(
                [(field.to_string(), value)].into_iter().collect()
            )]);
            body.to_string().into_bytes()
        });
    let removed =
        (valid_body(), prop::sample::select(&FIELDS[..])).prop_map(|(mut body, field)| {
            body.as_object_mut().unwrap().remove(field);
            body.to_string().into_bytes()
        });
    let truncated = (valid_body(), any::<prop::sample::Index>()).prop_map(|(body, at)| {
        let text = body.to_string().into_bytes();
        text[..at.index(text.len())].to_vec()
    });
    let deep = (1usize..20_000, any::<bool>()).prop_map(|(depth, object)| {
        let (open, close) = if object { ("{\"a\":", "}") } else { ("[", "]") };
        format!(
            "{{\"messages\":{}1{}}}",
            open.repeat(depth),
            close.repeat(depth)
        )
        .into_bytes()
    });
    let huge_number = (
        prop::sample::select(&["max_tokens", "temperature", "top_p", "top_k", "seed", "n"][..]),
        prop::sample::select(
            &[
                "1e999",
                "-1e999",
                "1e-999",
                "123456789012345678901234567890",
                "-0",
                "NaN",
                "Infinity",
                "0x10",
                "1.",
                ".5",
            ][..],
        ),
    )
        .prop_map(|(field, literal)| {
            format!(
                "{{\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"{field}\":{literal}}}"
            )
            .into_bytes()
        });
    let oversized = (MAX_BODY + 1..MAX_BODY * 3)
        .prop_map(|n| format!("{{\"prompt\":\"{}\"}}", "a".repeat(n)).into_bytes());
    prop_oneof![
        6 => mutated,
        2 => in_message,
        1 => removed,
        2 => json_value().prop_map(|v| v.to_string().into_bytes()),
        2 => prop::collection::vec(any::<u8>(), 0..300),
        1 => truncated,
        1 => deep,
        1 => huge_number,
        1 => oversized,
    ]
}

fn path() -> impl Strategy<Value = String> {
    let endpoint = prop::sample::select(&ENDPOINTS[..]).prop_map(str::to_string);
    prop_oneof![
        8 => endpoint.clone(),
        1 => (endpoint, "[?#/a-z0-9=&%.]{0,30}").prop_map(|(e, tail)| format!("{e}{tail}")),
        1 => prop::sample::select(&["/", "/v1", "/v1/", "/../../etc/passwd", "/v1/%2e%2e/%00", "//v1/models", "/v1/chat/completions/../models"][..]).prop_map(str::to_string),
        1 => "/[\\PC]{0,40}",
        1 => (1usize..20_000).prop_map(|n| format!("/{}", "x".repeat(n))),
    ]
}

fn method() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => Just("POST".to_string()),
        3 => Just("GET".to_string()),
        2 => prop::sample::select(&["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "CONNECT"][..]).prop_map(str::to_string),
        1 => "[A-Za-z\\-]{1,12}",
    ]
}

fn headers() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    let content_type = prop_oneof![
        4 => Just(Some(b"application/json".to_vec())),
        1 => Just(None),
        1 => Just(Some(b"text/plain; charset=latin1".to_vec())),
        1 => prop::collection::vec(any::<u8>(), 0..40).prop_map(Some),
        1 => "[ -~]{0,40}".prop_map(|v| Some(v.into_bytes())),
    ];
    let authorization = prop_oneof![
        3 => Just(None),
        1 => "Bearer [\\PC]{0,60}".prop_map(|v| Some(v.into_bytes())),
    ];
    let value = prop_oneof![
        4 => "[ -~]{0,60}".prop_map(String::into_bytes),
        1 => prop::collection::vec(any::<u8>(), 0..80),
    ];
    let name = prop_oneof![4 => "[A-Za-z0-9\\-]{1,20}", 1 => "[\\PC]{1,10}"];
    let extra = prop::collection::vec((name, value), 0..3);
    (content_type, authorization, extra).prop_map(|(content_type, authorization, extra)| {
        let mut headers = Vec::new();
        if let Some(value) = content_type {
            headers.push(("Content-Type".to_string(), value));
        }
        if let Some(value) = authorization {
            headers.push(("Authorization".to_string(), value));
        }
        headers.extend(extra);
        headers
    })
}

/// Three cases in four are well-formed POSTs to a generation endpoint, so most bodies reach the
/// request validation; the rest vary the method, path and framing too.
fn case() -> impl Strategy<Value = Case> {
    let generation = prop::sample::select(&ENDPOINTS[..2]).prop_map(str::to_string);
    let targeted = (generation, body()).prop_map(|(path, body)| Case {
        method: "POST".to_string(),
        path,
        headers: vec![("Content-Type".to_string(), b"application/json".to_vec())],
        body,
        framing: Framing::Exact,
    });
    let framing = prop_oneof![
        12 => Just(Framing::Exact),
        2 => Just(Framing::Chunked),
        1 => Just(Framing::Missing),
        1 => Just(Framing::Short),
        1 => Just(Framing::Long),
        1 => Just(Framing::BadChunks),
    ];
    let anything = (method(), path(), headers(), body(), framing).prop_map(
        |(method, path, headers, body, framing)| Case {
            method,
            path,
            headers,
            body,
            framing,
        },
    );
    prop_oneof![3 => targeted, 1 => anything]
}

fn cases() -> u32 {
    std::env::var("HEADWAY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000)
}

/// The reply to the probe request that must keep coming back unchanged during the fuzzing.
fn probe(server: &Server) -> Result<String, String> {
    let (status, body) = post(server, "/v1/chat/completions", &chat("the probe", 8));
    match body["choices"][0]["message"]["content"].as_str() {
        Some(text) if status == 200 => Ok(text.to_string()),
        _ => Err(format!("probe got {status}: {body}")),
    }
}

#[test]
fn fuzzed_requests_never_crash_or_hang_the_server() {
    let server = start(&[
        "--max-body-bytes",
        &MAX_BODY.to_string(),
        "--max-queue",
        "64",
    ]);
    let expected = probe(&server).unwrap();
    let tally = Mutex::new(Tally::default());
    let done = AtomicBool::new(false);
    let probes = AtomicUsize::new(0);
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 200,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[23; 32]));
    let started = Instant::now();
    let result = std::thread::scope(|scope| {
        // Valid traffic throughout: the fuzzing must never change or block a valid answer.
        let prober = scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                assert_eq!(
                    probe(&server).unwrap(),
                    expected,
                    "the probe's answer changed"
                );
                probes.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let result = runner.run(&case(), |case| {
            judge(&case, send(&server, &case), &tally).map_err(TestCaseError::fail)
        });
        done.store(true, Ordering::Relaxed);
        prober.join().expect("the probe failed");
        // The failure's text carries the shrunk case.
        result.map_err(|failure| failure.to_string())
    });
    let tally = tally.into_inner().unwrap();
    eprintln!(
        "{} cases in {:.1} s ({} probes answered, all identical): {tally:?}",
        tally.cases,
        started.elapsed().as_secs_f64(),
        probes.load(Ordering::Relaxed),
    );
    if let Err(failure) = result {
        panic!("{failure}");
    }
    assert_server_healthy(&server);
}

/// Still running, still answering, and no panic in its log.
fn assert_server_healthy(server: &Server) {
    assert_eq!(
        post(server, "/v1/chat/completions", &chat("after", 4)).0,
        200
    );
    let log = server.log();
    assert!(!log.contains("panicked"), "the server panicked:\n{log}");
}

/// Opens a connection and writes `head` (the start of a request), leaving it open.
fn open_with(server: &Server, head: &[u8]) -> TcpStream {
    let mut socket = TcpStream::connect(server.url.trim_start_matches("http://")).unwrap();
    socket.write_all(head).unwrap();
    socket
}

#[test]
fn slow_clients_do_not_hold_up_the_others() {
    let server = start(&["--max-queue", "64"]);
    let expected = probe(&server).unwrap();
    // Headers that never end, one more byte per round (slowloris).
    let mut stalled: Vec<TcpStream> = (0..48)
        .map(|_| {
            open_with(
                &server,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ",
            )
        })
        .collect();
    // A valid request whose body arrives four bytes per round.
    let body = chat("a slow body", 4).to_string().into_bytes();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut trickling: Vec<TcpStream> = (0..8)
        .map(|_| open_with(&server, head.as_bytes()))
        .collect();
    // Long streams that nobody reads.
    let unread = chat("nobody reads this", 400);
    let unread =
        json!({"stream": true, "messages": unread["messages"], "max_tokens": 400}).to_string();
    let _readers: Vec<TcpStream> = (0..4)
        .map(|_| {
            let request = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{unread}",
                unread.len()
            );
            open_with(&server, request.as_bytes())
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for piece in body.chunks(4) {
        for socket in &mut stalled {
            let _ = socket.write_all(b"a");
        }
        for socket in &mut trickling {
            socket.write_all(piece).unwrap();
        }
        let asked = Instant::now();
        assert_eq!(probe(&server).unwrap(), expected);
        slowest = slowest.max(asked.elapsed());
    }
    for mut socket in trickling {
        socket.set_read_timeout(Some(HANG)).unwrap();
        let mut raw = Vec::new();
        socket.read_to_end(&mut raw).unwrap();
        let answer = parse_answer(&raw).expect("an answer to the slow body");
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    eprintln!(
        "{} rounds with 48 stalled headers, 8 trickled bodies and 4 unread streams: slowest probe {:.3} s",
        body.len().div_ceil(4),
        slowest.as_secs_f64()
    );
    drop(stalled);
    assert_server_healthy(&server);
}
