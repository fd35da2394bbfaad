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
//! for cache reuse across rows). Training (tensors that require grad), other dtypes and GPUs use
//! libtorch.

use tch::{Device, Kind, Tensor};

use crate::cpu::CpuPolicy;
use crate::row_kernel::{self, Product};
use crate::spin_pool::SpinPool;

/// A dense layer whose weight is `[out_features, in_features]` (the HF layout).
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// `weight` is made contiguous so the fast path can read it row by row.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight: weight.contiguous(),
            bias,
        }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// `x` is `[..., in_features]`; returns `[..., out_features]`, on Headway's kernels where
    /// `cpu` asks for them and the tensors allow (f32 on the CPU, no gradients), else libtorch's.
    pub fn forward(&self, x: &Tensor, cpu: &CpuPolicy) -> Tensor {
        let in_features = self.weight.size()[1];
        let rows = x.numel() as i64 / in_features.max(1);
        let pool = cpu.pool().filter(|_| {
            self.weight.device() == Device::Cpu
                && self.weight.kind() == Kind::Float
                && x.kind() == Kind::Float
                && !self.weight.requires_grad()
                && !x.requires_grad()
        });
        let Some(pool) = pool else {
            return x.linear(&self.weight, self.bias.as_ref());
        };
        let mut out_shape = x.size();
        let out_features = self.weight.size()[0];
        *out_shape.last_mut().expect("x has a feature dimension") = out_features;
        let y = split_gemm(
            &x.contiguous().view([rows, in_features]),
            &self.weight,
            pool,
        )
        .view(out_shape.as_slice());
        match &self.bias {
            Some(b) => y + b,
            None => y,
        }
    }
}

/// Products with up to this many rows run on [`row_kernel`] (it streams the weight once; `gemm`
/// first packs it), larger ones on `gemm`. `cargo run --release -p headway-model --example
/// row_kernel` (30 × (1536 × 576) products, one thread), ms row kernel vs gemm: 1 row 4.0 vs 4.6,
/// 2 rows 3.8 vs 13.9, 4 rows 4.6 vs 14.3, 8 rows 8.6 vs 16.8, 13 rows 14.1 vs 19.3, 16 rows
/// 19.8 vs 19.5 (and 17.1 vs 20.0 in another run), 20 rows 24.6 vs 22.2, 32 rows 31.8 vs 28.1.
const ROW_KERNEL_MAX_ROWS: usize = 16;

/// `x [rows, in] · wᵀ` for contiguous f32 CPU tensors, output features split between `pool`'s
/// threads.
fn split_gemm(x: &Tensor, weight: &Tensor, pool: &SpinPool) -> Tensor {
    let (rows, in_features) = (x.size()[0] as usize, x.size()[1] as usize);
    let out_features = weight.size()[0] as usize;
    let y = Tensor::empty(
        [rows as i64, out_features as i64],
        (Kind::Float, Device::Cpu),
    );
    let parts = pool.parallelism();
    // Pointers cross into the pool as integers; every part writes a disjoint column range of `y`.
    let (x_ptr, w_ptr, y_ptr) = (
        x.data_ptr() as usize,
        weight.data_ptr() as usize,
        y.data_ptr() as usize,
    );
    let part_len = out_features.div_ceil(parts);
    let streamed = rows <= ROW_KERNEL_MAX_ROWS && row_kernel::available();
    let product = Product {
        rows,
        in_features,
        y_stride: out_features,
    };
    let run_part = |part: usize| {
        let first = part * part_len;
        let len = part_len.min(out_features.saturating_sub(first));
        if len == 0 {
            return;
        }
        let (x, w, y) = (x_ptr as *const f32, w_ptr as *const f32, y_ptr as *mut f32);
        // SAFETY: x, weight and y are contiguous f32 CPU tensors of the shapes read above, alive
        // for the whole call; part `part` reads weight rows first..first+len and writes only
        // columns first..first+len of y, so parts never overlap; the row kernel runs only where
        // it is available.
        unsafe {
            #[cfg(target_arch = "x86_64")]
            if streamed {
                row_kernel::columns(x, w, y, product, first, len);
                return;
            }
            gemm_columns(x, w, y, product, first, len);
        }
    };
    pool.run(&run_part);
    y
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
    /// row's output is bit-for-bit the same whatever the number of rows beside it.
    #[test]
    fn each_row_of_a_few_row_product_equals_that_row_alone() {
        for inp in [576, 133, 7] {
            let x = Tensor::randn(
                [ROW_KERNEL_MAX_ROWS as i64, inp],
                (Kind::Float, Device::Cpu),
            );
            let layer = Linear::new(Tensor::randn([301, inp], (Kind::Float, Device::Cpu)), None);
            let cpu = decode();
            for rows in [2, 5, 13, ROW_KERNEL_MAX_ROWS as i64] {
                let together = layer.forward(&x.narrow(0, 0, rows), &cpu);
                for row in 0..rows {
                    let alone = layer.forward(&x.narrow(0, row, 1), &cpu);
                    assert!(
                        together.narrow(0, row, 1).equal(&alone),
                        "in {inp}, row {row} of {rows}"
                    );
                }
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
