//! Head checkpoints (config + safetensors, tied to the target's fingerprint) and the training
//! state that makes `--resume` continue bit for bit.
//!
//! Empty until the trainer arrives (issue 4).
