//! Target-model runtime for Headway.
//!
//! One Llama-family implementation ([`llama`]) serves every use: plain decoding, feature
//! extraction and tree verification. The forward pass takes explicit position ids and an optional
//! boolean attention mask over cached prefix + new tokens ([`mask`]), so the caller chooses between
//! causal prefill, single-token decode and tree-masked verification; the [`KvCache`] is passed
//! explicitly, never hidden in the model. The trunk returns hidden states; the LM head is separate
//! so callers project only the rows they need.

pub mod allocator;
pub mod chat;
pub mod config;
pub mod cpu;
pub mod dtype;
pub mod error;
pub mod files;
pub mod fingerprint;
pub mod generate;
pub mod hash;
pub mod json;
pub mod kv_cache;
mod kv_elements;
pub mod linear;
pub mod llama;
pub mod mask;
mod on_devices;
pub mod quant;
pub mod quant_gguf;
pub mod quant_kernel;
pub mod roof;
pub mod row_attention;
pub mod row_kernel;
pub mod safetensors_io;
pub mod sampling;
pub mod spin_pool;
pub mod target;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use chat::{ChatTemplate, Message};
pub use config::{Architecture, ModelConfig};
pub use cpu::{CpuPolicy, CpuThreads};
pub use dtype::Dtype;
pub use error::{ModelError, Result};
pub use generate::{check_request, generate, generate_batch, Generation, StopReason};
pub use kv_cache::KvCache;
pub use linear::ROW_KERNEL_MAX_ROWS;
pub use llama::{
    AttentionInput, CausalLm, DecoderLayer, ForwardInput, ForwardOutput, Llama, LmHead, RmsNorm,
    Rotary, SequenceForward,
};
pub use mask::TreeInput;
pub use sampling::{greedy_tokens, Sampler, SamplingArgs, SamplingParams};
pub use target::{Target, TargetArgs};
pub use tokenizer::TextTokenizer;
pub use weights::{RandomWeights, SafetensorsWeights, ShapeRecorder, WeightSource};
