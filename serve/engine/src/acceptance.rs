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

    fn sampler(seed: u64) -> Sampler {
        Sampler::new(SamplingParams::new(1.0, 0, 1.0, 0.0, seed).unwrap())
    }

    fn random_distribution(rng: &mut StdRng, n: usize, zeros: usize) -> Vec<f32> {
        let mut p: Vec<f32> = (0..n).map(|_| rng.random::<f32>().powi(2)).collect();
        for i in 0..zeros {
            p[(i * 3) % n] = 0.0;
        }
        let total: f32 = p.iter().sum();
        p.iter().map(|x| x / total).collect()
    }

    /// Pearson's chi-square statistic of `counts` against `expected` probabilities.
    fn chi_square(counts: &[usize], expected: &[f32]) -> f64 {
        let n: usize = counts.iter().sum();
        counts
            .iter()
            .zip(expected)
            .filter(|(_, &e)| e > 0.0)
            .map(|(&c, &e)| {
                let e = e as f64 * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// An acceptance rule under test: [`choose_candidate`] or a deliberately wrong one.
    type Rule = fn(&mut [f32], &[(u32, &Proposal)], &mut Sampler) -> Option<usize>;

    /// One emission: candidates drawn by `draft`, accepted or the residual sampled.
    fn emit(q: &[f32], candidates: &[(u32, Proposal)], sampler: &mut Sampler, choose: Rule) -> u32 {
        let mut residual = q.to_vec();
        let refs: Vec<(u32, &Proposal)> = candidates.iter().map(|(t, p)| (*t, p)).collect();
        match choose(&mut residual, &refs, sampler) {
            Some(i) => candidates[i].0,
            None => sampler.sample_slice(&residual),
        }
    }

    /// Emitted-token frequencies over `trials` against `q`, with `k` candidates per trial drawn
    /// either i.i.d. from a random draft `p` (sampled) or as `p`'s top-k (deterministic).
    fn chi_square_of_rule(seed: u64, sampled: bool, choose: Rule) -> f64 {
        let n = 8;
        let mut rng = StdRng::seed_from_u64(seed);
        let q = random_distribution(&mut rng, n, 1);
        let p = Rc::new(random_distribution(&mut rng, n, 2));
        let mut sampler = sampler(seed);
        let mut counts = vec![0usize; n];
        let trials = 40_000;
        for _ in 0..trials {
            let candidates: Vec<(u32, Proposal)> = if sampled {
                (0..3)
                    .map(|_| (sampler.sample_slice(&p), Proposal::Sampled(p.clone())))
                    .collect()
            } else {
                let mut order: Vec<u32> = (0..n as u32).collect();
                order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
                order
                    .into_iter()
                    .take(3)
                    .map(|t| (t, Proposal::Deterministic))
                    .collect()
            };
            counts[emit(&q, &candidates, &mut sampler, choose) as usize] += 1;
        }
        chi_square(&counts, &q)
    }

    // Chi-square with 6 degrees of freedom (8 tokens, one with q = 0): the 0.999 quantile is 22.5.
    const CRITICAL: f64 = 22.5;

    #[test]
    fn multi_candidate_rejection_sampling_emits_the_target_distribution() {
        for seed in 0..4 {
            for sampled in [true, false] {
                let stat = chi_square_of_rule(seed, sampled, choose_candidate);
                assert!(
                    stat < CRITICAL,
                    "seed {seed} sampled {sampled}: chi2 {stat}"
                );
            }
        }
    }

    /// A plausible mistake: on rejection keep trying the next candidate against the unchanged q.
    fn without_residual(
        q: &mut [f32],
        candidates: &[(u32, &Proposal)],
        sampler: &mut Sampler,
    ) -> Option<usize> {
        for (i, &(token, proposal)) in candidates.iter().enumerate() {
            let p_x = match proposal {
                Proposal::Deterministic => 1.0,
                Proposal::Sampled(p) => p[token as usize],
            };
            if sampler.uniform() < f64::from((q[token as usize] / p_x).min(1.0)) {
                return Some(i);
            }
        }
        None
    }

    #[test]
    fn forgetting_the_residual_is_caught_by_the_same_test() {
        for sampled in [true, false] {
            let stat = chi_square_of_rule(1, sampled, without_residual);
            assert!(stat > CRITICAL * 4.0, "sampled {sampled}: chi2 {stat}");
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
