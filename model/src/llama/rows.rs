//! A decoder layer over the few f32 rows of decoding and tree verification, in Headway's own code.
//!
//! Once the weights are quantised, a decode step of SmolLM2-135M lasts ~10 ms over 30 layers, and
//! the ~35 libtorch ops of a layer outside its matrix products (norms, rotary, SiLU, adds, views,
//! the cache copy) cost a few microseconds of dispatch each: a third of the step. Here a layer is
//! plain loops over row buffers around the same matrix kernels and row attention as the tensor
//! path ([`Linear::forward_rows`], [`row_attention::attend_rows`]), new keys and values written
//! straight into the cache.
//!
//! Exactness rests on every row being computed by the same operations whatever rows are beside
//! it: norms, rotary and SiLU run row by row (SiLU lane by lane), products and attention on the
//! row-invariant kernels, so a token verified inside a tree gets the bits it gets when decoded.

use tch::{Device, Kind, Tensor};

use super::{key_mask, Attention, DecoderLayer, LayerContext, Mlp, RmsNorm};
use crate::kv_cache::KvCache;
use crate::linear::{
    even_part, f32_slice, f32_slice_mut, plain_cpu_f32, ColumnSplit, Linear, ROW_KERNEL_MAX_ROWS,
};
use crate::row_attention::{self, AttentionPart, KeyMask, KeyValueRows, RowLayout, RowStrides};
use crate::row_kernel;
use crate::spin_pool::SpinPool;
use crate::{kv_elements, Dtype};

impl DecoderLayer {
    /// Whether [`Self::forward_rows`] runs `x` `[batch, new, hidden]` (with the attention input
    /// `given`, if any: `[batch, new, width]`) at `rope` in `ctx`: f32 on the CPU without
    /// gradients, at most [`ROW_KERNEL_MAX_ROWS`] rows, a CPU policy with a pool, a CPU cache of
    /// `x`'s batch (f32, f16 or bf16), and every weight one the few-row kernels take.
    pub(super) fn runs_rows(
        &self,
        x: &Tensor,
        given: Option<&Tensor>,
        rope: &(Tensor, Tensor),
        ctx: &LayerContext,
    ) -> bool {
        let size = x.size();
        let rows = size.iter().take(2).product::<i64>() as usize;
        let given_rows = given.is_none_or(|given| {
            let given_size = given.size();
            plain_cpu_f32(given)
                && given_size.len() == 3
                && given_size[..2] == size[..2]
                && given_size[2] == self.self_attn.qkv_proj.in_features() as i64
        });
        let rope_rows = [&rope.0, &rope.1].into_iter().all(|t| {
            plain_cpu_f32(t)
                && t.is_contiguous()
                && t.numel() == rows * self.self_attn.head_dim as usize
        });
        let cache_rows = ctx.cache.as_deref().is_some_and(|cache| {
            size.first()
                .is_some_and(|&batch| cache_runs_rows(cache, ctx.layer, batch))
        });
        ctx.cpu.pool().is_some()
            && row_kernel::available()
            && size.len() == 3
            && plain_cpu_f32(x)
            && given_rows
            && (1..=ROW_KERNEL_MAX_ROWS).contains(&rows)
            && rope_rows
            && cache_rows
            && self.weights_run_rows()
    }

    /// Whether every norm and product of the layer is one the few-row path takes.
    pub(super) fn weights_run_rows(&self) -> bool {
        self.norms().all(|norm| plain_cpu_f32(&norm.weight))
            && self.linears().all(Linear::runs_rows)
    }

    fn norms(&self) -> impl Iterator<Item = &RmsNorm> {
        let qk = self.self_attn.qk_norm.iter().flat_map(|(q, k)| [q, k]);
        self.input_layernorm
            .iter()
            .chain([&self.post_attention_layernorm])
            .chain(qk)
    }

    /// The layer's matrix products, in the order a forward runs them.
    pub fn linears(&self) -> impl Iterator<Item = &Linear> {
        [
            &self.self_attn.qkv_proj,
            &self.self_attn.o_proj,
            &self.mlp.gate_up_proj,
            &self.mlp.down_proj,
        ]
        .into_iter()
    }

    /// The layer as [`Self::forward`] computes it, on row buffers; only where
    /// [`Self::runs_rows`] holds.
    pub(super) fn forward_rows(
        &self,
        x: &Tensor,
        given: Option<&Tensor>,
        rope: &(Tensor, Tensor),
        ctx: &mut LayerContext,
    ) -> Tensor {
        let pool = ctx.cpu.pool().expect("runs_rows checked the pool");
        let (kv_heads, dim) = self.self_attn.kv_shape();
        let cache = ctx
            .cache
            .as_deref_mut()
            .expect("runs_rows checked the cache");
        let new = x.size()[1] as usize;
        let cache = CacheRows::new(cache, ctx.layer, (kv_heads, dim), new);
        let parts = [CachedRows {
            cache,
            mask: ctx.key_mask(),
        }];
        self.rows_over(x, given, rope, &parts, pool)
    }

    /// The layer over rows of several sequences at once, each over its own cache (`parts`, in
    /// the order of `x`'s rows): the products run once over every row, attention per sequence.
    /// Where [`Self::runs_rows`] holds for `x` against each part's cache.
    pub(super) fn forward_rows_of_sequences(
        &self,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        layer: usize,
        sequences: &mut [SequenceRows],
        pool: &SpinPool,
    ) -> Tensor {
        let kv_shape = self.self_attn.kv_shape();
        let parts: Vec<CachedRows> = sequences
            .iter_mut()
            .map(|sequence| CachedRows {
                cache: CacheRows::new(sequence.cache, layer, kv_shape, sequence.new),
                mask: sequence.key_mask(),
            })
            .collect();
        self.rows_over(x, None, rope, &parts, pool)
    }

    /// The layer on row buffers: `x`'s rows are `parts`' rows in order.
    fn rows_over(
        &self,
        x: &Tensor,
        given: Option<&Tensor>,
        rope: &(Tensor, Tensor),
        parts: &[CachedRows],
        pool: &SpinPool,
    ) -> Tensor {
        let x = x.contiguous();
        let size = x.size();
        let input = f32_slice(&x);
        let (normed, given) = (
            self.input_layernorm.as_ref().filter(|_| given.is_none()),
            given.map(Tensor::contiguous),
        );
        let normed = normed.map(|norm| norm.rows(input));
        let attention_input = match (&given, &normed) {
            (Some(given), _) => f32_slice(given),
            (None, Some(normed)) => &normed[..],
            (None, None) => input,
        };
        let attended = self.self_attn.rows(attention_input, parts, rope, pool);
        let mut out = Tensor::empty(size.as_slice(), (Kind::Float, Device::Cpu));
        let residual = f32_slice_mut(&mut out);
        self.self_attn
            .o_proj
            .forward_rows(&attended, residual, pool);
        add_into(residual, input);
        let mlp = self
            .mlp
            .rows(&self.post_attention_layernorm.rows(residual), pool);
        add_into(residual, &mlp);
        out
    }
}

/// One sequence of a forward over several ([`crate::Llama::forward_sequences`]): its cache and
/// which keys its `new` rows may attend to.
pub(super) struct SequenceRows<'a> {
    pub cache: &'a mut KvCache,
    pub new: usize,
    pub mask: Option<&'a Tensor>,
    pub is_causal: bool,
}

impl SequenceRows<'_> {
    fn key_mask(&self) -> KeyMask<'_> {
        key_mask(self.mask, self.is_causal)
    }
}

/// The rows of one cache in a few-row layer: where their keys and values go, which keys each
/// may attend to.
struct CachedRows<'m> {
    cache: CacheRows,
    mask: KeyMask<'m>,
}

/// Whether the few-row layer writes and reads `layer` of `cache` for `batch` sequences: CPU
/// storage of a row-kernel element type, contiguous, without gradients.
pub(super) fn cache_runs_rows(cache: &KvCache, layer: usize, batch: i64) -> bool {
    let (keys, values) = cache.storage(layer);
    [keys, values].into_iter().all(|t| {
        Dtype::of_kind(t.kind()).is_some()
            && t.device() == Device::Cpu
            && !t.requires_grad()
            && t.is_contiguous()
            && t.size()[0] == batch
    })
}

/// `sum[i] += add[i]`.
fn add_into(sum: &mut [f32], add: &[f32]) {
    sum.iter_mut().zip(add).for_each(|(s, a)| *s += a);
}

impl Attention {
    /// Key/value heads and the head width.
    fn kv_shape(&self) -> (usize, usize) {
        (self.num_kv_heads as usize, self.head_dim as usize)
    }

    /// Attended values (`heads · head_dim` features a row) of `input`, whose rows are `parts`'
    /// rows in order; each part's new keys and values written into its cache after its rows.
    fn rows(
        &self,
        input: &[f32],
        parts: &[CachedRows],
        rope: &(Tensor, Tensor),
        pool: &SpinPool,
    ) -> Vec<f32> {
        let (heads, kv_heads, dim) = (
            self.num_heads as usize,
            self.num_kv_heads as usize,
            self.head_dim as usize,
        );
        let width = (heads + 2 * kv_heads) * dim;
        let rows = input.len() / self.qkv_proj.in_features();
        // Each row's part and its row within that part.
        let row_parts: Vec<(usize, usize)> = parts
            .iter()
            .enumerate()
            .flat_map(|(index, part)| (0..part.cache.rows()).map(move |row| (index, row)))
            .collect();
        assert_eq!(row_parts.len(), rows, "the parts cover the input's rows");
        // The caches alone go to the threads: a mask is a tensor, which is not `Sync`.
        let caches: Vec<&CacheRows> = parts.iter().map(|part| &part.cache).collect();
        let mut qkv = vec![0f32; rows * width];
        let (cos, sin) = (f32_slice(&rope.0), f32_slice(&rope.1));
        // Weights and ε only: the closures below run on every thread, and a tensor is not `Sync`.
        let qk_norms = self.qk_norm.as_ref().map(|(q, k)| {
            let weights = (f32_slice(&q.weight), f32_slice(&k.weight));
            ((weights.0, q.eps), (weights.1, k.eps))
        });
        // Each thread takes whole heads: it rotates its queries and keys (their norms first, where
        // the model has them) and writes its keys and values into the cache, in the product's own
        // parallel region. Every head gets the same operations on whichever thread it lands.
        let threads = pool.parallelism();
        let head_align = self.qkv_proj.column_align() / gcd(self.qkv_proj.column_align(), dim);
        let heads_of = |part| even_part(heads + 2 * kv_heads, threads, head_align, part);
        let ranges = |part| {
            let own = heads_of(part);
            [own.start * dim..own.end * dim, 0..0]
        };
        let then = |part, qkv: *mut f32| {
            for (row, &(cache_part, cache_row)) in row_parts.iter().enumerate() {
                let (cos, sin) = (&cos[row * dim..][..dim], &sin[row * dim..][..dim]);
                for head in heads_of(part) {
                    // SAFETY: `qkv` holds rows × width floats, and this part alone touches its
                    // heads' features.
                    let values = unsafe {
                        std::slice::from_raw_parts_mut(qkv.add(row * width + head * dim), dim)
                    };
                    if head < heads + kv_heads {
                        if let Some((q_norm, k_norm)) = qk_norms {
                            let (weight, eps) = if head < heads { q_norm } else { k_norm };
                            normalise(values, weight, eps);
                        }
                        rotate(values, cos, sin);
                    }
                    if head >= heads {
                        // SAFETY: this part alone writes this head's cache rows.
                        unsafe { caches[cache_part].write(cache_row, head - heads, values) };
                    }
                }
            }
        };
        let split = ColumnSplit {
            ranges: &ranges,
            then: &then,
        };
        self.qkv_proj
            .forward_rows_split(input, &mut qkv, pool, &split);
        let mut out = vec![0f32; rows * heads * dim];
        let (qkv_rows, out_rows) = (qkv.as_ptr(), out.as_mut_ptr());
        let mut first_row = 0;
        let attention: Vec<AttentionPart> = parts
            .iter()
            .map(|part| {
                let (batch, new) = (part.cache.batch(), part.cache.new);
                let queries = RowLayout {
                    batch,
                    heads,
                    new,
                    dim,
                    strides: RowStrides {
                        batch: new * width,
                        head: dim,
                        token: width,
                    },
                };
                let out_strides = RowStrides {
                    batch: new * heads * dim,
                    head: dim,
                    token: heads * dim,
                };
                let at = first_row;
                first_row += batch * new;
                // SAFETY: row `at` is one of `qkv`'s and `out`'s rows.
                let (queries_at, out_at) =
                    unsafe { (qkv_rows.add(at * width), out_rows.add(at * heads * dim)) };
                AttentionPart {
                    queries: queries_at,
                    layout: queries,
                    cached: part.cache.written(),
                    mask: part.mask,
                    out: (out_at, out_strides),
                }
            })
            .collect();
        // SAFETY: `qkv` holds the query rows each part describes (each row's heads first), `out`
        // the output rows at their strides; both outlive the call, as do the caches the parts
        // read (borrowed by the caller).
        unsafe { row_attention::attend_rows(&attention, pool) };
        out
    }
}

/// Where the new rows' keys and values go: `layer`'s cache storage `[batch, kv_heads, capacity,
/// dim]`, after its cached rows, rounded to the cache's element type. Written by many threads at
/// once, each its own heads.
struct CacheRows {
    batch: usize,
    keys: usize,
    values: usize,
    elements: Dtype,
    capacity: usize,
    past: usize,
    new: usize,
    kv_heads: usize,
    dim: usize,
}

impl CacheRows {
    fn new(cache: &mut KvCache, layer: usize, (kv_heads, dim): (usize, usize), new: usize) -> Self {
        let (keys, values) = cache.storage(layer);
        let capacity = keys.size()[2] as usize;
        let past = cache.len();
        assert!(
            past + new <= capacity,
            "the forward checked the cache's room"
        );
        Self {
            batch: keys.size()[0] as usize,
            keys: keys.data_ptr() as usize,
            values: values.data_ptr() as usize,
            elements: Dtype::of_kind(keys.kind()).expect("`runs_rows` checked the cache's kind"),
            capacity,
            past,
            new,
            kv_heads,
            dim,
        }
    }

    /// Sequences of the cache (its batch).
    fn batch(&self) -> usize {
        self.batch
    }

    /// New rows: `new` of each sequence.
    fn rows(&self) -> usize {
        self.batch * self.new
    }

    /// The cached rows and the new ones after them, as row attention reads them.
    fn written(&self) -> KeyValueRows {
        let head = self.capacity * self.dim;
        let strides = [self.kv_heads * head, head];
        KeyValueRows {
            keys: self.keys,
            values: self.values,
            elements: self.elements,
            kv_heads: self.kv_heads,
            len: self.past + self.new,
            key_strides: strides,
            value_strides: strides,
        }
    }

    /// Writes `from` as row `row`'s (`sequence · new + token`) key of `kv_head` (`0..kv_heads`)
    /// or, for `kv_head` in `kv_heads..2 · kv_heads`, its value.
    ///
    /// # Safety
    /// The cache this was made from is still borrowed mutably by the caller, and no other thread
    /// writes the same row and head.
    unsafe fn write(&self, row: usize, kv_head: usize, from: &[f32]) {
        let (storage, kv_head) = match kv_head.checked_sub(self.kv_heads) {
            None => (self.keys, kv_head),
            Some(value_head) => (self.values, value_head),
        };
        let (sequence, token) = (row / self.new, row % self.new);
        let at =
            ((sequence * self.kv_heads + kv_head) * self.capacity + self.past + token) * self.dim;
        // SAFETY: the storage is a contiguous `[batch, kv_heads, capacity, dim]` tensor of
        // `elements` (`runs_rows`) of the rows' batch, and `at` addresses one of its rows (room
        // asserted in `new`).
        unsafe {
            let to = (storage as *mut u8).add(at * self.elements.bytes());
            kv_elements::narrow(self.elements, from, to)
        };
    }
}

/// Greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `x · cos + rotate_half(x) · sin` for one head's `x`, each product rounded before the sum as
/// libtorch's elementwise ops round them.
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for j in 0..half {
        let (low, high) = (x[j], x[j + half]);
        x[j] = low * cos[j] + -high * sin[j];
        x[j + half] = high * cos[j + half] + low * sin[j + half];
    }
}

impl RmsNorm {
    /// Whether [`Self::rows`] runs: the weight is an f32 CPU tensor without gradients.
    pub fn runs_rows(&self) -> bool {
        plain_cpu_f32(&self.weight)
    }

    /// [`Self::forward`] of `x` `[..., size]` on [`Self::rows`] where `x` and the weight are f32
    /// CPU tensors without gradients, else on libtorch's ops: a draft head's norms, a dozen
    /// libtorch calls each on ops, run at every draft depth.
    pub fn forward_rows_where_plain(&self, x: &Tensor) -> Tensor {
        if !(self.runs_rows() && plain_cpu_f32(x)) {
            return self.forward(x);
        }
        let x = x.contiguous();
        Tensor::from_slice(&self.rows(f32_slice(&x))).view(x.size().as_slice())
    }

    /// Each row of `x` (rows of the weight's size) normalised, as the few-row layer norms them.
    pub fn rows(&self, x: &[f32]) -> Vec<f32> {
        let weight = f32_slice(&self.weight);
        let mut out = x.to_vec();
        for row in out.chunks_exact_mut(weight.len()) {
            normalise(row, weight, self.eps);
        }
        out
    }
}

/// `weight · row / √(mean(row²) + ε)` in place, the squares summed in [`LANES`] lanes.
fn normalise(row: &mut [f32], weight: &[f32], eps: f64) {
    let mut lanes = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
    for chunk in chunks {
        lanes.iter_mut().zip(chunk).for_each(|(l, v)| *l += v * v);
    }
    let mean = (lanes.iter().sum::<f32>() + tail) / row.len() as f32;
    let inverse = 1.0 / (mean + eps as f32).sqrt();
    row.iter_mut()
        .zip(weight)
        .for_each(|(v, w)| *v = w * (*v * inverse));
}

/// Floats per vector of the SiLU and the norms' sums of squares.
const LANES: usize = 8;

impl Mlp {
    /// `down(silu(gate(x)) · up(x))` for rows of `x`.
    fn rows(&self, x: &[f32], pool: &SpinPool) -> Vec<f32> {
        let intermediate = self.intermediate as usize;
        let hidden = self.down_proj.out_features();
        let rows = x.len() / hidden;
        let mut gate_up = vec![0f32; rows * 2 * intermediate];
        let mut activated = vec![0f32; rows * intermediate];
        // Each thread computes some gate features and the up features beside them, then their
        // SiLU product, in the product's own parallel region. SiLU works lane by lane, so any
        // split gives every element the same bits.
        let parts = pool.parallelism();
        let align = self.gate_up_proj.column_align().max(LANES);
        let gates_of = |part| even_part(intermediate, parts, align, part);
        let ranges = |part| {
            let gates = gates_of(part);
            let ups = intermediate + gates.start..intermediate + gates.end;
            [gates, ups]
        };
        let activated_ptr = activated.as_mut_ptr() as usize;
        let then = |part, gate_up: *mut f32| {
            let gates = gates_of(part);
            for row in 0..rows {
                // SAFETY: `gate_up` holds rows × 2·intermediate floats and `activated` rows ×
                // intermediate; this part alone touches these features of them.
                let (gate, up, out) = unsafe {
                    let row_in = gate_up.add(row * 2 * intermediate);
                    let row_out = (activated_ptr as *mut f32).add(row * intermediate);
                    (
                        std::slice::from_raw_parts(row_in.add(gates.start), gates.len()),
                        std::slice::from_raw_parts(
                            row_in.add(intermediate + gates.start),
                            gates.len(),
                        ),
                        std::slice::from_raw_parts_mut(row_out.add(gates.start), gates.len()),
                    )
                };
                silu_times(gate, up, out);
            }
        };
        let split = ColumnSplit {
            ranges: &ranges,
            then: &then,
        };
        self.gate_up_proj
            .forward_rows_split(x, &mut gate_up, pool, &split);
        let mut out = vec![0f32; rows * hidden];
        self.down_proj.forward_rows(&activated, &mut out, pool);
        out
    }
}

/// `out = silu(gate) · up`, eight lanes at a time (the tail padded into one more vector), so every
/// element gets the same operations wherever it lies.
fn silu_times(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let full = gate.len() / LANES * LANES;
    // SAFETY: the few-row layer runs only where the row kernel does: AVX2 and FMA.
    unsafe {
        for at in (0..full).step_by(LANES) {
            let chunk = gate[at..at + LANES].try_into().expect("a whole vector");
            let lanes = silu_times_8(chunk, &up[at..]);
            out[at..at + LANES].copy_from_slice(&lanes);
        }
        if full < gate.len() {
            let mut padded = ([0f32; LANES], [0f32; LANES]);
            padded.0[..gate.len() - full].copy_from_slice(&gate[full..]);
            padded.1[..gate.len() - full].copy_from_slice(&up[full..]);
            let lanes = silu_times_8(padded.0, &padded.1);
            out[full..].copy_from_slice(&lanes[..gate.len() - full]);
        }
    }
}

/// `silu(g) · u` for eight `g` and the first eight `u`: `g · σ(g)`, `σ` from `e = exp(−|g|)` as
/// `1 / (1 + e)` or `e / (1 + e)` so the exponential never overflows.
///
/// # Safety
/// AVX2 and FMA are available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_times_8(gate: [f32; LANES], up: &[f32]) -> [f32; LANES] {
    use std::arch::x86_64::*;
    let g = _mm256_loadu_ps(gate.as_ptr());
    let sign = _mm256_set1_ps(-0.0);
    let e = row_attention::exp_nonpositive(_mm256_or_ps(g, sign));
    let one = _mm256_set1_ps(1.0);
    let negative = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    let sigmoid = _mm256_div_ps(_mm256_blendv_ps(one, e, negative), _mm256_add_ps(one, e));
    let product = _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up.as_ptr()));
    let mut out = [0f32; LANES];
    _mm256_storeu_ps(out.as_mut_ptr(), product);
    out
}

/// Elsewhere the row kernel, and so this layer, never runs.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn silu_times_8(_: [f32; LANES], _: &[f32]) -> [f32; LANES] {
    unreachable!("the few-row layer runs only where the row kernel does")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::tiny_config;
    use crate::{CausalLm, CpuPolicy, CpuThreads, RandomWeights};

    fn context<'a>(cache: Option<&'a mut KvCache>, cpu: &'a CpuPolicy) -> LayerContext<'a> {
        LayerContext {
            layer: 0,
            cache,
            mask: None,
            is_causal: true,
            cpu,
        }
    }

    /// Rotary rows gathered from the table are the ops' own, bit for bit, for SmolLM2's and
    /// Llama's head widths, in any order, across the table's blocks and after it grows.
    #[test]
    fn rotary_table_rows_are_the_ops_bits() {
        for (heads, kv_heads, theta) in [(9, 3, 100_000.0), (8, 2, 500_000.0)] {
            let mut json = crate::testing::tiny_config_json();
            json["hidden_size"] = (64 * heads).into();
            json["num_attention_heads"] = heads.into();
            json["num_key_value_heads"] = kv_heads.into();
            json["rope_theta"] = theta.into();
            json["max_position_embeddings"] = 4096.into();
            let config = crate::testing::resolve_tiny_config(json);
            let rotary = super::super::Rotary::new(&config, Device::Cpu);
            let batches: [&[i64]; 3] = [
                &[5],
                &[0, 7, 511, 512, 1300, 3, 2, 2, 9, 1000, 0, 64],
                &[2047],
            ];
            for positions in batches {
                let positions =
                    Tensor::from_slice(positions).view([2.min(positions.len() as i64), -1]);
                let (cos, sin) = rotary.cos_sin(&positions, Kind::Float);
                let (want_cos, want_sin) = rotary.computed(&positions, Kind::Float);
                assert_eq!(cos.size(), want_cos.size());
                for (got, want) in [(cos, want_cos), (sin, want_sin)] {
                    let bits = |t: &Tensor| -> Vec<u32> {
                        Vec::<f32>::try_from(t.reshape([-1]))
                            .unwrap()
                            .iter()
                            .map(|v| v.to_bits())
                            .collect()
                    };
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "head_dim {}: {positions:?}",
                        config.head_dim
                    );
                }
            }
        }
    }

    /// The few-row layer takes cached decoding and verification, computes what libtorch's ops
    /// compute (its own norm sums differ in the last bits) and writes the same cache rows; it
    /// declines what it does not run.
    #[test]
    fn the_few_row_layer_matches_libtorchs_ops_where_it_runs() {
        let config = tiny_config();
        let model = CausalLm::load(
            &config,
            &mut RandomWeights::new(3, Kind::Float, Device::Cpu),
        )
        .unwrap();
        let layer = &model.model.layers[0];
        let cpu = CpuThreads::new(2).decode();
        let new = 5;
        let x = Tensor::randn(
            [1, new, config.hidden_size as i64],
            (Kind::Float, Device::Cpu),
        );
        let positions = Tensor::arange(new, (Kind::Int64, Device::Cpu)).unsqueeze(0);
        let rope = model.model.rotary.cos_sin(&positions, Kind::Float);
        let caches: Vec<KvCache> = (0..2)
            .map(|_| KvCache::new(&config, 1, 8, Kind::Float, Device::Cpu).unwrap())
            .collect();
        let [mut rows_cache, mut ops_cache] = <[KvCache; 2]>::try_from(caches).ok().unwrap();
        let mut rows_ctx = context(Some(&mut rows_cache), &cpu);
        assert!(layer.runs_rows(&x, None, &rope, &rows_ctx));
        let rows = layer.forward_rows(&x, None, &rope, &mut rows_ctx);
        let ops = layer.forward_ops(&x, None, &rope, &mut context(Some(&mut ops_cache), &cpu));
        let diff = (&rows - &ops).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "max |Δ| {diff}");
        let (rows_kv, ops_kv) = (rows_cache.storage(0), ops_cache.storage(0));
        for (a, b) in [(rows_kv.0, ops_kv.0), (rows_kv.1, ops_kv.1)] {
            let diff = (a.narrow(2, 0, 5) - b.narrow(2, 0, 5))
                .abs()
                .max()
                .double_value(&[]);
            assert!(diff < 1e-4, "cache rows differ by {diff}");
        }
        assert!(
            !layer.runs_rows(&x, None, &rope, &context(None, &cpu)),
            "no cache"
        );
        let long = Tensor::randn(
            [1, 65, config.hidden_size as i64],
            (Kind::Float, Device::Cpu),
        );
        let long_rope = model.model.rotary.cos_sin(
            &Tensor::arange(65, (Kind::Int64, Device::Cpu)).unsqueeze(0),
            Kind::Float,
        );
        let mut room = KvCache::new(&config, 1, 80, Kind::Float, Device::Cpu).unwrap();
        assert!(
            !layer.runs_rows(&long, None, &long_rope, &context(Some(&mut room), &cpu)),
            "65 rows"
        );
        let batch = CpuPolicy::Batch { threads: 2 };
        let batch_ctx = context(Some(&mut room), &batch);
        assert!(
            !layer.runs_rows(&x, None, &rope, &batch_ctx),
            "libtorch's policy"
        );
    }

    /// A draft head's layer, whose attention reads an input of its own (EAGLE-3's: twice the
    /// hidden size) beside the residual stream, runs on rows too, under a tree mask after a
    /// cached prefix, and computes what libtorch's ops compute.
    #[test]
    fn a_layer_given_its_attention_input_runs_on_rows() {
        let config = tiny_config();
        let h = config.hidden_size as i64;
        let layer = DecoderLayer::load_with(
            &mut RandomWeights::new(5, Kind::Float, Device::Cpu),
            "midlayer",
            &config,
            super::super::AttentionInput::Given(2 * config.hidden_size),
        )
        .unwrap();
        let cpu = CpuThreads::new(2).decode();
        let rotary = super::super::Rotary::new(&config, Device::Cpu);
        let (past, new) = (3usize, 4usize);
        let mut caches: Vec<KvCache> = (0..2)
            .map(|_| KvCache::new(&config, 1, 16, Kind::Float, Device::Cpu).unwrap())
            .collect();
        let residual = Tensor::randn([1, past as i64, h], (Kind::Float, Device::Cpu));
        let given = Tensor::randn([1, past as i64, 2 * h], (Kind::Float, Device::Cpu));
        let mask =
            crate::mask::tree_mask(past, &[None, Some(0), Some(0), Some(1)], Device::Cpu).unwrap();
        let x = Tensor::randn([1, new as i64, h], (Kind::Float, Device::Cpu));
        let wide = Tensor::randn([1, new as i64, 2 * h], (Kind::Float, Device::Cpu));
        let positions = Tensor::from_slice(&[3i64, 4, 4, 5]).unsqueeze(0);
        let rope = rotary.cos_sin(&positions, Kind::Float);
        let mut outputs = Vec::new();
        for (cache, rows) in caches.iter_mut().zip([true, false]) {
            let prefix_rope = rotary.cos_sin(
                &Tensor::arange(past as i64, (Kind::Int64, Device::Cpu)).unsqueeze(0),
                Kind::Float,
            );
            // The prefix only fills the cache.
            let _prefix = layer
                .forward_given(&residual, &given, &prefix_rope, Some(cache), None, &cpu)
                .unwrap();
            let mut ctx = LayerContext {
                layer: 0,
                cache: Some(cache),
                mask: Some(&mask),
                is_causal: false,
                cpu: &cpu,
            };
            assert!(layer.runs_rows(&x, Some(&wide), &rope, &ctx));
            outputs.push(if rows {
                layer.forward_rows(&x, Some(&wide), &rope, &mut ctx)
            } else {
                layer.forward_ops(&x, Some(&wide), &rope, &mut ctx)
            });
        }
        let diff = (&outputs[0] - &outputs[1]).abs().max().double_value(&[]);
        assert!(diff < 1e-4, "max |Δ| {diff}");
        let narrow = wide.narrow(2, 0, h);
        let ctx = context(Some(&mut caches[0]), &cpu);
        assert!(
            !layer.runs_rows(&x, Some(&narrow), &rope, &ctx),
            "an input of the wrong width"
        );
    }

    #[test]
    fn norms_match_libtorchs_within_rounding() {
        let norm = RmsNorm {
            weight: Tensor::randn([37], (Kind::Float, Device::Cpu)),
            eps: 1e-5,
        };
        let x = Tensor::randn([3, 37], (Kind::Float, Device::Cpu));
        let rows = Tensor::from_slice(&norm.rows(f32_slice(&x))).view([3, 37]);
        let diff = (rows - norm.forward(&x)).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "max |Δ| {diff}");
    }

    /// Every element, in whole vectors or the padded tail, for large and tiny gates alike.
    #[test]
    fn silu_times_matches_the_formula_everywhere() {
        let gate: Vec<f32> = (0..21)
            .map(|i| (i as f32 - 10.0) * 1.7)
            .chain([-100.0, 100.0, 0.0])
            .collect();
        let up: Vec<f32> = (0..gate.len()).map(|i| 0.5 + i as f32 * 0.1).collect();
        let mut out = vec![f32::NAN; gate.len()];
        silu_times(&gate, &up, &mut out);
        for ((g, u), o) in gate.iter().zip(&up).zip(&out) {
            let expected = (*g as f64 / (1.0 + (-*g as f64).exp())) * *u as f64;
            assert!(
                (*o as f64 - expected).abs() <= 1e-6 * expected.abs() + 1e-30,
                "silu({g}) · {u}: {o} vs {expected}"
            );
        }
    }
}
