//! Attention for the few query rows of decoding and tree verification, each row's output
//! bit-identical whatever rows are computed beside it.
//!
//! libtorch's `scaled_dot_product_attention` picks its CPU kernel, block sizes and GEMM shapes from
//! the number of queries, the key length and whether a mask is given, so one query decoded alone
//! (no mask) and the same query inside a verified tree (many queries, a tree mask) sum in different
//! orders and differ in the last bits; two near-tied logits then pick different tokens. Here every
//! query row is computed by the same steps whatever the others are (see [`kernel`]): each score one
//! chain of FMAs over the features, then softmax and the weighted values over the row's allowed
//! keys taken in cache order. A token's allowed keys are the same, in the same order, whether it is
//! decoded after its accepted ancestors or verified beside its tree siblings (a tree lists parents
//! before children), so its output is too.
//!
//! `cargo run --release -p headway-model --example row_attention` times it against libtorch's.

use tch::{Device, Kind, Tensor};

use crate::linear::ROW_KERNEL_MAX_ROWS;
use crate::row_kernel;
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
/// row kernel runs on, at most [`ROW_KERNEL_MAX_ROWS`] new tokens (decoding and verification, as
/// for linear layers); elsewhere libtorch's attention serves. A longer prefill is computed alike
/// in plain and speculative decoding, and libtorch's blocked kernel is faster there (a 1,334-token
/// prompt of SmolLM2: 4.4–4.7 s against 6.6–6.8 s here).
pub fn applies(queries: &Tensor, keys: &Tensor) -> bool {
    row_kernel::available()
        && queries.dim() == 4
        && queries.size()[2] as usize <= ROW_KERNEL_MAX_ROWS
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
    let [batch, heads, new, dim] = dims(&queries32);
    let out = Tensor::zeros(
        [batch as i64, heads as i64, new as i64, dim as i64],
        (Kind::Float, Device::Cpu),
    );
    let layout = RowLayout {
        batch,
        heads,
        new,
        dim,
        strides: RowStrides {
            batch: heads * new * dim,
            head: new * dim,
            token: dim,
        },
    };
    // SAFETY: both tensors are contiguous f32 `[batch, heads, new, dim]`, alive for the call.
    unsafe {
        attend_rows(
            queries32.data_ptr() as *const f32,
            layout,
            (keys, values),
            mask,
            (out.data_ptr() as *mut f32, layout.strides),
            pool,
        )
    };
    out.to_kind(kind)
}

/// Element strides of query or output row `(batch, head, token)`; each row's `dim` features are
/// contiguous.
#[derive(Clone, Copy)]
pub(crate) struct RowStrides {
    pub batch: usize,
    pub head: usize,
    pub token: usize,
}

/// The query rows [`attend_rows`] reads: `batch × heads × new` rows of `dim` floats at `strides`.
#[derive(Clone, Copy)]
pub(crate) struct RowLayout {
    pub batch: usize,
    pub heads: usize,
    pub new: usize,
    pub dim: usize,
    pub strides: RowStrides,
}

/// [`attend`] for queries wherever they lie (the fused q/k/v rows of [`crate::llama`]'s
/// few-row layer), writing each output row at `out.1`'s strides from `out.0`.
///
/// # Safety
/// `queries` addresses the rows `layout` describes and `out.0` as many rows at `out.1`, all
/// alive for the call, the output rows written by nobody else; the keys and values satisfy
/// [`applies`] and `[batch, kv_heads, len, dim]`.
pub(crate) unsafe fn attend_rows(
    queries: *const f32,
    layout: RowLayout,
    (keys, values): (&Tensor, &Tensor),
    mask: KeyMask,
    out: (*mut f32, RowStrides),
    pool: &SpinPool,
) {
    let RowLayout {
        batch,
        heads,
        new,
        dim,
        ..
    } = layout;
    let (keys32, values32) = (rows_of_f32(keys), rows_of_f32(values));
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
        queries: queries as usize,
        query_strides: layout.strides,
        keys: keys32.data_ptr() as usize,
        values: values32.data_ptr() as usize,
        key_strides: [keys32.stride()[0] as usize, keys32.stride()[1] as usize],
        value_strides: [values32.stride()[0] as usize, values32.stride()[1] as usize],
        out: out.0 as usize,
        out_strides: out.1,
        mask: given_mask.as_ref().map_or(0, |m| m.data_ptr() as usize),
    };
    let rows = batch * heads * new;
    let part_len = rows.div_ceil(pool.parallelism());
    let run_part = |part: usize| {
        let first = (part * part_len).min(rows);
        let end = (first + part_len).min(rows);
        // SAFETY: the tensors behind `pointers` are f32 (the mask bool) of the shapes read above,
        // their rows of `dim` floats contiguous (the mask wholly), and outlive the call; each
        // part writes only its own rows of `out`.
        unsafe { shape.rows(pointers, &mask, first, end) };
    };
    pool.run(&run_part);
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
    query_strides: RowStrides,
    keys: usize,
    values: usize,
    key_strides: [usize; 2],
    value_strides: [usize; 2],
    out: usize,
    out_strides: RowStrides,
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
    /// Computes query rows `first..end`, rows numbered over `[batch, heads, new]`, in runs of the
    /// adjacent rows that share one batch entry's key/value head.
    ///
    /// # Safety
    /// As in [`attend`]: `pointers` address live tensors of this shape, and no other thread writes
    /// these rows of `out`; the row kernel is available.
    unsafe fn rows(&self, pointers: Pointers, mask: &Allowed, first: usize, end: usize) {
        let rows_per_kv_head = self.group * self.new;
        let mut scratch = Scratch::new(self.len);
        let mut row = first;
        while row < end {
            let run_end = ((row / rows_per_kv_head + 1) * rows_per_kv_head).min(end);
            self.run(pointers, mask, row, run_end, &mut scratch);
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
        scratch: &mut Scratch,
    ) {
        let dim = self.dim;
        let kv_block = first / (self.group * self.new);
        let (batch, kv_head) = (kv_block / self.kv_heads, kv_block % self.kv_heads);
        let at =
            |[batch_stride, head_stride]: [usize; 2]| batch * batch_stride + kv_head * head_stride;
        let keys = (pointers.keys as *const f32).add(at(pointers.key_strides));
        let values = (pointers.values as *const f32).add(at(pointers.value_strides));
        for row in first..end {
            let query = std::slice::from_raw_parts(
                (pointers.queries as *const f32).add(self.offset(pointers.query_strides, row)),
                dim,
            );
            let out = std::slice::from_raw_parts_mut(
                (pointers.out as *mut f32).add(self.offset(pointers.out_strides, row)),
                dim,
            );
            let allowed = self.allowed(pointers, mask, row);
            kernel::attend_row(query, &allowed, self.scale, (keys, values), scratch, out);
        }
    }

    /// Where row `row` (numbered over `[batch, heads, new]`) starts in a layout of `strides`.
    fn offset(&self, strides: RowStrides, row: usize) -> usize {
        let (batch, head, token) = (
            row / (self.heads * self.new),
            row / self.new % self.heads,
            row % self.new,
        );
        batch * strides.batch + head * strides.head + token * strides.token
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

/// One thread's buffers: a row's scores, and its allowed keys' weights and indices in key order.
struct Scratch {
    scores: Vec<f32>,
    weights: Vec<f32>,
    keys: Vec<usize>,
}

/// Floats per vector: weights and their sum go [`LANES`] keys at a time, dot products and values
/// [`LANES`] features at a time.
const LANES: usize = 8;

impl Scratch {
    fn new(len: usize) -> Self {
        Self {
            scores: vec![0.0; len],
            weights: vec![0.0; len.div_ceil(LANES) * LANES],
            keys: Vec::with_capacity(len),
        }
    }
}

/// The arithmetic, on AVX2 + FMA (where [`row_kernel::available`] holds).
///
/// What makes a row's output independent of the rows and keys beside it: each score is the same
/// sequence of operations on the query and that key alone; softmax and the weighted sum run over
/// the row's allowed keys compacted in key order, so the `i`-th allowed key always falls in lane
/// `i % LANES` of the sum and is the `i`-th term of every output feature's chain. A token decoded
/// alone and the same token in a tree have the same allowed keys in the same order (the prefix,
/// its ancestors, itself), only at other indices of the cache.
#[cfg(target_arch = "x86_64")]
mod kernel {
    use std::arch::x86_64::*;

    use super::{KeysOf, Scratch, LANES};

    /// One query's output: raw scores against every key, softmax over the allowed ones, values
    /// weighted in key order.
    ///
    /// # Safety
    /// AVX2 and FMA are available; `keys` and `values` each hold the scratch's `len` rows of
    /// `query.len()` floats.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_row(
        query: &[f32],
        allowed: &KeysOf,
        scale: f32,
        (keys, values): (*const f32, *const f32),
        scratch: &mut Scratch,
        out: &mut [f32],
    ) {
        let dim = query.len();
        for (key, score) in scratch.scores.iter_mut().enumerate() {
            *score = dot(query, keys.add(key * dim)) * scale;
        }
        scratch.keys.clear();
        match allowed {
            KeysOf::Prefix(n) => scratch.keys.extend(0..*n),
            KeysOf::Mask(mask) => scratch.keys.extend((0..mask.len()).filter(|&k| mask[k])),
        }
        out.fill(0.0);
        let count = scratch.keys.len();
        if count == 0 {
            return;
        }
        let weights = &mut scratch.weights[..count.div_ceil(LANES) * LANES];
        match allowed {
            KeysOf::Prefix(n) => weights[..*n].copy_from_slice(&scratch.scores[..*n]),
            KeysOf::Mask(_) => {
                for (weight, &key) in weights.iter_mut().zip(&scratch.keys) {
                    *weight = scratch.scores[key];
                }
            }
        }
        let sum = exponentiate(weights, count, max(&weights[..count]));
        weigh_values(&weights[..count], &scratch.keys, values, out);
        let inverse = 1.0 / sum;
        out.iter_mut().for_each(|o| *o *= inverse);
    }

    /// The largest of `weights` (exact in any order).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn max(weights: &[f32]) -> f32 {
        let mut chunks = weights.chunks_exact(LANES);
        let mut lanes = _mm256_set1_ps(f32::NEG_INFINITY);
        for chunk in &mut chunks {
            lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(chunk.as_ptr()));
        }
        let mut all = [0.0f32; LANES];
        _mm256_storeu_ps(all.as_mut_ptr(), lanes);
        all.iter()
            .chain(chunks.remainder())
            .fold(f32::NEG_INFINITY, |m, &w| m.max(w))
    }

    /// `q · k`: features `LANES` at a time into two alternating accumulators, their fixed
    /// horizontal sum, then the remaining features in order.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn dot(query: &[f32], key: *const f32) -> f32 {
        let dim = query.len();
        let full = dim / LANES * LANES;
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut at = 0;
        while at + 2 * LANES <= full {
            let q = query.as_ptr().add(at);
            even = _mm256_fmadd_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(key.add(at)), even);
            odd = _mm256_fmadd_ps(
                _mm256_loadu_ps(q.add(LANES)),
                _mm256_loadu_ps(key.add(at + LANES)),
                odd,
            );
            at += 2 * LANES;
        }
        if at < full {
            let q = query.as_ptr().add(at);
            even = _mm256_fmadd_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(key.add(at)), even);
        }
        let mut sum = horizontal_sum(_mm256_add_ps(even, odd));
        for (t, &q) in query.iter().enumerate().skip(full) {
            sum = q.mul_add(*key.add(t), sum);
        }
        sum
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
    }

    /// Replaces the first `count` weights `w` by `exp(w − max)` and the padding after them by 0;
    /// returns their sum, lane `i % LANES` collecting weight `i`.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exponentiate(weights: &mut [f32], count: usize, max: f32) -> f32 {
        let max = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        for (block, chunk) in weights.chunks_exact_mut(LANES).enumerate() {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), max));
            _mm256_storeu_ps(chunk.as_mut_ptr(), e);
            let valid = count - block * LANES;
            if valid < LANES {
                chunk[valid..].fill(0.0);
            }
            sum = _mm256_add_ps(sum, _mm256_loadu_ps(chunk.as_ptr()));
        }
        let mut lanes = [0.0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        lanes.iter().sum()
    }

    /// `out = Σ_i weights[i] · v[keys[i]]` (out starts at zero), each feature one chain of FMAs
    /// over the keys in order; features [`GROUP`] vectors at a time, kept in registers.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weigh_values(weights: &[f32], keys: &[usize], values: *const f32, out: &mut [f32]) {
        let dim = out.len();
        let vectors = dim / LANES;
        let mut first = 0;
        while first + GROUP <= vectors {
            weigh_group::<GROUP>(weights, keys, values, dim, first, out);
            first += GROUP;
        }
        while first < vectors {
            weigh_group::<1>(weights, keys, values, dim, first, out);
            first += 1;
        }
        for (t, feature) in out.iter_mut().enumerate().skip(vectors * LANES) {
            for (&weight, &key) in weights.iter().zip(keys) {
                *feature = weight.mul_add(*values.add(key * dim + t), *feature);
            }
        }
    }

    /// Vectors per pass of [`weigh_values`]: 64 features, 8 of the 16 registers.
    const GROUP: usize = 8;

    /// Feature vectors `first..first + N` of [`weigh_values`].
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn weigh_group<const N: usize>(
        weights: &[f32],
        keys: &[usize],
        values: *const f32,
        dim: usize,
        first: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); N];
        for (&weight, &key) in weights.iter().zip(keys) {
            let value = values.add(key * dim + first * LANES);
            let w = _mm256_set1_ps(weight);
            for (v, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(value.add(v * LANES)), *a);
            }
        }
        for (v, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add((first + v) * LANES), *a);
        }
    }

    /// `e^x` lane by lane (Cephes' single-precision polynomial, within 2 ulp), the same bits
    /// whatever the lane: inputs here are ≤ 0, and below −87.3 give the smallest normal result.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(x, _mm256_set1_ps(-87.336_55));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        // x − n·ln 2 in two steps, ln 2's high part exact in few bits.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            0.166_666_65,
            0.5,
        ] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let p = _mm256_fmadd_ps(
            p,
            _mm256_mul_ps(r, r),
            _mm256_add_ps(r, _mm256_set1_ps(1.0)),
        );
        let exponent = _mm256_slli_epi32(
            _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
            23,
        );
        _mm256_mul_ps(p, _mm256_castsi256_ps(exponent))
    }
}

/// `e^x` for eight `x ≤ 0` at once, each lane's bits independent of the others (for other
/// row-invariant kernels: the few-row decoder layer's SiLU).
#[cfg(target_arch = "x86_64")]
pub(crate) use kernel::exp as exp_nonpositive;

/// Elsewhere [`applies`] is false and this is never called.
#[cfg(not(target_arch = "x86_64"))]
mod kernel {
    use super::{KeysOf, Scratch};

    pub(super) unsafe fn attend_row(
        _: &[f32],
        _: &KeysOf,
        _: f32,
        _: (*const f32, *const f32),
        _: &mut Scratch,
        _: &mut [f32],
    ) {
        unreachable!("row attention runs only where the row kernel does")
    }
}
