//! Where a model's tensors come from: safetensors checkpoints (single file or sharded with an
//! index) or deterministic random values for tests.
//!
//! Layers ask a [`WeightSource`] for each tensor by its HF name and expected shape, so a checkpoint
//! whose tensor is missing or mis-shaped fails at load time with the tensor's name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::Metadata;
use safetensors::SafeTensors;
use tch::{Device, Kind, Tensor};

use crate::linear::Matrix;
use crate::quant::{quantise, QuantFormat};
use crate::safetensors_io::kind_of;
use crate::{ModelError, Result};

/// Hands out a model's tensors by HF name.
pub trait WeightSource {
    /// The tensor `name` with exactly `shape`, on the source's device and dtype; an error names the
    /// tensor when it is absent, mis-shaped or unreadable.
    fn tensor(&mut self, name: &str, shape: &[i64]) -> Result<Tensor>;

    /// The weight matrix `name` of `shape` (`[out, in]`) for a [`crate::linear::Linear`] or an
    /// embedding: quantised where the source stores it so, else [`Self::tensor`].
    fn matrix(&mut self, name: &str, shape: &[i64]) -> Result<Matrix> {
        Ok(Matrix::Dense(self.tensor(name, shape)?))
    }
}

/// `matrix` in `format` (made from its f32 values by [`quantise`]) where it is a dense CPU matrix
/// of whole blocks, else unchanged: a head drafting beside a quantised target then streams a
/// quarter of its f32 bytes per product.
pub fn quantised_matrix(matrix: Matrix, format: QuantFormat) -> Matrix {
    let Matrix::Dense(tensor) = &matrix else {
        return matrix;
    };
    let [rows, cols] = [tensor.size()[0] as usize, tensor.size()[1] as usize];
    if tensor.device() != Device::Cpu || !cols.is_multiple_of(format.row_multiple()) {
        return matrix;
    }
    let values: Vec<f32> = tensor
        .detach()
        .to_kind(Kind::Float)
        .contiguous()
        .view([-1])
        .try_into()
        .expect("f32 values");
    Matrix::quantised(quantise(format, &values, rows, cols))
}

/// One memory-mapped safetensors file with its parsed (and validated) header.
struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    metadata: Metadata,
}

impl SafetensorsFile {
    fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the checkpoint is treated as read-only for the lifetime of the mapping; Headway
        // never writes a checkpoint in place (writes go to a temp file and are renamed).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::Safetensors {
                path: path.to_path_buf(),
                message: format!("{e} (truncated or not a safetensors file?)"),
            })?;
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            header_len,
            metadata,
        })
    }

    fn names(&self) -> Vec<String> {
        self.metadata.tensors().into_keys().collect()
    }

    /// Copies tensor `name` out of the mapping into a CPU tensor of its stored dtype.
    fn read(&self, name: &str) -> Result<Tensor> {
        let info = self
            .metadata
            .info(name)
            .ok_or_else(|| ModelError::MissingWeight {
                name: name.to_string(),
                path: self.path.clone(),
            })?;
        let kind = kind_of(info.dtype).ok_or_else(|| ModelError::Safetensors {
            path: self.path.clone(),
            message: format!("tensor {name} has unsupported dtype {:?}", info.dtype),
        })?;
        let start = 8 + self.header_len + info.data_offsets.0;
        let end = 8 + self.header_len + info.data_offsets.1;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        Tensor::f_from_data_size(&self.mmap[start..end], &shape, kind).map_err(ModelError::from)
    }
}

/// The weights of an HF model directory: `model.safetensors`, or the shards listed in
/// `model.safetensors.index.json`.
pub struct SafetensorsWeights {
    files: Vec<SafetensorsFile>,
    /// Tensor name → index into `files`.
    location: HashMap<String, usize>,
    kind: Kind,
    /// The kind of weight matrices ([`WeightSource::matrix`]); `kind` unless narrowed.
    matrix_kind: Kind,
    device: Device,
}

#[derive(serde::Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl SafetensorsWeights {
    /// Opens the checkpoint in `dir`; tensors are later converted to `kind` on `device`.
    pub fn open(dir: &Path, kind: Kind, device: Device) -> Result<Self> {
        Self::from_files(&weight_files(dir)?, kind, device)
    }

    /// Opens an explicit list of safetensors files (later names win on duplicates).
    pub fn from_files(paths: &[PathBuf], kind: Kind, device: Device) -> Result<Self> {
        let files = paths
            .iter()
            .map(|p| SafetensorsFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        let mut location = HashMap::new();
        for (i, file) in files.iter().enumerate() {
            for name in file.names() {
                location.insert(name, i);
            }
        }
        Ok(Self {
            files,
            location,
            kind,
            matrix_kind: kind,
            device,
        })
    }

    /// Hands out weight matrices in `kind` (the other tensors keep theirs).
    pub fn with_matrix_kind(self, kind: Kind) -> Self {
        Self {
            matrix_kind: kind,
            ..self
        }
    }

    /// The tensor `name` with exactly `shape`, converted to `kind` on the device.
    fn read(&self, name: &str, shape: &[i64], kind: Kind) -> Result<Tensor> {
        let file = self
            .location
            .get(name)
            .map(|&i| &self.files[i])
            .ok_or_else(|| ModelError::MissingWeight {
                name: name.to_string(),
                path: self.describe_files(),
            })?;
        let stored = file.read(name)?;
        if stored.size() != shape {
            return Err(ModelError::Shape {
                path: file.path.clone(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: stored.size(),
            });
        }
        Ok(stored.f_to_kind(kind)?.f_to_device(self.device)?)
    }

    fn describe_files(&self) -> PathBuf {
        match self.files.as_slice() {
            [one] => one.path.clone(),
            many => PathBuf::from(format!("{} safetensors shards", many.len())),
        }
    }
}

/// The safetensors files of the HF model directory `dir`: `model.safetensors`, or the shards that
/// `model.safetensors.index.json` lists (sorted, each once).
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index_path = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    if index_path.exists() {
        shard_paths(dir, &index_path)
    } else if single.exists() {
        Ok(vec![single])
    } else {
        Err(ModelError::io(
            &single,
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model.safetensors or model.safetensors.index.json in the model directory",
            ),
        ))
    }
}

fn shard_paths(dir: &Path, index_path: &Path) -> Result<Vec<PathBuf>> {
    let text = std::fs::read_to_string(index_path).map_err(|e| ModelError::io(index_path, e))?;
    let index: ShardIndex = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: index_path.to_path_buf(),
        source,
    })?;
    let mut shards: Vec<&String> = index.weight_map.values().collect();
    shards.sort();
    shards.dedup();
    Ok(shards.into_iter().map(|s| dir.join(s)).collect())
}

impl WeightSource for SafetensorsWeights {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> Result<Tensor> {
        self.read(name, shape, self.kind)
    }

    fn matrix(&mut self, name: &str, shape: &[i64]) -> Result<Matrix> {
        Ok(Matrix::Dense(self.read(name, shape, self.matrix_kind)?))
    }
}

/// `source` with every tensor moved to `device`: a layer of a target spread over devices. The
/// source reads each tensor where it reads everything (the first device), one at a time.
pub(crate) struct OnDevice<'a> {
    pub source: &'a mut dyn WeightSource,
    pub device: Device,
}

impl WeightSource for OnDevice<'_> {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> Result<Tensor> {
        Ok(self.source.tensor(name, shape)?.f_to_device(self.device)?)
    }

    fn matrix(&mut self, name: &str, shape: &[i64]) -> Result<Matrix> {
        match self.source.matrix(name, shape)? {
            Matrix::Dense(tensor) => Ok(Matrix::Dense(tensor.f_to_device(self.device)?)),
            quantised if self.device == Device::Cpu => Ok(quantised),
            _ => Err(ModelError::Input(format!(
                "{name}: quantised weights run on the CPU only, not on {:?}",
                self.device
            ))),
        }
    }
}

/// Deterministic random weights for tests: the values depend only on the seed and the tensor's
/// name, so two models built with the same seed are identical whatever order layers load in.
pub struct RandomWeights {
    seed: u64,
    kind: Kind,
    device: Device,
}

impl RandomWeights {
    pub fn new(seed: u64, kind: Kind, device: Device) -> Self {
        Self { seed, kind, device }
    }

    /// Norm weights are drawn around 1 and everything else around 0 with a scale that keeps
    /// activations O(1), so random models produce varied, non-degenerate logits.
    fn values(&self, name: &str, numel: usize, fan_in: i64) -> Vec<f32> {
        let name_hash = crate::hash::fnv1a64(name.as_bytes());
        let mut rng = StdRng::seed_from_u64(self.seed ^ name_hash);
        let is_norm = name.ends_with("norm.weight");
        let scale = if is_norm {
            0.1
        } else {
            1.0 / (fan_in.max(1) as f32).sqrt()
        };
        (0..numel)
            .map(|_| {
                let u: f32 = rng.random_range(-1.0..1.0);
                if is_norm {
                    1.0 + scale * u
                } else {
                    scale * u * 1.7
                }
            })
            .collect()
    }
}

impl WeightSource for RandomWeights {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> Result<Tensor> {
        let numel = shape.iter().product::<i64>() as usize;
        let fan_in = *shape.last().unwrap_or(&1);
        let values = self.values(name, numel, fan_in);
        Ok(Tensor::f_from_slice(&values)?
            .f_reshape(shape)?
            .f_to_kind(self.kind)?
            .f_to_device(self.device)?)
    }
}

/// A source that hands out zeros of whatever is asked and records each name and shape: the list
/// of weights a layer or model reads, taken from its loading code itself.
#[derive(Default)]
pub struct ShapeRecorder {
    shapes: Vec<(String, Vec<i64>)>,
}

impl ShapeRecorder {
    /// The recorded `(name, shape)` pairs, in the order they were asked for.
    pub fn into_shapes(self) -> Vec<(String, Vec<i64>)> {
        self.shapes
    }
}

impl WeightSource for ShapeRecorder {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> Result<Tensor> {
        self.shapes.push((name.to_string(), shape.to_vec()));
        Ok(Tensor::f_zeros(shape, (Kind::Float, Device::Cpu))?)
    }
}
