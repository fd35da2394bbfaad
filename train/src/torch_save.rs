//! State dicts in `torch.save`'s file format, for loaders that read only that (the EAGLE
//! repository's `pytorch_model.bin`, the Medusa repository's `medusa_lm_head.pt`).
//!
//! The format is a zip archive (entries stored, 64-byte aligned as PyTorch writes them) holding
//! `data.pkl`, a pickle (protocol 2) of an `OrderedDict` from names to tensors, each rebuilt by
//! `torch._utils._rebuild_tensor_v2` from a storage that the pickle names by a persistent id and
//! whose bytes are the entry `data/<key>`. Only globals that `torch.load(weights_only=True)`
//! allows are used.

use std::io::Write;

use anyhow::Context;
use tch::{Kind, Tensor};
use zip::write::SimpleFileOptions;
use zip::{CompressionMethod, ZipWriter};

/// The archive's top-level directory (PyTorch uses the file's stem; readers take any).
const ARCHIVE: &str = "archive";

/// The bytes of `torch.save(state_dict)` for `tensors` (f32, i64 or bool), in that order.
pub fn state_dict_bytes(tensors: &[(String, Tensor)]) -> anyhow::Result<Vec<u8>> {
    let mut pickle = Pickle::default();
    pickle.global("collections", "OrderedDict");
    pickle.op(EMPTY_TUPLE).op(REDUCE).op(MARK);
    let mut storages = Vec::with_capacity(tensors.len());
    for (key, (name, tensor)) in tensors.iter().enumerate() {
        let (storage, bytes) = storage_of(tensor).with_context(|| format!("tensor {name}"))?;
        pickle.string(name);
        pickle.tensor(&key.to_string(), storage, &tensor.size());
        storages.push(bytes);
    }
    pickle.op(SETITEMS).op(STOP);

    let mut zip = ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = SimpleFileOptions::default()
        .compression_method(CompressionMethod::Stored)
        .with_alignment(64);
    let mut entry = |name: &str, bytes: &[u8]| -> anyhow::Result<()> {
        zip.start_file(format!("{ARCHIVE}/{name}"), options)?;
        zip.write_all(bytes)?;
        Ok(())
    };
    entry("data.pkl", &pickle.bytes)?;
    entry("byteorder", b"little")?;
    for (key, bytes) in storages.iter().enumerate() {
        entry(&format!("data/{key}"), bytes)?;
    }
    entry("version", b"3\n")?;
    Ok(zip.finish()?.into_inner())
}

/// The storage class and little-endian bytes of a tensor's values.
fn storage_of(tensor: &Tensor) -> anyhow::Result<(&'static str, Vec<u8>)> {
    let flat = tensor.flatten(0, -1).contiguous();
    Ok(match tensor.kind() {
        Kind::Float => (
            "FloatStorage",
            Vec::<f32>::try_from(&flat)?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        Kind::Int64 => (
            "LongStorage",
            Vec::<i64>::try_from(&flat)?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        Kind::Bool => (
            "BoolStorage",
            Vec::<bool>::try_from(&flat)?
                .iter()
                .map(|&v| u8::from(v))
                .collect(),
        ),
        other => anyhow::bail!("{other:?} tensors are not written (f32, i64 and bool are)"),
    })
}

const PROTO: u8 = 0x80;
const GLOBAL: u8 = b'c';
const EMPTY_TUPLE: u8 = b')';
const REDUCE: u8 = b'R';
const MARK: u8 = b'(';
const TUPLE: u8 = b't';
const BINUNICODE: u8 = b'X';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINPERSID: u8 = b'Q';
const NEWFALSE: u8 = 0x89;
const SETITEMS: u8 = b'u';
const STOP: u8 = b'.';

/// A protocol-2 pickle being written.
struct Pickle {
    bytes: Vec<u8>,
}

impl Default for Pickle {
    fn default() -> Self {
        Self {
            bytes: vec![PROTO, 2],
        }
    }
}

impl Pickle {
    fn op(&mut self, code: u8) -> &mut Self {
        self.bytes.push(code);
        self
    }

    fn global(&mut self, module: &str, name: &str) {
        self.bytes.push(GLOBAL);
        self.bytes
            .extend_from_slice(format!("{module}\n{name}\n").as_bytes());
    }

    fn string(&mut self, text: &str) {
        self.bytes.push(BINUNICODE);
        self.bytes
            .extend_from_slice(&(text.len() as u32).to_le_bytes());
        self.bytes.extend_from_slice(text.as_bytes());
    }

    fn int(&mut self, value: i64) {
        match i32::try_from(value) {
            Ok(small) => {
                self.bytes.push(BININT);
                self.bytes.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                self.bytes.extend_from_slice(&[LONG1, 8]);
                self.bytes.extend_from_slice(&value.to_le_bytes());
            }
        }
    }

    fn ints(&mut self, values: &[i64]) {
        self.op(MARK);
        for &v in values {
            self.int(v);
        }
        self.op(TUPLE);
    }

    /// `_rebuild_tensor_v2(storage, 0, size, contiguous stride, False, OrderedDict())`, its
    /// storage the persistent id `('storage', torch.<storage>, key, 'cpu', numel)`.
    fn tensor(&mut self, key: &str, storage: &str, size: &[i64]) {
        let mut stride = vec![1i64; size.len()];
        for d in (0..size.len().saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * size[d + 1];
        }
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.op(MARK);
        self.op(MARK);
        self.string("storage");
        self.global("torch", storage);
        self.string(key);
        self.string("cpu");
        self.int(size.iter().product());
        self.op(TUPLE).op(BINPERSID);
        self.int(0);
        self.ints(size);
        self.ints(&stride);
        self.op(NEWFALSE);
        self.global("collections", "OrderedDict");
        self.op(EMPTY_TUPLE).op(REDUCE);
        self.op(TUPLE).op(REDUCE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What candle's reader (the one `import` uses for `.bin` files) reads back; PyTorch's own
    /// `torch.load` is the interop test's check.
    #[test]
    fn a_written_state_dict_reads_back_with_names_shapes_and_values() {
        let tensors = vec![
            (
                "layers.0.w".to_string(),
                Tensor::randn([3, 5], (Kind::Float, tch::Device::Cpu)),
            ),
            ("d2t".to_string(), Tensor::from_slice(&[4i64, -2, 7])),
            ("scalar".to_string(), Tensor::from(2.5f32)),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.bin");
        std::fs::write(&path, state_dict_bytes(&tensors).unwrap()).unwrap();
        let read: std::collections::HashMap<String, candle_core::Tensor> =
            candle_core::pickle::read_all(&path)
                .unwrap()
                .into_iter()
                .collect();
        assert_eq!(read.len(), 3);
        for (name, tensor) in &tensors {
            let read_tensor = &read[name];
            let dims: Vec<i64> = read_tensor.dims().iter().map(|&d| d as i64).collect();
            assert_eq!(dims, tensor.size(), "{name}");
            let values = read_tensor
                .flatten_all()
                .unwrap()
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let expected =
                Vec::<f64>::try_from(&tensor.flatten(0, -1).to_kind(Kind::Double)).unwrap();
            assert_eq!(values, expected, "{name}");
        }
    }
}
