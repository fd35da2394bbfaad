//! The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3).
//!
//! Weights are looked up by their HF names. Two deliberate departures from HF's module layout,
//! both for CPU decode speed: q/k/v are stored as one fused projection and gate/up as another
//! (one GEMV instead of three or two, and rotary embedding applied to q and k in one op), built by
//! concatenating the HF tensors at load time.

use std::sync::RwLock;

use tch::{Device, Kind, Tensor};

use crate::allocator;
use crate::config::ModelConfig;
use crate::cpu::CpuPolicy;
use crate::kv_cache::KvCache;
use crate::linear::{plain_cpu_f32, Linear, Matrix, ROW_KERNEL_MAX_ROWS};
use crate::mask::TreeInput;
use crate::on_devices::OnDevices;
use crate::row_attention::{self, KeyMask};
use crate::row_kernel;
use crate::spin_pool::SpinPool;
use crate::weights::{OnDevice, ShapeRecorder, WeightSource};
use crate::{ModelError, Result};

mod rows;

use rows::SequenceRows;

/// Loads `{prefix}.{part}.weight` (and `.bias` when `with_bias`) for each part and stacks them
/// along the output dimension; `rows[i]` is part `i`'s output size.
fn fused_linear(
    source: &mut dyn WeightSource,
    prefix: &str,
    parts: &[&str],
    rows: &[usize],
    in_features: usize,
    with_bias: bool,
) -> Result<Linear> {
    let mut weights = Vec::with_capacity(parts.len());
    let mut biases = Vec::with_capacity(parts.len());
    for (part, &out) in parts.iter().zip(rows) {
        weights.push(source.matrix(
            &format!("{prefix}.{part}.weight"),
            &[out as i64, in_features as i64],
        )?);
        if with_bias {
            biases.push(source.tensor(&format!("{prefix}.{part}.bias"), &[out as i64])?);
        }
    }
    let bias = match biases.len() {
        0 => None,
        1 => biases.pop(),
        _ => Some(Tensor::f_cat(&biases, 0)?),
    };
    Ok(Linear::from_matrix(Matrix::concat_rows(weights)?, bias))
}

/// RMSNorm exactly as HF computes it: statistics in f32, scale in the model dtype.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    /// Loads the norm weight `name` of `size` elements.
    pub fn load(source: &mut dyn WeightSource, name: &str, size: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: source.tensor(name, &[size as i64])?,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        let x32 = x.to_kind(Kind::Float);
        let variance = x32.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        let normed = x32 * (variance + self.eps).rsqrt();
        &self.weight * normed.to_kind(kind)
    }
}

/// Rotary embedding: inverse frequencies, and cos/sin computed per forward from explicit position
/// ids (so tree nodes at equal depth share a position).
pub struct Rotary {
    inv_freq: Tensor,
    /// On the CPU, the f32 cos and sin rows of every position reached so far, computed by
    /// libtorch's ops in blocks (the same bits: each element is one product and one `cos` or
    /// `sin`, whatever tensor it lies in): a forward gathers its positions' rows instead of
    /// running eight ops, at every decoding step and every draft depth.
    table: RwLock<RotaryTable>,
}

/// Rows `0..len` of [`Rotary`]'s table, `head_dim` floats each.
#[derive(Default)]
struct RotaryTable {
    len: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// Positions a table grows by at least, so that decoding extends it once in a while.
const ROTARY_TABLE_BLOCK: usize = 512;

impl Rotary {
    pub fn new(config: &ModelConfig, device: tch::Device) -> Self {
        let dim = config.head_dim;
        let mut inv_freq: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / config.rope_theta.powf((2 * i) as f64 / dim as f64))
            .collect();
        if let Some(s) = &config.rope_scaling {
            inv_freq = inv_freq.into_iter().map(|f| llama3_scaled(f, s)).collect();
        }
        let inv_freq: Vec<f32> = inv_freq.into_iter().map(|f| f as f32).collect();
        Self {
            inv_freq: Tensor::from_slice(&inv_freq).to_device(device),
            table: RwLock::default(),
        }
    }

    /// `(cos, sin)` of shape `[batch, new, 1, head_dim]` in `kind`, for positions `[batch, new]`:
    /// gathered from the table for f32 on the CPU, else computed.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let tabled = kind == Kind::Float
            && self.inv_freq.device() == Device::Cpu
            && positions.device() == Device::Cpu;
        let gathered = tabled.then(|| self.gathered(positions)).flatten();
        gathered.unwrap_or_else(|| self.computed(positions, kind))
    }

    /// `(cos, sin)` by libtorch's ops.
    fn computed(&self, positions: &Tensor, kind: Kind) -> (Tensor, Tensor) {
        let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * &self.inv_freq;
        let angles = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(2);
        (angles.cos().to_kind(kind), angles.sin().to_kind(kind))
    }

    /// `(cos, sin)` in f32 from the table, extended first where `positions` go past it; `None`
    /// for a negative position (the ops name nothing wrong there; they compute it).
    fn gathered(&self, positions: &Tensor) -> Option<(Tensor, Tensor)> {
        let ids = Vec::<i64>::try_from(positions.to_kind(Kind::Int64).reshape([-1])).ok()?;
        let ids: Vec<usize> = ids
            .into_iter()
            .map(usize::try_from)
            .collect::<std::result::Result<_, _>>()
            .ok()?;
        let needed = ids.iter().max().map_or(0, |&p| p + 1);
        if self.read_table().len < needed {
            self.extend_table(needed);
        }
        let table = self.read_table();
        let dim = self.inv_freq.numel() * 2;
        let rows = |values: &[f32]| -> Vec<f32> {
            ids.iter()
                .flat_map(|&p| &values[p * dim..(p + 1) * dim])
                .copied()
                .collect()
        };
        let mut shape = positions.size();
        shape.extend([1, dim as i64]);
        let tensor = |values: Vec<f32>| Tensor::from_slice(&values).view(shape.as_slice());
        Some((tensor(rows(&table.cos)), tensor(rows(&table.sin))))
    }

    fn read_table(&self) -> std::sync::RwLockReadGuard<'_, RotaryTable> {
        self.table.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Grows the table to at least `needed` positions, one block of positions per computation
    /// (a block's elements stay within one vectorised run of libtorch's `cos` and `sin`).
    fn extend_table(&self, needed: usize) {
        let mut table = self.table.write().unwrap_or_else(|e| e.into_inner());
        while table.len < needed {
            let (first, end) = (table.len as i64, (table.len + ROTARY_TABLE_BLOCK) as i64);
            let positions = Tensor::arange_start(first, end, (Kind::Int64, Device::Cpu));
            let (cos, sin) = self.computed(&positions.unsqueeze(0), Kind::Float);
            let floats = |t: Tensor| Vec::<f32>::try_from(t.reshape([-1])).expect("f32 CPU rows");
            table.cos.extend(floats(cos));
            table.sin.extend(floats(sin));
            table.len += ROTARY_TABLE_BLOCK;
        }
    }
}

/// Llama 3.1's frequency-dependent scaling of one inverse frequency.
fn llama3_scaled(inv_freq: f64, s: &crate::config::Llama3RopeScaling) -> f64 {
    let old_len = s.original_max_position_embeddings as f64;
    let low_wavelen = old_len / s.low_freq_factor;
    let high_wavelen = old_len / s.high_freq_factor;
    let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
    if wavelen > low_wavelen {
        inv_freq / s.factor
    } else if wavelen < high_wavelen {
        inv_freq
    } else {
        let smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}

/// `x * cos + rotate_half(x) * sin` on the last dimension.
fn apply_rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.narrow(-1, 0, half);
    let x2 = x.narrow(-1, half, half);
    let rotated = Tensor::cat(&[&x2.neg(), &x1], -1);
    x * cos + rotated * sin
}

struct Attention {
    qkv_proj: Linear,
    o_proj: Linear,
    /// Qwen3's per-head norms of q and k.
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn device(&self) -> Device {
        self.qkv_proj.matrix().device()
    }

    /// Loads the projections under `prefix`; q, k and v read `in_features` features.
    fn load(
        source: &mut dyn WeightSource,
        prefix: &str,
        c: &ModelConfig,
        in_features: usize,
    ) -> Result<Self> {
        let (q_rows, kv_rows) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        let qkv_proj = fused_linear(
            source,
            prefix,
            &["q_proj", "k_proj", "v_proj"],
            &[q_rows, kv_rows, kv_rows],
            in_features,
            c.qkv_bias,
        )?;
        let o_proj = fused_linear(source, prefix, &["o_proj"], &[c.hidden_size], q_rows, false)?;
        let qk_norm = if c.qk_norm {
            Some((
                RmsNorm::load(
                    source,
                    &format!("{prefix}.q_norm.weight"),
                    c.head_dim,
                    c.rms_norm_eps,
                )?,
                RmsNorm::load(
                    source,
                    &format!("{prefix}.k_norm.weight"),
                    c.head_dim,
                    c.rms_norm_eps,
                )?,
            ))
        } else {
            None
        };
        Ok(Self {
            qkv_proj,
            o_proj,
            qk_norm,
            num_heads: c.num_attention_heads as i64,
            num_kv_heads: c.num_key_value_heads as i64,
            head_dim: c.head_dim as i64,
        })
    }

    fn forward(&self, x: &Tensor, rope: &(Tensor, Tensor), ctx: &mut LayerContext) -> Tensor {
        let (queries, keys, values) = self.queries_keys_values(x, rope, ctx.cpu);
        let (keys, values) = match ctx.cache.as_deref_mut() {
            Some(cache) => cache.append(ctx.layer, &keys, &values),
            None => (keys, values),
        };
        let attended = match ctx.cpu.pool() {
            Some(pool) if row_attention::applies(&queries, &keys) => {
                row_attention::attend(&queries, &keys, &values, ctx.key_mask(), pool)
            }
            // A 16-bit cache under f32 queries (`--kv-dtype`) is read back in the queries' kind.
            _ => Tensor::scaled_dot_product_attention(
                &queries,
                &keys.to_kind(queries.kind()),
                &values.to_kind(queries.kind()),
                ctx.mask,
                0.0,
                ctx.is_causal,
                None,
                self.num_heads != self.num_kv_heads,
            ),
        };
        self.output(&attended, ctx.cpu)
    }

    /// Queries `[batch, heads, new, head_dim]`, keys and values `[batch, kv_heads, new,
    /// head_dim]` of `x` `[batch, new, in_features]`, rotary applied to queries and keys.
    fn queries_keys_values(
        &self,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        cpu: &CpuPolicy,
    ) -> (Tensor, Tensor, Tensor) {
        let (batch, new) = (x.size()[0], x.size()[1]);
        let (h, kv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let qkv = self
            .qkv_proj
            .forward(x, cpu)
            .view([batch, new, h + 2 * kv, d]);
        let values = qkv.narrow(2, h + kv, kv);
        let queries_keys = match &self.qk_norm {
            None => qkv.narrow(2, 0, h + kv),
            Some((q_norm, k_norm)) => Tensor::cat(
                &[
                    q_norm.forward(&qkv.narrow(2, 0, h)),
                    k_norm.forward(&qkv.narrow(2, h, kv)),
                ],
                2,
            ),
        };
        let queries_keys = apply_rotary(&queries_keys, &rope.0, &rope.1);
        let queries = queries_keys.narrow(2, 0, h).transpose(1, 2);
        let keys = queries_keys.narrow(2, h, kv).transpose(1, 2);
        (queries, keys, values.transpose(1, 2))
    }

    /// The output projection of attended values `[batch, heads, new, head_dim]`.
    fn output(&self, attended: &Tensor, cpu: &CpuPolicy) -> Tensor {
        let (batch, new) = (attended.size()[0], attended.size()[2]);
        let merged = attended
            .transpose(1, 2)
            .reshape([batch, new, self.num_heads * self.head_dim]);
        self.o_proj.forward(&merged, cpu)
    }
}

struct Mlp {
    gate_up_proj: Linear,
    down_proj: Linear,
    intermediate: i64,
}

impl Mlp {
    fn load(source: &mut dyn WeightSource, prefix: &str, c: &ModelConfig) -> Result<Self> {
        let i = c.intermediate_size;
        Ok(Self {
            gate_up_proj: fused_linear(
                source,
                prefix,
                &["gate_proj", "up_proj"],
                &[i, i],
                c.hidden_size,
                false,
            )?,
            down_proj: fused_linear(source, prefix, &["down_proj"], &[c.hidden_size], i, false)?,
            intermediate: i as i64,
        })
    }

    fn forward(&self, x: &Tensor, cpu: &CpuPolicy) -> Tensor {
        let gate_up = self.gate_up_proj.forward(x, cpu);
        let gate = gate_up.narrow(-1, 0, self.intermediate);
        let up = gate_up.narrow(-1, self.intermediate, self.intermediate);
        self.down_proj.forward(&(gate.silu() * up), cpu)
    }
}

/// What a decoder layer's attention reads: the one extension point draft heads need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionInput {
    /// The layer's input after its own `input_layernorm` (every target layer).
    Normed,
    /// The layer's input as it is: EAGLE-1's first draft layer reads `fc`'s output, not a
    /// residual stream, and has no `input_layernorm`.
    Raw,
    /// Features of this width that the caller builds (EAGLE-3's draft layer reads the normed
    /// token embedding beside the normed hidden state, twice the hidden size); the residual stream
    /// stays hidden-wide. Run with [`DecoderLayer::forward_given`].
    Given(usize),
}

/// One pre-norm decoder layer: attention and MLP, each with a residual connection.
pub struct DecoderLayer {
    /// `None` when the attention reads its input un-normed or from the caller.
    input_layernorm: Option<RmsNorm>,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// What one layer needs besides its input: its index (for the cache), the cache, the mask and
/// the CPU policy.
struct LayerContext<'a> {
    layer: usize,
    cache: Option<&'a mut KvCache>,
    mask: Option<&'a Tensor>,
    is_causal: bool,
    cpu: &'a CpuPolicy,
}

impl LayerContext<'_> {
    /// The keys each new token may attend to, as row attention reads them.
    fn key_mask(&self) -> KeyMask<'_> {
        key_mask(self.mask, self.is_causal)
    }
}

/// The keys each new token may attend to, as row attention reads them: `mask` where given, else
/// in order (`is_causal`) or all.
fn key_mask(mask: Option<&Tensor>, is_causal: bool) -> KeyMask<'_> {
    match (mask, is_causal) {
        (Some(mask), _) => KeyMask::Given(mask),
        (None, true) => KeyMask::Causal,
        (None, false) => KeyMask::All,
    }
}

impl DecoderLayer {
    /// Loads the layer under `prefix` (e.g. `model.layers.3`).
    pub fn load(source: &mut dyn WeightSource, prefix: &str, c: &ModelConfig) -> Result<Self> {
        Self::load_with(source, prefix, c, AttentionInput::Normed)
    }

    /// Loads the layer whose attention reads `input` (draft heads' layers).
    pub fn load_with(
        source: &mut dyn WeightSource,
        prefix: &str,
        c: &ModelConfig,
        input: AttentionInput,
    ) -> Result<Self> {
        let norm = |source: &mut dyn WeightSource, name: &str| {
            RmsNorm::load(
                source,
                &format!("{prefix}.{name}.weight"),
                c.hidden_size,
                c.rms_norm_eps,
            )
        };
        let in_features = match input {
            AttentionInput::Given(width) => width,
            AttentionInput::Normed | AttentionInput::Raw => c.hidden_size,
        };
        Ok(Self {
            input_layernorm: match input {
                AttentionInput::Normed => Some(norm(source, "input_layernorm")?),
                AttentionInput::Raw | AttentionInput::Given(_) => None,
            },
            self_attn: Attention::load(source, &format!("{prefix}.self_attn"), c, in_features)?,
            post_attention_layernorm: norm(source, "post_attention_layernorm")?,
            mlp: Mlp::load(source, &format!("{prefix}.mlp"), c)?,
        })
    }

    /// HF names and shapes of the weights [`Self::load_with`] reads under `prefix` (what a draft
    /// head built from this layer must hold).
    pub fn weight_shapes(
        prefix: &str,
        c: &ModelConfig,
        input: AttentionInput,
    ) -> Result<Vec<(String, Vec<i64>)>> {
        let mut recorder = ShapeRecorder::default();
        Self::load_with(&mut recorder, prefix, c, input)?;
        Ok(recorder.into_shapes())
    }

    /// Runs `layers` in order outside a model (a draft head's layers): `x` is
    /// `[batch, new, hidden]`, `rope` comes from [`Rotary::cos_sin`], the cache (if any) holds
    /// layer k of the stack as its layer k, and `mask` and `cpu` work as in [`ForwardInput`].
    pub fn forward_stack(
        layers: &[DecoderLayer],
        x: &Tensor,
        rope: &(Tensor, Tensor),
        cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
        cpu: &CpuPolicy,
    ) -> Result<Tensor> {
        Self::run_stack(layers, x, cache, mask, cpu, |_, layer, x, ctx| {
            layer.forward(x, None, rope, ctx)
        })
    }

    /// Runs this layer (loaded with [`AttentionInput::Given`]) as the only layer of a draft
    /// head: `residual` `[batch, new, hidden]` is the stream it adds to, `attention_input`
    /// `[batch, new, width]` what its attention reads; the cache (if any) holds it as layer 0, and
    /// `mask` and `cpu` work as in [`ForwardInput`].
    pub fn forward_given(
        &self,
        residual: &Tensor,
        attention_input: &Tensor,
        rope: &(Tensor, Tensor),
        cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
        cpu: &CpuPolicy,
    ) -> Result<Tensor> {
        let layers = std::slice::from_ref(self);
        Self::run_stack(layers, residual, cache, mask, cpu, |_, layer, x, ctx| {
            layer.forward(x, Some(attention_input), rope, ctx)
        })
    }

    /// The attention's queries `[batch, heads, new, head_dim]`, keys and values `[batch,
    /// kv_heads, new, head_dim]` for `attention_input` at `rope`'s positions, as the layer's own
    /// attention computes them (for attention patterns of its own: EAGLE-3's training-time test).
    pub fn queries_keys_values(
        &self,
        attention_input: &Tensor,
        rope: &(Tensor, Tensor),
        cpu: &CpuPolicy,
    ) -> (Tensor, Tensor, Tensor) {
        self.self_attn
            .queries_keys_values(attention_input, rope, cpu)
    }

    /// The rest of the layer once values are attended (`[batch, heads, new, head_dim]`): the
    /// output projection added to `residual`, then the MLP with its residual connection.
    pub fn finish(&self, residual: &Tensor, attended_values: &Tensor, cpu: &CpuPolicy) -> Tensor {
        let attended = self.self_attn.output(attended_values, cpu);
        self.after_attention(residual, &attended, cpu)
    }

    /// `residual + attended`, then the MLP with its residual connection.
    fn after_attention(&self, residual: &Tensor, attended: &Tensor, cpu: &CpuPolicy) -> Tensor {
        let x = residual + attended;
        let mlp = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x), cpu);
        x + mlp
    }

    /// Runs `layers` in order through `run_layer(index, layer, input, context)` with the cache's
    /// room checked, the implicit mask built and the cache advanced once all have run.
    fn run_stack(
        layers: &[DecoderLayer],
        x: &Tensor,
        mut cache: Option<&mut KvCache>,
        mask: Option<&Tensor>,
        cpu: &CpuPolicy,
        mut run_layer: impl FnMut(usize, &DecoderLayer, &Tensor, &mut LayerContext) -> Tensor,
    ) -> Result<Tensor> {
        cpu.enter();
        let past = cache.as_ref().map_or(0, |c| c.len());
        let new = x.size()[1] as usize;
        // A prefill's ops free buffers of megabytes that the next layer's ask for again.
        let _reusing = (new > ROW_KERNEL_MAX_ROWS).then(allocator::reuse_large_buffers);
        if let Some(c) = cache.as_deref() {
            c.check_room(new, layers.len())?;
        }
        let implicit = attention_mask(past, new, mask, x.device());
        let mask = mask.or(implicit.mask.as_ref());
        let mut masks = mask.map(|m| OnDevices::new(m.shallow_clone()));
        let mut x = x.shallow_clone();
        for (index, layer) in layers.iter().enumerate() {
            // A target spread over devices: the stream follows its layers.
            let device = layer.device();
            if x.device() != device {
                x = x.to_device(device);
            }
            let mut ctx = LayerContext {
                layer: index,
                cache: cache.as_deref_mut(),
                mask: masks.as_mut().map(|m| m.on(device)),
                is_causal: implicit.is_causal,
                cpu,
            };
            x = run_layer(index, layer, &x, &mut ctx);
        }
        if let Some(c) = cache {
            c.advance(new);
        }
        Ok(x)
    }

    /// Where the layer's weights are.
    pub fn device(&self) -> Device {
        self.self_attn.device()
    }

    /// The layer on [`Self::forward_rows`] where it runs, else on libtorch's ops: `x` is the
    /// residual stream, `given` what the attention reads when the caller gives it (a layer
    /// loaded with [`AttentionInput::Given`]), else `x` (normed where the layer norms it).
    fn forward(
        &self,
        x: &Tensor,
        given: Option<&Tensor>,
        rope: &(Tensor, Tensor),
        ctx: &mut LayerContext,
    ) -> Tensor {
        if self.runs_rows(x, given, rope, ctx) {
            self.forward_rows(x, given, rope, ctx)
        } else {
            self.forward_ops(x, given, rope, ctx)
        }
    }

    fn forward_ops(
        &self,
        x: &Tensor,
        given: Option<&Tensor>,
        rope: &(Tensor, Tensor),
        ctx: &mut LayerContext,
    ) -> Tensor {
        let attention_input = match (given, &self.input_layernorm) {
            (Some(given), _) => given.shallow_clone(),
            (None, Some(norm)) => norm.forward(x),
            (None, None) => x.shallow_clone(),
        };
        let attended = self.self_attn.forward(&attention_input, rope, ctx);
        self.after_attention(x, &attended, ctx.cpu)
    }
}

/// Inputs of one forward pass over `new` tokens per sequence.
pub struct ForwardInput<'a> {
    /// Token ids `[batch, new]`.
    pub input_ids: &'a Tensor,
    /// Position ids `[batch, new]`: consecutive for plain decoding, prefix length + depth for tree
    /// nodes.
    pub positions: &'a Tensor,
    /// Boolean mask `[batch or 1, 1, new, past + new]` (see [`crate::mask`]); `None` means causal.
    pub mask: Option<&'a Tensor>,
    /// Residual-stream taps to return: tap `k` is the hidden state after `k` decoder layers (HF's
    /// `hidden_states[k]`), `k < num_hidden_layers`.
    pub taps: &'a [usize],
    /// How the forward runs on the CPU (decoding and verification must use one policy: the
    /// greedy identity of speculative decoding rests on their arithmetic being the same).
    pub cpu: &'a CpuPolicy,
}

impl<'a> ForwardInput<'a> {
    /// A forward over `tokens` (a causal run or a tree, batch 1) returning `taps`, under `cpu`.
    pub fn new(tokens: &'a TreeInput, taps: &'a [usize], cpu: &'a CpuPolicy) -> Self {
        Self {
            input_ids: &tokens.ids,
            positions: &tokens.positions,
            mask: tokens.mask.as_ref(),
            taps,
            cpu,
        }
    }
}

/// One sequence of [`Llama::forward_sequences`]: its new tokens and its own cache.
pub struct SequenceForward<'a> {
    pub input: ForwardInput<'a>,
    pub cache: &'a mut KvCache,
}

/// Outputs of one forward pass.
pub struct ForwardOutput {
    /// Final hidden states after the last norm, `[batch, new, hidden]`: what the LM head reads.
    pub hidden: Tensor,
    /// The requested taps, in the order asked, each `[batch, new, hidden]`.
    pub taps: Vec<Tensor>,
}

/// The decoder trunk: embeddings, layers and final norm (no LM head).
pub struct Llama {
    embed_tokens: Matrix,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rotary: Rotary,
    config: ModelConfig,
}

impl Llama {
    /// Builds the trunk from `source`, reading HF names under `model.`.
    pub fn load(config: &ModelConfig, source: &mut dyn WeightSource) -> Result<Self> {
        Self::load_placed(config, source, &[])
    }

    /// [`Self::load`] with layer `i` on `placement[i]` (empty: every layer on `source`'s device,
    /// which holds the embeddings and the final norm in any case).
    pub fn load_placed(
        config: &ModelConfig,
        source: &mut dyn WeightSource,
        placement: &[Device],
    ) -> Result<Self> {
        let c = config;
        let embed_tokens = source.matrix(
            "model.embed_tokens.weight",
            &[c.vocab_size as i64, c.hidden_size as i64],
        )?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let prefix = format!("model.layers.{i}");
                match placement.get(i) {
                    Some(&device) => {
                        let mut placed = OnDevice {
                            source: &mut *source,
                            device,
                        };
                        DecoderLayer::load(&mut placed, &prefix, c)
                    }
                    None => DecoderLayer::load(source, &prefix, c),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(source, "model.norm.weight", c.hidden_size, c.rms_norm_eps)?;
        Ok(Self {
            rotary: Rotary::new(c, embed_tokens.device()),
            embed_tokens,
            layers,
            norm,
            config: c.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The device of each layer (they differ when the target is spread over several).
    pub fn layer_devices(&self) -> Vec<Device> {
        self.layers.iter().map(DecoderLayer::device).collect()
    }

    /// The token embedding matrix `[vocab, hidden]` as a tensor (for training; dequantised once,
    /// and kept, when the target is quantised).
    pub fn embed_tokens(&self) -> &Tensor {
        self.embed_tokens.dense()
    }

    /// The token embedding matrix as stored (quantised blocks stay quantised): what draft heads
    /// share, reading the rows they need.
    pub fn embedding(&self) -> &Matrix {
        &self.embed_tokens
    }

    /// The final norm's weight `[hidden]`: the scale of the features the LM head reads.
    pub fn final_norm_weight(&self) -> &Tensor {
        &self.norm.weight
    }

    /// Runs the trunk over `input.input_ids`. With a cache, attention covers the cached prefix plus
    /// the new tokens, whose keys and values are appended to it; without one, only the new tokens.
    /// Errors (never panics) on inputs of the wrong shape, out-of-range taps or a full cache.
    pub fn forward(
        &self,
        input: &ForwardInput,
        cache: Option<&mut KvCache>,
    ) -> Result<ForwardOutput> {
        let past = cache.as_ref().map_or(0, |c| c.len());
        self.check_input(input, past)?;
        // Activations run in the kind of the model's vectors; the matrices may be stored
        // narrower (`crate::target::activation_kind`).
        let x = self
            .embed_tokens
            .rows(input.input_ids)
            .to_kind(self.norm.weight.kind());
        let rope = self.rotary.cos_sin(input.positions, x.kind());
        let mut ropes = OnDevices::new(rope);
        let mut taps: Vec<Option<Tensor>> = input.taps.iter().map(|_| None).collect();
        let x = DecoderLayer::run_stack(
            &self.layers,
            &x,
            cache,
            input.mask,
            input.cpu,
            |index, layer, x, ctx| {
                record_tap(&mut taps, input.taps, index, x);
                layer.forward(x, None, ropes.on(x.device()), ctx)
            },
        )?;
        // Layers spread over devices leave the stream on the last: back to the first, where the
        // final norm and the LM head are.
        let home = self.norm.weight.device();
        let to_home = |t: Tensor| match t.device() == home {
            true => t,
            false => t.to_device(home),
        };
        Ok(ForwardOutput {
            hidden: self.norm.forward_rows_where_plain(&to_home(x)),
            taps: taps.into_iter().flatten().map(to_home).collect(),
        })
    }

    /// [`Self::forward`] for several sequences at once, each over its own cache: what continuous
    /// batching verifies in one step. Each sequence's outputs are the ones its own forward would
    /// give, bit for bit: sequences that the few-row path takes together ([`Self::fused_groups`])
    /// run every layer's products once over all their rows and attention per sequence; any
    /// other sequence runs alone. Outputs in the order of `sequences`.
    pub fn forward_sequences(
        &self,
        sequences: &mut [SequenceForward],
    ) -> Result<Vec<ForwardOutput>> {
        let groups = self.fused_groups(sequences);
        let mut members: Vec<Vec<&mut SequenceForward>> =
            groups.iter().map(|_| Vec::new()).collect();
        let mut group_of = vec![0; sequences.len()];
        for (group, indices) in groups.iter().enumerate() {
            indices.iter().for_each(|&index| group_of[index] = group);
        }
        for (index, sequence) in sequences.iter_mut().enumerate() {
            members[group_of[index]].push(sequence);
        }
        let mut outputs: Vec<Option<ForwardOutput>> = group_of.iter().map(|_| None).collect();
        for (indices, mut group) in groups.iter().zip(members) {
            let group_outputs = match &mut group[..] {
                [alone] => vec![self.forward(&alone.input, Some(&mut *alone.cache))?],
                together => self.forward_fused(together)?,
            };
            for (&index, output) in indices.iter().zip(group_outputs) {
                outputs[index] = Some(output);
            }
        }
        Ok(outputs.into_iter().flatten().collect())
    }

    /// `sequences` (their indices, in order) in groups that run together on the few-row path:
    /// one token sequence each (batch 1) of at most [`ROW_KERNEL_MAX_ROWS`] rows over a cache
    /// the path reads, with the same taps and decoding pool, at most [`ROW_KERNEL_MAX_ROWS`] rows
    /// in all, each sequence in the first group it fits. Any other sequence is a group of its own,
    /// as is a lone sequence (unchecked: [`Self::forward`] checks it).
    fn fused_groups(&self, sequences: &[SequenceForward]) -> Vec<Vec<usize>> {
        let rows_path = sequences.len() > 1
            && row_kernel::available()
            && plain_cpu_f32(&self.norm.weight)
            && self.layers.iter().all(DecoderLayer::weights_run_rows);
        // What sequences run together share: their taps and pool (`None`: runs alone).
        type Key<'a> = Option<(&'a [usize], *const SpinPool)>;
        // Open groups: their key, rows so far and members.
        let mut groups: Vec<(Key, usize, Vec<usize>)> = Vec::new();
        for (index, sequence) in sequences.iter().enumerate() {
            let input = &sequence.input;
            let size = input.input_ids.size();
            let new = size.get(1).copied().unwrap_or(0) as usize;
            let cache = &*sequence.cache;
            let fusable = rows_path
                && size.len() == 2
                && size[0] == 1
                && (1..=ROW_KERNEL_MAX_ROWS).contains(&new)
                && (0..self.layers.len()).all(|layer| rows::cache_runs_rows(cache, layer, 1));
            let key = input
                .cpu
                .pool()
                .filter(|_| fusable)
                .map(|pool| (input.taps, std::ptr::from_ref(pool)));
            let open = groups.iter_mut().find(|(group_key, rows, _)| {
                key.is_some() && *group_key == key && rows + new <= ROW_KERNEL_MAX_ROWS
            });
            match open {
                Some((_, rows, members)) => {
                    *rows += new;
                    members.push(index);
                }
                None => groups.push((key, new, vec![index])),
            }
        }
        groups.into_iter().map(|(_, _, members)| members).collect()
    }

    /// A group of [`Self::fused_groups`] in one pass of the layers over all their rows.
    fn forward_fused(&self, sequences: &mut [&mut SequenceForward]) -> Result<Vec<ForwardOutput>> {
        let cpu = sequences[0].input.cpu;
        let wanted_taps = sequences[0].input.taps;
        let pool = cpu.pool().expect("fused_groups checked the policy");
        cpu.enter();
        let (mut masks, mut news) = (Vec::new(), Vec::new());
        for sequence in sequences.iter() {
            let (past, input) = (sequence.cache.len(), &sequence.input);
            self.check_input(input, past)?;
            let new = input.input_ids.size()[1] as usize;
            sequence.cache.check_room(new, self.layers.len())?;
            masks.push(attention_mask(past, new, input.mask, Device::Cpu));
            news.push(new);
        }
        let ids: Vec<&Tensor> = sequences.iter().map(|s| s.input.input_ids).collect();
        let positions: Vec<&Tensor> = sequences.iter().map(|s| s.input.positions).collect();
        let mut x = self
            .embed_tokens
            .rows(&Tensor::f_cat(&ids, 1)?)
            .to_kind(self.norm.weight.kind());
        let rope = self
            .rotary
            .cos_sin(&Tensor::f_cat(&positions, 1)?, x.kind());
        let mut taps: Vec<Option<Tensor>> = wanted_taps.iter().map(|_| None).collect();
        for (index, layer) in self.layers.iter().enumerate() {
            record_tap(&mut taps, wanted_taps, index, &x);
            let mut rows: Vec<SequenceRows> = sequences
                .iter_mut()
                .zip(&masks)
                .zip(&news)
                .map(|((sequence, implicit), &new)| SequenceRows {
                    cache: &mut *sequence.cache,
                    new,
                    mask: sequence.input.mask.or(implicit.mask.as_ref()),
                    is_causal: implicit.is_causal,
                })
                .collect();
            x = layer.forward_rows_of_sequences(&x, &rope, index, &mut rows, pool);
        }
        for (sequence, &new) in sequences.iter_mut().zip(&news) {
            sequence.cache.advance(new);
        }
        let hidden = self.norm.forward_rows_where_plain(&x);
        let taps: Vec<Tensor> = taps.into_iter().flatten().collect();
        let mut start = 0;
        Ok(news
            .iter()
            .map(|&new| {
                let of_sequence = |t: &Tensor| t.narrow(1, start, new as i64);
                let output = ForwardOutput {
                    hidden: of_sequence(&hidden),
                    taps: taps.iter().map(of_sequence).collect(),
                };
                start += new as i64;
                output
            })
            .collect())
    }

    /// Validates shapes, taps and token ids.
    fn check_input(&self, input: &ForwardInput, past: usize) -> Result<()> {
        let ids = input.input_ids.size();
        let [batch, new] = ids[..] else {
            return Err(ModelError::Input(format!(
                "input_ids must be [batch, new], got {ids:?}"
            )));
        };
        if input.positions.size() != ids {
            return Err(ModelError::Input(format!(
                "positions {:?} must match input_ids {ids:?}",
                input.positions.size()
            )));
        }
        if let Some(mask) = input.mask {
            let s = mask.size();
            let ok = s.len() == 4
                && (s[0] == 1 || s[0] == batch)
                && s[1] == 1
                && s[2] == new
                && s[3] == past as i64 + new
                && mask.kind() == Kind::Bool;
            if !ok {
                return Err(ModelError::Input(format!(
                    "mask must be Bool [1 or {batch}, 1, {new}, {}], got {:?} {s:?}",
                    past as i64 + new,
                    mask.kind()
                )));
            }
        }
        if let Some(&tap) = input.taps.iter().find(|&&t| t >= self.layers.len()) {
            return Err(ModelError::Input(format!(
                "tap {tap} out of range: the model has {} layers",
                self.layers.len()
            )));
        }
        let max_id = input.input_ids.max().int64_value(&[]);
        if new > 0
            && (max_id >= self.config.vocab_size as i64
                || input.input_ids.min().int64_value(&[]) < 0)
        {
            return Err(ModelError::Input(format!(
                "token id {max_id} outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        Ok(())
    }
}

/// What attention needs when the caller gave no mask: nothing for one new token, SDPA's causal
/// flag for a prefill without cache, an explicit causal mask over cache + new tokens otherwise.
struct ImplicitMask {
    mask: Option<Tensor>,
    is_causal: bool,
}

fn attention_mask(
    past: usize,
    new: usize,
    given: Option<&Tensor>,
    device: tch::Device,
) -> ImplicitMask {
    let (mask, is_causal) = match (given, past, new) {
        (Some(_), _, _) | (None, _, 1) => (None, false),
        (None, 0, _) => (None, true),
        (None, _, _) => (Some(crate::mask::causal_mask(past, new, device)), false),
    };
    ImplicitMask { mask, is_causal }
}

fn record_tap(taps: &mut [Option<Tensor>], wanted: &[usize], layer: usize, x: &Tensor) {
    for (slot, _) in taps.iter_mut().zip(wanted).filter(|(_, &w)| w == layer) {
        *slot = Some(x.shallow_clone());
    }
}

/// The output projection from final hidden states to vocabulary logits.
pub struct LmHead {
    projection: Linear,
}

impl LmHead {
    /// Loads `lm_head.weight`, or shares the embedding matrix when the model ties them.
    pub fn load(
        config: &ModelConfig,
        trunk: &Llama,
        source: &mut dyn WeightSource,
    ) -> Result<Self> {
        let weight = if config.tie_word_embeddings {
            trunk.embed_tokens.share()
        } else {
            source.matrix(
                "lm_head.weight",
                &[config.vocab_size as i64, config.hidden_size as i64],
            )?
        };
        Ok(Self {
            projection: Linear::from_matrix(weight, None),
        })
    }

    /// Logits `[..., vocab]` for hidden states `[..., hidden]`; callers pass only the rows they
    /// need (the last one when decoding).
    pub fn forward(&self, hidden: &Tensor, cpu: &CpuPolicy) -> Tensor {
        self.projection.forward(hidden, cpu)
    }

    /// [`Self::forward`] of several sequences' hidden rows (each `[n, hidden]`), the rows of as
    /// many sequences as fit the few-row kernel's [`ROW_KERNEL_MAX_ROWS`] in one product: each
    /// sequence's logits are the bits its own product gives, at a fraction of the weight reads.
    pub fn forward_sequences(&self, hidden: &[Tensor], cpu: &CpuPolicy) -> Vec<Tensor> {
        let mut logits = Vec::with_capacity(hidden.len());
        let mut rest = hidden;
        while !rest.is_empty() {
            let mut rows = 0;
            let together = rest
                .iter()
                .take_while(|h| {
                    rows += h.size()[0] as usize;
                    rows <= ROW_KERNEL_MAX_ROWS
                })
                .count()
                .max(1);
            let (group, after) = rest.split_at(together);
            let product = self.forward(&Tensor::cat(group, 0), cpu);
            let mut start = 0;
            for h in group {
                let n = h.size()[0];
                logits.push(product.narrow(0, start, n));
                start += n;
            }
            rest = after;
        }
        logits
    }

    pub fn weight(&self) -> &Tensor {
        self.projection.weight()
    }

    pub fn matrix(&self) -> &Matrix {
        self.projection.matrix()
    }
}

/// A target model: trunk plus LM head.
pub struct CausalLm {
    pub model: Llama,
    pub lm_head: LmHead,
}

impl CausalLm {
    pub fn load(config: &ModelConfig, source: &mut dyn WeightSource) -> Result<Self> {
        Self::load_placed(config, source, &[])
    }

    /// [`Self::load`] with the layers placed as [`Llama::load_placed`] places them (the LM head
    /// on `source`'s device, beside the embeddings it may share).
    pub fn load_placed(
        config: &ModelConfig,
        source: &mut dyn WeightSource,
        placement: &[Device],
    ) -> Result<Self> {
        let model = Llama::load_placed(config, source, placement)?;
        let lm_head = LmHead::load(config, &model, source)?;
        Ok(Self { model, lm_head })
    }

    /// HF names and shapes of every weight [`Self::load`] reads for `config` (loads zeros: meant
    /// for small test configs).
    pub fn weight_shapes(config: &ModelConfig) -> Result<Vec<(String, Vec<i64>)>> {
        let mut recorder = ShapeRecorder::default();
        Self::load(config, &mut recorder)?;
        Ok(recorder.into_shapes())
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// Bytes of weights one decoding step reads: every layer's matrices and the LM head. On a
    /// CPU, memory bandwidth over these bytes bounds the decoding rate.
    pub fn decode_step_bytes(&self) -> usize {
        self.decode_step_matrices().map(Matrix::bytes).sum()
    }

    /// Whether any matrix a decoding step reads runs quantised (a GGUF's blocks).
    pub fn runs_quantised(&self) -> bool {
        self.decode_step_matrices()
            .any(|m| matches!(m, Matrix::Quantised { .. }))
    }

    /// The matrices of [`Self::decode_step_bytes`], in the order a step reads them.
    pub fn decode_step_matrices(&self) -> impl Iterator<Item = &Matrix> {
        let layers = self.model.layers.iter().flat_map(DecoderLayer::linears);
        layers.map(Linear::matrix).chain([self.lm_head.matrix()])
    }
}
