//! Prompt lookup decoding: no model, the draft is what followed the latest earlier occurrence of
//! the context's last n-gram (summaries, code edits and retrieval answers repeat their input).

use headway_model::Sampler;

use super::{Drafter, Verified};
use crate::error::Result;
use crate::tree::{DraftTree, Proposal};

#[derive(Debug, Clone, Copy)]
pub struct LookupDrafter {
    /// Longest n-gram tried first, down to `min_ngram`.
    pub max_ngram: usize,
    pub min_ngram: usize,
    /// Most tokens proposed per step (a chain). A match of `n` tokens proposes at most `2n − 1`:
    /// a lone repeated token predicts little (on Spec-Bench a unigram match's first token was
    /// right about a quarter of the time), and on a CPU every proposed token costs verification
    /// compute, while one extra token is nearly free.
    pub num_tokens: usize,
}

impl Default for LookupDrafter {
    fn default() -> Self {
        Self {
            max_ngram: 3,
            min_ngram: 1,
            num_tokens: 6,
        }
    }
}

impl LookupDrafter {
    /// The tokens after the latest earlier match of the longest matching suffix n-gram.
    pub fn propose(&self, context: &[u32]) -> Vec<u32> {
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if context.len() <= n {
                continue;
            }
            let suffix = &context[context.len() - n..];
            // Latest start first; the match must leave at least one token after it.
            let found = (0..context.len() - n)
                .rev()
                .find(|&start| &context[start..start + n] == suffix);
            if let Some(start) = found {
                let after = start + n;
                let end = (after + self.num_tokens.min(2 * n - 1)).min(context.len());
                return context[after..end].to_vec();
            }
        }
        Vec::new()
    }
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
            max_ngram: 2,
            min_ngram: 1,
            num_tokens: 3,
        };
        // Suffix [1, 2] last occurred at 3..5, followed by 9, 9, 1.
        assert_eq!(drafter.propose(&[1, 2, 7, 1, 2, 9, 9, 1, 2]), vec![9, 9, 1]);
        // No bigram match: fall back to the unigram 5, last seen before 6; one token only.
        assert_eq!(drafter.propose(&[5, 6, 4, 5]), vec![6]);
        assert!(drafter.propose(&[1, 2, 3]).is_empty());
    }
}
