//! Which drafted tokens the target accepts, keeping its output distribution exact.
//!
//! Verification gives the target's logits at the root and at every tree node. Acceptance walks
//! down from the root:
//! - greedy: go to the child whose token is the target's argmax; stop when there is none. The
//!   target's argmax at the last accepted node is the bonus token.
//! - sampling: multi-candidate rejection sampling (SpecInfer). With `q` the target's distribution
//!   at the current node, try the children in order: a child `x` drafted from `p` is accepted with
//!   probability `min(1, q(x)/p(x))`; on rejection `q ← norm(max(0, q − p))` and the next child is
//!   tried against that residual. A deterministic child (`p` one-hot on `x`) is accepted with
//!   probability `q(x)`, and its residual is `q` with `x` zeroed. When no child is accepted the
//!   bonus token is drawn from the residual. Each step emits exactly the target's distribution,
//!   because `min(p, q) + max(0, q − p) = q` at every try.
//! - typical acceptance (Medusa's, opt-in and LOSSY): accept the first child whose target
//!   probability exceeds `min(threshold, alpha · exp(−entropy(q)))`; the bonus token is sampled
//!   from `q`. Faster at high temperature, but the output no longer follows the target's
//!   distribution.

use headway_model::Sampler;

use crate::tree::{DraftTree, Proposal};

/// The accepted root-to-node path (tree node indices, depth order) and the target's own next
/// token after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Accepted {
    pub path: Vec<usize>,
    pub bonus: u32,
}

/// Greedy acceptance; `argmax[e]` is the target's argmax at verification entry `e` (entry 0 is
/// the root, entry `i + 1` is node `i`).
pub fn accept_greedy(tree: &DraftTree, argmax: &[u32]) -> Accepted {
    let mut path = Vec::new();
    let mut entry = 0;
    loop {
        let parent = path.last().copied();
        let wanted = argmax[entry];
        match tree
            .children(parent)
            .find(|&c| tree.nodes()[c].token == wanted)
        {
            Some(child) => {
                path.push(child);
                entry = child + 1;
            }
            None => {
                return Accepted {
                    path,
                    bonus: wanted,
                }
            }
        }
    }
}

/// Lossless acceptance under sampling. `target_distribution(e)` is the target's sampling
/// distribution (temperature, top-k, top-p applied) at verification entry `e`; it is only asked
/// for the entries the walk reaches.
pub fn accept_sampled(
    tree: &DraftTree,
    target_distribution: &mut dyn FnMut(usize) -> Vec<f32>,
    sampler: &mut Sampler,
) -> Accepted {
    let mut path = Vec::new();
    let mut entry = 0;
    loop {
        let parent = path.last().copied();
        let mut q = target_distribution(entry);
        let children: Vec<usize> = tree.children(parent).collect();
        let candidates: Vec<(u32, &Proposal)> = children
            .iter()
            .map(|&c| (tree.nodes()[c].token, &tree.nodes()[c].proposal))
            .collect();
        match choose_candidate(&mut q, &candidates, sampler) {
            Some(i) => {
                path.push(children[i]);
                entry = children[i] + 1;
            }
            None => {
                let bonus = sampler.sample_slice(&q);
                return Accepted { path, bonus };
            }
        }
    }
}

/// How drafted tokens are accepted under sampling.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Acceptance {
    /// Rejection sampling: the output has exactly the target's distribution.
    Lossless,
    /// Medusa's typical acceptance. Lossy: the output distribution changes.
    Typical { threshold: f64, alpha: f64 },
}

/// Typical acceptance (lossy, see the module notes).
pub fn accept_typical(
    tree: &DraftTree,
    target_distribution: &mut dyn FnMut(usize) -> Vec<f32>,
    sampler: &mut Sampler,
    threshold: f64,
    alpha: f64,
) -> Accepted {
    let mut path = Vec::new();
    let mut entry = 0;
    loop {
        let q = target_distribution(entry);
        let entropy: f64 = q
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| -f64::from(p) * f64::from(p).ln())
            .sum();
        let cut = threshold.min(alpha * (-entropy).exp());
        let parent = path.last().copied();
        match tree
            .children(parent)
            .find(|&c| f64::from(q[tree.nodes()[c].token as usize]) > cut)
        {
            Some(child) => {
                path.push(child);
                entry = child + 1;
            }
            None => {
                let bonus = sampler.sample_slice(&q);
                return Accepted { path, bonus };
            }
        }
    }
}

/// Tries `candidates` in order against `q`; returns the index of the accepted one, or `None`
/// with `q` replaced by the residual distribution to draw the bonus token from.
pub fn choose_candidate(
    q: &mut [f32],
    candidates: &[(u32, &Proposal)],
    sampler: &mut Sampler,
) -> Option<usize> {
    for (i, &(token, proposal)) in candidates.iter().enumerate() {
        let x = token as usize;
        let total: f32 = q.iter().sum();
        if total <= 0.0 {
            // Only possible through rounding after q was exhausted; nothing more can be accepted.
            return None;
        }
        let q_x = q[x] / total;
        let p_x = match proposal {
            Proposal::Deterministic => 1.0,
            Proposal::Sampled(p) => p[x],
        };
        if p_x > 0.0 && sampler.uniform() < f64::from((q_x / p_x).min(1.0)) {
            return Some(i);
        }
        match proposal {
            Proposal::Deterministic => q[x] = 0.0,
            Proposal::Sampled(p) => subtract_draft(q, total, p),
        }
    }
    None
}

/// `q ← max(0, q/total − p)` (unnormalised; draws and ratios normalise). If that leaves nothing,
/// `q` equalled `p`, a rejection was a rounding artefact, and `q` is kept.
fn subtract_draft(q: &mut [f32], total: f32, p: &[f32]) {
    let residual: Vec<f32> = q
        .iter()
        .zip(p)
        .map(|(&q, &p)| (q / total - p).max(0.0))
        .collect();
    if residual.iter().sum::<f32>() > 0.0 {
        q.copy_from_slice(&residual);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headway_model::SamplingParams;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::rc::Rc;
    use tch::Tensor;

    /// An acceptance rule under test: [`choose_candidate`] or a deliberately wrong one.
    type Rule = fn(&mut [f32], &[(u32, &Proposal)], &mut Sampler) -> Option<usize>;

    /// How one emission's candidates are drafted from the draft distribution `p`.
    #[derive(Debug, Clone, Copy)]
    enum Drafting {
        /// Three i.i.d. draws from `p` (sampled siblings).
        Sampled,
        /// `p`'s top three, deterministic (an EAGLE/Medusa top-k level).
        TopThree,
        /// Two draws from `p`, then `p`'s top token deterministic (sampled children, then a
        /// prompt-lookup candidate).
        SampledThenTop,
    }

    /// A target distribution `q` and a draft distribution `p` over the same ids.
    struct Case {
        name: &'static str,
        q: Vec<f32>,
        p: Rc<Vec<f32>>,
    }

    fn uniform_logits(rng: &mut StdRng, n: usize, spread: f32) -> Vec<f32> {
        (0..n)
            .map(|_| spread * (rng.random::<f32>() - 0.5))
            .collect()
    }

    fn distribution(params: SamplingParams, logits: &[f32]) -> Vec<f32> {
        Vec::<f32>::try_from(params.distribution(&Tensor::from_slice(logits))).unwrap()
    }

    /// The cases each rule meets, drawn with `seed`; each has draft mass where the target has
    /// none (what truncating each side by its own top-k/top-p creates).
    fn cases(seed: u64) -> Vec<Case> {
        let mut rng = StdRng::seed_from_u64(seed);
        // Unrelated distributions: the target truncated to 7 of 10 ids, the draft over all 10.
        let mut q: Vec<f32> = (0..10).map(|_| rng.random::<f32>().powi(2)).collect();
        for i in [1, 4, 8] {
            q[i] = 0.0;
        }
        let q_total: f32 = q.iter().sum();
        let q = q.iter().map(|x| x / q_total).collect();
        let untruncated = SamplingParams::new(1.0, 0, 1.0, 0.0, 0).unwrap();
        let p = Rc::new(distribution(
            untruncated,
            &uniform_logits(&mut rng, 10, 4.0),
        ));
        // A perturbed copy under temperature 0.7 and top-p 0.9: most candidates have q > 0,
        // and the nuclei differ at their edges.
        let nucleus = SamplingParams::new(0.7, 0, 0.9, 0.0, 0).unwrap();
        let logits = uniform_logits(&mut rng, 16, 6.0);
        let noise = uniform_logits(&mut rng, 16, 0.8);
        let perturbed: Vec<f32> = logits.iter().zip(&noise).map(|(l, e)| l + e).collect();
        // Top-k 5 at temperature 1.3 on both sides, from different logits.
        let top_five = SamplingParams::new(1.3, 5, 1.0, 0.0, 0).unwrap();
        vec![
            Case {
                name: "unrelated",
                q,
                p,
            },
            Case {
                name: "perturbed copy, T 0.7, top-p 0.9",
                q: distribution(nucleus, &logits),
                p: Rc::new(distribution(nucleus, &perturbed)),
            },
            Case {
                name: "top-k 5, T 1.3",
                q: distribution(top_five, &uniform_logits(&mut rng, 12, 4.0)),
                p: Rc::new(distribution(top_five, &uniform_logits(&mut rng, 12, 4.0))),
            },
        ]
    }

    fn candidates(case: &Case, drafting: Drafting, sampler: &mut Sampler) -> Vec<(u32, Proposal)> {
        let p = &case.p;
        let mut order: Vec<u32> = (0..p.len() as u32).collect();
        order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
        let sampled =
            |sampler: &mut Sampler| (sampler.sample_slice(p), Proposal::Sampled(p.clone()));
        match drafting {
            Drafting::Sampled => (0..3).map(|_| sampled(sampler)).collect(),
            Drafting::TopThree => order[..3]
                .iter()
                .map(|&t| (t, Proposal::Deterministic))
                .collect(),
            Drafting::SampledThenTop => vec![
                sampled(sampler),
                sampled(sampler),
                (order[0], Proposal::Deterministic),
            ],
        }
    }

    /// What [`emissions`] saw: tokens emitted per id, and how often the first candidate was
    /// accepted.
    struct Emissions {
        counts: Vec<usize>,
        first_accepted: usize,
    }

    const TRIALS: usize = 40_000;

    /// `TRIALS` emissions: candidates drafted, accepted by `choose` or the residual sampled.
    fn emissions(case: &Case, drafting: Drafting, choose: Rule, seed: u64) -> Emissions {
        let mut sampler = Sampler::new(SamplingParams::new(1.0, 0, 1.0, 0.0, seed).unwrap());
        let mut seen = Emissions {
            counts: vec![0; case.q.len()],
            first_accepted: 0,
        };
        for _ in 0..TRIALS {
            let candidates = candidates(case, drafting, &mut sampler);
            let refs: Vec<(u32, &Proposal)> = candidates.iter().map(|(t, p)| (*t, p)).collect();
            let mut residual = case.q.clone();
            let token = match choose(&mut residual, &refs, &mut sampler) {
                Some(i) => {
                    seen.first_accepted += usize::from(i == 0);
                    candidates[i].0
                }
                None => sampler.sample_slice(&residual),
            };
            seen.counts[token as usize] += 1;
        }
        seen
    }

    /// Why `choose` fails to emit `case.q` under `drafting`, or `None`: a token the target gives
    /// no mass was emitted, Pearson's chi-square over the target's support is past its 0.9999
    /// quantile, or the first candidate was accepted at a rate more than 4.5 standard deviations
    /// from `Σ min(p, q)` (sampled drafts) or `q(x)` (a deterministic `x`).
    fn fault(case: &Case, drafting: Drafting, choose: Rule, seed: u64) -> Option<String> {
        let seen = emissions(case, drafting, choose, seed);
        let q = &case.q;
        let leaked: usize = (0..q.len())
            .filter(|&x| q[x] == 0.0)
            .map(|x| seen.counts[x])
            .sum();
        if leaked > 0 {
            return Some(format!("{leaked} emissions where the target has no mass"));
        }
        let (stat, critical) = chi_square(&seen.counts, q);
        if stat > critical {
            return Some(format!("chi2 {stat:.1} > {critical:.1}"));
        }
        let p = &case.p;
        let expected = match drafting {
            Drafting::TopThree => {
                let top = (0..p.len()).max_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap();
                f64::from(q[top])
            }
            _ => q
                .iter()
                .zip(p.iter())
                .map(|(&q, &p)| f64::from(q.min(p)))
                .sum(),
        };
        let sigma = (expected * (1.0 - expected) / TRIALS as f64).sqrt();
        let rate = seen.first_accepted as f64 / TRIALS as f64;
        if (rate - expected).abs() > 4.5 * sigma.max(1e-4) {
            return Some(format!(
                "first candidate accepted at {rate:.4}, not {expected:.4}"
            ));
        }
        None
    }

    /// Pearson's chi-square of `counts` against `expected` over the cells with expected mass,
    /// with the 0.9999 quantile (Wilson–Hilferty, z = 3.719) for its degrees of freedom.
    fn chi_square(counts: &[usize], expected: &[f32]) -> (f64, f64) {
        let n: usize = counts.iter().sum();
        let support: Vec<(usize, f64)> = counts
            .iter()
            .zip(expected)
            .filter(|(_, &e)| e > 0.0)
            .map(|(&c, &e)| (c, f64::from(e) * n as f64))
            .collect();
        let stat = support
            .iter()
            .map(|&(c, e)| (c as f64 - e).powi(2) / e)
            .sum();
        let df = (support.len() - 1) as f64;
        let h = 2.0 / (9.0 * df);
        (stat, df * (1.0 - h + 3.719 * h.sqrt()).powi(3))
    }

    const DRAFTINGS: [Drafting; 3] = [
        Drafting::Sampled,
        Drafting::TopThree,
        Drafting::SampledThenTop,
    ];
    const SEEDS: std::ops::Range<u64> = 0..3;

    /// Every (case, drafting, seed) `choose` fails on.
    fn faults(choose: Rule) -> Vec<String> {
        let mut found = Vec::new();
        for seed in SEEDS {
            for case in cases(seed) {
                for drafting in DRAFTINGS {
                    if let Some(why) = fault(&case, drafting, choose, seed) {
                        found.push(format!("seed {seed}, {}, {drafting:?}: {why}", case.name));
                    }
                }
            }
        }
        found
    }

    #[test]
    fn multi_candidate_rejection_sampling_emits_the_target_distribution() {
        assert_eq!(faults(choose_candidate), Vec::<String>::new());
        // The perturbed copy exercises the q/p ratio: most first candidates are accepted.
        let case = &cases(0)[1];
        let seen = emissions(case, Drafting::Sampled, choose_candidate, 0);
        assert!(
            seen.first_accepted > TRIALS * 3 / 4,
            "{}",
            seen.first_accepted
        );
    }

    /// Candidates tried one at a time through [`choose_candidate`]; a rejected one's residual is
    /// kept only where `keep_residual` says.
    fn one_at_a_time(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
        keep_residual: fn(&Proposal) -> bool,
    ) -> Option<usize> {
        for (i, &candidate) in candidates.iter().enumerate() {
            let mut residual = q.to_vec();
            if choose_candidate(&mut residual, &[candidate], sampler).is_some() {
                return Some(i);
            }
            if keep_residual(candidate.1) {
                q.copy_from_slice(&residual);
            }
        }
        None
    }

    /// Wrong: each candidate tried against the unchanged target distribution.
    fn without_residual(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
    ) -> Option<usize> {
        one_at_a_time(q, candidates, sampler, |_| false)
    }

    /// Wrong: a rejected deterministic sibling's token is not zeroed before the next try.
    fn deterministic_sibling_kept(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
    ) -> Option<usize> {
        one_at_a_time(q, candidates, sampler, |proposal| {
            matches!(proposal, Proposal::Sampled(_))
        })
    }

    /// Wrong: after a rejection the ratio reads the residual `max(0, q − p)` unnormalised.
    fn residual_not_renormalised(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
    ) -> Option<usize> {
        for (i, &(token, proposal)) in candidates.iter().enumerate() {
            let x = token as usize;
            let total: f32 = q.iter().sum();
            let p_x = match proposal {
                Proposal::Deterministic => 1.0,
                Proposal::Sampled(p) => p[x],
            };
            if p_x > 0.0 && sampler.uniform() < f64::from(q[x] / p_x) {
                return Some(i);
            }
            match proposal {
                Proposal::Deterministic => q[x] = 0.0,
                Proposal::Sampled(p) => subtract_draft(q, total, p),
            }
        }
        None
    }

    /// Wrong: a sampled candidate accepted with probability `q(x)`, the one-hot rule.
    fn sampled_as_deterministic(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
    ) -> Option<usize> {
        let one_hot: Vec<(u32, &Proposal)> = candidates
            .iter()
            .map(|&(token, _)| (token, &Proposal::Deterministic))
            .collect();
        choose_candidate(q, &one_hot, sampler)
    }

    /// Wrong: the bonus drawn from a residual smoothed with 1% uniform mass.
    fn smoothed_bonus(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
    ) -> Option<usize> {
        let chosen = choose_candidate(q, candidates, sampler);
        let total: f32 = q.iter().sum();
        let leak = 0.01 * total / q.len() as f32;
        q.iter_mut().for_each(|x| *x = 0.99 * *x + leak);
        chosen
    }

    /// Each wrong rule is caught. (Accepting when `u < q/p` without the `min(1, ·)` is not among
    /// them: for `u` in [0, 1) it is the same event.)
    #[test]
    fn wrong_acceptance_rules_are_caught() {
        let wrong: [(&str, Rule); 5] = [
            ("without residual", without_residual),
            ("deterministic sibling kept", deterministic_sibling_kept),
            ("residual not renormalised", residual_not_renormalised),
            ("sampled as deterministic", sampled_as_deterministic),
            ("smoothed bonus", smoothed_bonus),
        ];
        for (name, rule) in wrong {
            assert!(!faults(rule).is_empty(), "{name} passed as exact");
        }
    }

    #[test]
    fn greedy_follows_the_argmax_and_ends_with_the_bonus() {
        let mut tree = DraftTree::new();
        tree.push(5, None, Proposal::Deterministic).unwrap(); // node 0
        tree.push(6, None, Proposal::Deterministic).unwrap(); // node 1
        tree.push(7, Some(1), Proposal::Deterministic).unwrap(); // node 2
        tree.push(8, Some(2), Proposal::Deterministic).unwrap(); // node 3
                                                                 // Root's argmax is 6 (node 1), node 1's is 7 (node 2), node 2's is 9: not drafted.
        let argmax = [6, 0, 7, 9, 0];
        assert_eq!(
            accept_greedy(&tree, &argmax),
            Accepted {
                path: vec![1, 2],
                bonus: 9
            }
        );
        assert_eq!(accept_greedy(&DraftTree::new(), &[4]).bonus, 4);
    }
}
