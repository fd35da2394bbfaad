//! What the host allows: memory read bandwidth, and the decoding rate it bounds for the bytes a
//! step reads; the process's resident memory.
//!
//! Hosts of one machine kind differ a lot (2-thread reads from ~10 to 55 GB/s), and one host's
//! rate drifts within a run, so absolute tokens/s do not travel between them; the fraction of the
//! host's bandwidth limit does. The rate is measured on the weights themselves, again after every
//! question, and the best kept: no run can then beat its own limit by the probe's bad luck.

use headway_model::roof::read_rate;
use headway_model::CausalLm;
use serde::{Deserialize, Serialize};

/// Host figures of a bench run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostFigures {
    /// Threads that read together (the run's threads).
    pub threads: usize,
    /// Bytes per second those threads read the step's weights, best of every probe of the run.
    pub read_bytes_per_s: f64,
    /// Probes taken: one before the run and one after each question, so that a faster hour of a
    /// shared host during the run raises the limit too (reports from before probes were counted
    /// read 0).
    #[serde(default)]
    pub read_probes: usize,
    /// Weight bytes one decoding step reads.
    pub decode_step_bytes: usize,
    /// `read_bytes_per_s / decode_step_bytes`: decoding can go no faster.
    pub limit_tokens_per_s: f64,
    /// Resident set of this process after the run, and its peak since the weights were loaded
    /// (`None` where `/proc` does not tell).
    pub rss_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
    /// Resident set once the target was loaded, and once the method's drafter (its head and
    /// caches; plain decoding has none) was made beside it: what the method adds to the
    /// target's own memory (absent in reports from before they were taken).
    #[serde(default)]
    pub target_rss_bytes: Option<u64>,
    #[serde(default)]
    pub with_drafter_rss_bytes: Option<u64>,
    /// Whether the kernel's peak count restarted after the weights were loaded.
    #[serde(skip)]
    peak_restarted: bool,
}

impl HostFigures {
    /// Measures how fast `threads` threads read `model`'s decoding-step weights (a few passes
    /// over them; no buffer of its own, so resident memory is the model's), and restarts the
    /// kernel's peak-RSS count.
    pub fn measure(threads: usize, model: &CausalLm) -> Self {
        // Best effort: without it the peak counts what loading the weights held for a while.
        let peak_restarted = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        let mut host = Self {
            threads,
            read_bytes_per_s: 0.0,
            read_probes: 0,
            decode_step_bytes: model.decode_step_bytes(),
            limit_tokens_per_s: 0.0,
            rss_bytes: None,
            peak_rss_bytes: None,
            target_rss_bytes: None,
            with_drafter_rss_bytes: None,
            peak_restarted,
        };
        host.probe(model);
        host
    }

    /// Reads the weights again and keeps the faster rate.
    pub fn probe(&mut self, model: &CausalLm) {
        let rate = read_rate(self.threads.max(1), &step_regions(model));
        self.read_bytes_per_s = self.read_bytes_per_s.max(rate);
        self.read_probes += 1;
        self.limit_tokens_per_s = self.read_bytes_per_s / self.decode_step_bytes.max(1) as f64;
    }

    /// Records the resident set now and its peak.
    pub fn record_memory(&mut self) {
        self.rss_bytes = resident_bytes();
        if self.peak_restarted {
            self.peak_rss_bytes = status_bytes("VmHWM:");
        }
    }

    /// One line: bandwidth, limit, `decode_tokens_per_s` as a fraction of it, memory.
    pub fn describe(&self, decode_tokens_per_s: f64) -> String {
        let megabytes = |b: u64| format!("{:.0} MB", b as f64 / 1e6);
        format!(
            "Host: {} threads read the weights at {:.1} GB/s (best of {} probes); a decoding step \
             reads {:.1} MB of them, so at most {:.0} tokens/s; decoding ran {:.1} tokens/s, {:.0} % \
             of that. Resident memory {}{}{}.\n",
            self.threads,
            self.read_bytes_per_s / 1e9,
            self.read_probes,
            self.decode_step_bytes as f64 / 1e6,
            self.limit_tokens_per_s,
            decode_tokens_per_s,
            100.0 * decode_tokens_per_s / self.limit_tokens_per_s.max(f64::MIN_POSITIVE),
            self.rss_bytes.map_or("unknown".into(), megabytes),
            self.peak_rss_bytes
                .map_or(String::new(), |b| format!(" (peak {})", megabytes(b))),
            match (self.target_rss_bytes, self.with_drafter_rss_bytes) {
                (Some(target), Some(drafter)) => format!(
                    "; {} once the target was loaded, {} with the drafter beside it",
                    megabytes(target),
                    megabytes(drafter)
                ),
                _ => String::new(),
            },
        )
    }
}

/// The byte regions of a decoding step's weights.
fn step_regions(model: &CausalLm) -> Vec<&[u8]> {
    let mut regions = Vec::new();
    for matrix in model.decode_step_matrices() {
        matrix.for_each_region(&mut |bytes| regions.push(bytes));
    }
    regions
}

/// A `kB` line of `/proc/self/status` in bytes.
/// This process's resident set now (`None` where `/proc` does not tell).
pub fn resident_bytes() -> Option<u64> {
    status_bytes("VmRSS:")
}

fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kilobytes: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kilobytes * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_and_memory_are_measured() {
        let dir = tempfile::tempdir().unwrap();
        headway_model::testing::write_tiny_model(dir.path(), 1).unwrap();
        let threads = headway_model::CpuThreads::new(2);
        let target = headway_model::Target::load(
            dir.path(),
            headway_model::Dtype::F32.kind(),
            headway_model::target::parse_device("cpu").unwrap(),
            threads,
        )
        .unwrap();
        let model = &target.model;
        let mut host = HostFigures::measure(2, model);
        assert!(host.read_bytes_per_s > 1e8, "{} B/s", host.read_bytes_per_s);
        let step = model.decode_step_bytes() as f64;
        assert!((host.limit_tokens_per_s - host.read_bytes_per_s / step).abs() < 1e-6);
        let first = host.read_bytes_per_s;
        host.probe(model);
        assert!(host.read_bytes_per_s >= first && host.read_probes == 2);
        host.record_memory();
        assert!(host.rss_bytes.is_some_and(|b| b > 1 << 20));
        assert!(host.describe(10.0).contains("tokens/s"));
        (host.target_rss_bytes, host.with_drafter_rss_bytes) =
            (Some(400_000_000), Some(500_000_000));
        assert!(host
            .describe(10.0)
            .contains("400 MB once the target was loaded, 500 MB with the drafter beside it"));
    }
}
