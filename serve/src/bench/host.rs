//! What the host allows: memory read bandwidth, and the decoding rate it bounds for the bytes a
//! step reads; the process's resident memory.
//!
//! Hosts of one machine kind differ a lot (2-thread reads from ~10 to 38 GB/s), so absolute
//! tokens/s do not travel between them; the fraction of the host's bandwidth limit does.

use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Host figures of a bench run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HostFigures {
    /// Threads that read together (the run's threads).
    pub threads: usize,
    /// Bytes per second those threads read from memory, best of a few passes.
    pub read_bytes_per_s: f64,
    /// Weight bytes one decoding step reads.
    pub decode_step_bytes: usize,
    /// `read_bytes_per_s / decode_step_bytes`: decoding can go no faster.
    pub limit_tokens_per_s: f64,
    /// Resident set of this process after the run, and its peak since the weights were loaded
    /// (`None` where `/proc` does not tell).
    pub rss_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
    /// Whether the kernel's peak count restarted after the bandwidth buffer was freed.
    #[serde(skip)]
    peak_restarted: bool,
}

impl HostFigures {
    /// Measures the read bandwidth of `threads` threads (a few hundred milliseconds), then
    /// restarts the kernel's peak-RSS count so that the buffer it read is not counted.
    pub fn measure(threads: usize, decode_step_bytes: usize) -> Self {
        let read_bytes_per_s = read_bandwidth(threads.max(1));
        // Best effort: without it the peak may include the buffer above, and is dropped.
        let peak_restarted = std::fs::write("/proc/self/clear_refs", "5").is_ok();
        Self {
            threads,
            read_bytes_per_s,
            decode_step_bytes,
            limit_tokens_per_s: read_bytes_per_s / decode_step_bytes.max(1) as f64,
            rss_bytes: None,
            peak_rss_bytes: None,
            peak_restarted,
        }
    }

    /// Records the resident set now and its peak.
    pub fn record_memory(&mut self) {
        self.rss_bytes = status_bytes("VmRSS:");
        if self.peak_restarted {
            self.peak_rss_bytes = status_bytes("VmHWM:");
        }
    }

    /// One line: bandwidth, limit, `decode_tokens_per_s` as a fraction of it, memory.
    pub fn describe(&self, decode_tokens_per_s: f64) -> String {
        let megabytes = |b: u64| format!("{:.0} MB", b as f64 / 1e6);
        format!(
            "Host: {} threads read {:.1} GB/s; a decoding step reads {:.1} MB of weights, so at most \
             {:.0} tokens/s; decoding ran {:.1} tokens/s, {:.0} % of that. Resident memory {}{}.\n",
            self.threads,
            self.read_bytes_per_s / 1e9,
            self.decode_step_bytes as f64 / 1e6,
            self.limit_tokens_per_s,
            decode_tokens_per_s,
            100.0 * decode_tokens_per_s / self.limit_tokens_per_s.max(f64::MIN_POSITIVE),
            self.rss_bytes.map_or("unknown".into(), megabytes),
            self.peak_rss_bytes
                .map_or(String::new(), |b| format!(" (peak {})", megabytes(b))),
        )
    }
}

/// Bytes per second `threads` threads read together, each summing its part of a buffer far
/// larger than any cache; the best of three passes.
fn read_bandwidth(threads: usize) -> f64 {
    const BYTES: usize = 512 << 20;
    // Ones, not zeros: every page is written, so none is the kernel's shared zero page.
    let buffer = vec![1u64; BYTES / 8];
    let part = buffer.len().div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|scope| {
            let sums: Vec<_> = buffer
                .chunks(part)
                .map(|chunk| scope.spawn(move || lane_sum(chunk)))
                .collect();
            sums.into_iter().map(|s| s.join().unwrap_or(0)).sum()
        });
        std::hint::black_box(total);
        best = best.min(start.elapsed().as_secs_f64());
    }
    BYTES as f64 / best
}

/// A sum in eight independent lanes (vectorised; no dependency chain to wait on).
fn lane_sum(values: &[u64]) -> u64 {
    let mut lanes = [0u64; 8];
    for chunk in values.chunks_exact(8) {
        for (lane, value) in lanes.iter_mut().zip(chunk) {
            *lane = lane.wrapping_add(*value);
        }
    }
    lanes.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// A `kB` line of `/proc/self/status` in bytes.
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
        let mut host = HostFigures::measure(2, 1_000_000);
        assert!(host.read_bytes_per_s > 1e8, "{} B/s", host.read_bytes_per_s);
        assert!((host.limit_tokens_per_s - host.read_bytes_per_s / 1e6).abs() < 1e-6);
        host.record_memory();
        assert!(host.rss_bytes.is_some_and(|b| b > 1 << 20));
        assert!(host.describe(10.0).contains("tokens/s"));
    }
}
