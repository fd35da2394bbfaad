//! `y = x Wᵀ + b`, with a CPU inference path built for the few-row products of decoding.
//!
//! Decoding multiplies one (or a few) activation rows by every weight matrix, so its speed is the
//! rate at which weights stream from memory. Measured on the 2-core development machine (see
//! docs/benchmarks.md): libtorch's f32 `linear` with one row reads weights at about 11 GB/s and
//! does not spread the work over its threads, while memory delivers about 32 GB/s. Splitting the
//! output features between threads and running the `gemm` crate's kernel on each part, on
//! spinning threads ([`SpinPool`]), reaches about 33 GB/s. Products of up to
//! [`ROW_KERNEL_MAX_ROWS`] rows (decoding, tree verification) run on [`row_kernel`] instead,
//! which streams each weight row once for all rows, so verifying a few tokens costs about what
//! decoding one does. The same split serves prefill and batched feature extraction (`gemm` blocks
//! for cache reuse across rows). bf16 weights take the row kernel too (widened to f32 as they are
//! read, under f32 activations on the CPU, see [`crate::target::activation_kind`]), libtorch's
//! bf16 product past its rows. Training (tensors that require grad), other dtypes and GPUs use
//! libtorch.

use std::ops::Range;
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use crate::cpu::CpuPolicy;
use crate::quant::{dequantise_rows, QuantMatrix};
use crate::quant_kernel::{self, QuantisedRows, StackedMatrix};
use crate::row_kernel::{self, Bf16, Product};
use crate::spin_pool::SpinPool;

/// A weight matrix `[out_features, in_features]` (the HF layout): a tensor, or GGUF blocks that
/// the CPU multiplies without widening them (interleaved by eight rows, [`crate::quant_kernel`];
/// row ranges may differ in format).
pub enum Matrix {
    Dense(Tensor),
    Quantised {
        blocks: StackedMatrix,
        /// The dequantised values, made the first time someone asks for a tensor.
        dense: OnceLock<Tensor>,
    },
}

impl Matrix {
    /// GGUF blocks, repacked for the kernels.
    pub fn quantised(blocks: QuantMatrix) -> Self {
        Self::packed(StackedMatrix::new(&[blocks]).expect("one part"))
    }

    fn packed(blocks: StackedMatrix) -> Self {
        Self::Quantised {
            blocks,
            dense: OnceLock::new(),
        }
    }

    /// The values as a tensor: the dense weight, or (made once, f32 on the CPU) the blocks'.
    pub fn dense(&self) -> &Tensor {
        match self {
            Self::Dense(tensor) => tensor,
            Self::Quantised { blocks, dense } => dense.get_or_init(|| blocks.dequantise()),
        }
    }

    /// Where the values live (quantised blocks: the CPU).
    pub fn device(&self) -> Device {
        match self {
            Self::Dense(tensor) => tensor.device(),
            Self::Quantised { .. } => Device::Cpu,
        }
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [i64; 2] {
        match self {
            Self::Dense(tensor) => {
                let size = tensor.size();
                [size[0], size[1]]
            }
            Self::Quantised { blocks, .. } => [blocks.rows() as i64, blocks.cols() as i64],
        }
    }

    /// Bytes the values occupy as the kernels read them.
    pub fn bytes(&self) -> usize {
        match self {
            Self::Dense(tensor) => tensor.numel() * tensor.kind().elt_size_in_bytes(),
            Self::Quantised { blocks, .. } => blocks.bytes(),
        }
    }

    /// The bytes [`Self::bytes`] counts, as the kernels read them (a quantised matrix's parts
    /// one after another), for `read` to stream: a read-rate probe over the very pages a step
    /// reads. Dense values must be on the CPU and contiguous.
    pub fn for_each_region<'a>(&'a self, read: &mut impl FnMut(&'a [u8])) {
        match self {
            Self::Dense(tensor) => {
                assert!(
                    tensor.device() == Device::Cpu && tensor.is_contiguous(),
                    "a contiguous CPU matrix"
                );
                // SAFETY: checked above: `bytes()` contiguous bytes, borrowed for as long as the
                // tensor (`self`).
                read(unsafe {
                    std::slice::from_raw_parts(tensor.data_ptr() as *const u8, self.bytes())
                })
            }
            Self::Quantised { blocks, .. } => {
                blocks.parts().for_each(|(_, part)| read(part.data()))
            }
        }
    }

    /// The same weights (shared, not copied).
    pub fn share(&self) -> Self {
        match self {
            Self::Dense(tensor) => Self::Dense(tensor.shallow_clone()),
            Self::Quantised { blocks, .. } => Self::packed(blocks.clone()),
        }
    }

    /// Rows `ids` (any shape) as `[.., cols]` values: an embedding lookup.
    pub fn rows(&self, ids: &Tensor) -> Tensor {
        match self {
            Self::Dense(tensor) => Tensor::embedding(tensor, ids, -1, false, false),
            Self::Quantised { blocks, .. } => {
                let flat: Vec<i64> = Vec::try_from(ids.flatten(0, -1).to_device(Device::Cpu))
                    .expect("token ids are integers");
                let mut shape = ids.size();
                shape.push(blocks.cols() as i64);
                dequantise_rows(blocks.cols(), &flat, |row, out| {
                    blocks.dequantise_row(row, out)
                })
                .view(shape.as_slice())
                .to_device(ids.device())
            }
        }
    }

    /// Row `row`'s values widened to f32 into `out` (`cols` long), read in place: quantised
    /// blocks dequantised as [`Self::rows`] does, an f32 or bf16 CPU tensor's row copied. The
    /// few-row code's embedding lookup, with no dense copy of a quantised table. `false`, `out`
    /// untouched, for a row out of range or values that live elsewhere (another device or kind,
    /// a tensor that needs gradients): [`Self::rows`] serves those.
    pub fn row_into(&self, row: usize, out: &mut [f32]) -> bool {
        let [rows, cols] = self.shape().map(|n| n as usize);
        if row >= rows || out.len() != cols {
            return false;
        }
        match self {
            Self::Quantised { blocks, .. } => blocks.dequantise_row(row, out),
            Self::Dense(t) if !t.is_contiguous() || t.device() != Device::Cpu => return false,
            Self::Dense(t) if t.requires_grad() => return false,
            Self::Dense(t) => match t.kind() {
                Kind::Float => out.copy_from_slice(&f32_slice(t)[row * cols..][..cols]),
                Kind::BFloat16 => {
                    // SAFETY: a contiguous bf16 CPU tensor of `rows × cols` elements, borrowed
                    // for the call; `row < rows`.
                    let values = unsafe {
                        std::slice::from_raw_parts(
                            (t.data_ptr() as *const half::bf16).add(row * cols),
                            cols,
                        )
                    };
                    for (o, v) in out.iter_mut().zip(values) {
                        *o = v.to_f32();
                    }
                }
                _ => return false,
            },
        }
        true
    }

    /// The rows of `parts` one after another: quantised when every part is quantised, else a
    /// dense tensor.
    pub fn concat_rows(parts: Vec<Matrix>) -> crate::Result<Matrix> {
        let blocks: Option<Vec<QuantMatrix>> = parts
            .iter()
            .map(|part| match part {
                Self::Quantised { blocks, .. } => Some(blocks.unpacked()),
                Self::Dense(_) => None,
            })
            .collect::<Option<Vec<_>>>()
            .map(|parts| parts.concat());
        if let Some(joined) = blocks.as_deref().and_then(StackedMatrix::new) {
            return Ok(Self::packed(joined));
        }
        let mut dense: Vec<Tensor> = parts.iter().map(|p| p.dense().shallow_clone()).collect();
        Ok(Self::Dense(if dense.len() == 1 {
            dense.remove(0)
        } else {
            Tensor::f_cat(&dense, 0)?
        }))
    }
}

/// A dense layer `y = x Wᵀ + b`.
pub struct Linear {
    weight: Matrix,
    bias: Option<Tensor>,
}

impl Linear {
    /// `weight` is made contiguous so the fast path can read it row by row.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::from_matrix(Matrix::Dense(weight), bias)
    }

    pub fn from_matrix(weight: Matrix, bias: Option<Tensor>) -> Self {
        let weight = match weight {
            Matrix::Dense(tensor) => Matrix::Dense(tensor.contiguous()),
            quantised => quantised,
        };
        Self { weight, bias }
    }

    /// The weight as a tensor (dequantised once, for quantised weights).
    pub fn weight(&self) -> &Tensor {
        self.weight.dense()
    }

    pub fn matrix(&self) -> &Matrix {
        &self.weight
    }

    /// Whether [`Self::forward_rows`] runs this layer: quantised blocks, or an f32 or bf16 CPU
    /// weight the row kernel streams; no gradients.
    pub(crate) fn runs_rows(&self) -> bool {
        let weight = match &self.weight {
            Matrix::Dense(weight) => {
                let streamable = plain_cpu_f32(weight)
                    || (weight.kind() == Kind::BFloat16
                        && weight.device() == Device::Cpu
                        && !weight.requires_grad());
                streamable && row_kernel::available()
            }
            Matrix::Quantised { .. } => true,
        };
        weight
            && self
                .bias
                .as_ref()
                .is_none_or(|b| plain_cpu_f32(b) && b.is_contiguous())
    }

    /// `y = x Wᵀ + b` for `x` of up to [`ROW_KERNEL_MAX_ROWS`] whole rows of f32 features, into
    /// `y` (rows × out_features), on `pool`: the kernels, and so the bits, of [`Self::forward`].
    /// Only where [`Self::runs_rows`] holds.
    pub(crate) fn forward_rows(&self, x: &[f32], y: &mut [f32], pool: &SpinPool) {
        let (columns, parts) = (self.out_features(), pool.parallelism());
        let align = self.column_align();
        let ranges = |part| [even_part(columns, parts, align, part), 0..0];
        let split = ColumnSplit {
            ranges: &ranges,
            then: &|_, _| {},
        };
        self.forward_rows_split(x, y, pool, &split);
    }

    /// What the output features a thread computes should start at a multiple of: whole octets
    /// for quantised weights, so that two threads never unpack the same blocks.
    pub(crate) fn column_align(&self) -> usize {
        match self.weight {
            Matrix::Dense(_) => 1,
            Matrix::Quantised { .. } => quant_kernel::COLUMN_ALIGN,
        }
    }

    /// [`Self::forward_rows`] with the output features shared between `pool`'s threads as
    /// `split` says, each thread then running `split.then` on its own: work that needs only a
    /// thread's columns (rotary on its heads, SiLU on its features) joins the product's parallel
    /// region instead of running on one thread after it. The bits are the same for any split.
    pub(crate) fn forward_rows_split(
        &self,
        x: &[f32],
        y: &mut [f32],
        pool: &SpinPool,
        split: &ColumnSplit,
    ) {
        let out_features = self.out_features();
        let rows = x.len() / self.weight.shape()[1].max(1) as usize;
        assert_eq!(y.len(), rows * out_features, "output size");
        let y_ptr = y.as_mut_ptr() as usize;
        let bias = self.bias.as_ref().map(f32_slice);
        let run = |columns: &(dyn Fn(usize, usize) + Sync)| {
            pool.run(&|part| {
                for range in (split.ranges)(part) {
                    if range.is_empty() {
                        continue;
                    }
                    columns(range.start, range.len());
                    if let Some(bias) = bias {
                        for row in 0..rows {
                            // SAFETY: `y` holds rows × out_features floats, alive for the call,
                            // and this part alone touches these columns.
                            let y = unsafe {
                                let first =
                                    (y_ptr as *mut f32).add(row * out_features + range.start);
                                std::slice::from_raw_parts_mut(first, range.len())
                            };
                            y.iter_mut()
                                .zip(&bias[range.clone()])
                                .for_each(|(y, b)| *y += b);
                        }
                    }
                }
                (split.then)(part, y_ptr as *mut f32);
            })
        };
        match &self.weight {
            Matrix::Dense(weight) => {
                assert!(streams(rows), "few rows");
                run(&dense_columns(x, weight, y));
            }
            Matrix::Quantised { blocks, .. } => {
                let activations = QuantisedRows::new(x, blocks.cols());
                run(&quantised_columns(&activations, blocks, y));
            }
        }
    }

    /// Output features.
    pub(crate) fn out_features(&self) -> usize {
        self.weight.shape()[0] as usize
    }

    /// Input features.
    pub(crate) fn in_features(&self) -> usize {
        self.weight.shape()[1] as usize
    }

    /// `x` is `[..., in_features]`; returns `[..., out_features]`, on Headway's kernels where
    /// `cpu` asks for them and the tensors allow (f32 or bf16 on the CPU, no gradients; quantised
    /// weights always), else libtorch's.
    pub fn forward(&self, x: &Tensor, cpu: &CpuPolicy) -> Tensor {
        let y = match &self.weight {
            Matrix::Dense(weight) => dense_forward(x, weight, cpu),
            Matrix::Quantised { blocks, .. } => quantised_forward(x, blocks, cpu),
        };
        match &self.bias {
            Some(b) => y + b,
            None => y,
        }
    }
}

/// `x wᵀ` for a dense weight.
fn dense_forward(x: &Tensor, weight: &Tensor, cpu: &CpuPolicy) -> Tensor {
    let in_features = weight.size()[1];
    let rows = x.numel() as i64 / in_features.max(1);
    let kind = weight.kind();
    let pool = cpu.pool().filter(|_| {
        weight.device() == Device::Cpu
            && !weight.requires_grad()
            && !x.requires_grad()
            && match (x.kind(), kind) {
                (Kind::Float, Kind::Float) => true,
                // bf16 weights (under bf16 or f32 activations): the row kernel up to its rows.
                (Kind::Float | Kind::BFloat16, Kind::BFloat16) => streams(rows as usize),
                _ => false,
            }
    });
    let Some(pool) = pool else {
        // Past the row kernel's rows (prefill, batches) bf16 weights take libtorch's bf16
        // product, which AMX and AVX-512 BF16 speed up: the activations round to bf16 for it and
        // the result comes back in `x`'s kind.
        return x
            .to_kind(kind)
            .linear::<Tensor>(weight, None)
            .to_kind(x.kind());
    };
    // bf16 activations widen to f32 exactly; the product rounds back to bf16 once.
    let x32 = x
        .to_kind(Kind::Float)
        .contiguous()
        .view([rows, in_features]);
    split_gemm(&x32, weight, pool)
        .to_kind(x.kind())
        .view(output_shape(x, weight.size()[0]).as_slice())
}

/// `x`'s shape with the last dimension `out_features`.
fn output_shape(x: &Tensor, out_features: i64) -> Vec<i64> {
    let mut shape = x.size();
    *shape.last_mut().expect("x has a feature dimension") = out_features;
    shape
}

/// `x wᵀ` for quantised blocks, on the CPU threads `cpu` names; the activations are quantised
/// first (see [`crate::quant_kernel`]), the result has `x`'s kind.
fn quantised_forward(x: &Tensor, blocks: &StackedMatrix, cpu: &CpuPolicy) -> Tensor {
    let x32 = x.to_device(Device::Cpu).to_kind(Kind::Float).contiguous();
    let rows = x32.numel() / blocks.cols().max(1);
    let out_features = blocks.rows();
    let mut y = Tensor::empty(
        [rows as i64, out_features as i64],
        (Kind::Float, Device::Cpu),
    );
    cpu.with_pool(|pool| quantised_into(f32_slice(&x32), blocks, f32_slice_mut(&mut y), pool));
    y.to_kind(x.kind())
        .to_device(x.device())
        .view(output_shape(x, out_features as i64).as_slice())
}

/// `y = x wᵀ` for `x` of whole rows of `blocks.cols()` floats, output features split between
/// `pool`'s threads.
fn quantised_into(x: &[f32], blocks: &StackedMatrix, y: &mut [f32], pool: &SpinPool) {
    let activations = QuantisedRows::new(x, blocks.cols());
    let columns = quantised_columns(&activations, blocks, y);
    split_columns(pool, blocks.rows(), quant_kernel::COLUMN_ALIGN, &columns);
}

/// What computes columns `first..first + len` of `y = x wᵀ` for the quantised `activations` (each
/// column within its own part's row range of `blocks`), any such ranges on any threads at once.
fn quantised_columns<'a>(
    activations: &'a QuantisedRows,
    blocks: &'a StackedMatrix,
    y: &mut [f32],
) -> impl Fn(usize, usize) + Sync + 'a {
    let out_features = blocks.rows();
    assert_eq!(y.len(), activations.rows() * out_features, "output size");
    let y_ptr = y.as_mut_ptr() as usize;
    let isa = quant_kernel::kernel_isa();
    move |first, len| {
        for (part_first, part) in blocks.parts() {
            let start = first.max(part_first);
            let end = (first + len).min(part_first + part.rows());
            if start >= end {
                continue;
            }
            // SAFETY: `isa` was detected on this CPU; y holds rows × out_features floats, the
            // part's columns start `part_first` floats into each row, and each call writes only
            // its own columns.
            unsafe {
                quant_kernel::columns(
                    isa,
                    activations,
                    part,
                    (y_ptr as *mut f32).add(part_first),
                    out_features,
                    start - part_first,
                    end - start,
                )
            }
        }
    }
}

/// Whether `t` is f32 on the CPU without gradients: what Headway's few-row code reads.
pub fn plain_cpu_f32(t: &Tensor) -> bool {
    t.kind() == Kind::Float && t.device() == Device::Cpu && !t.requires_grad()
}

/// The values of a contiguous f32 CPU tensor.
pub fn f32_slice(t: &Tensor) -> &[f32] {
    assert!(
        t.kind() == Kind::Float && t.device() == Device::Cpu && t.is_contiguous(),
        "a contiguous f32 CPU tensor"
    );
    // SAFETY: checked above: `numel` contiguous floats, borrowed for as long as `t`.
    unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, t.numel()) }
}

/// The values of a contiguous f32 CPU tensor, to write.
pub(crate) fn f32_slice_mut(t: &mut Tensor) -> &mut [f32] {
    let len = f32_slice(t).len();
    // SAFETY: as in `f32_slice`; the exclusive borrow of `t` makes this the only view through
    // this handle.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, len) }
}

/// Runs `part(first, len)` for disjoint column ranges covering `0..columns`, one per thread of
/// `pool`, each starting at a multiple of `align`.
fn split_columns(
    pool: &SpinPool,
    columns: usize,
    align: usize,
    part: &(dyn Fn(usize, usize) + Sync),
) {
    let parts = pool.parallelism();
    pool.run(&|index| {
        let range = even_part(columns, parts, align, index);
        if !range.is_empty() {
            part(range.start, range.len());
        }
    });
}

/// Part `index` of `0..columns` cut into `parts` ranges, each starting at a multiple of `align`
/// (the last ones perhaps empty).
pub(crate) fn even_part(columns: usize, parts: usize, align: usize, index: usize) -> Range<usize> {
    let part_len = columns.div_ceil(parts).next_multiple_of(align);
    let first = (index * part_len).min(columns);
    first..(first + part_len).min(columns)
}

/// How a few-row product's output features are shared between a pool's threads, and what each
/// thread does next with its own ([`Linear::forward_rows_split`]).
pub(crate) struct ColumnSplit<'a> {
    /// The output features part `p` computes: up to two ranges (a gate's and its up's).
    pub ranges: &'a (dyn Fn(usize) -> [Range<usize>; 2] + Sync),
    /// Run by part `p` once its features are written, bias included, with the output's first
    /// float: it may read and change that part's own features, and touch nothing else of it.
    pub then: &'a (dyn Fn(usize, *mut f32) + Sync),
}

/// Products with up to this many rows run on [`row_kernel`] (it streams the weight once; `gemm`
/// first packs it), larger ones on `gemm`. 64 is the most rows a step verifies: every
/// verified row must take the kernel decoding takes, whatever the tree size, for its logits to be
/// bit-identical to decoding's. `cargo run --release -p headway-model --example row_kernel`
/// (30 × (1536 × 576) products, one thread), ms row kernel vs gemm: 1 row 4.0 vs 4.6, 2 rows 3.8
/// vs 13.9, 4 rows 4.6 vs 14.3, 8 rows 8.6 vs 16.8, 13 rows 14.1 vs 19.3, 16 rows 19.8 vs 19.5,
/// 20 rows 24.6 vs 22.2, 32 rows 31.8 vs 28.1: past 16 rows the kernel costs up to 13 % more than
/// `gemm` would, the price of exactness. A draft plan that could verify more rows in one step
/// (root, tree and a grafted lookup chain) is refused (`headway_engine::DraftPlan`).
pub const ROW_KERNEL_MAX_ROWS: usize = 64;

/// Whether a product of `rows` rows runs on the row kernel.
fn streams(rows: usize) -> bool {
    rows <= ROW_KERNEL_MAX_ROWS && row_kernel::available()
}

/// `x [rows, in] · wᵀ` for a contiguous f32 `x` and an f32 or bf16 `weight` on the CPU (bf16
/// only where [`streams`]), output features split between `pool`'s threads; f32 result.
fn split_gemm(x: &Tensor, weight: &Tensor, pool: &SpinPool) -> Tensor {
    let rows = x.size()[0];
    let mut y = Tensor::empty([rows, weight.size()[0]], (Kind::Float, Device::Cpu));
    dense_into(f32_slice(x), weight, f32_slice_mut(&mut y), pool);
    y
}

/// `y = x wᵀ` for `x` of whole rows of `in_features` floats and a contiguous f32 or bf16 CPU
/// `weight` (bf16 only where [`streams`]), output features split between `pool`'s threads.
fn dense_into(x: &[f32], weight: &Tensor, y: &mut [f32], pool: &SpinPool) {
    let columns = dense_columns(x, weight, y);
    split_columns(pool, weight.size()[0] as usize, 1, &columns);
}

/// What computes columns `first..first + len` of [`dense_into`]'s product, any such ranges on any
/// threads at once.
fn dense_columns<'a>(
    x: &'a [f32],
    weight: &'a Tensor,
    y: &mut [f32],
) -> impl Fn(usize, usize) + Sync + 'a {
    let (out_features, in_features) = (weight.size()[0] as usize, weight.size()[1] as usize);
    let rows = x.len() / in_features.max(1);
    assert!(
        weight.device() == Device::Cpu && weight.is_contiguous(),
        "a contiguous CPU weight"
    );
    assert_eq!(y.len(), rows * out_features, "output size");
    // Pointers cross into the pool as integers; every part writes a disjoint column range of `y`.
    let (x_ptr, w_ptr, y_ptr) = (
        x.as_ptr() as usize,
        weight.data_ptr() as usize,
        y.as_mut_ptr() as usize,
    );
    let streamed = streams(rows);
    let bf16 = weight.kind() == Kind::BFloat16;
    let product = Product {
        rows,
        in_features,
        y_stride: out_features,
    };
    move |first: usize, len: usize| {
        let (x, y) = (x_ptr as *const f32, y_ptr as *mut f32);
        // SAFETY: x, weight and y hold the shapes and kinds read above, alive for the whole
        // call; a part reads weight rows first..first+len and writes only columns
        // first..first+len of y, so parts never overlap; the row kernel runs only where it is
        // available, and bf16 weights only reach this function where it is.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if streamed {
                if bf16 {
                    row_kernel::columns(x, w_ptr as *const Bf16, y, product, first, len);
                } else {
                    row_kernel::columns(x, w_ptr as *const f32, y, product, first, len);
                }
                return;
            }
            gemm_columns(x, w_ptr as *const f32, y, product, first, len);
        }
    }
}

/// Columns `first..first + len` of `y = x wᵀ` with the `gemm` crate (which packs `w` first).
///
/// # Safety
/// As [`row_kernel::columns`], availability aside.
pub unsafe fn gemm_columns(
    x: *const f32,
    w: *const f32,
    y: *mut f32,
    product: Product,
    first: usize,
    len: usize,
) {
    let Product {
        rows,
        in_features,
        y_stride,
    } = product;
    gemm::gemm(
        rows,
        len,
        in_features,
        y.add(first),
        1,
        y_stride as isize,
        false,
        x,
        1,
        in_features as isize,
        w.add(first * in_features),
        in_features as isize,
        1,
        0.0,
        1.0,
        false,
        false,
        false,
        gemm::Parallelism::None,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuThreads;

    fn decode() -> CpuPolicy {
        CpuThreads::new(2).decode()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// A fused matrix whose parts differ in format (as `Q4_K_M` files store q/k/v) stays
    /// quantised and gives each part's own outputs, bit for bit, for any row count and thread
    /// split; its dense copy and embedding rows are the parts' too.
    #[test]
    fn a_stack_of_formats_computes_each_part_as_alone() {
        use crate::quant::{quantise, QuantFormat};
        let (cols, parts) = (256, [(QuantFormat::Q4_K, 20), (QuantFormat::Q6_K, 13)]);
        let blocks: Vec<QuantMatrix> = parts
            .iter()
            .map(|&(format, rows)| {
                let values = Vec::<f32>::try_from(Tensor::randn(
                    [(rows * cols) as i64],
                    (Kind::Float, Device::Cpu),
                ))
                .unwrap();
                quantise(format, &values, rows, cols)
            })
            .collect();
        let alone: Vec<Linear> = blocks
            .iter()
            .map(|b| Linear::from_matrix(Matrix::quantised(b.clone()), None))
            .collect();
        let parts: Vec<Matrix> = alone.iter().map(|l| l.matrix().share()).collect();
        let fused = Linear::from_matrix(Matrix::concat_rows(parts).unwrap(), None);
        assert!(matches!(fused.matrix(), Matrix::Quantised { .. }));
        assert_eq!(fused.matrix().shape(), [33, cols as i64]);
        for rows in [1, 3, 70] {
            let x = Tensor::randn([rows, cols as i64], (Kind::Float, Device::Cpu));
            for threads in [1, 2] {
                let cpu = CpuThreads::new(threads).decode();
                let each: Vec<Tensor> = alone.iter().map(|l| l.forward(&x, &cpu)).collect();
                let got = fused.forward(&x, &cpu);
                assert!(
                    got.equal(&Tensor::cat(&each, 1)),
                    "{rows} rows, {threads} threads"
                );
            }
        }
        let dense: Vec<Tensor> = alone.iter().map(|l| l.weight().shallow_clone()).collect();
        assert!(fused.weight().equal(&Tensor::cat(&dense, 0)));
        let ids = Tensor::from_slice(&[0i64, 19, 20, 32]);
        assert!(fused
            .matrix()
            .rows(&ids)
            .equal(&fused.weight().index_select(0, &ids)));
    }

    /// A row read in place is [`Matrix::rows`]' row, bit for bit, for quantised blocks and f32
    /// and bf16 tensors, without making the quantised matrix's dense copy; rows out of range,
    /// a wrong width and tensors the few-row code does not read are refused.
    #[test]
    fn a_row_read_in_place_is_the_lookups_row() {
        use crate::quant::{quantise, QuantFormat};
        let (rows, cols) = (12, 64);
        let values = Tensor::randn([rows, cols], (Kind::Float, Device::Cpu));
        let flat = Vec::<f32>::try_from(values.reshape([-1])).unwrap();
        let quantised = Matrix::quantised(quantise(QuantFormat::Q4_1, &flat, 12, 64));
        let tables = [
            quantised,
            Matrix::Dense(values.shallow_clone()),
            Matrix::Dense(values.to_kind(Kind::BFloat16)),
        ];
        let ids = Tensor::from_slice(&[0i64, 5, 11]);
        for table in &tables {
            let expected = table.rows(&ids).to_kind(Kind::Float);
            let mut row = vec![0f32; cols as usize];
            for (i, id) in [0, 5, 11].into_iter().enumerate() {
                assert!(table.row_into(id, &mut row));
                assert!(Tensor::from_slice(&row).equal(&expected.get(i as i64)));
            }
            assert!(!table.row_into(rows as usize, &mut row));
            assert!(!table.row_into(0, &mut row[1..]));
            if let Matrix::Quantised { dense, .. } = table {
                assert!(dense.get().is_none(), "no dense copy made");
            }
        }
        let other_kind = Matrix::Dense(values.to_kind(Kind::Half));
        let strided = Matrix::Dense(values.tr().contiguous().tr());
        for table in [other_kind, strided] {
            assert!(!table.row_into(0, &mut vec![0f32; cols as usize]));
        }
    }

    #[test]
    fn the_fast_path_equals_libtorch_for_every_row_count_and_odd_sizes() {
        for (rows, out, inp) in [
            (1, 7, 5),
            (1, 960, 576),
            (3, 1001, 64),
            (8, 333, 130),
            (9, 64, 32),
            (16, 96, 600),
            (17, 96, 600),
        ] {
            let x = Tensor::randn([1, rows, inp], (Kind::Float, Device::Cpu));
            let w = Tensor::randn([out, inp], (Kind::Float, Device::Cpu));
            let b = Tensor::randn([out], (Kind::Float, Device::Cpu));
            let layer = Linear::new(w.shallow_clone(), Some(b.shallow_clone()));
            let expected = x.linear(&w, Some(&b));
            let got = layer.forward(&x, &decode());
            assert_eq!(got.size(), expected.size());
            assert!(
                max_diff(&got, &expected) < 1e-4,
                "rows {rows} out {out} in {inp}"
            );
        }
    }

    /// Decoding a token alone and verifying it inside a tree must give the same logits: every
    /// row's output is bit-for-bit the same whatever the number of rows beside it, up to the
    /// largest verified tree, for f32 and bf16 weights.
    #[test]
    fn each_row_of_a_few_row_product_equals_that_row_alone() {
        for kind in [Kind::Float, Kind::BFloat16] {
            for inp in [576, 133, 7] {
                let x = Tensor::randn([ROW_KERNEL_MAX_ROWS as i64, inp], (kind, Device::Cpu));
                let weight = Tensor::randn([301, inp], (kind, Device::Cpu));
                let layer = Linear::new(weight, Some(Tensor::randn([301], (kind, Device::Cpu))));
                let cpu = decode();
                for rows in [2, 5, 13, 16, 17, 32, ROW_KERNEL_MAX_ROWS as i64] {
                    let together = layer.forward(&x.narrow(0, 0, rows), &cpu);
                    for row in 0..rows {
                        let alone = layer.forward(&x.narrow(0, row, 1), &cpu);
                        assert!(
                            together.narrow(0, row, 1).equal(&alone),
                            "{kind:?}, in {inp}, row {row} of {rows}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_weights_match_libtorch_within_bf16_rounding() {
        let x = Tensor::randn([5, 576], (Kind::BFloat16, Device::Cpu));
        let w = Tensor::randn([96, 576], (Kind::BFloat16, Device::Cpu));
        let got = Linear::new(w.shallow_clone(), None).forward(&x, &decode());
        assert_eq!(got.kind(), Kind::BFloat16);
        let exact = x
            .to_kind(Kind::Float)
            .linear::<Tensor>(&w.to_kind(Kind::Float), None);
        let relative =
            max_diff(&got.to_kind(Kind::Float), &exact) / exact.abs().max().double_value(&[]);
        assert!(relative < 1e-2, "relative error {relative}");
    }

    /// f32 activations with bf16 weights (a CPU target loaded in bf16): the row kernel up to its
    /// rows gives the f32 product of the widened weights; libtorch's bf16 product past them (130
    /// rows) or without a pool stays within the activations' bf16 rounding; f32 comes back.
    #[test]
    fn bf16_weights_under_f32_activations_match_the_widened_product() {
        let w = Tensor::randn([301, 133], (Kind::BFloat16, Device::Cpu));
        let layer = Linear::new(w.shallow_clone(), None);
        let widened = w.to_kind(Kind::Float);
        for rows in [1, 17, ROW_KERNEL_MAX_ROWS as i64, 130] {
            let x = Tensor::randn([rows, 133], (Kind::Float, Device::Cpu));
            let exact = x.linear::<Tensor>(&widened, None);
            for (cpu, streamed) in [
                (decode(), rows <= ROW_KERNEL_MAX_ROWS as i64),
                (CpuThreads::new(1).batch(), false),
            ] {
                let got = layer.forward(&x, &cpu);
                assert_eq!(got.kind(), Kind::Float);
                let relative = max_diff(&got, &exact) / exact.abs().max().double_value(&[]);
                let bound = if streamed { 1e-5 } else { 2e-2 };
                assert!(relative < bound, "{rows} rows: relative error {relative}");
            }
        }
    }

    #[test]
    fn non_contiguous_inputs_are_handled() {
        let x = Tensor::randn([16, 2], (Kind::Float, Device::Cpu)).tr();
        let w = Tensor::randn([5, 16], (Kind::Float, Device::Cpu));
        let got = Linear::new(w.shallow_clone(), None).forward(&x, &decode());
        assert!(max_diff(&got, &x.linear::<Tensor>(&w, None)) < 1e-4);
    }
}
