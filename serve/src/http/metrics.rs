//! Prometheus text-format metrics of the server.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds.
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, value: f64) {
        for (bound, count) in self.bounds.iter().zip(&mut self.counts) {
            if value <= *bound {
                *count += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (bound, count) in self.bounds.iter().zip(&self.counts) {
            out.push_str(&format!("{name}_bucket{{le=\"{bound}\"}} {count}\n"));
        }
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {}\n", self.count));
        out.push_str(&format!(
            "{name}_sum {}\n{name}_count {}\n",
            self.sum, self.count
        ));
    }
}

const TAU_BOUNDS: &[f64] = &[1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0];
const SECONDS_BOUNDS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    cancelled: AtomicU64,
    queue_depth: AtomicUsize,
    batch_size: AtomicUsize,
    steps: AtomicU64,
    tau: Mutex<Histogram>,
    time_to_first_token: Mutex<Histogram>,
    latency: Mutex<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Mutex::default(),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            queue_depth: AtomicUsize::new(0),
            batch_size: AtomicUsize::new(0),
            steps: AtomicU64::new(0),
            tau: Mutex::new(Histogram::new(TAU_BOUNDS)),
            time_to_first_token: Mutex::new(Histogram::new(SECONDS_BOUNDS)),
            latency: Mutex::new(Histogram::new(SECONDS_BOUNDS)),
        }
    }
}

impl Metrics {
    pub fn request(&self, path: &str, status: u16) {
        let mut requests = self.requests.lock().expect("metrics lock");
        *requests.entry((path.to_string(), status)).or_insert(0) += 1;
    }

    pub fn enqueued(&self) {
        self.queue_depth.fetch_add(1, Ordering::Relaxed);
    }

    pub fn dequeued(&self) {
        self.queue_depth.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn queue_depth(&self) -> usize {
        self.queue_depth.load(Ordering::Relaxed)
    }

    /// An engine step over `requests` running requests (one target forward for all).
    pub fn batch(&self, requests: usize) {
        self.batch_size.store(requests, Ordering::Relaxed);
        self.steps.fetch_add(1, Ordering::Relaxed);
    }

    pub fn cancelled(&self) {
        self.cancelled.fetch_add(1, Ordering::Relaxed);
    }

    pub fn first_token(&self, seconds: f64) {
        self.time_to_first_token
            .lock()
            .expect("metrics lock")
            .observe(seconds);
    }

    /// A finished generation.
    pub fn finished(&self, prompt_tokens: usize, generated: usize, tau: f64, seconds: f64) {
        self.prompt_tokens
            .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(generated as u64, Ordering::Relaxed);
        self.tau.lock().expect("metrics lock").observe(tau);
        self.latency.lock().expect("metrics lock").observe(seconds);
    }

    pub fn render(&self) -> String {
        let mut out = String::from(
            "# HELP headway_requests_total HTTP requests by path and status.\n# TYPE headway_requests_total counter\n",
        );
        for ((path, status), count) in self.requests.lock().expect("metrics lock").iter() {
            out.push_str(&format!(
                "headway_requests_total{{path=\"{path}\",status=\"{status}\"}} {count}\n"
            ));
        }
        let counters = [
            (
                "headway_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                &self.prompt_tokens,
            ),
            (
                "headway_generated_tokens_total",
                "Tokens generated.",
                &self.generated_tokens,
            ),
            (
                "headway_cancelled_total",
                "Generations stopped because the client went away.",
                &self.cancelled,
            ),
            (
                "headway_engine_steps_total",
                "Engine steps: target forwards verifying every running request's tree.",
                &self.steps,
            ),
        ];
        for (name, help, value) in counters {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}\n",
                value.load(Ordering::Relaxed)
            ));
        }
        out.push_str(&format!(
            "# HELP headway_queue_depth Requests waiting for the engine.\n# TYPE headway_queue_depth gauge\nheadway_queue_depth {}\n",
            self.queue_depth()
        ));
        out.push_str(&format!(
            "# HELP headway_batch_size Requests in the engine's last step.\n# TYPE headway_batch_size gauge\nheadway_batch_size {}\n",
            self.batch_size.load(Ordering::Relaxed)
        ));
        self.tau.lock().expect("metrics lock").render(
            "headway_tau",
            "Tokens per target forward per request (plain decoding: 1).",
            &mut out,
        );
        self.time_to_first_token
            .lock()
            .expect("metrics lock")
            .render(
                "headway_time_to_first_token_seconds",
                "From arrival to the first generated text.",
                &mut out,
            );
        self.latency.lock().expect("metrics lock").render(
            "headway_request_duration_seconds",
            "From arrival to the last token.",
            &mut out,
        );
        out
    }
}
