//! `headway-serve load`: a bounded load run against a running server — N streamed chat requests
//! at concurrency C — reporting latency and time-to-first-token percentiles, throughput and
//! errors.

use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::bench::load_questions;

#[derive(Debug, Clone, clap::Args)]
pub struct LoadArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// Requests in total.
    #[arg(long, default_value_t = 32)]
    pub requests: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Prompts: the first turns of these Spec-Bench questions, in turn.
    #[arg(long, default_value = "../shared/data/spec_bench/question.jsonl")]
    pub questions: PathBuf,
    #[arg(long, env = "HEADWAY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

/// One request's outcome.
struct Sample {
    seconds: f64,
    first_token_seconds: f64,
    tokens: usize,
    tau: f64,
}

/// Runs the load and prints the report; fails if any request failed.
pub fn run(args: LoadArgs) -> anyhow::Result<()> {
    let questions = load_questions(&args.questions)?;
    anyhow::ensure!(
        !questions.is_empty(),
        "no questions in {}",
        args.questions.display()
    );
    let next = AtomicUsize::new(0);
    let samples = Mutex::new(Vec::new());
    let errors = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..args.concurrency.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= args.requests {
                    break;
                }
                let prompt = &questions[i % questions.len()].turns[0];
                match one_request(&args, prompt) {
                    Ok(sample) => samples.lock().expect("lock").push(sample),
                    Err(e) => errors
                        .lock()
                        .expect("lock")
                        .push(format!("request {i}: {e:#}")),
                }
            });
        }
    });
    let wall = start.elapsed().as_secs_f64();
    let samples = samples.into_inner().expect("lock");
    let errors = errors.into_inner().expect("lock");
    for e in errors.iter().take(5) {
        eprintln!("error: {e}");
    }
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let latency = percentiles(samples.iter().map(|s| s.seconds).collect());
    let first = percentiles(samples.iter().map(|s| s.first_token_seconds).collect());
    let tau = samples.iter().map(|s| s.tau).sum::<f64>() / samples.len().max(1) as f64;
    println!(
        "{} requests at concurrency {} in {wall:.1} s: {} ok, {} errors; {tokens} tokens, {:.1} tokens/s overall",
        args.requests,
        args.concurrency,
        samples.len(),
        errors.len(),
        tokens as f64 / wall
    );
    println!(
        "latency p50 {:.2} s, p99 {:.2} s; time to first token p50 {:.2} s, p99 {:.2} s; mean τ {tau:.2}",
        latency.0, latency.1, first.0, first.1
    );
    anyhow::ensure!(errors.is_empty(), "{} requests failed", errors.len());
    Ok(())
}

/// (p50, p99) of `values`.
fn percentiles(mut values: Vec<f64>) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn one_request(args: &LoadArgs, prompt: &str) -> anyhow::Result<Sample> {
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut request = ureq::post(&format!("{}/v1/chat/completions", args.url));
    if let Some(key) = &args.api_key {
        request = request.set("Authorization", &format!("Bearer {key}"));
    }
    let response = request.send_string(&body.to_string())?;
    let mut first_token_seconds = None;
    let (mut tokens, mut tau) = (0, 1.0);
    for line in std::io::BufReader::new(response.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(data)?;
        if let Some(error) = chunk.get("error") {
            anyhow::bail!("server error: {error}");
        }
        let content = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("");
        if !content.is_empty() && first_token_seconds.is_none() {
            first_token_seconds = Some(start.elapsed().as_secs_f64());
        }
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            tokens = n as usize;
            tau = chunk["speculative"]["tau"].as_f64().unwrap_or(1.0);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    Ok(Sample {
        seconds,
        first_token_seconds: first_token_seconds.unwrap_or(seconds),
        tokens,
        tau,
    })
}
