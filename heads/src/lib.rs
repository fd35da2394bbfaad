//! Draft heads for speculative decoding: Medusa heads and the EAGLE feature-conditioned head,
//! and how each drafts a token tree.
//!
//! Empty until the heads arrive (issue 4). Heads read the target's final hidden states and reuse
//! its embedding and LM head from `headway-model`; the EAGLE head's decoder layer will be the
//! target's own `DecoderLayer`, not a copy.
