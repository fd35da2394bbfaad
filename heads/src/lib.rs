//! Draft heads for speculative decoding: Medusa heads and the EAGLE-1 and EAGLE-3
//! feature-conditioned heads (both drafting through [`FeatureHead`]).
//!
//! Heads read the target's final (post-norm) hidden states and reuse its frozen embedding and LM
//! head. Their trainable tensors live in a [`Params`] map under the names the reference
//! implementations use (Medusa's `{head}.{layer}.linear.weight`, EAGLE's `fc.weight`,
//! `layers.0.self_attn.q_proj.weight`, …), so checkpoints export without renaming.
//!
//! The EAGLE head's decoder layer is the target runtime's own [`headway_model::DecoderLayer`],
//! built from the parameter map through [`headway_model::WeightSource`] each time the head is
//! assembled: the runtime fuses q/k/v and gate/up by concatenation, and a concatenation of leaf
//! tensors passes gradients back to each of them.

pub mod draft_vocab;
pub mod eagle;
pub mod eagle3;
pub mod error;
pub mod feature_head;
pub mod medusa;
pub mod params;
pub mod testing;

pub use draft_vocab::DraftVocab;
pub use eagle::{EagleConfig, EagleHead};
pub use eagle3::{Eagle3Config, Eagle3Head};
pub use error::{HeadError, Result};
pub use feature_head::{FeatureHead, FeatureModules};
pub use medusa::{MedusaConfig, MedusaHeads};
pub use params::Params;
