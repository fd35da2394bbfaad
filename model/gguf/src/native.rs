//! A GGUF file opened as a target, without converting it: config, tokenizer and chat template
//! from its metadata (as `convert` builds them), and its `Q4_0`, `Q4_1`, `Q8_0`, `Q5_0`, `Q4_K`
//! and `Q6_K` matrices kept as blocks ([`GgufBlocks`]: the first three as stored, the others
//! re-expressed exactly in 32-value blocks), for Headway's quantised CPU kernels
//! ([`headway_model::quant_kernel`]). Every other tensor (norms, biases, other block types) is
//! dequantised as `convert` does. On a GPU or in
//! another dtype than f32 every tensor is dequantised: the quantised kernels are the CPU's.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::GgmlDType;
use tch::{Device, Kind, Tensor};

use headway_model::config::HfConfig;
use headway_model::linear::Matrix;
use headway_model::quant_gguf::GgufBlocks;
use headway_model::target::{missing_target, parse_devices, TargetParts};
use headway_model::{
    ChatTemplate, CpuThreads, Dtype, ModelError, Result, Target, TargetArgs, TextTokenizer,
    WeightSource,
};

use crate::file::GgufFile;
use crate::hf_config::{self, GgufArchitecture};
use crate::tensors::{self, rotary_row_order, unpermute_rotary_rows, TensorPlan};
use crate::tokenizer;

/// Loads the target `--target` names (a model directory or a GGUF file) on `--device` in
/// `--dtype`, on `--threads` CPU threads: the one way the binaries open a target.
pub fn load_target(args: &TargetArgs) -> Result<Target> {
    let devices = parse_devices(&args.device)?;
    let path = args.path();
    let cpu = CpuThreads::checked(args.threads)?;
    let mut target = open_target_placed(&path, args.dtype.kind(), &devices, cpu)?;
    target.set_kv_dtype(args.kv_dtype);
    Ok(target)
}

/// Opens `path`: a GGUF file natively, anything else as an HF model directory.
pub fn open_target(path: &Path, kind: Kind, device: Device, cpu: CpuThreads) -> Result<Target> {
    open_target_placed(path, kind, &[device], cpu)
}

/// [`open_target`] with the layers spread over `devices` (the rest on the first).
pub fn open_target_placed(
    path: &Path,
    kind: Kind,
    devices: &[Device],
    cpu: CpuThreads,
) -> Result<Target> {
    if !path.exists() {
        return Err(missing_target(path));
    }
    if !path.is_file() {
        return Target::load_placed(path, kind, devices, cpu);
    }
    let device = devices[0];
    let dtype = Dtype::of_kind(kind).ok_or_else(|| ModelError::Config {
        path: path.to_path_buf(),
        message: format!("cannot run a target in {kind:?}"),
    })?;
    let mut file = GgufFile::open(path)?;
    let (parts, plans) = gguf_parts(&mut file, dtype)?;
    let mut weights = GgufWeights {
        plans: plans.into_iter().map(|p| (p.hf_name.clone(), p)).collect(),
        file,
        kind,
        device,
        native: device == Device::Cpu && kind == Kind::Float,
    };
    Target::from_parts_placed(parts, &mut weights, kind, devices, cpu)
}

/// The configuration, tokenizer and chat template of a target (a model directory or a GGUF
/// file) without its weights: what a server needs to validate and tokenize requests.
pub fn target_parts(path: &Path) -> Result<TargetParts> {
    if !path.exists() {
        return Err(missing_target(path));
    }
    if !path.is_file() {
        return TargetParts::from_dir(path);
    }
    let mut file = GgufFile::open(path)?;
    Ok(gguf_parts(&mut file, Dtype::F32)?.0)
}

/// A GGUF file's configuration, tokenizer and chat template, and the plan of its tensors.
fn gguf_parts(file: &mut GgufFile, dtype: Dtype) -> Result<(TargetParts, Vec<TensorPlan>)> {
    let path = file.path().to_path_buf();
    let arch = GgufArchitecture::from_file(file)?;
    let config_json = hf_config::build(file, arch, dtype)?;
    let tokenizer = tokenizer::build(file, config_json.max_position_embeddings)?;
    let plans = tensors::plan(file, arch, &config_json)?;
    let json_error = |source| ModelError::Json {
        path: path.clone(),
        source,
    };
    let config: HfConfig = serde_json::to_value(&config_json)
        .and_then(serde_json::from_value)
        .map_err(json_error)?;
    let tokenizer_config = serde_json::to_string(&tokenizer.config).map_err(json_error)?;
    let parts = TargetParts {
        config: config.resolve(&path)?,
        tokenizer: TextTokenizer::from_tokenizer(tokenizer.tokenizer),
        chat_template: ChatTemplate::from_tokenizer_config_text(&tokenizer_config, &path)?,
        path,
    };
    Ok((parts, plans))
}

/// The tensors of a GGUF file by HF name.
struct GgufWeights {
    file: GgufFile,
    plans: HashMap<String, TensorPlan>,
    kind: Kind,
    device: Device,
    /// Whether matrices in a native format stay quantised.
    native: bool,
}

impl GgufWeights {
    /// The plan of `name`, checked against the `shape` the model asks for.
    fn plan(&self, name: &str, shape: &[i64]) -> Result<&TensorPlan> {
        let plan = self
            .plans
            .get(name)
            .ok_or_else(|| ModelError::MissingWeight {
                name: name.to_string(),
                path: self.file.path().to_path_buf(),
            })?;
        if !plan
            .shape
            .iter()
            .map(|&d| d as i64)
            .eq(shape.iter().copied())
        {
            return Err(self.file.error(format!(
                "tensor {} has shape {:?}, the model needs {shape:?}",
                plan.gguf_name, plan.shape
            )));
        }
        Ok(plan)
    }
}

/// The blocks Headway multiplies natively for a GGML type, if any.
pub(crate) fn native_blocks(dtype: GgmlDType) -> Option<GgufBlocks> {
    match dtype {
        GgmlDType::Q4_0 => Some(GgufBlocks::Q4_0),
        GgmlDType::Q4_1 => Some(GgufBlocks::Q4_1),
        GgmlDType::Q8_0 => Some(GgufBlocks::Q8_0),
        GgmlDType::Q5_0 => Some(GgufBlocks::Q5_0),
        GgmlDType::Q4K => Some(GgufBlocks::Q4_K),
        GgmlDType::Q6K => Some(GgufBlocks::Q6_K),
        _ => None,
    }
}

impl WeightSource for GgufWeights {
    fn tensor(&mut self, name: &str, shape: &[i64]) -> Result<Tensor> {
        let plan = self.plan(name, shape)?;
        let (gguf_name, unpermute) = (plan.gguf_name.clone(), plan.unpermute_heads);
        let dense = self.file.read_dense(&gguf_name)?;
        let values = match unpermute {
            Some(heads) => unpermute_rotary_rows(&dense.values, dense.shape[0], heads)
                .map_err(|m| self.file.error(format!("tensor {gguf_name}: {m}")))?,
            None => dense.values,
        };
        Ok(Tensor::from_slice(&values)
            .view(shape)
            .to_kind(self.kind)
            .to_device(self.device))
    }

    fn matrix(&mut self, name: &str, shape: &[i64]) -> Result<Matrix> {
        let plan = self.plan(name, shape)?;
        let (gguf_name, unpermute) = (plan.gguf_name.clone(), plan.unpermute_heads);
        let blocks = native_blocks(self.file.supported_type(&gguf_name)?);
        let Some(blocks) = blocks.filter(|_| self.native) else {
            return Ok(Matrix::Dense(self.tensor(name, shape)?));
        };
        let (_, bytes) = self.file.read_raw(&gguf_name)?;
        let in_file = |m: String| self.file.error(format!("tensor {gguf_name}: {m}"));
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        let mut matrix = blocks.matrix(rows, cols, bytes).map_err(in_file)?;
        if let Some(heads) = unpermute {
            matrix = matrix.permute_rows(&rotary_row_order(rows, heads).map_err(in_file)?);
        }
        Ok(Matrix::quantised(matrix))
    }
}
