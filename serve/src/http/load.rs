//! `headway-serve load`: a bounded load run against a running server — N chat requests at
//! concurrency C — reporting latency and time-to-first-token percentiles, throughput and errors.
//!
//! With `--mix` it is a soak (issue 23): seeded requests mix greedy answers (whole and streamed),
//! stop strings, sampling and cancellation mid-stream; a 429 is retried after a pause and counted
//! apart; the server's resident memory is sampled after warm-up and at the end (`--server-pid`);
//! and every greedy answer is checked against a server that decodes plainly (`--reference-url`).

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::{Rng, SeedableRng};

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
    /// Temperature of every request (without --mix).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Prompts: the first turns of these Spec-Bench questions, in turn.
    #[arg(long, default_value = "../shared/data/spec_bench/question.jsonl")]
    pub questions: PathBuf,
    #[arg(long, env = "HEADWAY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Soak: mix greedy requests (whole and streamed), stop strings, sampling (temperature 0.8,
    /// top-p 0.95) and cancellation after the first token, drawn from --seed.
    #[arg(long)]
    pub mix: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sample this process's resident memory (the server's, on this host; Linux) after warm-up,
    /// at its peak and at the end.
    #[arg(long)]
    pub server_pid: Option<u32>,
    /// Requests completed before the warm-up memory sample (default: a tenth of them).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Fail when resident memory at the end exceeds the warm-up sample by more than this
    /// fraction (e.g. 0.05).
    #[arg(long, requires = "server_pid")]
    pub max_rss_growth: Option<f64>,
    /// A server decoding plainly (`--method ar`) on the same target: every greedy answer must
    /// equal its answer to the same request.
    #[arg(long)]
    pub reference_url: Option<String>,
    /// A request refused (429) this many seconds after it was first sent is an error; until then
    /// it is retried after a growing pause.
    #[arg(long, default_value_t = 1800.0)]
    pub give_up_after: f64,
    /// Also write the run's figures here as JSON (requests, concurrency, tokens, seconds,
    /// tokens_per_s, latency and time-to-first-token percentiles, mean τ).
    #[arg(long)]
    pub json: Option<PathBuf>,
}

impl LoadArgs {
    fn give_up_after(&self) -> Duration {
        Duration::from_secs_f64(self.give_up_after)
    }
}

/// What one request asks for.
#[derive(Debug, Clone)]
struct Spec {
    question: usize,
    stream: bool,
    temperature: f64,
    stop: Option<&'static str>,
    /// Drop the connection after the first content token.
    cancel: bool,
}

impl Spec {
    /// Greedy and run to the end: the answer is determined, and comparable.
    fn greedy_key(&self) -> Option<(usize, Option<&'static str>)> {
        (self.temperature == 0.0 && !self.cancel).then_some((self.question, self.stop))
    }

    fn kind(&self) -> &'static str {
        match self {
            Spec { cancel: true, .. } => "cancelled",
            Spec { stop: Some(_), .. } => "stop string",
            Spec { temperature, .. } if *temperature > 0.0 => "sampled",
            Spec { stream: true, .. } => "greedy streamed",
            _ => "greedy whole",
        }
    }
}

const STOP_STRINGS: [&str; 4] = [".", "\n", " the", ","];

/// The request for index `i`: every request streamed at --temperature, or with --mix a seeded
/// draw.
fn spec(args: &LoadArgs, i: usize, questions: usize) -> Spec {
    let question = i % questions;
    if !args.mix {
        return Spec {
            question,
            stream: true,
            temperature: args.temperature,
            stop: None,
            cancel: false,
        };
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed.wrapping_add(i as u64));
    // Half greedy; a fifth each sampled and with a stop string; a tenth cancelled.
    let roll = rng.random_range(0..10);
    let cancel = roll == 9;
    Spec {
        question,
        stream: cancel || rng.random_bool(0.5),
        temperature: if (5..7).contains(&roll) { 0.8 } else { 0.0 },
        stop: (7..9)
            .contains(&roll)
            .then(|| STOP_STRINGS[rng.random_range(0..STOP_STRINGS.len())]),
        cancel,
    }
}

/// One request's outcome.
struct Sample {
    spec: Spec,
    seconds: f64,
    /// Streamed requests only.
    first_token_seconds: Option<f64>,
    tokens: usize,
    tau: f64,
    text: String,
    /// 429s answered before this request was accepted.
    refusals: usize,
}

/// Runs the load and prints the report; fails if any request failed, a greedy answer differs
/// from the reference, or memory grew past --max-rss-growth.
pub fn run(args: LoadArgs) -> anyhow::Result<()> {
    let questions = load_questions(&args.questions)?;
    anyhow::ensure!(
        !questions.is_empty(),
        "no questions in {}",
        args.questions.display()
    );
    let prompts: Vec<&str> = questions.iter().map(|q| q.turns[0].as_str()).collect();
    let memory = MemoryWatch::new(args.server_pid, args.warmup.unwrap_or(args.requests / 10))?;
    let (samples, errors, wall) = drive(&args, &prompts, &memory)?;
    for e in errors.iter().take(5) {
        eprintln!("error: {e}");
    }
    let figures = report(&args, &samples, errors.len(), wall);
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&figures)?;
        headway_model::files::write_bytes_atomically(path, text.as_bytes())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let rss_growth = memory.report()?;
    let mismatches = check_greedy(&args, &prompts, &samples)?;
    anyhow::ensure!(errors.is_empty(), "{} requests failed", errors.len());
    anyhow::ensure!(
        mismatches == 0,
        "{mismatches} greedy answers differ from plain decoding's"
    );
    if let (Some(limit), Some(growth)) = (args.max_rss_growth, rss_growth) {
        anyhow::ensure!(
            growth <= limit,
            "resident memory grew {:.1} % after warm-up (limit {:.1} %)",
            100.0 * growth,
            100.0 * limit
        );
    }
    Ok(())
}

type Outcomes = (Vec<Sample>, Vec<String>, f64);

/// Sends every request from --concurrency threads.
fn drive(args: &LoadArgs, prompts: &[&str], memory: &MemoryWatch) -> anyhow::Result<Outcomes> {
    let next = AtomicUsize::new(0);
    let samples = Mutex::new(Vec::new());
    let errors = Mutex::new(Vec::new());
    let start = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            memory.watch_peak(|| {
                samples.lock().expect("lock").len() + errors.lock().expect("lock").len()
                    >= args.requests
            })
        });
        for _ in 0..args.concurrency.max(1) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= args.requests {
                    break;
                }
                let spec = spec(args, i, prompts.len());
                match one_request(args, &args.url, prompts[spec.question], spec) {
                    Ok(sample) => samples.lock().expect("lock").push(sample),
                    Err(e) => errors
                        .lock()
                        .expect("lock")
                        .push(format!("request {i}: {e:#}")),
                }
                memory.completed();
            });
        }
    });
    let wall = start.elapsed().as_secs_f64();
    Ok((
        samples.into_inner().expect("lock"),
        errors.into_inner().expect("lock"),
        wall,
    ))
}

/// What a load run measured (`--json`).
#[derive(serde::Serialize)]
struct LoadFigures {
    url: String,
    requests: usize,
    concurrency: usize,
    max_tokens: usize,
    ok: usize,
    errors: usize,
    tokens: usize,
    seconds: f64,
    tokens_per_s: f64,
    latency_p50: f64,
    latency_p99: f64,
    first_token_p50: f64,
    first_token_p99: f64,
    tau: f64,
}

fn report(args: &LoadArgs, samples: &[Sample], errors: usize, wall: f64) -> LoadFigures {
    let mut kinds = BTreeMap::<&str, usize>::new();
    for s in samples {
        *kinds.entry(s.spec.kind()).or_default() += 1;
    }
    let tokens: usize = samples.iter().map(|s| s.tokens).sum();
    let refusals: usize = samples.iter().map(|s| s.refusals).sum();
    let finished: Vec<&Sample> = samples.iter().filter(|s| !s.spec.cancel).collect();
    let latency = percentiles(finished.iter().map(|s| s.seconds).collect());
    let first = percentiles(
        samples
            .iter()
            .filter_map(|s| s.first_token_seconds)
            .collect(),
    );
    let tau = finished.iter().map(|s| s.tau).sum::<f64>() / finished.len().max(1) as f64;
    println!(
        "{} requests at concurrency {} in {wall:.1} s: {} ok, {errors} errors, {refusals} refusals (429, retried); {tokens} tokens, {:.1} tokens/s overall",
        args.requests,
        args.concurrency,
        samples.len(),
        tokens as f64 / wall
    );
    if args.mix {
        let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
        println!("mix: {}", kinds.join(", "));
    }
    println!(
        "latency p50 {:.2} s, p99 {:.2} s (requests run to the end); time to first token p50 {:.2} s, p99 {:.2} s (streamed); mean τ {tau:.2}",
        latency.0, latency.1, first.0, first.1
    );
    LoadFigures {
        url: args.url.clone(),
        requests: args.requests,
        concurrency: args.concurrency,
        max_tokens: args.max_tokens,
        ok: samples.len(),
        errors,
        tokens,
        seconds: wall,
        tokens_per_s: tokens as f64 / wall,
        latency_p50: latency.0,
        latency_p99: latency.1,
        first_token_p50: first.0,
        first_token_p99: first.1,
        tau,
    }
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

/// Longest pause between retries of a refused request.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The pause before retry `refusals`: exponential from 20 ms up to [`MAX_BACKOFF`], with full
/// jitter so that refused clients do not retry in step.
fn backoff(refusals: usize) -> Duration {
    let ceiling = MAX_BACKOFF.min(Duration::from_millis(20 << refusals.min(7)));
    ceiling.mul_f64(rand::rng().random_range(0.5..1.0))
}

fn one_request(args: &LoadArgs, url: &str, prompt: &str, spec: Spec) -> anyhow::Result<Sample> {
    let mut body = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": spec.temperature,
        "stream": spec.stream,
    });
    if spec.stream {
        body["stream_options"] = serde_json::json!({"include_usage": true});
    }
    if spec.temperature > 0.0 {
        body["top_p"] = serde_json::json!(0.95);
    }
    if let Some(stop) = spec.stop {
        body["stop"] = serde_json::json!([stop]);
    }
    let start = Instant::now();
    let mut refusals = 0;
    let response = loop {
        let mut request = ureq::post(&format!("{url}/v1/chat/completions"));
        if let Some(key) = &args.api_key {
            request = request.set("Authorization", &format!("Bearer {key}"));
        }
        match request.send_string(&body.to_string()) {
            Err(ureq::Error::Status(429, _)) if start.elapsed() < args.give_up_after() => {
                refusals += 1;
                std::thread::sleep(backoff(refusals));
            }
            Err(ureq::Error::Status(status, response)) => {
                bail!(
                    "HTTP {status}: {}",
                    response.into_string().unwrap_or_default()
                )
            }
            other => break other?,
        }
    };
    let mut sample = Sample {
        spec,
        seconds: 0.0,
        first_token_seconds: None,
        tokens: 0,
        tau: 1.0,
        text: String::new(),
        refusals,
    };
    if sample.spec.stream {
        read_stream(response, start, &mut sample)?;
    } else {
        let answer: serde_json::Value = serde_json::from_str(&response.into_string()?)?;
        sample.text = answer["choices"][0]["message"]["content"]
            .as_str()
            .context("no message content in the answer")?
            .to_string();
        sample.tokens = answer["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
        sample.tau = answer["speculative"]["tau"].as_f64().unwrap_or(1.0);
    }
    sample.seconds = start.elapsed().as_secs_f64();
    Ok(sample)
}

/// Reads server-sent events into `sample` until `[DONE]` (or the first token, for a request
/// that cancels: dropping the response closes the connection).
fn read_stream(
    response: ureq::Response,
    start: Instant,
    sample: &mut Sample,
) -> anyhow::Result<()> {
    let mut done = false;
    for line in std::io::BufReader::new(response.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(data)?;
        if let Some(error) = chunk.get("error") {
            bail!("server error: {error}");
        }
        let content = chunk["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("");
        if !content.is_empty() && sample.first_token_seconds.is_none() {
            sample.first_token_seconds = Some(start.elapsed().as_secs_f64());
            if sample.spec.cancel {
                return Ok(());
            }
        }
        sample.text.push_str(content);
        if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
            sample.tokens = n as usize;
            sample.tau = chunk["speculative"]["tau"].as_f64().unwrap_or(1.0);
        }
    }
    anyhow::ensure!(done, "the stream ended without data: [DONE]");
    Ok(())
}

/// Checks that every greedy request got one answer however it was sent, and (with
/// --reference-url) that it is plain decoding's; returns the number of answers that differ.
fn check_greedy(args: &LoadArgs, prompts: &[&str], samples: &[Sample]) -> anyhow::Result<usize> {
    let mut answers = BTreeMap::<_, Vec<&str>>::new();
    for s in samples {
        if let Some(key) = s.spec.greedy_key() {
            answers.entry(key).or_default().push(&s.text);
        }
    }
    let mut mismatches = 0;
    for ((question, stop), texts) in &answers {
        let reference = match &args.reference_url {
            Some(url) => {
                let spec = Spec {
                    question: *question,
                    stream: false,
                    temperature: 0.0,
                    stop: *stop,
                    cancel: false,
                };
                one_request(args, url, prompts[*question], spec)?.text
            }
            None => texts[0].to_string(),
        };
        let differing = texts.iter().filter(|t| **t != reference).count();
        if differing > 0 {
            eprintln!("question {question} (stop {stop:?}): {differing} of {} answers differ from {reference:?}, e.g. {:?}", texts.len(), texts.iter().find(|t| **t != reference));
        }
        mismatches += differing;
    }
    let compared: usize = answers.values().map(Vec::len).sum();
    let against = match &args.reference_url {
        Some(url) => format!("plain decoding's at {url}"),
        None => "each other (no --reference-url)".to_string(),
    };
    println!(
        "greedy answers: {compared} over {} distinct requests, {} identical to {against}",
        answers.len(),
        compared - mismatches
    );
    Ok(mismatches)
}

/// The server's resident memory: a sample once `warmup` requests have completed, the peak
/// (sampled every 200 ms) and the end.
struct MemoryWatch {
    pid: Option<u32>,
    warmup: usize,
    completed: AtomicUsize,
    warm_bytes: AtomicU64,
    peak_bytes: AtomicU64,
}

impl MemoryWatch {
    fn new(pid: Option<u32>, warmup: usize) -> anyhow::Result<Self> {
        let watch = Self {
            pid,
            warmup: warmup.max(1),
            completed: AtomicUsize::new(0),
            warm_bytes: AtomicU64::new(0),
            peak_bytes: AtomicU64::new(0),
        };
        watch.sample()?;
        Ok(watch)
    }

    /// Resident bytes now (0 without a pid); keeps the peak.
    fn sample(&self) -> anyhow::Result<u64> {
        let Some(pid) = self.pid else { return Ok(0) };
        let bytes = resident_bytes(pid)?;
        self.peak_bytes.fetch_max(bytes, Ordering::Relaxed);
        Ok(bytes)
    }

    fn completed(&self) {
        if self.completed.fetch_add(1, Ordering::Relaxed) + 1 == self.warmup {
            if let Ok(bytes) = self.sample() {
                self.warm_bytes.store(bytes, Ordering::Relaxed);
            }
        }
    }

    fn watch_peak(&self, finished: impl Fn() -> bool) {
        while self.pid.is_some() && !finished() && self.sample().is_ok() {
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Prints the samples; the growth after warm-up as a fraction (None without a pid).
    fn report(&self) -> anyhow::Result<Option<f64>> {
        let Some(pid) = self.pid else { return Ok(None) };
        let end = self.sample()?;
        let warm = self.warm_bytes.load(Ordering::Relaxed);
        anyhow::ensure!(
            warm > 0,
            "fewer requests completed than --warmup ({})",
            self.warmup
        );
        let growth = end as f64 / warm as f64 - 1.0;
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "server (pid {pid}) resident memory: {:.1} MB after {} requests (warm-up), {:.1} MB at the end ({:+.2} %), peak {:.1} MB",
            mb(warm),
            self.warmup,
            mb(end),
            100.0 * growth,
            mb(self.peak_bytes.load(Ordering::Relaxed))
        );
        Ok(Some(growth))
    }
}

/// VmRSS of a process, from /proc.
fn resident_bytes(pid: u32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let kilobytes = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .with_context(|| format!("no VmRSS in {path}"))?;
    Ok(kilobytes * 1024)
}
