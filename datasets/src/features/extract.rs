//! Running the frozen target over training sequences: length-bucketed, right-padded batches.
//!
//! Sequences are sorted by length (longest first) and packed into batches whose padded size
//! (`rows × longest`) stays within a token budget, so little compute goes to padding. Padding goes
//! on the right: with causal attention no real token attends to a later position, so padded
//! batches give every real position the same hidden state as running its sequence alone (up to
//! the last bits of the matrix kernels' blocking).

use headway_model::{CpuPolicy, ForwardInput, Llama};
use tch::{Device, Kind, Tensor};

use crate::error::Result;

/// Batches of indices into `lengths`: longest first, each within `batch_tokens` padded tokens (a
/// sequence longer than the budget gets a batch of its own). Deterministic; ties keep input order.
pub fn length_buckets(lengths: &[usize], batch_tokens: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lengths[i]));
    let mut batches: Vec<Vec<usize>> = Vec::new();
    for i in order {
        match batches.last_mut() {
            // Sorted longest first, so the batch's first sequence sets its padded length.
            Some(batch) if (batch.len() + 1) * lengths[batch[0]] <= batch_tokens => batch.push(i),
            _ => batches.push(vec![i]),
        }
    }
    batches
}

/// The hidden states of one sequence, on the CPU in the requested dtype.
pub struct ExtractedFeatures {
    /// `[len, hidden]` final post-norm hidden states.
    pub hidden: Tensor,
    /// `[len, hidden]` per requested tap.
    pub taps: Vec<Tensor>,
}

/// Runs a target trunk over token sequences and returns their features.
pub struct FeatureExtractor<'a> {
    pub model: &'a Llama,
    pub device: Device,
    /// Residual-stream taps to return besides the final hidden state.
    pub taps: &'a [usize],
    /// Padded tokens per forward.
    pub batch_tokens: usize,
    /// Dtype of the returned tensors.
    pub output_kind: Kind,
    /// The CPU policy of the forwards (batch work: libtorch on every thread).
    pub cpu: CpuPolicy,
}

impl FeatureExtractor<'_> {
    /// Features of every sequence of `batch` (indices into `sequences`, one forward), in the
    /// batch's order.
    pub fn run_batch(
        &self,
        sequences: &[&[u32]],
        batch: &[usize],
    ) -> Result<Vec<ExtractedFeatures>> {
        let _no_grad = tch::no_grad_guard();
        let longest = batch.iter().map(|&i| sequences[i].len()).max().unwrap_or(0);
        let mut ids = vec![0i64; batch.len() * longest];
        for (row, &i) in batch.iter().enumerate() {
            for (slot, &token) in ids[row * longest..].iter_mut().zip(sequences[i]) {
                *slot = i64::from(token);
            }
        }
        let shape = [batch.len() as i64, longest as i64];
        let input_ids = Tensor::from_slice(&ids).view(shape).to_device(self.device);
        let positions = Tensor::arange(longest as i64, (Kind::Int64, self.device))
            .unsqueeze(0)
            .expand(shape, false)
            .contiguous();
        let output = self.model.forward(
            &ForwardInput {
                input_ids: &input_ids,
                positions: &positions,
                mask: None,
                taps: self.taps,
                cpu: &self.cpu,
            },
            None,
        )?;
        let to_output = |t: &Tensor| t.to_device(Device::Cpu).to_kind(self.output_kind);
        let hidden = to_output(&output.hidden);
        let taps: Vec<Tensor> = output.taps.iter().map(to_output).collect();
        Ok(batch
            .iter()
            .enumerate()
            .map(|(row, &i)| {
                let len = sequences[i].len() as i64;
                let rows = |t: &Tensor| t.get(row as i64).narrow(0, 0, len);
                ExtractedFeatures {
                    hidden: rows(&hidden),
                    taps: taps.iter().map(rows).collect(),
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_respect_the_budget_and_cover_every_sequence_once() {
        let lengths = [5, 100, 30, 30, 7, 250, 1, 29];
        let batches = length_buckets(&lengths, 100);
        let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
        seen.sort();
        assert_eq!(seen, (0..lengths.len()).collect::<Vec<_>>());
        for batch in &batches {
            let longest = batch.iter().map(|&i| lengths[i]).max().unwrap();
            assert!(
                batch.len() == 1 || batch.len() * longest <= 100,
                "{batch:?}"
            );
        }
        // Longest first: 250 alone (over budget), then 100 alone, then 30, 30, 29 together.
        assert_eq!(batches[0], vec![5]);
        assert_eq!(batches[1], vec![1]);
        assert_eq!(batches[2], vec![2, 3, 7]);
    }
}
