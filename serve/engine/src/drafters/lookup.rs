//! Prompt lookup decoding: no model, the draft is what followed the latest earlier occurrence of
//! the context's last n-gram (summaries, code edits and retrieval answers repeat their input).

use headway_model::Sampler;

use super::{Drafter, Verified};
use crate::error::Result;
use crate::tree::{DraftTree, Proposal};

/// The longest n-gram a proposal matches.
pub const LONGEST_MATCH: usize = 3;

#[derive(Debug, Clone, Copy)]
pub struct LookupDrafter {
    /// Most tokens proposed per step (a chain).
    pub num_tokens: usize,
    /// Most tokens proposed after a match of `n` tokens, at index `n − 1`; 0 proposes none.
    /// By default `2n − 1`: a lone repeated token predicts little (on Spec-Bench a unigram
    /// match's first token was right about a quarter of the time), and on a CPU every proposed
    /// token costs verification compute, while one extra token is nearly free.
    /// `--tree-tokens auto` measures them on the host ([`crate::autotune::tune_lookup`]).
    pub after_match: [usize; LONGEST_MATCH],
}

impl Default for LookupDrafter {
    fn default() -> Self {
        Self {
            num_tokens: 6,
            after_match: std::array::from_fn(|i| 2 * (i + 1) - 1),
        }
    }
}

/// The latest earlier occurrence of a context's longest matching suffix n-gram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Match {
    /// Tokens matched: `1..=LONGEST_MATCH`.
    pub length: usize,
    /// Where the tokens after the occurrence start in the context.
    pub after: usize,
}

impl LookupDrafter {
    /// The tokens after the latest earlier match of the longest matching suffix n-gram, as many
    /// as [`Self::after_match`] allows for its length (and [`Self::num_tokens`]).
    pub fn propose(&self, context: &[u32]) -> Vec<u32> {
        longest_match(context).map_or_else(Vec::new, |found| self.tokens_after(context, found))
    }

    /// What this drafter proposes after `found`, a match in `context`.
    pub fn tokens_after(&self, context: &[u32], found: Match) -> Vec<u32> {
        let most = self.num_tokens.min(self.after_match[found.length - 1]);
        context[found.after..(found.after + most).min(context.len())].to_vec()
    }
}

/// The latest earlier occurrence of `context`'s longest suffix n-gram (up to
/// [`LONGEST_MATCH`] tokens) that leaves at least one token after it.
pub fn longest_match(context: &[u32]) -> Option<Match> {
    (1..=LONGEST_MATCH).rev().find_map(|n| {
        let suffix = context.get(context.len().checked_sub(n)?..)?;
        let start = (0..context.len() - n)
            .rev()
            .find(|&start| &context[start..start + n] == suffix)?;
        Some(Match {
            length: n,
            after: start + n,
        })
    })
}

impl Drafter for LookupDrafter {
    fn draft(&mut self, verified: &Verified, _: &mut Sampler) -> Result<DraftTree> {
        let tokens = self.propose(verified.context);
        Ok(DraftTree::chain(
            &tokens,
            std::iter::repeat(Proposal::Deterministic),
        ))
    }

    fn max_tree_tokens(&self) -> usize {
        self.num_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_longest_match() {
        let drafter = LookupDrafter {
            num_tokens: 3,
            ..Default::default()
        };
        // Suffix [1, 2] last occurred at 3..5, followed by 9, 9, 1 (no trigram matches).
        assert_eq!(drafter.propose(&[1, 2, 7, 1, 2, 9, 9, 1, 2]), vec![9, 9, 1]);
        // No bigram match: fall back to the unigram 5, last seen before 6; one token only.
        assert_eq!(drafter.propose(&[5, 6, 4, 5]), vec![6]);
        assert!(drafter.propose(&[1, 2, 3]).is_empty());
        assert!(drafter.propose(&[]).is_empty());
        assert_eq!(
            longest_match(&[1, 2, 3, 1, 2, 3]),
            Some(Match {
                length: 3,
                after: 3
            })
        );
    }

    /// A length's cap applies to its matches alone: a unigram match proposes nothing at 0,
    /// while a bigram match still proposes its tokens.
    #[test]
    fn each_match_length_has_its_own_cap() {
        let drafter = LookupDrafter {
            num_tokens: 6,
            after_match: [0, 2, 5],
        };
        assert!(drafter.propose(&[5, 6, 4, 5]).is_empty());
        assert_eq!(drafter.propose(&[1, 2, 7, 1, 2, 9, 9, 1, 2]), vec![9, 9]);
    }
}
