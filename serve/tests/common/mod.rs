//! The harness the HTTP tests share: the real `headway-serve http` binary on a loopback port.
// Each test binary uses part of the harness.
#![allow(dead_code)]

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use headway_model::testing::write_tiny_model;
use serde_json::{json, Value};

pub struct Server {
    pub child: Child,
    pub url: String,
    dir: tempfile::TempDir,
}

impl Server {
    /// What the server wrote to stderr so far (a file, so a chatty server never blocks on a
    /// full pipe).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the server on the tiny model with prompt lookup and `extra` options; waits for /health.
pub fn start(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target");
    write_tiny_model(&target, 41).unwrap();
    start_on(&target, dir, extra)
}

pub fn start_on(target: &Path, dir: tempfile::TempDir, extra: &[&str]) -> Server {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_headway-serve"))
        .args(["http", "--threads", "1", "--port"])
        .arg(port.to_string())
        // Prompt lookup unless the test picks the method.
        .args(if extra.contains(&"--method") {
            &[][..]
        } else {
            &["--method", "lookup"][..]
        })
        .arg("--target")
        .arg(target)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(File::create(dir.path().join("server.log")).unwrap())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while ureq::get(&format!("{url}/health")).call().is_err() {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(100));
    }
    Server { child, url, dir }
}

/// An HTTP client whose requests fail instead of waiting forever on a hung server.
pub fn client() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build()
}

/// POSTs `body` (raw bytes) and returns (status, parsed JSON body).
pub fn post_raw(server: &Server, path: &str, body: &[u8], key: Option<&str>) -> (u16, Value) {
    let mut request = client()
        .post(&format!("{}{path}", server.url))
        .set("Content-Type", "application/json");
    if let Some(key) = key {
        request = request.set("Authorization", &format!("Bearer {key}"));
    }
    let response = match request.send_bytes(body) {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{e}"),
    };
    let status = response.status();
    let text = response.into_string().unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

pub fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_raw(server, path, body.to_string().as_bytes(), None)
}

pub fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0})
}

/// Content deltas of a streamed response, and its last JSON chunk.
pub fn stream(server: &Server, path: &str, body: &Value) -> (String, Value) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = client()
        .post(&format!("{}{path}", server.url))
        .send_string(&body.to_string())
        .unwrap();
    let (mut text, mut last, mut done) = (String::new(), Value::Null, false);
    for line in BufReader::new(response.into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        let choice = &chunk["choices"][0];
        let piece = choice["delta"]["content"]
            .as_str()
            .or(choice["text"].as_str());
        text.push_str(piece.unwrap_or(""));
        last = chunk;
    }
    assert!(done, "the stream ended without data: [DONE]");
    (text, last)
}
