//! A head's trainable tensors by name.

use std::collections::BTreeMap;

use headway_model::linear::Matrix;
use headway_model::quant::QuantFormat;
use headway_model::weights::quantised_matrix;
use headway_model::{ModelError, WeightSource};
use tch::{Device, Kind, Tensor};

use crate::error::{HeadError, Result};

/// A fresh parameter as torch's modules start it: a `*norm.weight` is one, any other weight or
/// bias is uniform ±1/√fan_in (`nn.Linear`'s default), fan_in being a matrix's columns and
/// `bias_fan_in` for a 1-D bias. Draws from libtorch's generator (seed it with
/// `tch::manual_seed`).
pub fn torch_default(name: &str, shape: &[i64], bias_fan_in: i64, device: Device) -> Tensor {
    if name.ends_with("norm.weight") {
        return Tensor::ones(shape, (Kind::Float, device));
    }
    let fan_in = if shape.len() == 2 {
        shape[1]
    } else {
        bias_fan_in
    };
    let bound = 1.0 / (fan_in as f64).sqrt();
    Tensor::empty(shape, (Kind::Float, device)).uniform_(-bound, bound)
}

/// Named leaf tensors (sorted by name, so iteration, saving and optimizer state have one order).
#[derive(Default)]
pub struct Params {
    tensors: BTreeMap<String, Tensor>,
    /// Matrices kept only as blocks of a drafting format ([`Self::quantise_matrices`]), their
    /// f32 values dropped.
    quantised: BTreeMap<String, Matrix>,
}

impl Params {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `value` as the trainable leaf `name` (detached copy, `requires_grad` set).
    pub fn insert(&mut self, name: impl Into<String>, value: &Tensor) {
        let leaf = value.detach().copy().set_requires_grad(true);
        self.tensors.insert(name.into(), leaf);
    }

    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| HeadError::Invalid(format!("head parameter {name} is missing")))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.tensors.iter()
    }

    pub fn len(&self) -> usize {
        self.tensors.len() + self.quantised.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shape of parameter `name`, whether an f32 tensor or quantised blocks.
    pub fn shape(&self, name: &str) -> Result<Vec<i64>> {
        match self.quantised.get(name) {
            Some(matrix) => Ok(matrix.shape().to_vec()),
            None => Ok(self.get(name)?.size()),
        }
    }

    /// Keeps every matrix whose rows are whole blocks of `format` as those blocks only, its f32
    /// values dropped: a frozen head that only drafts beside a quantised target resides in the
    /// blocks it streams (the committed EAGLE-3 head: 10.4 MB of Q8_0 instead of 39 MB of f32
    /// beside them). Modules built afterwards take the blocks as they are; the parameters can no
    /// longer train, be saved or be quantised to another format.
    pub fn quantise_matrices(&mut self, format: QuantFormat) {
        let matrices: Vec<String> = self
            .tensors
            .iter()
            .filter(|(_, t)| t.dim() == 2)
            .map(|(name, _)| name.clone())
            .collect();
        for name in matrices {
            let tensor = self.tensors.remove(&name).expect("listed above");
            match quantised_matrix(Matrix::Dense(tensor), format) {
                Matrix::Dense(tensor) => {
                    self.tensors.insert(name, tensor);
                }
                blocks => {
                    self.quantised.insert(name, blocks);
                }
            }
        }
    }

    /// Stops tracking gradients (serving): layers built from frozen parameters take the
    /// runtime's inference path.
    pub fn freeze(&mut self) {
        for leaf in self.tensors.values_mut() {
            *leaf = leaf.detach();
        }
    }

    /// Number of scalars.
    pub fn numel(&self) -> usize {
        let quantised = self
            .quantised
            .values()
            .map(|m| m.shape().iter().product::<i64>());
        self.tensors.values().map(Tensor::numel).sum::<usize>() + quantised.sum::<i64>() as usize
    }

    /// Replaces every tensor with the one of the same name and shape in `values` (as loaded from a
    /// checkpoint); an error names the first missing, extra or mis-shaped tensor.
    pub fn load(&mut self, values: &BTreeMap<String, Tensor>) -> Result<()> {
        if let Some(extra) = values.keys().find(|k| !self.tensors.contains_key(*k)) {
            return Err(HeadError::Invalid(format!(
                "checkpoint tensor {extra} is not a parameter of this head"
            )));
        }
        for (name, leaf) in &mut self.tensors {
            let value = values
                .get(name)
                .ok_or_else(|| HeadError::Invalid(format!("checkpoint has no tensor {name}")))?;
            if value.size() != leaf.size() {
                return Err(HeadError::Invalid(format!(
                    "checkpoint tensor {name} has shape {:?}, the head expects {:?}",
                    value.size(),
                    leaf.size()
                )));
            }
            let kind = leaf.kind();
            let device = leaf.device();
            *leaf = value
                .to_kind(kind)
                .to_device(device)
                .detach()
                .copy()
                .set_requires_grad(true);
        }
        Ok(())
    }
}

/// Hands the parameters to layers of the target runtime by name (the leaves themselves, so
/// gradients reach them).
impl WeightSource for &Params {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> headway_model::Result<Tensor> {
        let tensor = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingWeight {
                name: name.to_string(),
                path: "the head's parameters".into(),
            })?;
        check_shape(name, shape, &tensor.size())?;
        Ok(tensor.shallow_clone())
    }

    fn matrix(&mut self, name: &str, shape: &[i64]) -> headway_model::Result<Matrix> {
        let Some(blocks) = self.quantised.get(name) else {
            return Ok(Matrix::Dense(self.tensor(name, shape)?));
        };
        check_shape(name, shape, &blocks.shape())?;
        Ok(blocks.share())
    }
}

/// An error naming parameter `name` unless it has the `expected` shape.
fn check_shape(name: &str, expected: &[i64], found: &[i64]) -> headway_model::Result<()> {
    if found == expected {
        return Ok(());
    }
    Err(ModelError::Shape {
        path: "the head's parameters".into(),
        name: name.to_string(),
        expected: expected.to_vec(),
        found: found.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Matrices of whole blocks keep only their blocks (handed to modules as they are, under a
    /// shape check); a norm and a matrix of rows no whole number of blocks stay f32.
    #[test]
    fn quantised_matrices_keep_only_their_blocks() {
        let options = (Kind::Float, Device::Cpu);
        let mut params = Params::new();
        params.insert("fc.weight", &Tensor::randn([16, 64], options));
        params.insert("odd.weight", &Tensor::randn([4, 40], options));
        params.insert("norm.weight", &Tensor::ones([64], options));
        let numel = params.numel();
        params.freeze();
        params.quantise_matrices(QuantFormat::Q8_0);
        assert_eq!((params.len(), params.numel()), (3, numel));
        assert_eq!(params.shape("fc.weight").unwrap(), vec![16, 64]);
        assert!(params.get("fc.weight").is_err(), "its f32 values are gone");
        let source = &mut &params;
        let blocks = source.matrix("fc.weight", &[16, 64]).unwrap();
        assert!(matches!(blocks, Matrix::Quantised { .. }));
        assert!(
            source.matrix("fc.weight", &[64, 16]).is_err(),
            "shape checked"
        );
        let odd = source.matrix("odd.weight", &[4, 40]).unwrap();
        assert!(matches!(odd, Matrix::Dense(_)));
        assert_eq!(params.get("norm.weight").unwrap().size(), vec![64]);
    }
}
