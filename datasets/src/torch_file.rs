//! Tensors from `torch.save` files — a zip archive of a pickle and the storages it names — read
//! with candle's pickle reader and handed over as tch tensors. A `.gz` file (SpecForge compresses
//! its offline features so) is first decompressed into a temporary file: the zip's directory sits
//! at its end, so it cannot be read as a stream.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::pickle::PthTensors;
use candle_core::DType;
use tch::{Kind, Tensor};

use crate::error::{DatasetError, Result};

/// An opened `torch.save` file.
pub struct TorchFile {
    path: PathBuf,
    tensors: PthTensors,
    /// The decompressed copy of a `.gz` file, removed on drop.
    _decompressed: Option<tempfile::NamedTempFile>,
}

impl TorchFile {
    /// Opens `path` (`.gz`: decompressed first) and reads its pickle; an error names the file
    /// when it is not a `torch.save` archive.
    pub fn open(path: &Path) -> Result<Self> {
        let decompressed = match path.extension().is_some_and(|e| e == "gz") {
            true => Some(decompress(path)?),
            false => None,
        };
        let archive = decompressed.as_ref().map_or(path, |file| file.path());
        let tensors = PthTensors::new(archive, None).map_err(|e| {
            DatasetError::format(
                path,
                format!("not a torch.save archive candle can read: {e}"),
            )
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            tensors,
            _decompressed: decompressed,
        })
    }

    /// The file it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of the tensors it holds, sorted. A tensor in a storage candle does not read
    /// (bool, int32) is missing here.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .tensors
            .tensor_infos()
            .keys()
            .map(String::as_str)
            .collect();
        names.sort_unstable();
        names
    }

    /// Tensor `name` on the CPU in its stored dtype (f64 as f32); `None` when the file has no
    /// such tensor.
    pub fn get(&self, name: &str) -> Result<Option<Tensor>> {
        let read_error =
            |e: candle_core::Error| DatasetError::format(&self.path, format!("tensor {name}: {e}"));
        let Some(stored) = self.tensors.get(name).map_err(read_error)? else {
            return Ok(None);
        };
        let shape: Vec<i64> = stored.dims().iter().map(|&d| d as i64).collect();
        let flat = stored.flatten_all().map_err(read_error)?;
        // 16-bit floats travel as their bits: captured hidden states are mostly bf16, and
        // widening them on the way would double what is copied.
        let from_bits = |bits: Vec<u16>, kind: Kind| {
            let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
            Tensor::from_data_size(&bytes, &shape, kind)
        };
        let tensor = match stored.dtype() {
            DType::I64 => Tensor::from_slice(&flat.to_vec1::<i64>().map_err(read_error)?),
            DType::U8 => Tensor::from_slice(&flat.to_vec1::<u8>().map_err(read_error)?),
            DType::BF16 => {
                let values = flat.to_vec1::<half::bf16>().map_err(read_error)?;
                let bits = values.iter().map(|v| v.to_bits()).collect();
                return Ok(Some(from_bits(bits, Kind::BFloat16)));
            }
            DType::F16 => {
                let values = flat.to_vec1::<half::f16>().map_err(read_error)?;
                let bits = values.iter().map(|v| v.to_bits()).collect();
                return Ok(Some(from_bits(bits, Kind::Half)));
            }
            _ => {
                let values = flat.to_dtype(DType::F32).map_err(read_error)?;
                Tensor::from_slice(&values.to_vec1::<f32>().map_err(read_error)?)
            }
        };
        Ok(Some(tensor.view(shape.as_slice())))
    }

    /// Every tensor, by name, floating point as f32 (a state dict for f32 modules).
    pub fn read_all_f32(&self) -> Result<BTreeMap<String, Tensor>> {
        self.names()
            .into_iter()
            .map(|name| {
                let tensor = self.get(name)?.expect("listed by the archive");
                let tensor = match tensor.is_floating_point() {
                    true => tensor.to_kind(Kind::Float),
                    false => tensor,
                };
                Ok((name.to_string(), tensor))
            })
            .collect()
    }
}

fn decompress(path: &Path) -> Result<tempfile::NamedTempFile> {
    let io = |e| DatasetError::io(path, e);
    let mut input = flate2::read::GzDecoder::new(std::fs::File::open(path).map_err(io)?);
    let mut output = tempfile::NamedTempFile::new().map_err(io)?;
    std::io::copy(&mut input, &mut output)
        .map_err(|e| DatasetError::format(path, format!("not a readable gzip file: {e}")))?;
    Ok(output)
}
