//! Attention for the few query rows of decoding and tree verification, each row's output
//! bit-identical whatever rows are computed beside it.
//!
//! libtorch's `scaled_dot_product_attention` picks its CPU kernel, block sizes and GEMM shapes from
//! the number of queries, the key length and whether a mask is given, so one query decoded alone
//! (no mask) and the same query inside a verified tree (many queries, a tree mask) sum in different
//! orders and differ in the last bits; two near-tied logits then pick different tokens. Here every
//! query row is computed by the same steps whatever the others are: scores with [`row_kernel`]
//! (whose outputs do not depend on the row count), the allowed keys in cache order, `exp` of each
//! score minus their maximum, their sum in key order, then the values weighted in key order. A
//! token's allowed keys are the same, in the same order, whether it is decoded after its accepted
//! ancestors or verified beside its tree siblings (a tree lists parents before children), so its
//! output is too.

use tch::{Device, Kind, Tensor};

use crate::row_kernel::{self, Product};
use crate::spin_pool::SpinPool;

/// Which keys each query row may attend to.
#[derive(Clone, Copy)]
pub enum KeyMask<'a> {
    /// Every key (one new token after the cache).
    All,
    /// Query `i` of `n` sees keys `0..=len - n + i` (a prefill, or several new tokens in order).
    Causal,
    /// A boolean mask `[batch or 1, 1, new, len]`, `true` where a query may attend.
    Given(&'a Tensor),
}

/// Whether [`attend`] runs these tensors: f32 or bf16 on the CPU without gradients, on a CPU the
/// row kernel runs on; elsewhere libtorch's attention serves.
pub fn applies(queries: &Tensor, keys: &Tensor) -> bool {
    row_kernel::available()
        && queries.device() == Device::Cpu
        && matches!(queries.kind(), Kind::Float | Kind::BFloat16)
        && keys.kind() == queries.kind()
        && !queries.requires_grad()
        && !keys.requires_grad()
}

/// `softmax(q kᵀ / √d + mask) v` for `queries [batch, heads, new, d]` and `keys`, `values`
/// `[batch, kv_heads, len, d]` (heads share key/value heads in equal groups), split over `pool`'s
/// threads by query rows; returns `[batch, heads, new, d]` in the queries' kind. A row that may
/// attend to no key gets zeros. Only where [`applies`] holds.
pub fn attend(
    queries: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    mask: KeyMask,
    pool: &SpinPool,
) -> Tensor {
    let kind = queries.kind();
    let queries32 = queries.to_kind(Kind::Float).contiguous();
    let (keys32, values32) = (rows_of_f32(keys), rows_of_f32(values));
    let [batch, heads, new, dim] = dims(&queries32);
    let [_, kv_heads, len, _] = dims(&keys32);
    // The mask's bytes, kept alive here while the pool's threads read them.
    let given_mask = match mask {
        KeyMask::Given(m) => Some(m.to_kind(Kind::Bool).contiguous()),
        KeyMask::Causal | KeyMask::All => None,
    };
    let mask = match (&given_mask, mask) {
        (Some(m), _) => Allowed::Given {
            batch_stride: if m.size()[0] == 1 { 0 } else { new * len },
        },
        (None, KeyMask::Causal) => Allowed::Causal,
        (None, _) => Allowed::All,
    };
    let out = Tensor::zeros(
        [batch as i64, heads as i64, new as i64, dim as i64],
        (Kind::Float, Device::Cpu),
    );
    let shape = Shape {
        heads,
        kv_heads,
        group: heads / kv_heads.max(1),
        new,
        len,
        dim,
        scale: 1.0 / (dim as f32).sqrt(),
    };
    let pointers = Pointers {
        queries: queries32.data_ptr() as usize,
        keys: keys32.data_ptr() as usize,
        values: values32.data_ptr() as usize,
        key_strides: [keys32.stride()[0] as usize, keys32.stride()[1] as usize],
        value_strides: [values32.stride()[0] as usize, values32.stride()[1] as usize],
        out: out.data_ptr() as usize,
        mask: given_mask.as_ref().map_or(0, |m| m.data_ptr() as usize),
    };
    let rows = batch * heads * new;
    let part_len = rows.div_ceil(pool.parallelism());
    let run_part = |part: usize| {
        let first = (part * part_len).min(rows);
        let end = (first + part_len).min(rows);
        // SAFETY: the tensors behind `pointers` are f32 (the mask bool) of the shapes read above,
        // their rows of `dim` floats contiguous (the queries and mask wholly), and outlive the
        // call; each part writes only its own rows of `out`.
        unsafe { shape.rows(pointers, &mask, first, end) };
    };
    pool.run(&run_part);
    out.to_kind(kind)
}

/// `t [batch, kv_heads, len, dim]` as f32 whose rows of `dim` floats are contiguous: a cache's
/// keys or values as they are (their heads lie `capacity` rows apart), anything else copied.
fn rows_of_f32(t: &Tensor) -> Tensor {
    let t = t.to_kind(Kind::Float);
    let dim = t.size()[3];
    match t.stride()[..] {
        [_, _, row, 1] if row == dim => t,
        _ => t.contiguous(),
    }
}

fn dims(t: &Tensor) -> [usize; 4] {
    let s = t.size();
    [s[0] as usize, s[1] as usize, s[2] as usize, s[3] as usize]
}

/// The mask as the kernel reads it.
enum Allowed {
    All,
    Causal,
    /// Read through [`Pointers::mask`].
    Given {
        batch_stride: usize,
    },
}

/// Addresses of the f32 tensors (and the bool mask), passed to the pool's threads; keys and values
/// with their batch and head strides.
#[derive(Clone, Copy)]
struct Pointers {
    queries: usize,
    keys: usize,
    values: usize,
    key_strides: [usize; 2],
    value_strides: [usize; 2],
    out: usize,
    mask: usize,
}

#[derive(Clone, Copy)]
struct Shape {
    heads: usize,
    kv_heads: usize,
    /// Query heads per key/value head.
    group: usize,
    new: usize,
    len: usize,
    dim: usize,
    scale: f32,
}

impl Shape {
    /// Computes query rows `first..end`, rows numbered over `[batch, heads, new]`. Rows of one
    /// batch entry and key/value head are adjacent in memory and share keys, so each such run is
    /// one score product.
    ///
    /// # Safety
    /// As in [`attend`]: `pointers` address live tensors of this shape, and no other thread writes
    /// these rows of `out`.
    unsafe fn rows(&self, pointers: Pointers, mask: &Allowed, first: usize, end: usize) {
        let rows_per_kv_head = self.group * self.new;
        let mut scores = vec![0.0f32; rows_per_kv_head.min(end - first) * self.len];
        let mut row = first;
        while row < end {
            let run_end = ((row / rows_per_kv_head + 1) * rows_per_kv_head).min(end);
            self.run(pointers, mask, row, run_end, &mut scores);
            row = run_end;
        }
    }

    /// Rows `first..end`, all of one batch entry and key/value head.
    unsafe fn run(
        &self,
        pointers: Pointers,
        mask: &Allowed,
        first: usize,
        end: usize,
        scores: &mut [f32],
    ) {
        let (len, dim) = (self.len, self.dim);
        let kv_block = first / (self.group * self.new);
        let (batch, kv_head) = (kv_block / self.kv_heads, kv_block % self.kv_heads);
        let at =
            |[batch_stride, head_stride]: [usize; 2]| batch * batch_stride + kv_head * head_stride;
        let keys = (pointers.keys as *const f32).add(at(pointers.key_strides));
        let values = (pointers.values as *const f32).add(at(pointers.value_strides));
        let product = Product {
            rows: end - first,
            in_features: dim,
            y_stride: len,
        };
        let queries = (pointers.queries as *const f32).add(first * dim);
        #[cfg(target_arch = "x86_64")]
        row_kernel::columns(queries, keys, scores.as_mut_ptr(), product, 0, len);
        for (offset, row) in (first..end).enumerate() {
            let row_scores = &mut scores[offset * len..(offset + 1) * len];
            let out =
                std::slice::from_raw_parts_mut((pointers.out as *mut f32).add(row * dim), dim);
            let allowed = self.allowed(pointers, mask, row);
            attend_row(row_scores, &allowed, self.scale, values, dim, out);
        }
    }

    /// Which of the `len` keys query row `row` may attend to.
    unsafe fn allowed(&self, pointers: Pointers, mask: &Allowed, row: usize) -> KeysOf<'_> {
        let query = row % self.new;
        let batch = row / (self.heads * self.new);
        match mask {
            Allowed::All => KeysOf::Prefix(self.len),
            Allowed::Causal => KeysOf::Prefix(self.len - self.new + query + 1),
            Allowed::Given { batch_stride, .. } => {
                let at = batch * batch_stride + query * self.len;
                KeysOf::Mask(std::slice::from_raw_parts(
                    (pointers.mask as *const bool).add(at),
                    self.len,
                ))
            }
        }
    }
}

/// The keys one query may attend to.
enum KeysOf<'a> {
    /// Keys `0..n`.
    Prefix(usize),
    /// Key `j` where `mask[j]`.
    Mask(&'a [bool]),
}

impl KeysOf<'_> {
    fn contains(&self, key: usize) -> bool {
        match self {
            Self::Prefix(n) => key < *n,
            Self::Mask(mask) => mask[key],
        }
    }
}

/// One query's output from its raw scores: softmax over the allowed keys (in key order), then the
/// values weighted in key order. `scores` is overwritten with the weights.
///
/// # Safety
/// `values` holds `scores.len()` rows of `dim` floats.
unsafe fn attend_row(
    scores: &mut [f32],
    allowed: &KeysOf,
    scale: f32,
    values: *const f32,
    dim: usize,
    out: &mut [f32],
) {
    let mut max = f32::NEG_INFINITY;
    for (key, score) in scores.iter_mut().enumerate() {
        if allowed.contains(key) {
            *score *= scale;
            max = max.max(*score);
        }
    }
    if max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0.0f32;
    for (key, score) in scores.iter_mut().enumerate() {
        if allowed.contains(key) {
            *score = (*score - max).exp();
            sum += *score;
        }
    }
    out.fill(0.0);
    for (key, &weight) in scores.iter().enumerate() {
        if allowed.contains(key) {
            let value = std::slice::from_raw_parts(values.add(key * dim), dim);
            // A multiply and an add, never fused: the same in every build of this loop.
            for (o, &v) in out.iter_mut().zip(value) {
                *o += weight * v;
            }
        }
    }
    let inverse = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inverse);
}
