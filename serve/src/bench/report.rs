//! What a benchmark run measured, per prompt, per category and overall, and how it is reported:
//! JSON, a markdown table, and the prompts whose outputs differ between two runs.

use std::collections::BTreeMap;

use headway_engine::engine::SpecGeneration;
use serde::{Deserialize, Serialize};

use super::curve::RowsCurve;
use super::host::HostFigures;
use super::questions::{spec_bench_category, QuestionId};

/// Figures for one prompt (one turn of one question).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PromptResult {
    pub question_id: QuestionId,
    pub category: String,
    /// 0 for the first turn.
    pub turn: usize,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Seconds from the start to the last token, prompt forward included.
    pub seconds: f64,
    /// Seconds of the prompt forward (time to first token).
    pub prefill_seconds: f64,
    /// Target forwards, the prompt's included.
    pub target_forwards: usize,
    /// Draft tokens the target accepted and that were emitted (not those cut after a stop).
    pub accepted_tokens: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
}

/// Totals over a set of prompts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub prompts: usize,
    pub new_tokens: usize,
    pub seconds: f64,
    /// New tokens over all seconds, the prompts' forwards included.
    pub tokens_per_s: f64,
    #[serde(default)]
    pub prompt_tokens: usize,
    /// Prompt tokens per second of the prompts' forwards.
    #[serde(default)]
    pub prefill_tokens_per_s: f64,
    /// New tokens after each prompt's first (which its forward gives) per second after it:
    /// decoding alone, as llama.cpp's "eval" rate counts it.
    #[serde(default)]
    pub decode_tokens_per_s: f64,
    /// New tokens per target forward (plain decoding: 1.0).
    pub tau: f64,
    /// Accepted draft tokens per verification step.
    pub mean_accepted: f64,
}

impl Summary {
    fn of<'a>(results: impl IntoIterator<Item = &'a PromptResult>) -> Self {
        let (mut prompts, mut tokens, mut seconds, mut forwards, mut accepted) = (0, 0, 0.0, 0, 0);
        let (mut prompt_tokens, mut prefill_seconds, mut first_tokens) = (0, 0.0, 0);
        for r in results {
            prompts += 1;
            tokens += r.new_tokens;
            seconds += r.seconds;
            forwards += r.target_forwards;
            accepted += r.accepted_tokens;
            prompt_tokens += r.prompt_tokens;
            prefill_seconds += r.prefill_seconds;
            first_tokens += r.new_tokens.min(1);
        }
        let steps = forwards.saturating_sub(prompts);
        let rate = |count: usize, seconds: f64| count as f64 / seconds.max(f64::MIN_POSITIVE);
        Self {
            prompts,
            new_tokens: tokens,
            seconds,
            tokens_per_s: rate(tokens, seconds),
            prompt_tokens,
            prefill_tokens_per_s: rate(prompt_tokens, prefill_seconds),
            decode_tokens_per_s: rate(tokens - first_tokens, seconds - prefill_seconds),
            tau: tokens as f64 / forwards.max(1) as f64,
            mean_accepted: accepted as f64 / steps.max(1) as f64,
        }
    }
}

/// Per-depth acceptance: of the steps whose tree reached depth d and whose path got to depth
/// d − 1, the fraction that accepted a token at depth d.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DepthStats {
    pub reached: Vec<usize>,
    pub accepted: Vec<usize>,
}

impl DepthStats {
    fn add(&mut self, tree_depth: usize, accepted: usize) {
        if self.reached.len() < tree_depth {
            self.reached.resize(tree_depth, 0);
            self.accepted.resize(tree_depth, 0);
        }
        for d in 1..=tree_depth.min(accepted + 1) {
            self.reached[d - 1] += 1;
            if accepted >= d {
                self.accepted[d - 1] += 1;
            }
        }
    }

    /// α_d for d = 1, 2, …
    pub fn rates(&self) -> Vec<f64> {
        self.reached
            .iter()
            .zip(&self.accepted)
            .map(|(&r, &a)| a as f64 / r.max(1) as f64)
            .collect()
    }

    /// All depths pooled: the per-token acceptance rate α of the speedup formula.
    pub fn pooled(&self) -> f64 {
        self.accepted.iter().sum::<usize>() as f64
            / self.reached.iter().sum::<usize>().max(1) as f64
    }
}

/// One method's run over the prompts.
#[derive(Debug, Clone, Default)]
pub struct MethodRun {
    pub results: Vec<PromptResult>,
    pub depths: DepthStats,
    /// Seconds spent drafting and verifying, over all steps; verification steps.
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    /// Seconds choosing the accepted path and compacting the cache onto it.
    pub accept_seconds: f64,
    /// The drafter's passes over the prompts ([`SpecGeneration::drafter_prefill_seconds`]).
    pub drafter_prefill_seconds: f64,
    pub steps: usize,
    /// Sum of the steps' tree depths.
    depth_sum: usize,
    /// Steps and their verification seconds, by rows verified (the tree and its root).
    verified_rows: BTreeMap<usize, (usize, f64)>,
}

impl MethodRun {
    pub fn mean_tree_depth(&self) -> f64 {
        self.depth_sum as f64 / self.steps.max(1) as f64
    }

    /// Mean seconds of one step: drafting, verification and acceptance.
    fn seconds_per_step(&self) -> f64 {
        (self.draft_seconds + self.verify_seconds + self.accept_seconds) / self.steps.max(1) as f64
    }

    /// Adds one generation's steps and its prompt's figures.
    pub fn add(&mut self, out: &SpecGeneration, result: PromptResult) {
        for step in &out.steps {
            self.depths.add(step.tree_depth, step.accepted());
            self.draft_seconds += step.draft_seconds;
            self.verify_seconds += step.verify_seconds;
            self.accept_seconds += step.accept_seconds;
            self.depth_sum += step.tree_depth;
            let rows = self.verified_rows.entry(step.tree_tokens + 1).or_default();
            rows.0 += 1;
            rows.1 += step.verify_seconds;
        }
        self.steps += out.steps.len();
        self.drafter_prefill_seconds += out.drafter_prefill_seconds;
        self.results.push(result);
    }
}

/// A category's (or the whole run's) figures beside `ar`'s.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Comparison {
    #[serde(flatten)]
    pub method: Summary,
    pub ar: Option<Summary>,
    pub speedup_vs_ar: Option<f64>,
}

impl Comparison {
    fn of(method: Summary, ar: Option<Summary>) -> Self {
        let speedup_vs_ar = ar.as_ref().map(|a| method.tokens_per_s / a.tokens_per_s);
        Self {
            method,
            ar,
            speedup_vs_ar,
        }
    }
}

/// The JSON report of `bench`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchReport {
    pub method: String,
    /// Run settings: target, heads, device, dtype, threads, sampling, tree.
    pub settings: serde_json::Value,
    pub tau: f64,
    pub tokens_per_s: f64,
    pub speedup_vs_ar: Option<f64>,
    /// The expected-speedup formula with the run's pooled α, mean tree depth and draft cost.
    pub predicted_speedup: Option<f64>,
    /// α_d for depths 1, 2, …
    pub per_depth_acceptance: Vec<f64>,
    pub overall: Comparison,
    pub per_category: BTreeMap<String, Comparison>,
    /// The host's read bandwidth, the decoding rate it bounds, resident memory (absent in reports
    /// of older versions).
    #[serde(default)]
    pub host: Option<HostFigures>,
    /// Prompts whose outputs equal plain decoding's in the same run (greedy: all of them, or the
    /// arithmetic under verification differs from decoding's); `None` without a baseline.
    #[serde(default)]
    pub identical_to_ar: Option<usize>,
    /// The target's forward time by new tokens beside the host's roof (absent in reports of
    /// older versions).
    #[serde(default)]
    pub rows_curve: Option<RowsCurve>,
    /// Where a step's time goes (absent in reports of older versions).
    #[serde(default)]
    pub profile: Option<StepProfile>,
    pub per_prompt: Vec<PromptResult>,
}

/// Mean milliseconds of one step by phase, and one draft depth beside a plain decoding step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepProfile {
    pub drafting_ms: f64,
    /// The target's forward over the tree, with its LM head.
    pub verification_ms: f64,
    /// Choosing the accepted path and compacting the KV cache onto it.
    pub acceptance_ms: f64,
    /// Drafting over the mean depth of the verified trees.
    pub draft_depth_ms: f64,
    /// The drafter's pass over a prompt (its prefill: the head or draft model fed the whole
    /// prompt once, in no step), mean over the prompts (absent in reports of older versions).
    #[serde(default)]
    pub drafter_prefill_ms: f64,
    /// `ar`'s step in the same run, and one draft depth as a share of it.
    pub plain_step_ms: Option<f64>,
    pub draft_depth_share: Option<f64>,
    /// The run's own verifications by rows: what its trees cost, beside the rows curve measured
    /// apart (absent in reports of older versions).
    #[serde(default)]
    pub verification_by_rows: Vec<RowsVerified>,
}

/// The steps of a run that verified `rows` rows, and their mean verification time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RowsVerified {
    pub rows: usize,
    pub steps: usize,
    pub mean_ms: f64,
}

impl StepProfile {
    fn of(run: &MethodRun, ar: Option<&MethodRun>) -> Option<Self> {
        let steps = run.steps.max(1) as f64;
        let ms = |seconds: f64| 1e3 * seconds / steps;
        let draft_depth_ms = ms(run.draft_seconds) / run.mean_tree_depth().max(1.0);
        let plain_step_ms = ar
            .filter(|a| a.steps > 0)
            .map(|a| 1e3 * a.seconds_per_step());
        (run.steps > 0).then(|| Self {
            drafting_ms: ms(run.draft_seconds),
            verification_ms: ms(run.verify_seconds),
            acceptance_ms: ms(run.accept_seconds),
            draft_depth_ms,
            drafter_prefill_ms: 1e3 * run.drafter_prefill_seconds / run.results.len().max(1) as f64,
            plain_step_ms,
            draft_depth_share: plain_step_ms.map(|plain| draft_depth_ms / plain),
            verification_by_rows: run
                .verified_rows
                .iter()
                .map(|(&rows, &(steps, seconds))| RowsVerified {
                    rows,
                    steps,
                    mean_ms: 1e3 * seconds / steps.max(1) as f64,
                })
                .collect(),
        })
    }

    fn markdown(&self) -> String {
        let share = match (self.plain_step_ms, self.draft_depth_share) {
            (Some(plain), Some(share)) => {
                format!(" = {:.1} % of a plain step ({plain:.2} ms)", 100.0 * share)
            }
            _ => String::new(),
        };
        let by_rows: Vec<String> = self
            .verification_by_rows
            .iter()
            .map(|v| format!("{}: {:.2} ms ({} steps)", v.rows, v.mean_ms, v.steps))
            .collect();
        format!(
            "\nPer step: drafting {:.2} ms, verification {:.2} ms, acceptance + compaction {:.2} ms; one draft depth {:.2} ms{share}; the drafter's pass over a prompt {:.2} ms\nVerified rows → this run's mean verification: {}\n",
            self.drafting_ms,
            self.verification_ms,
            self.acceptance_ms,
            self.draft_depth_ms,
            self.drafter_prefill_ms,
            by_rows.join(", ")
        )
    }
}

/// Builds the report of `run`, compared with `ar` when given.
pub fn report(
    method: &str,
    settings: serde_json::Value,
    run: &MethodRun,
    ar: Option<&MethodRun>,
) -> BenchReport {
    let mut categories: BTreeMap<&str, (Vec<&PromptResult>, Vec<&PromptResult>)> = BTreeMap::new();
    for r in &run.results {
        categories
            .entry(spec_bench_category(&r.category))
            .or_default()
            .0
            .push(r);
    }
    for r in ar.iter().flat_map(|a| &a.results) {
        categories
            .entry(spec_bench_category(&r.category))
            .or_default()
            .1
            .push(r);
    }
    let ar_summary = |rows: &[&PromptResult]| ar.map(|_| Summary::of(rows.iter().copied()));
    let per_category = categories
        .iter()
        .map(|(name, (rows, ar_rows))| {
            let summary = Summary::of(rows.iter().copied());
            (
                name.to_string(),
                Comparison::of(summary, ar_summary(ar_rows)),
            )
        })
        .collect();
    let overall = Comparison::of(
        Summary::of(&run.results),
        ar.map(|a| Summary::of(&a.results)),
    );
    BenchReport {
        method: method.to_string(),
        settings,
        tau: overall.method.tau,
        tokens_per_s: overall.method.tokens_per_s,
        speedup_vs_ar: overall.speedup_vs_ar,
        predicted_speedup: ar.map(|a| predicted_speedup(run, a)),
        per_depth_acceptance: run.depths.rates(),
        host: None,
        overall,
        per_category,
        identical_to_ar: ar.map(|a| {
            let differing = differing_prompts(&run.results, &a.results).len();
            run.results.len().saturating_sub(differing)
        }),
        rows_curve: None,
        profile: StepProfile::of(run, ar),
        per_prompt: run.results.clone(),
    }
}

/// ((1 − α^(k+1)) / (1 − α)) / (1 + k·c_draft/c_target): α pooled over depths, k the mean tree
/// depth, c_draft the drafting time per depth, c_target `ar`'s time per forward. The formula
/// assumes verifying a tree costs one plain forward, true on a GPU and not on a CPU: the gap to
/// the measured speedup is the cost of verifying wide trees on this device.
pub fn predicted_speedup(run: &MethodRun, ar: &MethodRun) -> f64 {
    let k = run.mean_tree_depth();
    if run.steps == 0 || k == 0.0 {
        return 1.0;
    }
    let alpha = run.depths.pooled().min(0.999_999);
    let c_target = ar.seconds_per_step();
    let c_draft = run.draft_seconds / run.steps as f64 / k;
    let expected_tokens = (1.0 - alpha.powf(k + 1.0)) / (1.0 - alpha);
    expected_tokens / (1.0 + k * c_draft / c_target)
}

/// The report as a markdown table.
pub fn markdown(report: &BenchReport) -> String {
    let mut out = format!(
        "### `{}`: τ {:.2}, {:.1} tokens/s{}\n\n",
        report.method,
        report.tau,
        report.tokens_per_s,
        match (report.speedup_vs_ar, report.predicted_speedup) {
            (Some(s), Some(p)) => format!(", {s:.2}× vs ar (formula: {p:.2}×)"),
            _ => String::new(),
        }
    );
    out.push_str("| category | prompts | τ | accepted/step | tokens/s | ar tokens/s | speedup |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---:|\n");
    let rows = report
        .per_category
        .iter()
        .map(|(name, c)| (name.as_str(), c))
        .chain(std::iter::once(("**overall**", &report.overall)));
    for (name, c) in rows {
        out.push_str(&format!(
            "| {name} | {} | {:.2} | {:.2} | {:.1} | {} | {} |\n",
            c.method.prompts,
            c.method.tau,
            c.method.mean_accepted,
            c.method.tokens_per_s,
            c.ar.as_ref()
                .map_or("–".into(), |a| format!("{:.1}", a.tokens_per_s)),
            c.speedup_vs_ar.map_or("–".into(), |s| format!("{s:.2}×")),
        ));
    }
    let rates = |s: &Summary| {
        format!(
            "prefill {:.1} tokens/s, decoding {:.1} tokens/s",
            s.prefill_tokens_per_s, s.decode_tokens_per_s
        )
    };
    out.push_str(&format!(
        "\n{}: {}",
        report.method,
        rates(&report.overall.method)
    ));
    if let Some(ar) = &report.overall.ar {
        out.push_str(&format!("; ar: {}", rates(ar)));
    }
    out.push('\n');
    if let Some(host) = &report.host {
        let decoding = report.overall.ar.as_ref().unwrap_or(&report.overall.method);
        out.push_str(&format!(
            "\n{}",
            host.describe(decoding.decode_tokens_per_s)
        ));
    }
    if !report.per_depth_acceptance.is_empty() {
        let rates: Vec<String> = report
            .per_depth_acceptance
            .iter()
            .enumerate()
            .map(|(d, a)| format!("α{} {a:.3}", d + 1))
            .collect();
        out.push_str(&format!("\nAcceptance per depth: {}\n", rates.join(", ")));
    }
    if let Some(profile) = &report.profile {
        out.push_str(&profile.markdown());
    }
    if let Some(curve) = &report.rows_curve {
        out.push_str(&curve.markdown());
    }
    out
}

/// Prompts (question, turn) whose token ids differ between two runs, and prompts present in
/// only one of them.
pub fn differing_prompts(a: &[PromptResult], b: &[PromptResult]) -> Vec<String> {
    let key = |r: &PromptResult| (r.question_id.clone(), r.turn);
    let b_ids: BTreeMap<_, _> = b.iter().map(|r| (key(r), &r.token_ids)).collect();
    let a_keys: std::collections::BTreeSet<_> = a.iter().map(key).collect();
    let mut out = Vec::new();
    for r in a {
        match b_ids.get(&key(r)) {
            None => out.push(format!(
                "question {} turn {}: only in the first run",
                r.question_id,
                r.turn + 1
            )),
            Some(ids) if **ids != r.token_ids => {
                let first = ids
                    .iter()
                    .zip(&r.token_ids)
                    .take_while(|(x, y)| x == y)
                    .count();
                out.push(format!(
                    "question {} turn {}: outputs differ from token {first}",
                    r.question_id,
                    r.turn + 1
                ))
            }
            Some(_) => {}
        }
    }
    for r in b.iter().filter(|r| !a_keys.contains(&key(r))) {
        out.push(format!(
            "question {} turn {}: only in the second run",
            r.question_id,
            r.turn + 1
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_stats_count_only_depths_the_path_reached() {
        let mut stats = DepthStats::default();
        stats.add(3, 0); // depth 1 tried, rejected
        stats.add(3, 2); // depths 1, 2 accepted, 3 rejected
        stats.add(2, 2); // both accepted
        assert_eq!(stats.reached, vec![3, 2, 1]);
        assert_eq!(stats.accepted, vec![2, 2, 0]);
        assert_eq!(stats.rates(), vec![2.0 / 3.0, 1.0, 0.0]);
        assert!((stats.pooled() - 4.0 / 6.0).abs() < 1e-12);
    }

    fn prompt(question: u32, token_ids: Vec<u32>) -> PromptResult {
        PromptResult {
            question_id: QuestionId::Number(question.into()),
            category: "writing".into(),
            turn: 0,
            prompt_tokens: 3,
            new_tokens: token_ids.len(),
            seconds: 1.0,
            prefill_seconds: 0.1,
            target_forwards: 2,
            accepted_tokens: 0,
            text: String::new(),
            token_ids,
        }
    }

    /// Prefill counts prompt tokens over the prompts' forwards; decoding the tokens after each
    /// prompt's first over the rest of the time.
    #[test]
    fn prefill_and_decoding_rates_split_each_prompts_time() {
        let summary = Summary::of(&[prompt(1, vec![5, 6, 7]), prompt(2, vec![8, 9])]);
        assert!((summary.prefill_tokens_per_s - 6.0 / 0.2).abs() < 1e-9);
        assert!((summary.decode_tokens_per_s - 3.0 / 1.8).abs() < 1e-9);
        assert!((summary.tokens_per_s - 5.0 / 2.0).abs() < 1e-9);
    }

    #[test]
    fn the_report_counts_prompts_identical_to_plain_decoding() {
        let run = |second: Vec<u32>| MethodRun {
            results: vec![prompt(1, vec![5, 6, 7]), prompt(2, second)],
            ..MethodRun::default()
        };
        let (method, ar) = (run(vec![8, 9]), run(vec![8, 4]));
        let compared = report("eagle", serde_json::json!({}), &method, Some(&ar));
        assert_eq!(compared.identical_to_ar, Some(1));
        let alone = report("eagle", serde_json::json!({}), &method, None);
        assert_eq!(alone.identical_to_ar, None);
        let differing = differing_prompts(&method.results, &ar.results);
        assert_eq!(
            differing,
            ["question 2 turn 1: outputs differ from token 1"]
        );
    }

    /// Phases per step in ms; one draft depth is drafting over the mean tree depth, beside
    /// `ar`'s whole step.
    #[test]
    fn the_profile_splits_a_step_and_prices_a_draft_depth() {
        let method = MethodRun {
            draft_seconds: 0.8,
            verify_seconds: 1.0,
            accept_seconds: 0.2,
            steps: 100,
            depth_sum: 400,
            ..MethodRun::default()
        };
        let ar = MethodRun {
            verify_seconds: 0.9,
            accept_seconds: 0.1,
            steps: 200,
            ..MethodRun::default()
        };
        let profile = StepProfile::of(&method, Some(&ar)).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(profile.drafting_ms, 8.0) && close(profile.verification_ms, 10.0));
        assert!(close(profile.acceptance_ms, 2.0) && close(profile.draft_depth_ms, 2.0));
        assert!(close(profile.plain_step_ms.unwrap(), 5.0));
        assert!(close(profile.draft_depth_share.unwrap(), 0.4));
        assert!(profile
            .markdown()
            .contains("= 40.0 % of a plain step (5.00 ms)"));
        assert!(StepProfile::of(&method, None)
            .unwrap()
            .draft_depth_share
            .is_none());
        assert!(StepProfile::of(&MethodRun::default(), Some(&ar)).is_none());
    }

    /// Each step's verification is counted under its tree's rows, the root included.
    #[test]
    fn verifications_are_summed_by_rows() {
        use headway_engine::engine::Step;
        use headway_model::{Generation, StopReason};
        let step = |tree_tokens: usize, verify_seconds: f64| Step {
            emitted: vec![1],
            tree_tokens,
            tree_depth: tree_tokens.min(1),
            draft_seconds: 0.0,
            verify_seconds,
            accept_seconds: 0.0,
        };
        let generation = SpecGeneration {
            generation: Generation {
                tokens: vec![1, 1, 1, 1],
                text: String::new(),
                stop_reason: StopReason::Length,
                prefill_seconds: 0.0,
                seconds: 1.0,
            },
            drafter_prefill_seconds: 0.003,
            steps: vec![step(0, 0.004), step(2, 0.005), step(0, 0.002)],
        };
        let mut run = MethodRun::default();
        run.add(&generation, prompt(1, vec![1, 1, 1, 1]));
        let profile = StepProfile::of(&run, None).unwrap();
        let rows: Vec<(usize, usize)> = profile
            .verification_by_rows
            .iter()
            .map(|v| (v.rows, v.steps))
            .collect();
        assert_eq!(rows, [(1, 2), (3, 1)]);
        assert!(profile
            .markdown()
            .contains("1: 3.00 ms (2 steps), 3: 5.00 ms (1 steps)"));
        // The drafter's pass over the prompt is the prompt's, in no step's drafting.
        assert!((profile.drafter_prefill_ms - 3.0).abs() < 1e-9);
        assert_eq!(profile.drafting_ms, 0.0);
        assert!(profile
            .markdown()
            .contains("the drafter's pass over a prompt 3.00 ms"));
    }
}
