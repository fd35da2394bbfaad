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
//! The query rows that share a key/value head (its query heads × the new tokens) go in chunks of
//! [`CHUNK_ROWS`]: each block of keys, then of values, is read once for the whole chunk and stays
//! in L1 while every row takes its terms from it, and each row's allowed keys are runs read off
//! its mask eight bytes at a time. The order of every row's operations is the one above, whatever
//! the chunk.
//!
//! `cargo run --release -p headway-model --example row_attention` times it against libtorch's.

use tch::{Device, Kind, Tensor};

use crate::linear::ROW_KERNEL_MAX_ROWS;
use crate::row_kernel::{self, Bf16, F16};
use crate::spin_pool::SpinPool;
use crate::Dtype;

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

/// Whether [`attend`] runs these tensors: f32 or bf16 queries and f32, f16 or bf16 keys (a KV
/// cache's `--kv-dtype`) on the CPU without gradients, on a CPU the row kernel runs on, at most
/// [`ROW_KERNEL_MAX_ROWS`] new tokens (decoding and verification, as for linear layers); elsewhere
/// libtorch's attention serves. A longer prefill is computed alike in plain and speculative
/// decoding, and libtorch's blocked kernel is faster there (a 1,334-token prompt of SmolLM2:
/// 4.4–4.7 s against 6.6–6.8 s here).
pub fn applies(queries: &Tensor, keys: &Tensor) -> bool {
    row_kernel::available()
        && queries.dim() == 4
        && queries.size()[2] as usize <= ROW_KERNEL_MAX_ROWS
        && queries.device() == Device::Cpu
        && matches!(queries.kind(), Kind::Float | Kind::BFloat16)
        && Dtype::of_kind(keys.kind()).is_some()
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
    let (keys, values) = (cache_rows(keys), cache_rows(values));
    assert_eq!(values.kind(), keys.kind(), "keys and values of one cache");
    let [_, kv_heads, len, _] = dims(&keys);
    let strides = |t: &Tensor| [t.stride()[0] as usize, t.stride()[1] as usize];
    let cached = KeyValueRows {
        keys: keys.data_ptr() as usize,
        values: values.data_ptr() as usize,
        elements: Dtype::of_kind(keys.kind()).expect("`applies` checked the keys' kind"),
        kv_heads,
        len,
        key_strides: strides(&keys),
        value_strides: strides(&values),
    };
    // SAFETY: both query and output tensors are contiguous f32 `[batch, heads, new, dim]`, the
    // keys and values `[batch, kv_heads, len, dim]` rows as `cached` describes; all alive for
    // the call.
    unsafe {
        let part = AttentionPart {
            queries: queries32.data_ptr() as *const f32,
            layout,
            cached,
            mask,
            out: (out.data_ptr() as *mut f32, layout.strides),
        };
        attend_rows(&[part], pool)
    };
    out.to_kind(kind)
}

/// Keys and values `[batch, kv_heads, len, dim]` where [`attend_rows`] reads them: rows of `dim`
/// contiguous elements of `elements` from `keys` and `values` (addresses), their batch and head
/// strides in elements (a cache's heads lie its capacity apart).
#[derive(Clone, Copy)]
pub(crate) struct KeyValueRows {
    pub keys: usize,
    pub values: usize,
    pub elements: Dtype,
    pub kv_heads: usize,
    pub len: usize,
    pub key_strides: [usize; 2],
    pub value_strides: [usize; 2],
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

/// One attention problem of [`attend_rows`]: query rows wherever they lie (the fused q/k/v rows
/// of [`crate::llama`]'s few-row layer), the keys and values they read, which keys each may see,
/// and where each output row goes (`out.0` at `out.1`'s strides). A forward over several
/// sequences has one part per sequence, each over its own cache.
pub(crate) struct AttentionPart<'a> {
    pub queries: *const f32,
    pub layout: RowLayout,
    pub cached: KeyValueRows,
    pub mask: KeyMask<'a>,
    pub out: (*mut f32, RowStrides),
}

/// One part as the pool's threads read it: addresses only, the mask's bytes kept alive beside.
struct PartPlan {
    shape: Shape,
    pointers: Pointers,
    allowed: Allowed,
    rows: usize,
}

/// [`attend`] for every part in one parallel region, its query rows split over `pool`'s threads
/// by the keys they read (a row's work grows with its part's keys).
///
/// # Safety
/// Each part's `queries` addresses the rows its `layout` describes, `cached` its batch's keys and
/// values, and `out.0` as many rows at `out.1`, all alive for the call, the output rows written
/// by nobody else.
pub(crate) unsafe fn attend_rows(parts: &[AttentionPart], pool: &SpinPool) {
    // The masks' bytes, kept alive here while the pool's threads read them.
    let given_masks: Vec<Option<Tensor>> = parts
        .iter()
        .map(|part| match part.mask {
            KeyMask::Given(m) => Some(m.to_kind(Kind::Bool).contiguous()),
            KeyMask::Causal | KeyMask::All => None,
        })
        .collect();
    let plans: Vec<PartPlan> = parts
        .iter()
        .zip(&given_masks)
        .map(|(part, given_mask)| part.plan(given_mask.as_ref()))
        .collect();
    // Part `i`'s rows take `[starts[i], starts[i + 1])` of the work, `len` units a row.
    let mut starts = vec![0usize];
    for plan in &plans {
        starts.push(starts.last().unwrap() + plan.rows * plan.shape.len.max(1));
    }
    let total = *starts.last().unwrap();
    let threads = pool.parallelism();
    let run_part = |thread: usize| {
        let (from, to) = (total * thread / threads, total * (thread + 1) / threads);
        for (plan, &start) in plans.iter().zip(&starts) {
            // The rows whose work starts in `[from, to)`.
            let cost = plan.shape.len.max(1);
            let row_at = |work: usize| work.saturating_sub(start).div_ceil(cost).min(plan.rows);
            let (first, end) = (row_at(from), row_at(to));
            if first < end {
                // SAFETY: the tensors behind the part's pointers are f32 (keys and values of
                // `elements`, the mask bool) of the shapes read above, their rows of `dim`
                // elements contiguous (the mask wholly), and outlive the call; each thread writes
                // only its own rows of `out`.
                unsafe { plan.shape.rows(plan.pointers, &plan.allowed, first, end) };
            }
        }
    };
    pool.run(&run_part);
}

impl AttentionPart<'_> {
    fn plan(&self, given_mask: Option<&Tensor>) -> PartPlan {
        let RowLayout {
            batch,
            heads,
            new,
            dim,
            ..
        } = self.layout;
        let KeyValueRows { kv_heads, len, .. } = self.cached;
        let allowed = match (given_mask, self.mask) {
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
            queries: self.queries as usize,
            query_strides: self.layout.strides,
            cached: self.cached,
            out: self.out.0 as usize,
            out_strides: self.out.1,
            mask: given_mask.map_or(0, |m| m.data_ptr() as usize),
        };
        PartPlan {
            shape,
            pointers,
            allowed,
            rows: batch * heads * new,
        }
    }
}

/// `t [batch, kv_heads, len, dim]` with rows of `dim` contiguous elements: a cache's keys or
/// values as they are (their heads lie `capacity` rows apart, in the cache's element type),
/// anything else copied.
fn cache_rows(t: &Tensor) -> Tensor {
    let dim = t.size()[3];
    match t.stride()[..] {
        [_, _, row, 1] if row == dim => t.shallow_clone(),
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

/// Addresses of the f32 tensors (and the bool mask), passed to the pool's threads, beside the
/// keys and values they read.
#[derive(Clone, Copy)]
struct Pointers {
    queries: usize,
    query_strides: RowStrides,
    cached: KeyValueRows,
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
        let bytes = pointers.cached.elements.bytes();
        let at = |[batch_stride, head_stride]: [usize; 2]| {
            (batch * batch_stride + kv_head * head_stride) * bytes
        };
        let keys = (pointers.cached.keys as *const u8).add(at(pointers.cached.key_strides));
        let values = (pointers.cached.values as *const u8).add(at(pointers.cached.value_strides));
        for chunk in (first..end).step_by(CHUNK_ROWS) {
            let rows: Vec<Row> = (chunk..(chunk + CHUNK_ROWS).min(end))
                .map(|row| Row {
                    query: std::slice::from_raw_parts(
                        (pointers.queries as *const f32)
                            .add(self.offset(pointers.query_strides, row)),
                        dim,
                    ),
                    allowed: self.allowed(pointers, mask, row),
                    out: std::slice::from_raw_parts_mut(
                        (pointers.out as *mut f32).add(self.offset(pointers.out_strides, row)),
                        dim,
                    ),
                })
                .collect();
            let scale = self.scale;
            match pointers.cached.elements {
                Dtype::F32 => {
                    kernel::attend_chunk::<f32>(rows, scale, keys.cast(), values.cast(), scratch)
                }
                Dtype::F16 => {
                    kernel::attend_chunk::<F16>(rows, scale, keys.cast(), values.cast(), scratch)
                }
                Dtype::Bf16 => {
                    kernel::attend_chunk::<Bf16>(rows, scale, keys.cast(), values.cast(), scratch)
                }
            }
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

/// One query row of a chunk: its features, the keys it may attend to, and where its output goes.
struct Row<'a> {
    query: &'a [f32],
    allowed: KeysOf<'a>,
    out: &'a mut [f32],
}

/// The keys one query may attend to.
enum KeysOf<'a> {
    /// Keys `0..n`.
    Prefix(usize),
    /// Key `j` where `mask[j]`.
    Mask(&'a [bool]),
}

/// One thread's buffers, for each row of a chunk: its scores against every key, its allowed
/// keys as runs in key order, and their weights, compacted.
struct Scratch {
    len: usize,
    scores: Vec<f32>,
    weights: Vec<f32>,
    runs: Vec<Vec<std::ops::Range<usize>>>,
}

/// Floats per vector: weights and their sum go [`LANES`] keys at a time, dot products and values
/// [`LANES`] features at a time.
const LANES: usize = 8;

/// Query rows of one key/value head computed together: each block of keys, then of values, is
/// read into the cache once and serves them all.
const CHUNK_ROWS: usize = 8;

impl Scratch {
    fn new(len: usize) -> Self {
        Self {
            len,
            scores: vec![0.0; CHUNK_ROWS * len],
            weights: vec![0.0; CHUNK_ROWS * Self::padded(len)],
            runs: vec![Vec::new(); CHUNK_ROWS],
        }
    }

    /// A row's room for weights: whole vectors.
    fn padded(len: usize) -> usize {
        len.div_ceil(LANES) * LANES
    }
}

/// Appends the runs of `true` in `mask` to `runs`, in order, eight bytes at a time where they
/// agree.
fn mask_runs(mask: &[bool], runs: &mut Vec<std::ops::Range<usize>>) {
    // SAFETY: a bool is one byte, 0 or 1.
    let bytes = unsafe { std::slice::from_raw_parts(mask.as_ptr() as *const u8, mask.len()) };
    let word = |k: usize| {
        bytes
            .get(k..k + 8)
            .map(|b| u64::from_ne_bytes(b.try_into().unwrap()))
    };
    let skip = |mut k: usize, value: bool| {
        let whole = if value { u64::from_ne_bytes([1; 8]) } else { 0 };
        while k < bytes.len() && mask[k] == value {
            k += match word(k) {
                Some(w) if w == whole => 8,
                _ => 1,
            };
        }
        k
    };
    let mut k = 0;
    while k < bytes.len() {
        let start = skip(k, false);
        k = skip(start, true);
        if start < k {
            runs.push(start..k);
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

    use super::{mask_runs, KeysOf, Row, Scratch, LANES};
    use crate::row_kernel::Element;

    /// Keys per block of [`weigh_values`]: their values (16 KiB of f32 at 64 features) stay in
    /// L1 while every row of the chunk takes its terms from them.
    const VALUE_BLOCK: usize = 64;

    /// The outputs of `rows` (at most [`super::CHUNK_ROWS`], one key/value head): raw scores
    /// against every key, softmax over each row's allowed ones, values weighted in key order.
    /// Keys and values are stored as `E` and widened to f32 as they are loaded.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `keys` and `values` each hold the scratch's `len` rows
    /// of `query.len()` elements.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_chunk<E: Element>(
        mut rows: Vec<Row>,
        scale: f32,
        keys: *const E,
        values: *const E,
        scratch: &mut Scratch,
    ) {
        let len = scratch.len;
        let padded = Scratch::padded(len);
        let dim = rows.first().map_or(0, |row| row.query.len());
        // Head widths of common models as constants (see `lane_sums`), any other as it comes.
        let scores = &mut scratch.scores;
        match dim {
            64 => score_keys::<E, 8>(&rows, keys, len, scale, scores),
            128 => score_keys::<E, 16>(&rows, keys, len, scale, scores),
            _ => score_keys::<E, 0>(&rows, keys, len, scale, scores),
        }
        // Each row's sum of weights; none where it may attend to no key (its output stays zero).
        let mut sums = [None; super::CHUNK_ROWS];
        for (r, row) in rows.iter_mut().enumerate() {
            let runs = &mut scratch.runs[r];
            runs.clear();
            match row.allowed {
                KeysOf::Prefix(n) if n > 0 => runs.push(0..n),
                KeysOf::Prefix(_) => {}
                KeysOf::Mask(mask) => mask_runs(mask, runs),
            }
            row.out.fill(0.0);
            let weights = &mut scratch.weights[r * padded..][..padded];
            let scores = &scratch.scores[r * len..][..len];
            let mut count = 0;
            for run in runs.iter() {
                weights[count..count + run.len()].copy_from_slice(&scores[run.clone()]);
                count += run.len();
            }
            if count > 0 {
                let weights = &mut weights[..count.div_ceil(LANES) * LANES];
                sums[r] = Some(exponentiate(weights, count, max(&weights[..count])));
            }
        }
        for first in (0..len).step_by(VALUE_BLOCK) {
            let block = first..(first + VALUE_BLOCK).min(len);
            for (r, row) in rows.iter_mut().enumerate() {
                let mut weight = 0;
                for run in &scratch.runs[r] {
                    let part = run.start.max(block.start)..run.end.min(block.end);
                    if !part.is_empty() {
                        let first = weight + part.start - run.start;
                        let weights = &scratch.weights[r * padded + first..][..part.len()];
                        weigh_values(weights, values.add(part.start * dim), row.out);
                    }
                    weight += run.len();
                }
            }
        }
        for (row, sum) in rows.iter_mut().zip(sums) {
            if let Some(sum) = sum {
                let inverse = 1.0 / sum;
                row.out.iter_mut().for_each(|o| *o *= inverse);
            }
        }
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

    /// `scores[r · len + j] = (q_r · k_j) · scale` for every row `r` and key `j` of `keys` (`len`
    /// rows of the queries' width), each exactly as [`dot`] forms it. [`LANES`] keys at a time
    /// for every row (the keys stay in L1 meanwhile), their horizontal sums taken together by
    /// [`horizontal_sums`] (one sum at a time cost about as much as the products themselves).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn score_keys<E: Element, const VECTORS: usize>(
        rows: &[Row],
        keys: *const E,
        len: usize,
        scale: f32,
        scores: &mut [f32],
    ) {
        let Some(dim) = rows.first().map(|row| row.query.len()) else {
            return;
        };
        let whole = dim % LANES == 0;
        let key = |k: usize| keys.add(k * dim);
        for block in (0..len / LANES * LANES).step_by(LANES) {
            for (r, row) in rows.iter().enumerate() {
                let sums = horizontal_sums(|k| lane_sums::<E, VECTORS>(row.query, key(block + k)));
                let out = scores.as_mut_ptr().add(r * len + block);
                if whole {
                    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
                } else {
                    _mm256_storeu_ps(out, sums);
                    for k in 0..LANES {
                        *out.add(k) = tail(row.query, key(block + k), *out.add(k)) * scale;
                    }
                }
            }
        }
        for k in len / LANES * LANES..len {
            for (r, row) in rows.iter().enumerate() {
                scores[r * len + k] = dot(row.query, key(k)) * scale;
            }
        }
    }

    /// `q · k`: [`lane_sums`], their fixed [`horizontal_sum`], then the remaining features in
    /// order ([`tail`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot<E: Element>(query: &[f32], key: *const E) -> f32 {
        tail(query, key, horizontal_sum(lane_sums::<E, 0>(query, key)))
    }

    /// `sum` plus the products of the features past the last whole vector, in order.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tail<E: Element>(query: &[f32], key: *const E, mut sum: f32) -> f32 {
        for (t, &q) in query.iter().enumerate().skip(query.len() / LANES * LANES) {
            sum = q.mul_add(E::load1(key, t), sum);
        }
        sum
    }

    /// The products of `q` and `k`'s whole vectors of features, [`LANES`] at a time into two
    /// alternating accumulators, then their sum: lane `l` holds the features `l mod LANES`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn lane_sums<E: Element, const VECTORS: usize>(query: &[f32], key: *const E) -> __m256 {
        // A constant where the caller knows the width (then the loop unrolls and the query
        // stays in registers across keys), else the query's.
        let vectors = match VECTORS {
            0 => query.len() / LANES,
            known => known,
        };
        let q = |v: usize| _mm256_loadu_ps(query.as_ptr().add(v * LANES));
        let k = |v: usize| E::load8(key, v * LANES);
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for pair in 0..vectors / 2 {
            let v = 2 * pair;
            even = _mm256_fmadd_ps(q(v), k(v), even);
            odd = _mm256_fmadd_ps(q(v + 1), k(v + 1), odd);
        }
        if vectors % 2 == 1 {
            let v = vectors - 1;
            even = _mm256_fmadd_ps(q(v), k(v), even);
        }
        _mm256_add_ps(even, odd)
    }

    /// The sum of `v`'s lanes: `((v₀ + v₄) + (v₂ + v₆)) + ((v₁ + v₅) + (v₃ + v₇))`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn horizontal_sum(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)))
    }

    /// Lane `k` the [`horizontal_sum`] of `vector(k)`, by the same additions in the same order,
    /// for eight vectors at once: first each vector's halves (`v₀ + v₄`, …), then each quad's
    /// (`q₀ + q₂`, `q₁ + q₃`), then each pair's. Each vector is asked for only when its first
    /// addition is due, so at most two of them and two partial sums are live at once and the
    /// queries and accumulators of [`score_keys`] can stay in registers.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn horizontal_sums(mut vector: impl FnMut(usize) -> __m256) -> __m256 {
        // (quads of v[2i] | quads of v[2i + 1]).
        let mut quad = |i: usize| {
            let (a, b) = (vector(2 * i), vector(2 * i + 1));
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        };
        // (pairs of v[4i], of v[4i + 2] | pairs of v[4i + 1], of v[4i + 3]).
        let mut pair = |i: usize| {
            let (a, b) = (quad(2 * i), quad(2 * i + 1));
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        };
        let pairs = [pair(0), pair(1)];
        // Sums of v[0], v[2], v[4], v[6] | of v[1], v[3], v[5], v[7].
        let sums = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(pairs[0], pairs[1]),
            _mm256_shuffle_ps::<0b11_01_11_01>(pairs[0], pairs[1]),
        );
        _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// Eight vectors' horizontal sums taken together and one at a time (for the tests).
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sums_both_ways(values: &[f32]) -> ([f32; LANES], [f32; LANES]) {
        let v: [__m256; LANES] =
            std::array::from_fn(|k| _mm256_loadu_ps(values[k * LANES..].as_ptr()));
        let mut together = [0f32; LANES];
        _mm256_storeu_ps(together.as_mut_ptr(), horizontal_sums(|k| v[k]));
        (together, v.map(|v| horizontal_sum(v)))
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

    /// `out += Σ_i weights[i] · v_i` for the `weights.len()` consecutive value rows from `values`,
    /// each feature one chain of FMAs over the keys in order (continued from the last block's);
    /// features [`GROUP`] vectors at a time, kept in registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weigh_values<E: Element>(weights: &[f32], values: *const E, out: &mut [f32]) {
        let dim = out.len();
        let vectors = dim / LANES;
        let mut first = 0;
        while first + GROUP <= vectors {
            weigh_group::<E, GROUP>(weights, values, dim, first, out);
            first += GROUP;
        }
        while first < vectors {
            weigh_group::<E, 1>(weights, values, dim, first, out);
            first += 1;
        }
        for (t, feature) in out.iter_mut().enumerate().skip(vectors * LANES) {
            for (k, &weight) in weights.iter().enumerate() {
                *feature = weight.mul_add(E::load1(values, k * dim + t), *feature);
            }
        }
    }

    /// Vectors per pass of [`weigh_values`]: 64 features, 8 of the 16 registers.
    const GROUP: usize = 8;

    /// Feature vectors `first..first + N` of [`weigh_values`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn weigh_group<E: Element, const N: usize>(
        weights: &[f32],
        values: *const E,
        dim: usize,
        first: usize,
        out: &mut [f32],
    ) {
        let out = out.as_mut_ptr().add(first * LANES);
        let mut acc: [__m256; N] = std::array::from_fn(|v| _mm256_loadu_ps(out.add(v * LANES)));
        for (k, &weight) in weights.iter().enumerate() {
            let value = values.add(k * dim + first * LANES);
            let w = _mm256_set1_ps(weight);
            for (v, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(w, E::load8(value, v * LANES), *a);
            }
        }
        for (v, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.add(v * LANES), *a);
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
    use super::{Row, Scratch};
    use crate::row_kernel::Element;

    pub(super) unsafe fn attend_chunk<E: Element>(
        _: Vec<Row>,
        _: f32,
        _: *const E,
        _: *const E,
        _: &mut Scratch,
    ) {
        unreachable!("row attention runs only where the row kernel does")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs of a mask read eight bytes at a time where they can: every mask of up to 20 keys
    /// from a fixed pattern and its shifts gives the runs a plain scan gives.
    #[test]
    fn mask_runs_are_the_runs_of_true_in_order() {
        let pattern = [
            1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1,
        ];
        for len in 0..=20 {
            for shift in 0..pattern.len() {
                let mask: Vec<bool> = (0..len)
                    .map(|k| pattern[(k + shift) % pattern.len()] == 1)
                    .collect();
                let mut runs = Vec::new();
                mask_runs(&mask, &mut runs);
                let mut want: Vec<std::ops::Range<usize>> = Vec::new();
                for k in (0..len).filter(|&k| mask[k]) {
                    match want.last_mut() {
                        Some(run) if run.end == k => run.end += 1,
                        _ => want.push(k..k + 1),
                    }
                }
                assert_eq!(runs, want, "{mask:?}");
            }
        }
    }

    /// Keys and values stored in 16 bits are read as the f32 values they widen to: the same bits
    /// as an f32 cache holding those values, at key counts with partial tiles and tails, with
    /// and without a mask.
    #[test]
    fn sixteen_bit_keys_attend_as_their_f32_values() {
        if !row_kernel::available() {
            return;
        }
        let pool = SpinPool::new(2);
        let options = (Kind::Float, Device::Cpu);
        for (len, new) in [(7, 1), (64, 3), (150, 8), (301, 17)] {
            let queries = Tensor::randn([1, 6, new, 64], options);
            let mask = Tensor::rand([1, 1, new, len], options).gt(0.3);
            for kind in [Kind::Half, Kind::BFloat16] {
                let keys = Tensor::randn([1, 2, len, 64], options).to_kind(kind);
                let values = Tensor::randn([1, 2, len, 64], options).to_kind(kind);
                let wide = |t: &Tensor| t.to_kind(Kind::Float);
                for mask in [KeyMask::All, KeyMask::Given(&mask)] {
                    let narrow = attend(&queries, &keys, &values, mask, &pool);
                    let f32s = attend(&queries, &wide(&keys), &wide(&values), mask, &pool);
                    assert!(narrow.equal(&f32s), "{kind:?}, {len} keys, {new} rows");
                }
            }
        }
    }

    /// Eight horizontal sums at once give each lane the bits of one sum at a time.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn horizontal_sums_together_equal_one_at_a_time() {
        if !row_kernel::available() {
            return;
        }
        let values = Tensor::randn([8, 8], (Kind::Float, Device::Cpu));
        let values = Vec::<f32>::try_from(values.view(-1)).unwrap();
        let (together, alone) = unsafe { kernel::sums_both_ways(&values) };
        assert_eq!(together.map(f32::to_bits), alone.map(f32::to_bits));
    }
}
