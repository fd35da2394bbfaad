//! Draft trees: the candidate continuations a drafter proposes for one verification step.
//!
//! Nodes hang off a root, the last emitted token, which is not yet in the target's KV cache.
//! Verification feeds `[root, node 0, node 1, …]` in one forward with a tree mask; node `i` sits at
//! position `prefix + depth(i)`, where the root has depth 0 and its children depth 1. Parents
//! precede their children, and siblings are listed in the order acceptance tries them (best
//! first).

use std::rc::Rc;

use headway_model::TreeInput;
use tch::Device;

use crate::error::{EngineError, Result};

/// How a drafted token was chosen: what lossless rejection sampling needs to know about it.
#[derive(Debug, Clone)]
pub enum Proposal {
    /// Chosen deterministically (top-k, n-gram match, argmax): treated as drawn from a one-hot
    /// distribution on itself.
    Deterministic,
    /// Sampled from this draft distribution over the target vocabulary (siblings with the same
    /// distribution are independent draws from it).
    Sampled(Rc<Vec<f32>>),
}

#[derive(Debug, Clone)]
pub struct Node {
    pub token: u32,
    /// Index of the parent node; `None` for children of the root.
    pub parent: Option<usize>,
    pub proposal: Proposal,
}

/// A tree of drafted tokens (possibly empty: plain decoding).
#[derive(Debug, Clone, Default)]
pub struct DraftTree {
    nodes: Vec<Node>,
}

impl DraftTree {
    pub fn new() -> Self {
        Self::default()
    }

    /// A chain: each token the child of the previous one.
    pub fn chain(tokens: &[u32], proposals: impl IntoIterator<Item = Proposal>) -> Self {
        let nodes = tokens
            .iter()
            .zip(proposals)
            .enumerate()
            .map(|(i, (&token, proposal))| Node {
                token,
                parent: i.checked_sub(1),
                proposal,
            })
            .collect();
        Self { nodes }
    }

    /// Appends a node; its parent must already be in the tree.
    pub fn push(&mut self, token: u32, parent: Option<usize>, proposal: Proposal) -> Result<usize> {
        if parent.is_some_and(|p| p >= self.nodes.len()) {
            return Err(EngineError::Invalid {
                field: "tree",
                message: format!(
                    "node {} names parent {parent:?}, which is not in the tree yet",
                    self.nodes.len()
                ),
            });
        }
        self.nodes.push(Node {
            token,
            parent,
            proposal,
        });
        Ok(self.nodes.len() - 1)
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Depth of every node (children of the root: 1).
    pub fn depths(&self) -> Vec<usize> {
        let mut depths: Vec<usize> = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            depths.push(node.parent.map_or(1, |p| depths[p] + 1));
        }
        depths
    }

    pub fn max_depth(&self) -> usize {
        self.depths().into_iter().max().unwrap_or(0)
    }

    /// Children of the root (`None`) or of node `parent`, in order.
    pub fn children(&self, parent: Option<usize>) -> impl Iterator<Item = usize> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(move |(_, n)| n.parent == parent)
            .map(|(i, _)| i)
    }

    /// The first `count` nodes (parents come before their children, so they are a tree): what a
    /// shared row budget leaves a sequence ([`crate::engine::step_sessions`]).
    pub fn first(&self, count: usize) -> Self {
        Self {
            nodes: self.nodes[..count.min(self.nodes.len())].to_vec(),
        }
    }

    /// The nodes at depth `max_depth` or less (what fits before the model's context ends).
    pub fn truncated(&self, max_depth: usize) -> Self {
        let depths = self.depths();
        let mut index = vec![None; self.nodes.len()];
        let mut tree = Self::new();
        for (i, node) in self.nodes.iter().enumerate() {
            if depths[i] <= max_depth {
                let parent = node.parent.and_then(|p| index[p]);
                index[i] = Some(tree.nodes.len());
                tree.nodes.push(Node {
                    parent,
                    ..node.clone()
                });
            }
        }
        tree
    }

    /// Adds `tokens` as a deterministic path from the root, reusing the longest prefix of it that
    /// the tree already holds as deterministic nodes, so that no candidate is verified twice. The
    /// new nodes come after their siblings: acceptance tries them last.
    pub fn graft_chain(&mut self, tokens: &[u32]) {
        let mut parent = None;
        let mut rest = tokens;
        while let Some((&token, tail)) = rest.split_first() {
            let Some(existing) = self.children(parent).find(|&c| {
                let node = &self.nodes[c];
                node.token == token && matches!(node.proposal, Proposal::Deterministic)
            }) else {
                break;
            };
            parent = Some(existing);
            rest = tail;
        }
        for &token in rest {
            self.nodes.push(Node {
                token,
                parent,
                proposal: Proposal::Deterministic,
            });
            parent = Some(self.nodes.len() - 1);
        }
    }

    /// Parents in the verification input's numbering, where the root is entry 0 and node `i` is
    /// entry `i + 1`.
    pub fn verification_parents(&self) -> Vec<Option<usize>> {
        std::iter::once(None)
            .chain(
                self.nodes
                    .iter()
                    .map(|n| Some(n.parent.map_or(0, |p| p + 1))),
            )
            .collect()
    }

    /// The target's input that verifies this tree after `past` cached tokens: `[root, node 0,
    /// node 1, …]` with depth positions and the ancestor mask; without nodes, the root alone as
    /// plain decoding runs it (no mask).
    pub fn verification_input(&self, root: u32, past: usize, device: Device) -> Result<TreeInput> {
        let tokens: Vec<u32> = std::iter::once(root)
            .chain(self.nodes.iter().map(|n| n.token))
            .collect();
        if self.is_empty() {
            return Ok(TreeInput::causal(past, &tokens, device));
        }
        Ok(TreeInput::tree(
            past,
            &tokens,
            &self.verification_parents(),
            device,
        )?)
    }
}

/// Medusa-style static tree: each path is a list of ranks, `[r0, r1, …]` meaning head 0's
/// `r0`-th guess followed by head 1's `r1`-th guess, and so on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeChoices {
    paths: Vec<Vec<usize>>,
}

impl TreeChoices {
    /// Sorts the paths (parents before children, siblings by rank) and checks that every prefix of
    /// every path is itself a path.
    pub fn new(mut paths: Vec<Vec<usize>>) -> Result<Self> {
        paths.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        paths.dedup();
        for path in &paths {
            if path.is_empty() {
                return Err(EngineError::Invalid {
                    field: "tree",
                    message: "a path is empty".into(),
                });
            }
            let parent = &path[..path.len() - 1];
            if !parent.is_empty() && paths.binary_search_by(|p| cmp_paths(p, parent)).is_err() {
                return Err(EngineError::Invalid {
                    field: "tree",
                    message: format!("path {path:?} has no parent path {parent:?}"),
                });
            }
        }
        Ok(Self { paths })
    }

    /// Reads a JSON list of paths (the Medusa repository's `mc_sim_7b_63` format).
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| EngineError::file(path, e))?;
        let paths: Vec<Vec<usize>> = serde_json::from_str(&text).map_err(|e| {
            EngineError::file(
                path,
                format!("not a JSON list of rank paths ([[0], [0, 1]]): {e}"),
            )
        })?;
        Self::new(paths).map_err(|e| EngineError::file(path, e))
    }

    /// A chain of `depth` top-1 guesses.
    pub fn chain(depth: usize) -> Self {
        Self {
            paths: (1..=depth).map(|d| vec![0; d]).collect(),
        }
    }

    /// The `size` paths of highest expected acceptance when head `d` ranks the target's token at
    /// rank `r` with probability `accuracy[d][r]` (Medusa's greedy construction: a path's value is
    /// the product of its ranks' accuracies, and adding the best available child of the tree
    /// maximises expected accepted length).
    pub fn from_accuracies(accuracy: &[Vec<f64>], size: usize) -> Self {
        let mut paths: Vec<(Vec<usize>, f64)> = Vec::new();
        let mut frontier: Vec<(Vec<usize>, f64)> = accuracy
            .first()
            .map(|ranks| {
                ranks
                    .iter()
                    .enumerate()
                    .map(|(r, &a)| (vec![r], a))
                    .collect()
            })
            .unwrap_or_default();
        while paths.len() < size {
            let Some(best) = (0..frontier.len())
                .max_by(|&a, &b| frontier[a].1.total_cmp(&frontier[b].1).then(b.cmp(&a)))
            else {
                break;
            };
            let (path, value) = frontier.swap_remove(best);
            if let Some(ranks) = accuracy.get(path.len()) {
                for (r, &a) in ranks.iter().enumerate() {
                    let mut child = path.clone();
                    child.push(r);
                    frontier.push((child, value * a));
                }
            }
            paths.push((path, value));
        }
        Self::new(paths.into_iter().map(|(p, _)| p).collect())
            .expect("greedy expansion adds a path only after its parent")
    }

    pub fn paths(&self) -> &[Vec<usize>] {
        &self.paths
    }

    pub fn depth(&self) -> usize {
        self.paths.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Highest rank used at each depth, plus one (how many guesses each head must supply).
    pub fn ranks_per_depth(&self) -> Vec<usize> {
        let mut ranks = vec![0; self.depth()];
        for path in &self.paths {
            for (d, &r) in path.iter().enumerate() {
                ranks[d] = ranks[d].max(r + 1);
            }
        }
        ranks
    }

    /// The tree for `guesses[d]` = head d's candidates, best first.
    pub fn build(&self, guesses: &[Vec<u32>]) -> DraftTree {
        let mut tree = DraftTree::new();
        for path in &self.paths {
            let parent = (path.len() > 1).then(|| {
                let prefix = &path[..path.len() - 1];
                self.paths
                    .binary_search_by(|p| cmp_paths(p, prefix))
                    .expect("checked in new")
            });
            let token = guesses[path.len() - 1][*path.last().expect("paths are not empty")];
            tree.push(token, parent, Proposal::Deterministic)
                .expect("paths are sorted parents first");
        }
        tree
    }
}

fn cmp_paths(a: &[usize], b: &[usize]) -> std::cmp::Ordering {
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verification_parents_shift_by_the_root() {
        let mut tree = DraftTree::new();
        tree.push(5, None, Proposal::Deterministic).unwrap();
        tree.push(6, None, Proposal::Deterministic).unwrap();
        tree.push(7, Some(0), Proposal::Deterministic).unwrap();
        assert_eq!(
            tree.verification_parents(),
            vec![None, Some(0), Some(0), Some(1)]
        );
        assert_eq!(tree.depths(), vec![1, 1, 2]);
        assert_eq!(tree.children(None).collect::<Vec<_>>(), vec![0, 1]);
        assert!(tree.push(1, Some(9), Proposal::Deterministic).is_err());
        let shallow = tree.truncated(1);
        assert_eq!(shallow.len(), 2);
        assert_eq!(tree.truncated(0).len(), 0);
    }

    #[test]
    fn a_grafted_chain_shares_the_deterministic_prefix_already_in_the_tree() {
        let mut tree = DraftTree::new();
        tree.push(5, None, Proposal::Deterministic).unwrap();
        tree.push(6, None, Proposal::Deterministic).unwrap();
        tree.push(7, Some(0), Proposal::Deterministic).unwrap();
        tree.push(8, None, Proposal::Sampled(Rc::new(vec![0.5; 9])))
            .unwrap();
        // 5 → 7 is in the tree; 9 → 4 goes under node 2.
        tree.graft_chain(&[5, 7, 9, 4]);
        let shape: Vec<(u32, Option<usize>)> =
            tree.nodes().iter().map(|n| (n.token, n.parent)).collect();
        assert_eq!(
            shape,
            vec![
                (5, None),
                (6, None),
                (7, Some(0)),
                (8, None),
                (9, Some(2)),
                (4, Some(4))
            ]
        );
        // A sampled node is a draw, not a claim: a chain through its token gets its own node,
        // tried after it.
        tree.graft_chain(&[8]);
        assert_eq!(tree.children(None).collect::<Vec<_>>(), vec![0, 1, 3, 6]);
        let before = tree.len();
        tree.graft_chain(&[5, 7]);
        tree.graft_chain(&[]);
        assert_eq!(tree.len(), before);
    }

    #[test]
    fn choices_need_their_parents_and_build_in_order() {
        assert!(TreeChoices::new(vec![vec![0, 1]]).is_err());
        let choices = TreeChoices::new(vec![vec![1], vec![0, 0], vec![0]]).unwrap();
        assert_eq!(choices.paths(), &[vec![0], vec![1], vec![0, 0]]);
        assert_eq!(choices.ranks_per_depth(), vec![2, 1]);
        let tree = choices.build(&[vec![10, 11], vec![20]]);
        let tokens: Vec<u32> = tree.nodes().iter().map(|n| n.token).collect();
        assert_eq!(tokens, vec![10, 11, 20]);
        assert_eq!(tree.nodes()[2].parent, Some(0));
    }

    #[test]
    fn accuracies_grow_the_most_likely_paths_first() {
        let accuracy = vec![vec![0.6, 0.2], vec![0.5, 0.1]];
        let choices = TreeChoices::from_accuracies(&accuracy, 3);
        // [0] 0.6, then [0, 0] 0.3, then [1] 0.2 beats [0, 1] 0.06.
        assert_eq!(choices.paths(), &[vec![0], vec![1], vec![0, 0]]);
        assert_eq!(TreeChoices::chain(3).depth(), 3);
    }
}
