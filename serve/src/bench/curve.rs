//! What verifying more rows costs: the target's forward time for 1–16, 24, 32 and 64 new tokens
//! after a prompt, each as a multiple of one row's, beside the roof the host sets — reading the
//! step's weights and the prompt's keys and values at the rate the run measured, or computing:
//! the weights' multiply-accumulates (int8 where they run quantised, else f32 FMAs) plus row
//! attention's f32 FMAs over every cached key, each at the rate its instruction reaches on this
//! host (they share the same pipes, so their times add). Speculative decoding pays only while k
//! rows cost about one: this is the curve that says how far that holds.

use headway_engine::autotune::LatencyProfile;
use headway_model::quant_kernel::{int8_mac_rate, kernel_isa};
use headway_model::roof::f32_fma_rate;
use headway_model::{KvCache, Target};
use serde::{Deserialize, Serialize};

use super::HostFigures;

/// New tokens per forward the curve measures.
const CURVE_ROWS: [usize; 19] = [
    1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 24, 32, 64,
];

/// The prompt before each forward (shorter where the model's positions end first).
const CURVE_PREFIX: usize = 500;

/// Forwards per point, the median kept.
const REPS: usize = 5;

/// The target's forward time by new tokens, and the host's roof for each.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RowsCurve {
    /// Tokens in the cache before each forward.
    pub prefix: usize,
    pub rows: Vec<usize>,
    pub seconds: Vec<f64>,
    /// Fork-joins of the CPU pool in one forward of each size (0 where no pool runs it).
    #[serde(default)]
    pub fork_joins: Vec<usize>,
    /// Weight bytes a forward reads, whatever its rows.
    pub weight_bytes: usize,
    /// Bytes of the prompt's cached keys and values a forward reads (in the cache's type,
    /// `--kv-dtype`).
    #[serde(default)]
    pub cache_bytes: usize,
    /// Multiply-accumulates per row of the weights.
    pub macs_per_row: usize,
    /// The run's best read rate (its threads together).
    pub read_bytes_per_s: f64,
    /// The int8 MAC rate of the run's threads (one thread's, measured, times the threads), where
    /// the weights run quantised; `None` elsewhere.
    pub int8_macs_per_s: Option<f64>,
    /// f32 FMAs one query row spends on one cached key, over every layer and query head (its
    /// score and its weighted value); 0 in curves written before it was counted.
    #[serde(default)]
    pub attention_fmas_per_key: usize,
    /// The f32 FMA rate of the run's threads (measured likewise): row attention's, and the
    /// products' where the weights are f32 or bf16; `None` where the row kernels do not run.
    #[serde(default)]
    pub f32_fmas_per_s: Option<f64>,
}

impl RowsCurve {
    /// Measures `target`'s curve after [`CURVE_PREFIX`] tokens, with `host`'s read rate.
    pub fn measure(target: &Target, host: &HostFigures) -> anyhow::Result<Self> {
        let largest = CURVE_ROWS[CURVE_ROWS.len() - 1];
        let positions = target.model.config().max_position_embeddings;
        let prefix = CURVE_PREFIX.min(positions.saturating_sub(largest + 1));
        let profile = LatencyProfile::measure_rows(target, prefix, REPS, &CURVE_ROWS)?;
        let model = &target.model;
        let cache_bytes = prefix * KvCache::bytes_per_position(model.config(), target.kv_kind);
        let macs_per_row = model
            .decode_step_matrices()
            .map(|m| m.shape().iter().product::<i64>() as usize)
            .sum();
        let int8_macs_per_s = model
            .runs_quantised()
            .then(|| int8_mac_rate(kernel_isa()) * host.threads as f64)
            .filter(|rate| *rate > 0.0);
        let config = model.config();
        let attention_fmas_per_key =
            2 * config.num_attention_heads * config.head_dim * config.num_hidden_layers;
        Ok(Self {
            prefix,
            rows: profile.tokens,
            seconds: profile.seconds,
            fork_joins: profile.fork_joins,
            weight_bytes: host.decode_step_bytes,
            cache_bytes,
            macs_per_row,
            read_bytes_per_s: host.read_bytes_per_s,
            int8_macs_per_s,
            attention_fmas_per_key,
            f32_fmas_per_s: f32_fma_rate().map(|rate| rate * host.threads as f64),
        })
    }

    /// The fastest a forward of `rows` rows can go: the slower of reading the weights and the
    /// cache once and of computing every row (no compute roof where no rate was measured).
    fn roof_seconds(&self, rows: usize) -> f64 {
        let read = (self.weight_bytes + self.cache_bytes) as f64 / self.read_bytes_per_s;
        read.max(self.compute_seconds(rows))
    }

    /// The multiply-accumulates of `rows` rows at the host's rates: the weights' (int8 where
    /// quantised, else f32) and attention's over the prompt and the rows themselves.
    fn compute_seconds(&self, rows: usize) -> f64 {
        let f32_rate = self.f32_fmas_per_s.unwrap_or(f64::INFINITY);
        let weight_rate = self.int8_macs_per_s.unwrap_or(f32_rate);
        let attention = rows * (self.prefix + rows) * self.attention_fmas_per_key;
        (rows * self.macs_per_row) as f64 / weight_rate + attention as f64 / f32_rate
    }

    /// A markdown table: rows, ms, × one row, the roof's ms and the time as a multiple of it.
    pub fn markdown(&self) -> String {
        let read = format!(
            "reading {:.1} MB of weights and {:.1} MB of cached keys and values at {:.1} GB/s",
            self.weight_bytes as f64 / 1e6,
            self.cache_bytes as f64 / 1e6,
            self.read_bytes_per_s / 1e9
        );
        let weights = |rate: f64, what: &str| {
            format!(
                "{:.1} M {what} a row at {:.0} G/s",
                self.macs_per_row as f64 / 1e6,
                rate / 1e9
            )
        };
        let attention = match self.f32_fmas_per_s {
            Some(rate) => format!(
                " plus attention's {:.1} M f32 FMAs a row per 1,000 keys at {:.0} G/s",
                self.attention_fmas_per_key as f64 * 1e3 / 1e6,
                rate / 1e9
            ),
            None => String::new(),
        };
        let roof = match (self.int8_macs_per_s, self.f32_fmas_per_s) {
            (Some(rate), _) => {
                let weights = weights(rate, "int8 MACs");
                format!("the slower of {read} and of computing {weights}{attention}")
            }
            (None, Some(rate)) => {
                let weights = weights(rate, "f32 FMAs");
                format!("the slower of {read} and of computing {weights}{attention}")
            }
            (None, None) => format!("{read} (no compute roof measured)"),
        };
        let mut out = format!(
            "\nForward time by new tokens after a {}-token prompt; roof: {roof}.\n\n\
             | rows | ms | × 1 row | roof ms | × roof | fork-joins |\n\
             |---:|---:|---:|---:|---:|---:|\n",
            self.prefix
        );
        let one = self.seconds.first().copied().unwrap_or(f64::NAN);
        for (i, (&rows, &seconds)) in self.rows.iter().zip(&self.seconds).enumerate() {
            let roof = self.roof_seconds(rows);
            let fork_joins = self.fork_joins.get(i).map_or("–".into(), usize::to_string);
            out.push_str(&format!(
                "| {rows} | {:.2} | {:.2} | {:.2} | {:.2} | {fork_joins} |\n",
                seconds * 1e3,
                seconds / one,
                roof * 1e3,
                seconds / roof
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(int8_macs_per_s: Option<f64>, f32_fmas_per_s: Option<f64>) -> RowsCurve {
        RowsCurve {
            prefix: 500,
            rows: vec![1, 2, 64],
            seconds: vec![0.004, 0.005, 0.040],
            fork_joins: vec![151, 151, 151],
            weight_bytes: 90_000_000,
            cache_bytes: 10_000_000,
            macs_per_row: 100_000_000,
            read_bytes_per_s: 50e9,
            int8_macs_per_s,
            attention_fmas_per_key: 100_000,
            f32_fmas_per_s,
        }
    }

    /// One row is bound by the read of weights and cache (2 ms), 64 rows by the MACs (6.4e9 at
    /// 400 G/s: 16 ms); with no compute roof, every row count by the read alone.
    #[test]
    fn the_roof_is_the_read_until_the_multiplies_take_longer() {
        let quantised = curve(Some(400e9), None);
        assert!((quantised.roof_seconds(1) - 0.002).abs() < 1e-12);
        assert!((quantised.roof_seconds(64) - 0.016).abs() < 1e-12);
        let table = quantised.markdown();
        assert!(
            table.contains("| 64 | 40.00 | 10.00 | 16.00 | 2.50 | 151 |"),
            "{table}"
        );
        assert!(
            table.contains("| 1 | 4.00 | 1.00 | 2.00 | 2.00 | 151 |"),
            "{table}"
        );
        let unknown = curve(None, None);
        assert!((unknown.roof_seconds(64) - 0.002).abs() < 1e-12);
        assert!(unknown.markdown().contains("no compute roof"));
    }

    /// Attention's FMAs add to the weights' MACs: 64 rows over 564 keys at 100,000 FMAs a key
    /// are 3.6096e9 FMAs, 36.096 ms at 100 G/s, beside the MACs' 16 ms. Dense weights take the
    /// f32 rate for their MACs too (6.4e9 at 100 G/s: 64 ms).
    #[test]
    fn attention_adds_its_fmas_to_the_compute_roof() {
        let quantised = curve(Some(400e9), Some(100e9));
        assert!((quantised.roof_seconds(64) - 0.052_096).abs() < 1e-9);
        // One row: 501 keys, 0.501 ms of FMAs beside 0.25 ms of MACs: still the read's 2 ms.
        assert!((quantised.roof_seconds(1) - 0.002).abs() < 1e-12);
        assert!(quantised
            .markdown()
            .contains("100.0 M f32 FMAs a row per 1,000 keys"));
        let dense = curve(None, Some(100e9));
        assert!((dense.roof_seconds(64) - 0.100_096).abs() < 1e-9);
        assert!(dense
            .markdown()
            .contains("100.0 M f32 FMAs a row at 100 G/s"));
    }
}
