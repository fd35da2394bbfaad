//! One feature shard: a safetensors file holding a run of sequences back to back.
//!
//! | tensor | dtype | shape | holds |
//! |---|---|---|---|
//! | `input_ids` | i32 | `[T]` | the tokens of every sequence, concatenated |
//! | `loss_mask` | u8 | `[T]` | 1 on assistant tokens |
//! | `offsets` | i64 | `[n + 1]` | sequence `i` is rows `offsets[i]..offsets[i + 1]` |
//! | `hidden` | f32 / bf16 / f16 | `[T, hidden]` | final post-norm hidden state (what the LM head reads) |
//! | `tap_<k>` | same | `[T, hidden]` | residual stream after `k` layers, for each requested tap |
//!
//! The `headway` metadata holds the format tag and the sequences' corpus ids, in order.

use std::path::Path;

use headway_model::safetensors_io::{from_safetensors_bytes, to_safetensors_bytes};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::error::{DatasetError, Result};
use crate::features::manifest::FEATURES_FORMAT;
use headway_model::Dtype;

/// The sequences of one shard, as stored.
#[derive(Debug)]
pub struct ShardData {
    pub sequence_ids: Vec<String>,
    /// `n + 1` row offsets.
    pub offsets: Vec<i64>,
    /// `[T]` i32.
    pub input_ids: Tensor,
    /// `[T]` u8.
    pub loss_mask: Tensor,
    /// `[T, hidden]`.
    pub hidden: Tensor,
    /// One `[T, hidden]` tensor per tap, in the manifest's tap order.
    pub taps: Vec<Tensor>,
}

/// One sequence of a shard (views into the shard's tensors).
pub struct SequenceFeatures {
    pub input_ids: Tensor,
    pub loss_mask: Tensor,
    pub hidden: Tensor,
    pub taps: Vec<Tensor>,
}

#[derive(Serialize, Deserialize)]
struct ShardMetadata {
    format: String,
    sequence_ids: Vec<String>,
}

impl ShardData {
    pub fn len(&self) -> usize {
        self.sequence_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequence_ids.is_empty()
    }

    pub fn tokens(&self) -> usize {
        *self.offsets.last().unwrap_or(&0) as usize
    }

    /// Sequence `i` (`i < len()`).
    pub fn sequence(&self, i: usize) -> SequenceFeatures {
        let (start, end) = (self.offsets[i], self.offsets[i + 1]);
        let rows = |t: &Tensor| t.narrow(0, start, end - start);
        SequenceFeatures {
            input_ids: rows(&self.input_ids),
            loss_mask: rows(&self.loss_mask),
            hidden: rows(&self.hidden),
            taps: self.taps.iter().map(rows).collect(),
        }
    }

    /// The shard file's bytes (deterministic: same data, same bytes). `taps` are the layer
    /// indices of `self.taps`; `path` names the shard in errors.
    pub fn to_bytes(&self, taps: &[usize], path: &Path) -> Result<Vec<u8>> {
        let metadata = serde_json::to_string(&ShardMetadata {
            format: FEATURES_FORMAT.to_string(),
            sequence_ids: self.sequence_ids.clone(),
        })
        .expect("shard metadata serialises");
        let mut tensors = vec![
            ("input_ids".to_string(), self.input_ids.shallow_clone()),
            ("loss_mask".to_string(), self.loss_mask.shallow_clone()),
            ("offsets".to_string(), Tensor::from_slice(&self.offsets)),
            ("hidden".to_string(), self.hidden.shallow_clone()),
        ];
        for (layer, tap) in taps.iter().zip(&self.taps) {
            tensors.push((tap_name(*layer), tap.shallow_clone()));
        }
        Ok(to_safetensors_bytes(&tensors, Some(&metadata), path)?)
    }

    /// Parses shard bytes and checks them against what the manifest says the shard holds.
    pub fn from_bytes(bytes: &[u8], path: &Path, expected: &ShardLayout) -> Result<Self> {
        let bad = |message: String| DatasetError::shard(path, message);
        let (mut tensors, metadata) = from_safetensors_bytes(bytes, path)?;
        let metadata: ShardMetadata = metadata
            .as_deref()
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| bad(format!("unreadable headway metadata: {e}")))?
            .ok_or_else(|| bad("no headway metadata (not a feature shard?)".into()))?;
        if metadata.format != FEATURES_FORMAT {
            return Err(bad(format!(
                "format {:?}, expected {FEATURES_FORMAT:?}",
                metadata.format
            )));
        }
        let mut take = |name: &str, kind: Kind| {
            let t = tensors
                .remove(name)
                .ok_or_else(|| bad(format!("tensor {name} is missing")))?;
            if t.kind() != kind {
                return Err(bad(format!(
                    "tensor {name} is {:?}, expected {kind:?}",
                    t.kind()
                )));
            }
            Ok(t)
        };
        let input_ids = take("input_ids", Kind::Int)?;
        let loss_mask = take("loss_mask", Kind::Uint8)?;
        let offsets = Vec::<i64>::try_from(&take("offsets", Kind::Int64)?)?;
        let hidden = take("hidden", expected.dtype.kind())?;
        let taps = expected
            .taps
            .iter()
            .map(|&layer| take(&tap_name(layer), expected.dtype.kind()))
            .collect::<Result<Vec<_>>>()?;
        let shard = Self {
            sequence_ids: metadata.sequence_ids,
            offsets,
            input_ids,
            loss_mask,
            hidden,
            taps,
        };
        shard.check_shapes(expected).map_err(bad)?;
        Ok(shard)
    }

    fn check_shapes(&self, expected: &ShardLayout) -> std::result::Result<(), String> {
        let n = self.sequence_ids.len();
        if self.offsets.len() != n + 1
            || self.offsets[0] != 0
            || self.offsets.windows(2).any(|w| w[1] <= w[0])
        {
            return Err(format!(
                "offsets are not {} increasing row starts from 0",
                n + 1
            ));
        }
        let tokens = self.tokens() as i64;
        let hidden = expected.hidden_size as i64;
        let checks = [
            ("input_ids", self.input_ids.size(), vec![tokens]),
            ("loss_mask", self.loss_mask.size(), vec![tokens]),
            ("hidden", self.hidden.size(), vec![tokens, hidden]),
        ];
        let tap_checks = self
            .taps
            .iter()
            .zip(&expected.taps)
            .map(|(t, layer)| (tap_name(*layer), t.size(), vec![tokens, hidden]));
        for (name, found, wanted) in checks
            .into_iter()
            .map(|(n, f, w)| (n.to_string(), f, w))
            .chain(tap_checks)
        {
            if found != wanted {
                return Err(format!(
                    "tensor {name} has shape {found:?}, expected {wanted:?}"
                ));
            }
        }
        Ok(())
    }
}

/// What every shard of a feature directory must look like.
pub struct ShardLayout {
    pub hidden_size: usize,
    pub taps: Vec<usize>,
    pub dtype: Dtype,
}

fn tap_name(layer: usize) -> String {
    format!("tap_{layer}")
}
