//! Tensors to and from safetensors bytes, for the files Headway writes itself (feature shards,
//! head checkpoints). Model checkpoints are read through [`crate::weights`].
//!
//! Output is deterministic: the same tensors and metadata give the same bytes (the safetensors
//! header lists tensors in a fixed order, and Headway's metadata is a single `headway` key holding
//! a JSON string, so no hash-map order reaches the file).

use std::collections::HashMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

use crate::{ModelError, Result};

/// The metadata key under which Headway stores its JSON.
pub const METADATA_KEY: &str = "headway";

/// Serialises `tensors` (any device; copied to the CPU as stored) with `metadata` (a JSON string
/// stored under [`METADATA_KEY`]). `what` names the output in errors.
pub fn to_safetensors_bytes(
    tensors: &[(String, Tensor)],
    metadata: Option<&str>,
    what: &Path,
) -> Result<Vec<u8>> {
    let info = metadata.map(|json| HashMap::from([(METADATA_KEY.to_string(), json.to_string())]));
    serialize(tensors, info, what)
}

/// Serialises `tensors` for tools on the PyTorch side (exports, model files): the header carries
/// `format: pt` as PyTorch's writers put it, since transformers 4 refuses files without it.
pub fn to_pytorch_safetensors_bytes(tensors: &[(String, Tensor)], what: &Path) -> Result<Vec<u8>> {
    let info = HashMap::from([("format".to_string(), "pt".to_string())]);
    serialize(tensors, Some(info), what)
}

/// `tensors` with the header metadata `info` (one key at most: safetensors writes the map in
/// its hash order, and the bytes must not depend on it).
fn serialize(
    tensors: &[(String, Tensor)],
    info: Option<HashMap<String, String>>,
    what: &Path,
) -> Result<Vec<u8>> {
    let data = tensors
        .iter()
        .map(|(name, tensor)| {
            let dtype = dtype_of(tensor.kind()).ok_or_else(|| {
                error(
                    what,
                    format!("tensor {name}: unsupported dtype {:?}", tensor.kind()),
                )
            })?;
            let cpu = tensor.to_device(tch::Device::Cpu).contiguous();
            let mut bytes = vec![0u8; cpu.numel() * cpu.kind().elt_size_in_bytes()];
            cpu.f_copy_data_u8(&mut bytes, cpu.numel())?;
            let shape: Vec<usize> = cpu.size().iter().map(|&d| d as usize).collect();
            Ok((name.clone(), dtype, shape, bytes))
        })
        .collect::<Result<Vec<_>>>()?;
    let views = data
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .map(|view| (name.clone(), view))
                .map_err(|e| error(what, format!("tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize(views, info).map_err(|e| error(what, e.to_string()))
}

/// Every tensor in the safetensors `bytes` (copied to CPU tensors of their stored dtype) and the
/// Headway metadata JSON if present. `what` names the source in errors.
pub fn from_safetensors_bytes(
    bytes: &[u8],
    what: &Path,
) -> Result<(HashMap<String, Tensor>, Option<String>)> {
    let file = SafeTensors::deserialize(bytes)
        .map_err(|e| error(what, format!("{e} (truncated or not a safetensors file?)")))?;
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| error(what, e.to_string()))?;
    let metadata = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(METADATA_KEY).cloned());
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let kind = kind_of(view.dtype()).ok_or_else(|| {
                error(
                    what,
                    format!("tensor {name}: unsupported dtype {:?}", view.dtype()),
                )
            })?;
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            let tensor = Tensor::f_from_data_size(view.data(), &shape, kind)?;
            Ok((name, tensor))
        })
        .collect::<Result<HashMap<_, _>>>()?;
    Ok((tensors, metadata))
}

/// The libtorch kind of a safetensors dtype, for the dtypes Headway reads.
pub fn kind_of(dtype: Dtype) -> Option<Kind> {
    match dtype {
        Dtype::F32 => Some(Kind::Float),
        Dtype::F16 => Some(Kind::Half),
        Dtype::BF16 => Some(Kind::BFloat16),
        Dtype::F64 => Some(Kind::Double),
        Dtype::I64 => Some(Kind::Int64),
        Dtype::I32 => Some(Kind::Int),
        Dtype::U8 => Some(Kind::Uint8),
        Dtype::BOOL => Some(Kind::Bool),
        _ => None,
    }
}

fn dtype_of(kind: Kind) -> Option<Dtype> {
    match kind {
        Kind::Float => Some(Dtype::F32),
        Kind::Half => Some(Dtype::F16),
        Kind::BFloat16 => Some(Dtype::BF16),
        Kind::Double => Some(Dtype::F64),
        Kind::Int64 => Some(Dtype::I64),
        Kind::Int => Some(Dtype::I32),
        Kind::Uint8 => Some(Dtype::U8),
        Kind::Bool => Some(Dtype::BOOL),
        _ => None,
    }
}

fn error(what: &Path, message: String) -> ModelError {
    ModelError::Safetensors {
        path: what.to_path_buf(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_with_metadata_and_the_bytes_are_deterministic() {
        let base = Tensor::arange(12, (Kind::Float, tch::Device::Cpu)).view([3, 4]) / 7.0;
        let tensors: Vec<(String, Tensor)> = [
            Kind::Float,
            Kind::Half,
            Kind::BFloat16,
            Kind::Int,
            Kind::Int64,
            Kind::Uint8,
        ]
        .iter()
        .map(|&kind| (format!("{kind:?}"), base.to_kind(kind)))
        .collect();
        let what = Path::new("test.safetensors");
        let bytes = to_safetensors_bytes(&tensors, Some("{\"a\":1}"), what).unwrap();
        assert_eq!(
            bytes,
            to_safetensors_bytes(&tensors, Some("{\"a\":1}"), what).unwrap()
        );
        let (read, metadata) = from_safetensors_bytes(&bytes, what).unwrap();
        assert_eq!(metadata.as_deref(), Some("{\"a\":1}"));
        for (name, tensor) in &tensors {
            let got = &read[name];
            assert_eq!(got.kind(), tensor.kind());
            assert!(got.equal(tensor), "{name}");
        }
    }

    #[test]
    fn truncated_bytes_name_the_source() {
        let t = vec![(
            "x".to_string(),
            Tensor::ones([4], (Kind::Float, tch::Device::Cpu)),
        )];
        let bytes = to_safetensors_bytes(&t, None, Path::new("a")).unwrap();
        let err = from_safetensors_bytes(&bytes[..bytes.len() - 3], Path::new("shard-7"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("shard-7") && err.contains("truncated"),
            "{err}"
        );
    }
}
