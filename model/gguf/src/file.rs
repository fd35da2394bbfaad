//! An opened GGUF file: typed metadata look-ups and tensor reads whose errors name the file and
//! the key or tensor at fault. Parsing and dequantisation are candle-core's; this layer only adds
//! the checks and the context.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, TensorInfo, Value};
use candle_core::quantized::GgmlDType;
use candle_core::Device;

use headway_model::{ModelError, Result};

/// Tensor types the converter dequantises. candle can read a few more, but these are the ones
/// llama.cpp's common presets produce (`Q5_0` and `Q8_0` where `Q4_K_M` rows are not whole
/// 256-value super-blocks) and the ones the conversion is checked against.
pub(crate) const SUPPORTED_TYPES: &[GgmlDType] = &[
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
    GgmlDType::Q5_0,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
];

/// ggml's own spelling of a tensor type (`Q4_K`, not candle's `Q4K`), for messages and summaries.
pub(super) fn ggml_type_name(dtype: GgmlDType) -> &'static str {
    match dtype {
        GgmlDType::F32 => "F32",
        GgmlDType::F16 => "F16",
        GgmlDType::BF16 => "BF16",
        GgmlDType::Q4_0 => "Q4_0",
        GgmlDType::Q4_1 => "Q4_1",
        GgmlDType::Q5_0 => "Q5_0",
        GgmlDType::Q5_1 => "Q5_1",
        GgmlDType::Q8_0 => "Q8_0",
        GgmlDType::Q8_1 => "Q8_1",
        GgmlDType::Q2K => "Q2_K",
        GgmlDType::Q3K => "Q3_K",
        GgmlDType::Q4K => "Q4_K",
        GgmlDType::Q5K => "Q5_K",
        GgmlDType::Q6K => "Q6_K",
        GgmlDType::Q8K => "Q8_K",
    }
}

/// A dequantised tensor in HF (row-major, outermost dimension first) order.
pub(super) struct DenseTensor {
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

pub(super) struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Parses the header and checks that every tensor's data lies inside the file, so a truncated
    /// download fails here, before any output is written.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let file_len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| ModelError::Gguf {
            path: path.to_path_buf(),
            message: format!("cannot parse the header: {e}"),
        })?;
        let opened = Self {
            path: path.to_path_buf(),
            content,
            reader,
        };
        opened.check_tensor_extents(file_len)?;
        Ok(opened)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A [`ModelError::Gguf`] about this file.
    pub fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::Gguf {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    fn check_tensor_extents(&self, file_len: u64) -> Result<()> {
        for (name, info) in &self.content.tensor_infos {
            let bytes = info.shape.elem_count() / info.ggml_dtype.block_size()
                * info.ggml_dtype.type_size();
            let start = self.content.tensor_data_offset.saturating_add(info.offset);
            let end = start.saturating_add(bytes as u64);
            if end > file_len {
                return Err(self.error(format!(
                    "file is truncated: tensor {name} needs bytes {start}..{end} but the file has \
                     only {file_len} bytes"
                )));
            }
        }
        Ok(())
    }

    pub fn optional(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.optional(key)
            .ok_or_else(|| self.error(format!("missing metadata key {key}")))
    }

    fn wrong_type(&self, key: &str, expected: &str, found: &Value) -> ModelError {
        self.error(format!(
            "metadata key {key}: expected {expected}, found a {:?} value",
            found.value_type()
        ))
    }

    /// An unsigned integer stored as any GGUF integer type (writers disagree on the width).
    fn value_as_u64(&self, key: &str, value: &Value) -> Result<u64> {
        let signed = match value {
            Value::U8(v) => return Ok(u64::from(*v)),
            Value::U16(v) => return Ok(u64::from(*v)),
            Value::U32(v) => return Ok(u64::from(*v)),
            Value::U64(v) => return Ok(*v),
            Value::I8(v) => i64::from(*v),
            Value::I16(v) => i64::from(*v),
            Value::I32(v) => i64::from(*v),
            Value::I64(v) => *v,
            other => return Err(self.wrong_type(key, "an integer", other)),
        };
        u64::try_from(signed).map_err(|_| {
            self.error(format!(
                "metadata key {key}: expected a non-negative integer, found {signed}"
            ))
        })
    }

    pub fn usize(&self, key: &str) -> Result<usize> {
        let value = self.value_as_u64(key, self.required(key)?)?;
        usize::try_from(value)
            .map_err(|_| self.error(format!("metadata key {key}: {value} does not fit in usize")))
    }

    pub fn optional_usize(&self, key: &str) -> Result<Option<usize>> {
        self.optional(key).map(|_| self.usize(key)).transpose()
    }

    /// A token id: a non-negative integer that fits in `u32`.
    pub fn optional_u32(&self, key: &str) -> Result<Option<u32>> {
        let Some(value) = self.optional(key) else {
            return Ok(None);
        };
        let value = self.value_as_u64(key, value)?;
        u32::try_from(value)
            .map(Some)
            .map_err(|_| self.error(format!("metadata key {key}: {value} does not fit in u32")))
    }

    /// A float. llama.cpp stores hyperparameters such as `1e-5` as f32, and widening that gives
    /// 9.99999974e-6; the shortest decimal that round-trips through f32 gives back the 1e-5 the
    /// original HF config had.
    pub fn f64(&self, key: &str) -> Result<f64> {
        match self.required(key)? {
            Value::F32(v) => Ok(v.to_string().parse().unwrap_or(f64::from(*v))),
            Value::F64(v) => Ok(*v),
            other => Err(self.wrong_type(key, "a float", other)),
        }
    }

    pub fn optional_f64(&self, key: &str) -> Result<Option<f64>> {
        self.optional(key).map(|_| self.f64(key)).transpose()
    }

    pub fn optional_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.optional(key) {
            None => Ok(None),
            Some(Value::Bool(v)) => Ok(Some(*v)),
            Some(other) => Err(self.wrong_type(key, "a bool", other)),
        }
    }

    pub fn string(&self, key: &str) -> Result<&str> {
        match self.required(key)? {
            Value::String(v) => Ok(v),
            other => Err(self.wrong_type(key, "a string", other)),
        }
    }

    pub fn optional_string(&self, key: &str) -> Result<Option<&str>> {
        self.optional(key).map(|_| self.string(key)).transpose()
    }

    fn array(&self, key: &str) -> Result<&[Value]> {
        match self.required(key)? {
            Value::Array(items) => Ok(items),
            other => Err(self.wrong_type(key, "an array", other)),
        }
    }

    pub fn strings(&self, key: &str) -> Result<Vec<&str>> {
        self.array(key)?
            .iter()
            .map(|item| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(self.wrong_type(key, "an array of strings", other)),
            })
            .collect()
    }

    pub fn integers(&self, key: &str) -> Result<Vec<i64>> {
        self.array(key)?
            .iter()
            .map(|item| match item {
                Value::I32(v) => Ok(i64::from(*v)),
                Value::U32(v) => Ok(i64::from(*v)),
                Value::I8(v) => Ok(i64::from(*v)),
                Value::U8(v) => Ok(i64::from(*v)),
                Value::I64(v) => Ok(*v),
                other => Err(self.wrong_type(key, "an array of integers", other)),
            })
            .collect()
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Tensor names in file order, so reading them walks the file front to back.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<(&str, u64)> = self
            .content
            .tensor_infos
            .iter()
            .map(|(name, info)| (name.as_str(), info.offset))
            .collect();
        names.sort_by_key(|&(_, offset)| offset);
        names.into_iter().map(|(name, _)| name).collect()
    }

    fn tensor_info(&self, name: &str) -> Result<&TensorInfo> {
        find_tensor(&self.content, &self.path, name)
    }

    /// The HF-order shape of a tensor (candle already reverses GGUF's innermost-first order).
    pub fn tensor_shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.tensor_info(name)?.shape.dims().to_vec())
    }

    /// The tensor's type, or an error naming it when the converter cannot dequantise that type.
    pub fn supported_type(&self, name: &str) -> Result<GgmlDType> {
        let dtype = self.tensor_info(name)?.ggml_dtype;
        if SUPPORTED_TYPES.contains(&dtype) {
            return Ok(dtype);
        }
        let supported: Vec<&str> = SUPPORTED_TYPES.iter().map(|t| ggml_type_name(*t)).collect();
        Err(self.error(format!(
            "tensor {name} has type {}, which the converter cannot dequantise (supported: {})",
            ggml_type_name(dtype),
            supported.join(", ")
        )))
    }

    /// The stored bytes of one tensor, with its type.
    pub fn read_raw(&mut self, name: &str) -> Result<(GgmlDType, Vec<u8>)> {
        let info = find_tensor(&self.content, &self.path, name)?;
        let dtype = info.ggml_dtype;
        let len = info.shape.elem_count() / dtype.block_size() * dtype.type_size();
        let start = self.content.tensor_data_offset + info.offset;
        let mut bytes = vec![0u8; len];
        self.reader
            .seek(SeekFrom::Start(start))
            .and_then(|_| self.reader.read_exact(&mut bytes))
            .map_err(|e| ModelError::io(&self.path, e))?;
        Ok((dtype, bytes))
    }

    /// Reads and dequantises one tensor to f32.
    pub fn read_dense(&mut self, name: &str) -> Result<DenseTensor> {
        let dtype = self.supported_type(name)?;
        // A free function, so `info` borrows only `content` while `reader` is borrowed mutably.
        let info = find_tensor(&self.content, &self.path, name)?;
        let candle_error = |e: candle_core::Error| ModelError::Gguf {
            path: self.path.clone(),
            message: format!("tensor {name} ({}): {e}", ggml_type_name(dtype)),
        };
        let quantized = info
            .read(
                &mut self.reader,
                self.content.tensor_data_offset,
                &Device::Cpu,
            )
            .map_err(candle_error)?;
        let values = quantized
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(candle_error)?;
        Ok(DenseTensor {
            shape: info.shape.dims().to_vec(),
            values,
        })
    }
}

/// The info of tensor `name` in `content`, or an error naming it and the file.
fn find_tensor<'a>(content: &'a Content, path: &Path, name: &str) -> Result<&'a TensorInfo> {
    content
        .tensor_infos
        .get(name)
        .ok_or_else(|| ModelError::MissingWeight {
            name: name.to_string(),
            path: path.to_path_buf(),
        })
}
