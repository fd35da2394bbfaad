//! How a checkpoint's model.safetensors stores the head's weights: as trained, or with its
//! matrices as Q8_0 rows for shipping.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use headway_model::quant::{quantise, QuantFormat, QuantMatrix, BLOCK};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::{invalid, Result};

/// The storage of a checkpoint's weights, named by `weight_storage` in its config.json.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum WeightStorage {
    /// Every tensor as trained (checkpoints from before the option).
    #[default]
    #[serde(rename = "f32")]
    F32,
    /// Every f32 matrix whose rows are whole 32-value blocks as llama.cpp's Q8_0 rows, a U8
    /// tensor `[rows, cols / 32 × 34]` (per block an f16 scale and 32 int8 values); vectors as
    /// trained. About 28 % of f32's bytes. Read back dequantised to f32, and a quantised target's
    /// Q8_0 head (`--head-format auto`) quantises those values back into the very same blocks.
    #[serde(rename = "q8_0")]
    Q8_0,
}

impl WeightStorage {
    pub fn is_f32(&self) -> bool {
        *self == Self::F32
    }

    /// `weights` (f32, as trained) as this storage writes them.
    pub fn store(self, weights: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        weights
            .iter()
            .map(|(name, tensor)| {
                let stored = match self {
                    Self::Q8_0 if is_block_matrix(tensor) => q8_0_rows(tensor),
                    _ => tensor.shallow_clone(),
                };
                (name.clone(), stored)
            })
            .collect()
    }

    /// The head's weights from the tensors of a model.safetensors this storage wrote (`path` for
    /// errors): Q8_0 rows dequantised to f32.
    pub fn load(
        self,
        stored: HashMap<String, Tensor>,
        path: &Path,
    ) -> Result<BTreeMap<String, Tensor>> {
        stored
            .into_iter()
            .map(|(name, tensor)| {
                let weight = match self {
                    Self::Q8_0 if tensor.kind() == Kind::Uint8 => dequantised_q8_0(&tensor)
                        .map_err(|e| invalid(path, format!("tensor {name}: {e}")))?,
                    _ => tensor,
                };
                Ok((name, weight))
            })
            .collect()
    }
}

/// An f32 matrix whose rows split into whole Q8_0 blocks.
fn is_block_matrix(tensor: &Tensor) -> bool {
    let size = tensor.size();
    tensor.kind() == Kind::Float && size.len() == 2 && (size[1] as usize).is_multiple_of(BLOCK)
}

fn q8_0_rows(matrix: &Tensor) -> Tensor {
    let (rows, cols) = (matrix.size()[0] as usize, matrix.size()[1] as usize);
    let values = Vec::<f32>::try_from(
        matrix
            .detach()
            .to_device(Device::Cpu)
            .contiguous()
            .view([-1]),
    )
    .expect("an f32 matrix");
    let blocks = quantise(QuantFormat::Q8_0, &values, rows, cols);
    Tensor::from_slice(blocks.data()).view([rows as i64, blocks.row_bytes() as i64])
}

fn dequantised_q8_0(rows: &Tensor) -> std::result::Result<Tensor, String> {
    let size = rows.size();
    let block_bytes = QuantFormat::Q8_0.block_bytes();
    let [rows_count, row_bytes] = size[..] else {
        return Err(format!("Q8_0 rows must be a matrix, got shape {size:?}"));
    };
    if !(row_bytes as usize).is_multiple_of(block_bytes) {
        return Err(format!(
            "a Q8_0 row is whole {block_bytes}-byte blocks, got {row_bytes} bytes"
        ));
    }
    let cols = row_bytes as usize / block_bytes * BLOCK;
    let data = Vec::<u8>::try_from(rows.contiguous().view([-1])).map_err(|e| e.to_string())?;
    let matrix = QuantMatrix::new(
        QuantFormat::Q8_0,
        rows_count as usize,
        cols,
        Arc::from(data),
    )?;
    Ok(matrix.dequantise(Kind::Float, Device::Cpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head_like() -> Vec<(String, Tensor)> {
        tch::manual_seed(7);
        vec![
            (
                "fc.weight".into(),
                Tensor::randn([48, 96], (Kind::Float, Device::Cpu)) * 0.05,
            ),
            (
                "fc.bias".into(),
                Tensor::randn([48], (Kind::Float, Device::Cpu)),
            ),
            // Rows that are not whole blocks stay as trained.
            (
                "odd.weight".into(),
                Tensor::randn([4, 20], (Kind::Float, Device::Cpu)),
            ),
        ]
    }

    #[test]
    fn q8_0_keeps_vectors_and_odd_matrices_and_rounds_matrices_within_half_a_step() {
        let weights = head_like();
        let stored = WeightStorage::Q8_0.store(&weights);
        let kinds: Vec<Kind> = stored.iter().map(|(_, t)| t.kind()).collect();
        assert_eq!(kinds, [Kind::Uint8, Kind::Float, Kind::Float]);
        assert_eq!(stored[0].1.size(), [48, 96 / 32 * 34]);
        let loaded = WeightStorage::Q8_0
            .load(stored.into_iter().collect(), Path::new("test"))
            .unwrap();
        for (name, original) in &weights[1..] {
            assert!(loaded[name].equal(original), "{name} changed");
        }
        let (original, back) = (&weights[0].1, &loaded["fc.weight"]);
        assert_eq!(back.size(), original.size());
        // Per block the step is amax / 127: every value within half a step, plus the f16 scale's
        // rounding (2^-11 of it) times at most 127.
        let blocks = |t: &Tensor| t.view([48, 3, 32]);
        let step = blocks(original).abs().amax(&[2i64][..], true) / 127.0;
        let error = (blocks(back) - blocks(original)).abs();
        let ratio = (error / step).max().double_value(&[]);
        assert!(ratio <= 0.5 + 127.0 / 2048.0, "worst error {ratio} steps");
    }

    #[test]
    fn q8_0_blocks_survive_a_round_trip_through_f32_bit_for_bit() {
        // Serving on a quantised target quantises the loaded f32 values again: the blocks must be
        // the stored ones, so the head serves exactly what was shipped.
        let stored = WeightStorage::Q8_0.store(&head_like());
        let loaded = WeightStorage::Q8_0
            .load(
                stored
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect(),
                Path::new("test"),
            )
            .unwrap();
        let again = q8_0_rows(&loaded["fc.weight"]);
        assert!(again.equal(&stored[0].1), "re-quantised blocks differ");
    }

    #[test]
    fn malformed_q8_0_rows_are_named() {
        let bad = HashMap::from([(
            "fc.weight".to_string(),
            Tensor::zeros([2, 33], (Kind::Uint8, Device::Cpu)),
        )]);
        let error = WeightStorage::Q8_0
            .load(bad, Path::new("ckpt"))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("fc.weight") && error.contains("34-byte blocks"),
            "{error}"
        );
    }

    #[test]
    fn config_names_round_trip() {
        for storage in [WeightStorage::F32, WeightStorage::Q8_0] {
            let json = serde_json::to_string(&storage).unwrap();
            assert_eq!(
                serde_json::from_str::<WeightStorage>(&json).unwrap(),
                storage
            );
        }
        assert_eq!(
            serde_json::to_string(&WeightStorage::Q8_0).unwrap(),
            "\"q8_0\""
        );
    }
}
