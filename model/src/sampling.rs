//! Token selection from logits: greedy, or temperature / min-p / top-k / top-p sampling with a
//! seeded RNG.
//!
//! [`SamplingParams`] is the one type every front end (command line, HTTP, `prepare
//! --regenerate`, benchmarks) builds its sampling settings into, validated once by
//! [`SamplingParams::new`]; [`SamplingParams::distribution`] is the single place where they turn
//! logits into probabilities, so plain sampling, a draft model's proposals and speculative
//! acceptance all see the same distribution.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{ModelError, Result};
use crate::linear::{f32_slice, plain_cpu_f32};

/// How to pick each token. Temperature 0 means greedy (argmax); top-k 0, top-p 1 and min-p 0 are
/// off. Built only through [`SamplingParams::new`], so every value holds its rules.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "SamplingFields", into = "SamplingFields")]
pub struct SamplingParams {
    temperature: f64,
    top_k: usize,
    top_p: f64,
    min_p: f64,
    seed: u64,
}

impl Default for SamplingParams {
    /// Greedy decoding.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks every value: temperature a finite number ≥ 0, top-p in (0, 1], min-p in [0, 1]
    /// (a token is kept when its probability is at least min-p times the most likely token's).
    /// An error names the field.
    pub fn new(temperature: f64, top_k: usize, top_p: f64, min_p: f64, seed: u64) -> Result<Self> {
        let invalid = |field, message: String| Err(ModelError::Invalid { field, message });
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return invalid(
                "temperature",
                format!("{temperature} must be a finite number >= 0"),
            );
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return invalid("top_p", format!("{top_p} must be in (0, 1]"));
        }
        if !(0.0..=1.0).contains(&min_p) {
            return invalid("min_p", format!("{min_p} must be in [0, 1]"));
        }
        Ok(Self {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        })
    }

    /// The same settings with another RNG seed.
    pub fn with_seed(self, seed: u64) -> Self {
        Self { seed, ..self }
    }

    pub fn temperature(&self) -> f64 {
        self.temperature
    }

    pub fn top_k(&self) -> usize {
        self.top_k
    }

    pub fn top_p(&self) -> f64 {
        self.top_p
    }

    pub fn min_p(&self) -> f64 {
        self.min_p
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The sampling distribution over the vocabulary for `logits` (`[vocab]`), f32 on the logits'
    /// device: softmax(logits / T) restricted to the tokens at least min-p times as likely as the
    /// top one and to the top-k tokens, then to the top-p nucleus, renormalised (vLLM's order).
    /// Not meaningful for greedy params (use argmax).
    pub fn distribution(&self, logits: &Tensor) -> Tensor {
        let scaled = logits.to_kind(Kind::Float) / self.temperature;
        let vocab = scaled.size()[0] as usize;
        let scaled = if self.min_p > 0.0 {
            // p(x) ≥ min_p · p_max  ⇔  scaled(x) ≥ max(scaled) + ln(min_p).
            let threshold = scaled.max() + self.min_p.ln();
            scaled.masked_fill(&scaled.lt_tensor(&threshold), f64::NEG_INFINITY)
        } else {
            scaled
        };
        let filtered = if self.top_k > 0 && self.top_k < vocab {
            let (top, _) = scaled.topk(self.top_k as i64, 0, true, true);
            let threshold = top.get(self.top_k as i64 - 1);
            scaled.masked_fill(&scaled.lt_tensor(&threshold), f64::NEG_INFINITY)
        } else {
            scaled
        };
        let probs = filtered.softmax(0, Kind::Float);
        if self.top_p >= 1.0 {
            return probs;
        }
        let (sorted, order) = probs.sort(0, true);
        // Keep a token when the mass strictly before it is below top_p (so the top token always
        // stays).
        let mass_before = sorted.cumsum(0, Kind::Float) - &sorted;
        let drop_sorted = mass_before.ge(self.top_p);
        let drop = drop_sorted.zeros_like().scatter(0, &order, &drop_sorted);
        let kept = probs.masked_fill(&drop, 0.0);
        &kept / kept.sum(Kind::Float)
    }
}

/// [`SamplingParams`] as written in files (`prepare`'s manifest), checked on reading.
#[derive(Serialize, Deserialize)]
struct SamplingFields {
    /// 0: greedy.
    temperature: f64,
    top_p: f64,
    top_k: usize,
    /// Absent in files written before min-p existed: off.
    #[serde(default)]
    min_p: f64,
    seed: u64,
}

impl TryFrom<SamplingFields> for SamplingParams {
    type Error = ModelError;

    fn try_from(f: SamplingFields) -> Result<Self> {
        Self::new(f.temperature, f.top_k, f.top_p, f.min_p, f.seed)
    }
}

impl From<SamplingParams> for SamplingFields {
    fn from(p: SamplingParams) -> Self {
        Self {
            temperature: p.temperature,
            top_p: p.top_p,
            top_k: p.top_k,
            min_p: p.min_p,
            seed: p.seed,
        }
    }
}

/// Sampling options on the command line.
#[derive(Debug, Clone, clap::Args)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 decodes greedily (argmax).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Keep only the K most likely tokens before sampling (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Keep only tokens at least P times as likely as the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f64,
    /// Seed of the sampling RNG (same seed, same output).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> Result<SamplingParams> {
        SamplingParams::new(
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seed,
        )
    }
}

/// Picks tokens according to [`SamplingParams`], owning the seeded RNG.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Each row's argmax of `logits` `[n, vocab]`, as libtorch's `argmax` picks it (the first
/// largest, NaN above all): read in place from contiguous f32 CPU logits (libtorch's argmax and
/// the copy out cost a plain decoding step about 1 %), else by libtorch.
pub fn greedy_tokens(logits: &Tensor) -> Vec<u32> {
    if !(plain_cpu_f32(logits) && logits.is_contiguous() && logits.dim() == 2) {
        let argmax = logits.argmax(-1, false).to_device(tch::Device::Cpu);
        return Vec::<i64>::try_from(argmax)
            .expect("argmax gives i64 indices")
            .into_iter()
            .map(|t| t as u32)
            .collect();
    }
    let vocab = logits.size()[1] as usize;
    f32_slice(logits)
        .chunks_exact(vocab.max(1))
        .map(|row| first_largest(row) as u32)
        .collect()
}

/// The index of the first largest of `row`, a NaN counting as larger than any number (its
/// first). Eight lanes each keep their largest and where they first saw it (and whether they saw
/// a NaN); the lowest index of the lanes' largest is then the first.
fn first_largest(row: &[f32]) -> usize {
    const LANES: usize = 8;
    let whole = row.len() / LANES * LANES;
    let (mut largest, mut first) = ([f32::NEG_INFINITY; LANES], [0u32; LANES]);
    let mut nan = [false; LANES];
    for (c, chunk) in row[..whole].chunks_exact(LANES).enumerate() {
        for lane in 0..LANES {
            let v = chunk[lane];
            nan[lane] |= v.is_nan();
            let larger = v > largest[lane];
            largest[lane] = if larger { v } else { largest[lane] };
            first[lane] = if larger {
                (c * LANES + lane) as u32
            } else {
                first[lane]
            };
        }
    }
    if nan.contains(&true) || row[whole..].iter().any(|v| v.is_nan()) {
        return row.iter().position(|v| v.is_nan()).unwrap_or(0);
    }
    let lanes = largest.into_iter().zip(first.map(|i| i as usize));
    let tail = row[whole..]
        .iter()
        .enumerate()
        .map(|(i, &v)| (v, whole + i));
    lanes
        .chain(tail)
        .fold((f32::NEG_INFINITY, 0), |best, (v, i)| {
            if v > best.0 || (v == best.0 && i < best.1) {
                (v, i)
            } else {
                best
            }
        })
        .1
}

/// `log Σ exp(row)`, the normaliser of a log-softmax (`log p = logit − log_sum_exp(row)`), shifted
/// by the row's largest so that no term overflows: a draft depth's log-probabilities without
/// libtorch's reduction, which cost a tenth of EAGLE-3's drafting. Within a few ulp of
/// libtorch's `logsumexp`; NaN where the row holds one, −∞ for an empty row or one of −∞ only.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    // The first largest counts a NaN above all numbers: then it is the NaN.
    let Some(&largest) = row.get(first_largest(row)) else {
        return f32::NEG_INFINITY;
    };
    if !largest.is_finite() {
        return largest;
    }
    largest + sum_exp_below(row, largest).ln()
}

/// `Σ exp(v − largest)` over `row`, every `v ≤ largest`: eight lanes at a time on the row
/// kernel's instruction sets.
fn sum_exp_below(row: &[f32], largest: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::row_kernel::available() {
        // SAFETY: AVX2 and FMA were just detected.
        return unsafe { sum_exp_below_avx2(row, largest) };
    }
    row.iter().map(|&v| (v - largest).exp()).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_below_avx2(row: &[f32], largest: f32) -> f32 {
    use std::arch::x86_64::*;
    const LANES: usize = 8;
    let shift = _mm256_set1_ps(largest);
    let mut sum = _mm256_setzero_ps();
    let chunks = row.chunks_exact(LANES);
    let tail: f32 = chunks
        .remainder()
        .iter()
        .map(|&v| (v - largest).exp())
        .sum();
    for chunk in chunks {
        let shifted = _mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift);
        sum = _mm256_add_ps(sum, crate::row_attention::exp_nonpositive(shifted));
    }
    let mut lanes = [0f32; LANES];
    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
    lanes.iter().sum::<f32>() + tail
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self {
            rng: StdRng::seed_from_u64(params.seed),
            params,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token for `logits` (`[vocab]`).
    pub fn next_token(&mut self, logits: &Tensor) -> u32 {
        if self.params.is_greedy() {
            return greedy_tokens(&logits.reshape([1, -1]))[0];
        }
        let probs = self.params.distribution(logits);
        self.sample(&probs)
    }

    /// Draws one index from the probability vector `probs` (`[vocab]`, summing to 1).
    pub fn sample(&mut self, probs: &Tensor) -> u32 {
        let probs = Vec::<f32>::try_from(probs.to_device(tch::Device::Cpu))
            .expect("a 1-D f32 tensor converts to Vec<f32>");
        self.sample_slice(&probs)
    }

    /// Draws one index from `probs` (non-negative; need not be normalised exactly).
    pub fn sample_slice(&mut self, probs: &[f32]) -> u32 {
        let total: f64 = probs.iter().map(|&p| p as f64).sum();
        sample_index(probs, self.uniform() * total)
    }

    /// A uniform draw in [0, 1) from the sampler's RNG (acceptance tests of speculative decoding).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
}

/// Inverse-CDF draw: the first index whose cumulative probability exceeds `u` (∈ [0, 1)); the last
/// non-zero index absorbs rounding.
fn sample_index(probs: &[f32], u: f64) -> u32 {
    let mut cumulative = 0.0f64;
    let mut last_nonzero = 0;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cumulative += p as f64;
            last_nonzero = i;
            if u < cumulative {
                return i as u32;
            }
        }
    }
    last_nonzero as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Tensor {
        Tensor::from_slice(&[2.0f32, 1.0, 0.5, -1.0, 3.0])
    }

    fn params(temperature: f64, top_k: usize, top_p: f64) -> SamplingParams {
        SamplingParams::new(temperature, top_k, top_p, 0.0, 1).unwrap()
    }

    fn to_vec(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t).unwrap()
    }

    #[test]
    fn distribution_is_the_tempered_softmax_without_filters() {
        let probs = to_vec(&params(2.0, 0, 1.0).distribution(&logits()));
        let expected = to_vec(&(logits() / 2.0).softmax(0, Kind::Float));
        for (p, e) in probs.iter().zip(expected) {
            assert!((p - e).abs() < 1e-6);
        }
    }

    #[test]
    fn top_k_keeps_exactly_the_k_largest() {
        let probs = to_vec(&params(1.0, 2, 1.0).distribution(&logits()));
        assert_eq!(probs.iter().filter(|&&p| p > 0.0).count(), 2);
        assert!(probs[4] > probs[0] && probs[0] > 0.0);
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus_reaching_p() {
        // Softmax of the logits: token 4 ≈ 0.61, token 0 ≈ 0.22, token 1 ≈ 0.08, ...
        let probs = to_vec(&params(1.0, 0, 0.7).distribution(&logits()));
        let kept: Vec<usize> = (0..5).filter(|&i| probs[i] > 0.0).collect();
        assert_eq!(kept, vec![0, 4]);
        let only_top = to_vec(&params(1.0, 0, 0.1).distribution(&logits()));
        assert_eq!(only_top[4], 1.0);
    }

    /// Log-normalisers of rows of several lengths and scales, and of the edge rows, against
    /// libtorch's `logsumexp`.
    #[test]
    fn log_sum_exp_is_libtorchs() {
        for (len, scale) in [
            (1, 1.0),
            (7, 3.0),
            (8, 0.1),
            (100, 10.0),
            (8192, 5.0),
            (49_152, 30.0),
        ] {
            let row = Tensor::randn([len], (Kind::Float, tch::Device::Cpu)) * scale;
            let expected = row.logsumexp([0], false).double_value(&[]) as f32;
            let got = log_sum_exp(&Vec::<f32>::try_from(&row).unwrap());
            let tolerance = 4.0 * f32::EPSILON * expected.abs().max(1.0);
            assert!(
                (got - expected).abs() <= tolerance,
                "{len} × {scale}: {got} vs {expected}"
            );
        }
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        assert!(log_sum_exp(&[1.0, nan, 2.0]).is_nan());
        assert_eq!(log_sum_exp(&[-inf, -inf]), -inf);
        assert_eq!(log_sum_exp(&[]), -inf);
        assert_eq!(log_sum_exp(&[1.0, inf]), inf);
        assert_eq!(log_sum_exp(&[-inf, 0.0]), 0.0);
    }

    /// Rows of ties, NaNs, infinities and lengths around the lanes' width, each equal to
    /// libtorch's argmax (and so is a non-contiguous view, which libtorch itself serves).
    #[test]
    fn greedy_tokens_are_libtorchs_argmax() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let rows: Vec<Vec<f32>> = vec![
            vec![1.0, 3.0, 3.0, 2.0],
            vec![-inf; 9],
            vec![0.0, 1.0, nan, 5.0, nan, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0],
            vec![
                5.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 7.0, 1.0, 7.0, 0.0, 7.0, 7.0, 7.0, 7.0, 7.0,
            ],
            vec![-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 3.0, nan],
            vec![inf, 1.0, inf],
            vec![2.5],
        ];
        for row in &rows {
            let t = Tensor::from_slice(row).view([1, -1]);
            let expected = t.argmax(-1, false).int64_value(&[0]) as u32;
            assert_eq!(greedy_tokens(&t), [expected], "{row:?}");
        }
        let random = Tensor::randn([5, 1000], (Kind::Float, tch::Device::Cpu));
        let expected: Vec<u32> = Vec::<i64>::try_from(random.argmax(-1, false))
            .unwrap()
            .into_iter()
            .map(|t| t as u32)
            .collect();
        assert_eq!(greedy_tokens(&random), expected);
        assert_eq!(
            greedy_tokens(&random.tr().tr().transpose(0, 1).t_()),
            expected
        );
    }

    #[test]
    fn greedy_picks_the_argmax_and_seeds_reproduce() {
        assert_eq!(Sampler::new(params(0.0, 0, 1.0)).next_token(&logits()), 4);
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, 0, 1.0).with_seed(seed));
            (0..20).map(|_| s.next_token(&logits())).collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let mut sampler = Sampler::new(params(1.0, 0, 1.0));
        let probs = params(1.0, 0, 1.0).distribution(&logits());
        let mut counts = [0usize; 5];
        let n = 20_000;
        for _ in 0..n {
            counts[sampler.sample(&probs) as usize] += 1;
        }
        for (count, p) in counts.iter().zip(to_vec(&probs)) {
            let freq = *count as f32 / n as f32;
            assert!(
                (freq - p).abs() < 0.015,
                "frequency {freq} vs probability {p}"
            );
        }
    }

    #[test]
    fn min_p_keeps_the_tokens_at_least_that_fraction_of_the_top_one() {
        // Softmax of the logits: token 4 ≈ 0.61, 0 ≈ 0.22, 1 ≈ 0.08, 2 ≈ 0.05, 3 ≈ 0.01.
        let with = |min_p: f64, top_k: usize| {
            let params = SamplingParams::new(1.0, top_k, 1.0, min_p, 1).unwrap();
            to_vec(&params.distribution(&logits()))
        };
        let kept = |probs: &[f32]| (0..5).filter(|&i| probs[i] > 0.0).collect::<Vec<_>>();
        // 0.3 × 0.61 ≈ 0.18: tokens 4 and 0 stay, renormalised.
        let probs = with(0.3, 0);
        assert_eq!(kept(&probs), vec![0, 4]);
        assert!((probs[4] / probs[0] - (3.0f32 - 2.0).exp()).abs() < 1e-5);
        assert!((probs.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        // Looser than 0.08 / 0.61: three tokens; with top-k 2 only two of them.
        assert_eq!(kept(&with(0.1, 0)), vec![0, 1, 4]);
        assert_eq!(kept(&with(0.1, 2)), vec![0, 4]);
        assert_eq!(kept(&with(1.0, 0)), vec![4]);
        let off = to_vec(&params(1.0, 0, 1.0).distribution(&logits()));
        assert_eq!(with(0.0, 0), off);
    }

    #[test]
    fn invalid_params_name_the_field() {
        let err = |t, p, m| SamplingParams::new(t, 0, p, m, 0).unwrap_err().to_string();
        assert!(err(-1.0, 1.0, 0.0).contains("temperature"));
        assert!(err(f64::NAN, 1.0, 0.0).contains("temperature"));
        assert!(err(1.0, 1.5, 0.0).contains("top_p"));
        assert!(err(1.0, 0.0, 0.0).contains("top_p"));
        assert!(err(1.0, 1.0, -0.1).contains("min_p"));
        assert!(err(1.0, 1.0, 1.5).contains("min_p"));
        // Files hold the same rules.
        let bad = serde_json::json!({"temperature": 1.0, "top_p": 2.0, "top_k": 0, "seed": 0});
        let err = serde_json::from_value::<SamplingParams>(bad).unwrap_err();
        assert!(err.to_string().contains("top_p"), "{err}");
        let old = serde_json::json!({"temperature": 0.5, "top_p": 0.9, "top_k": 4, "seed": 3});
        let read: SamplingParams = serde_json::from_value(old).unwrap();
        assert_eq!(read, SamplingParams::new(0.5, 4, 0.9, 0.0, 3).unwrap());
    }
}
