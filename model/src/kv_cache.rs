//! Preallocated key/value cache with O(1) truncation and in-place compaction of accepted tree
//! paths.
//!
//! Layout per layer: `[batch, kv_heads, capacity, head_dim]`. Rows `0..len` are valid; a forward
//! over `n` new tokens writes rows `len..len + n` in every layer and then advances `len`. Rolling
//! back (rejected draft tokens) only moves `len`; nothing is freed or copied.

use tch::{Device, Kind, Tensor};

use crate::config::ModelConfig;
use crate::on_devices::OnDevices;
use crate::{ModelError, Result};

/// Key/value tensors of every layer for one batch of equally long sequences.
pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
}

impl KvCache {
    /// Allocates room for `capacity` positions of `batch` sequences.
    pub fn new(
        config: &ModelConfig,
        batch: usize,
        capacity: usize,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        Self::placed(config, batch, capacity, kind, &[device])
    }

    /// [`Self::new`] with layer `i`'s keys and values on `devices[i]` (a target spread over
    /// devices); one device: all layers on it.
    pub fn placed(
        config: &ModelConfig,
        batch: usize,
        capacity: usize,
        kind: Kind,
        devices: &[Device],
    ) -> Result<Self> {
        let layers = config.num_hidden_layers;
        if devices.len() != 1 && devices.len() != layers {
            return Err(ModelError::Input(format!(
                "a KV cache of {layers} layers placed on {} devices",
                devices.len()
            )));
        }
        let shape = [
            batch as i64,
            config.num_key_value_heads as i64,
            capacity as i64,
            config.head_dim as i64,
        ];
        let alloc = |layer: usize| Tensor::f_zeros(shape, (kind, devices[layer % devices.len()]));
        let keys = (0..layers).map(alloc).collect::<Result<Vec<_>, _>>()?;
        let values = (0..layers).map(alloc).collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            keys,
            values,
            len: 0,
            capacity,
        })
    }

    /// Bytes one position takes in a cache of `config`'s layers whose keys and values are stored
    /// in `kind`: what a forward reads per cached position.
    pub fn bytes_per_position(config: &ModelConfig, kind: Kind) -> usize {
        config.num_hidden_layers
            * 2
            * config.num_key_value_heads
            * config.head_dim
            * kind.elt_size_in_bytes()
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position at or after `len` (no data moves). Truncating to a length at or
    /// beyond the current one is an error: it would expose stale rows.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(ModelError::Input(format!(
                "cannot truncate a KV cache of {} positions to {len}",
                self.len
            )));
        }
        self.len = len;
        Ok(())
    }

    /// Keeps, in order, the positions `keep` (absolute, strictly increasing, all `>= start`) and
    /// moves them to `start..start + keep.len()`; everything after is dropped. This is how an
    /// accepted tree path replaces the whole verified tree without re-running the prefix.
    pub fn compact(&mut self, start: usize, keep: &[usize]) -> Result<()> {
        let increasing = keep.windows(2).all(|w| w[0] < w[1]);
        let in_range = keep.first().is_none_or(|&first| first >= start)
            && keep.last().is_none_or(|&last| last < self.len);
        if !increasing || !in_range || start > self.len {
            return Err(ModelError::Input(format!(
                "invalid compaction of a KV cache of {} positions: keep {keep:?} from {start}",
                self.len
            )));
        }
        let contiguous = keep.iter().enumerate().all(|(i, &p)| p == start + i);
        if !contiguous {
            let mut index = OnDevices::new(row_index(keep));
            for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
                // index_select materialises the rows before the copy, so source and destination
                // may overlap.
                let rows = cache.index_select(2, index.on(cache.device()));
                cache
                    .narrow(2, start as i64, keep.len() as i64)
                    .copy_(&rows);
            }
        }
        self.len = start + keep.len();
        Ok(())
    }

    /// Stacks single-sequence caches into one cache of `parts.len()` sequences, right-aligned:
    /// every part ends at the same position, and part `b` starts after `pads[b]` leading rows
    /// (returned) that hold zeros and must be masked out by the caller. Keys are stored after
    /// rotary embedding, so each sequence keeps its own positions. `capacity` is the room of the
    /// new cache, at least the longest part.
    pub fn stack_right_aligned(parts: &[KvCache], capacity: usize) -> Result<(Self, Vec<usize>)> {
        let longest = parts.iter().map(|p| p.len).max().unwrap_or(0);
        let Some(first) = parts.first() else {
            return Err(ModelError::Input("no caches to stack".into()));
        };
        if capacity < longest || parts.iter().any(|p| p.keys.len() != first.keys.len()) {
            return Err(ModelError::Input(format!(
                "cannot stack {} caches (longest {longest} positions) into a capacity of {capacity}",
                parts.len()
            )));
        }
        let pads: Vec<usize> = parts.iter().map(|p| longest - p.len).collect();
        let stack = |layers: fn(&KvCache) -> &Vec<Tensor>, layer: usize| -> Result<Tensor> {
            let sample = &layers(first)[layer];
            let size = sample.size();
            let alike = |p: &KvCache| {
                let s = layers(p)[layer].size();
                s[0] == 1 && s[1] == size[1] && s[3] == size[3]
            };
            if !parts.iter().all(alike) {
                return Err(ModelError::Input(format!(
                    "only single-sequence caches of one model stack, got {size:?}"
                )));
            }
            let out = Tensor::f_zeros(
                [parts.len() as i64, size[1], capacity as i64, size[3]],
                (sample.kind(), sample.device()),
            )?;
            for (row, (part, &pad)) in parts.iter().zip(&pads).enumerate() {
                out.get(row as i64)
                    .narrow(1, pad as i64, part.len as i64)
                    .copy_(&layers(part)[layer].get(0).narrow(1, 0, part.len as i64));
            }
            Ok(out)
        };
        let layers = first.keys.len();
        let keys = (0..layers)
            .map(|l| stack(|c| &c.keys, l))
            .collect::<Result<Vec<_>>>()?;
        let values = (0..layers)
            .map(|l| stack(|c| &c.values, l))
            .collect::<Result<Vec<_>>>()?;
        let cache = Self {
            keys,
            values,
            len: longest,
            capacity,
        };
        Ok((cache, pads))
    }

    /// Keeps only the sequences `rows` (indices into the batch, in the new order), dropping the
    /// others: batched generation sheds finished sequences so they stop costing compute.
    pub fn retain_sequences(&mut self, rows: &[usize]) -> Result<()> {
        let batch = self.keys.first().map_or(0, |k| k.size()[0] as usize);
        if rows.is_empty() || rows.iter().any(|&r| r >= batch) {
            return Err(ModelError::Input(format!(
                "cannot keep sequences {rows:?} of a cache of {batch}"
            )));
        }
        let mut index = OnDevices::new(row_index(rows));
        for cache in self.keys.iter_mut().chain(self.values.iter_mut()) {
            *cache = cache.index_select(0, index.on(cache.device()));
        }
        Ok(())
    }

    /// The valid keys and values of `layer`: views of shape `[batch, kv_heads, len, head_dim]`.
    pub fn layer(&self, layer: usize) -> (Tensor, Tensor) {
        let len = self.len as i64;
        (
            self.keys[layer].narrow(2, 0, len),
            self.values[layer].narrow(2, 0, len),
        )
    }

    /// Errors unless `new_tokens` more positions of `layers` layers fit.
    pub(crate) fn check_room(&self, new_tokens: usize, layers: usize) -> Result<()> {
        if layers > self.keys.len() {
            return Err(ModelError::Input(format!(
                "KV cache holds {} layers, but {layers} layers run on it",
                self.keys.len()
            )));
        }
        if self.len + new_tokens > self.capacity {
            return Err(ModelError::Input(format!(
                "KV cache full: {} cached + {new_tokens} new positions exceed its capacity of {}",
                self.len, self.capacity
            )));
        }
        Ok(())
    }

    /// Writes `keys`/`values` (`[batch, kv_heads, n, head_dim]`) of `layer` after the cached rows
    /// and returns views over cached + new rows. The length advances only in [`Self::advance`],
    /// once every layer has written.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> (Tensor, Tensor) {
        let new = keys.size()[2];
        let start = self.len as i64;
        self.keys[layer].narrow(2, start, new).copy_(keys);
        self.values[layer].narrow(2, start, new).copy_(values);
        let total = start + new;
        (
            self.keys[layer].narrow(2, 0, total),
            self.values[layer].narrow(2, 0, total),
        )
    }

    /// `layer`'s key and value storage, `[batch, kv_heads, capacity, head_dim]`: the few-row
    /// decoder layer writes its new rows (`len..`) into place and its attention reads them there
    /// with the cached ones.
    pub(crate) fn storage(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.keys[layer], &self.values[layer])
    }

    pub(crate) fn advance(&mut self, new_tokens: usize) {
        self.len += new_tokens;
    }
}

/// `rows` as an index tensor on the CPU (copied once to each device the layers use).
fn row_index(rows: &[usize]) -> Tensor {
    let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    Tensor::from_slice(&rows)
}
