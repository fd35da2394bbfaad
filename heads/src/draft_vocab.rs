//! A reduced output vocabulary for drafting: the N most frequent target tokens.
//!
//! A small target's LM head is a large share of its compute (SmolLM2-135M: 49,152 × 576, a fifth
//! of the model), and a head drafting through the full head pays it at every draft step. A draft
//! vocabulary keeps the rows of the tokens that carry most of the training text; `d2t[i]` is the
//! target id of draft token `i` (EAGLE-3's convention), and tokens outside it are never drafted.

use headway_model::linear::Matrix;
use tch::{Device, Kind, Tensor};

use crate::error::{HeadError, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftVocab {
    /// Draft index → target token id, most frequent first (ties by lower id).
    pub d2t: Vec<u32>,
}

impl DraftVocab {
    /// The `size` most frequent ids of `counts` (indexed by target id).
    pub fn from_counts(counts: &[u64], size: usize) -> Result<Self> {
        if size == 0 || size > counts.len() {
            return Err(HeadError::Invalid(format!(
                "draft vocabulary of {size} tokens: must be in 1..={}",
                counts.len()
            )));
        }
        let mut ids: Vec<u32> = (0..counts.len() as u32).collect();
        ids.sort_by_key(|&id| (std::cmp::Reverse(counts[id as usize]), id));
        ids.truncate(size);
        Ok(Self { d2t: ids })
    }

    pub fn len(&self) -> usize {
        self.d2t.len()
    }

    pub fn is_empty(&self) -> bool {
        self.d2t.is_empty()
    }

    /// `d2t` as an i64 tensor on `device` (for `index_select` of LM-head rows and of logits).
    pub fn index(&self, device: Device) -> Tensor {
        let ids: Vec<i64> = self.d2t.iter().map(|&t| i64::from(t)).collect();
        Tensor::from_slice(&ids).to_device(device)
    }

    /// Target ids `[..]` → draft indices, `-1` where the token is outside the draft vocabulary.
    pub fn to_draft(&self, target_ids: &Tensor, vocab_size: usize) -> Tensor {
        let mut table = vec![-1i64; vocab_size];
        for (draft, &target) in self.d2t.iter().enumerate() {
            table[target as usize] = draft as i64;
        }
        let table = Tensor::from_slice(&table).to_device(target_ids.device());
        table
            .index_select(0, &target_ids.to_kind(Kind::Int64).flatten(0, -1))
            .view_as(target_ids)
    }

    /// The rows of the target's LM head `weight` (`[vocab, hidden]`) that this vocabulary drafts
    /// over, as f32: only those rows are read from quantised blocks, so a quantised target keeps
    /// no dense copy of its LM head for a head drafting over a vocabulary of its own.
    pub fn lm_head_rows(draft: Option<&Self>, weight: &Matrix) -> Tensor {
        match draft {
            Some(d) => weight.rows(&d.index(weight.device())),
            None => weight.dense().shallow_clone(),
        }
        .to_kind(Kind::Float)
    }

    /// Fraction of the counted tokens the vocabulary covers.
    pub fn coverage(&self, counts: &[u64]) -> f64 {
        let total: u64 = counts.iter().sum();
        let kept: u64 = self.d2t.iter().map(|&t| counts[t as usize]).sum();
        kept as f64 / total.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_most_frequent_ids_and_maps_back() {
        let counts = [5, 0, 9, 5, 1];
        let vocab = DraftVocab::from_counts(&counts, 3).unwrap();
        assert_eq!(vocab.d2t, vec![2, 0, 3]);
        assert!((vocab.coverage(&counts) - 19.0 / 20.0).abs() < 1e-12);
        let draft = vocab.to_draft(&Tensor::from_slice(&[3i64, 1, 2]), 5);
        assert_eq!(Vec::<i64>::try_from(&draft).unwrap(), vec![2, -1, 0]);
        assert!(DraftVocab::from_counts(&counts, 6).is_err());
    }
}
