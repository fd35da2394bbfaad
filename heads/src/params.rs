//! A head's trainable tensors by name.

use std::collections::BTreeMap;

use headway_model::quant::QuantFormat;
use headway_model::{ModelError, Quantising, WeightSource};
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
#[derive(Debug, Default)]
pub struct Params {
    tensors: BTreeMap<String, Tensor>,
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
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
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
        self.tensors.values().map(Tensor::numel).sum()
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
impl Params {
    /// The parameters as a source of modules, their matrices quantised to `format` if given
    /// (a head drafting beside a quantised target).
    pub fn drafting_source(&self, format: Option<QuantFormat>) -> Quantising<&Params> {
        Quantising {
            source: self,
            format,
        }
    }
}

impl WeightSource for &Params {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> headway_model::Result<Tensor> {
        let tensor = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingWeight {
                name: name.to_string(),
                path: "the head's parameters".into(),
            })?;
        if tensor.size() != shape {
            return Err(ModelError::Shape {
                path: "the head's parameters".into(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: tensor.size(),
            });
        }
        Ok(tensor.shallow_clone())
    }
}
