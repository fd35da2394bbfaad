//! Training batches streamed from a feature directory.
//!
//! Each epoch visits the split's shards in a shuffled order and each shard's sequences in a
//! shuffled order (both from the seed and the epoch number), packing consecutive sequences into
//! right-padded batches of at most `batch_tokens` padded tokens. One shard is in memory at a time.
//! The stream's [`DataPosition`] (epoch, shard, sequence) is saved with checkpoints, and the
//! orders are pure functions of (seed, epoch), so a resumed run sees exactly the batches an
//! uninterrupted one would.

use anyhow::Context;
use headway_datasets::features::{FeatureSet, ShardData, ShardSplit};
use headway_model::hash::mix64;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// A padded batch of sequences.
pub struct Batch {
    /// `[batch, len]` i64 token ids (0 in padding).
    pub ids: Tensor,
    /// `[batch, len]` bool: assistant tokens (false in padding).
    pub loss_mask: Tensor,
    /// `[batch, len, hidden]` f32 final hidden states.
    pub hidden: Tensor,
    /// `[batch, len, hidden]` f32 residual-stream taps, those the stream was asked for, in order.
    pub taps: Vec<Tensor>,
    /// Real tokens in the batch.
    pub tokens: usize,
}

/// A batch the stream has moved past: its range in the shard's order, and its size.
pub struct BatchSlot {
    start: usize,
    end: usize,
    /// Sequences × the longest of them: what its forward and backward cost.
    pub padded_tokens: usize,
}

/// Where a stream stands: the next batch starts at sequence `sequence` (in shuffled order) of
/// shard `shard` (in the epoch's shuffled order) of epoch `epoch`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    pub epoch: u64,
    pub shard: usize,
    pub sequence: usize,
}

/// `0..n` shuffled by Fisher–Yates driven by SplitMix64 from `seed` (stable across platforms and
/// crate versions).
pub fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed;
    for i in (1..n).rev() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let j = (mix64(state) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Batches of `order` (indices into `lengths`) packed greedily: consecutive sequences while
/// `count × longest ≤ batch_tokens` (at least one per batch). Returns (start, end) ranges of
/// `order`.
pub fn pack(lengths: &[usize], order: &[usize], batch_tokens: usize) -> Vec<(usize, usize)> {
    let mut batches = Vec::new();
    let mut start = 0;
    let mut longest = 0;
    for (i, &s) in order.iter().enumerate() {
        let candidate = longest.max(lengths[s]);
        if i > start && (i - start + 1) * candidate > batch_tokens {
            batches.push((start, i));
            start = i;
            longest = lengths[s];
        } else {
            longest = candidate;
        }
    }
    if start < order.len() {
        batches.push((start, order.len()));
    }
    batches
}

/// A stream of batches over one split.
pub struct BatchStream<'a> {
    set: &'a FeatureSet,
    /// Manifest indices of the split's shards.
    shards: Vec<usize>,
    seed: u64,
    shuffle: bool,
    batch_tokens: usize,
    device: Device,
    /// Indices into the feature set's stored taps of the taps each batch carries.
    tap_columns: Vec<usize>,
    pub position: DataPosition,
    /// The shard in memory: (index in the epoch's order, its data, its sequence order, batches).
    current: Option<LoadedShard>,
}

struct LoadedShard {
    epoch: u64,
    slot: usize,
    data: ShardData,
    order: Vec<usize>,
    /// Tokens of each sequence, in stored order.
    lengths: Vec<usize>,
    batches: Vec<(usize, usize)>,
}

impl<'a> BatchStream<'a> {
    /// `shuffle`: training order (shuffled per epoch) or evaluation order (as stored).
    pub fn new(
        set: &'a FeatureSet,
        split: ShardSplit,
        seed: u64,
        shuffle: bool,
        batch_tokens: usize,
        device: Device,
        position: DataPosition,
    ) -> anyhow::Result<Self> {
        let shards: Vec<usize> = set.shards(split).map(|(i, _)| i).collect();
        anyhow::ensure!(
            !shards.is_empty(),
            "{} has no {} shards (prepare with --held-out > 0 for evaluation)",
            set.dir.display(),
            split.name()
        );
        Ok(Self {
            set,
            shards,
            seed,
            shuffle,
            batch_tokens,
            device,
            tap_columns: Vec::new(),
            position,
            current: None,
        })
    }

    /// The same stream with batches that also carry the residual-stream taps of target layers
    /// `taps`, which the feature set must store.
    pub fn with_taps(self, taps: &[usize]) -> anyhow::Result<Self> {
        Ok(Self {
            tap_columns: tap_columns(self.set, taps)?,
            ..self
        })
    }

    fn shard_order(&self, epoch: u64) -> Vec<usize> {
        if self.shuffle {
            shuffled(self.shards.len(), mix64(self.seed ^ mix64(epoch)))
        } else {
            (0..self.shards.len()).collect()
        }
    }

    /// The next batch, or `None` at the end of the epoch (the position then moves to the next
    /// epoch's start).
    pub fn next_batch(&mut self) -> anyhow::Result<Option<Batch>> {
        Ok(self.next_slot()?.map(|slot| self.assemble_slot(&slot)))
    }

    /// Moves past the next batch without assembling it, `None` at the end of the epoch (as
    /// [`Self::next_batch`]): its size decides which rank trains on it, and only that rank
    /// assembles it ([`Self::assemble_slot`], before the stream moves on).
    pub fn next_slot(&mut self) -> anyhow::Result<Option<BatchSlot>> {
        let p = self.position;
        if p.shard >= self.shards.len() {
            self.position = DataPosition {
                epoch: p.epoch + 1,
                shard: 0,
                sequence: 0,
            };
            return Ok(None);
        }
        let loaded = match self.current.take() {
            Some(l) if l.epoch == p.epoch && l.slot == p.shard => l,
            _ => self.load(p.epoch, p.shard)?,
        };
        let batch_index = loaded
            .batches
            .iter()
            .position(|&(start, _)| start == p.sequence);
        let Some(batch_index) = batch_index else {
            anyhow::bail!("data position {p:?} is not at a batch boundary (other --batch-tokens than the run being resumed?)");
        };
        let (start, end) = loaded.batches[batch_index];
        let longest = loaded.order[start..end].iter().map(|&i| loaded.lengths[i]);
        let padded_tokens = (end - start) * longest.max().expect("a batch has a sequence");
        self.position = if end == loaded.order.len() {
            DataPosition {
                epoch: p.epoch,
                shard: p.shard + 1,
                sequence: 0,
            }
        } else {
            DataPosition { sequence: end, ..p }
        };
        self.current = Some(loaded);
        Ok(Some(BatchSlot {
            start,
            end,
            padded_tokens,
        }))
    }

    /// The batch `slot` (just returned by [`Self::next_slot`]) of the shard in memory.
    pub fn assemble_slot(&self, slot: &BatchSlot) -> Batch {
        let loaded = self
            .current
            .as_ref()
            .expect("next_slot keeps the shard it read");
        self.assemble(&loaded.data, &loaded.order[slot.start..slot.end])
    }

    fn load(&self, epoch: u64, slot: usize) -> anyhow::Result<LoadedShard> {
        let index = self.shards[self.shard_order(epoch)[slot]];
        let data = self.set.load_shard(index)?;
        let n = data.len();
        let order = if self.shuffle {
            shuffled(n, mix64(self.seed ^ mix64(epoch) ^ mix64(index as u64 + 1)))
        } else {
            (0..n).collect()
        };
        let lengths: Vec<usize> = data
            .offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .collect();
        let batches = pack(&lengths, &order, self.batch_tokens);
        Ok(LoadedShard {
            epoch,
            slot,
            data,
            order,
            lengths,
            batches,
        })
    }

    /// Batches in one epoch (loads each shard's offsets; used to size the schedule).
    pub fn batches_in_epoch(&self, epoch: u64) -> anyhow::Result<usize> {
        let mut total = 0;
        for slot in 0..self.shards.len() {
            total += self.load(epoch, slot)?.batches.len();
        }
        Ok(total)
    }

    fn assemble(&self, data: &ShardData, members: &[usize]) -> Batch {
        let lengths: Vec<i64> = members
            .iter()
            .map(|&i| data.offsets[i + 1] - data.offsets[i])
            .collect();
        let longest = *lengths.iter().max().expect("a batch has a sequence");
        let pad = |t: Tensor, len: i64| -> Tensor {
            let mut padding = t.size();
            padding[0] = longest - len;
            Tensor::cat(
                &[
                    t.shallow_clone(),
                    t.new_zeros(padding.as_slice(), (t.kind(), t.device())),
                ],
                0,
            )
        };
        let (mut ids, mut mask, mut hidden) = (vec![], vec![], vec![]);
        let mut taps: Vec<Vec<Tensor>> = self.tap_columns.iter().map(|_| vec![]).collect();
        for (&i, &len) in members.iter().zip(&lengths) {
            let seq = data.sequence(i);
            ids.push(pad(seq.input_ids.to_kind(Kind::Int64), len));
            mask.push(pad(seq.loss_mask.to_kind(Kind::Bool), len));
            hidden.push(pad(seq.hidden.to_kind(Kind::Float), len));
            for (column, tap) in self.tap_columns.iter().zip(&mut taps) {
                tap.push(pad(seq.taps[*column].to_kind(Kind::Float), len));
            }
        }
        let on_device = |ts: Vec<Tensor>| Tensor::stack(&ts, 0).to_device(self.device);
        Batch {
            ids: on_device(ids),
            loss_mask: on_device(mask),
            hidden: on_device(hidden),
            taps: taps.into_iter().map(on_device).collect(),
            tokens: lengths.iter().sum::<i64>() as usize,
        }
    }
}

/// Where each of the target layers `taps` sits among the taps that `set` stores.
pub fn tap_columns(set: &FeatureSet, taps: &[usize]) -> anyhow::Result<Vec<usize>> {
    let stored = &set.manifest.settings.extraction.taps;
    taps.iter()
        .map(|tap| {
            stored.iter().position(|s| s == tap).with_context(|| {
                format!(
                    "the head reads the target's layer-{tap} tap, but {} stores taps {stored:?} (prepare with --layers)",
                    set.dir.display()
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffles_are_permutations_fixed_by_the_seed() {
        let a = shuffled(50, 7);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
        assert_eq!(a, shuffled(50, 7));
        assert_ne!(a, shuffled(50, 8));
    }

    #[test]
    fn packing_respects_the_padded_budget() {
        let lengths = [10, 40, 5, 30, 30, 100];
        let order = [0, 1, 2, 3, 4, 5];
        // 10,40 → 2×40 = 80 ≤ 100; +5 → 3×40 = 120 > 100: new batch. 5,30,30 → 90. 100 alone.
        assert_eq!(pack(&lengths, &order, 100), vec![(0, 2), (2, 5), (5, 6)]);
        assert_eq!(
            pack(&lengths, &order, 1),
            vec![(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6)]
        );
    }
}
