//! The element types Headway stores and computes weights and features in.

use tch::Kind;

/// A floating-point storage type: target weights (`--dtype`), stored features (`prepare
/// --dtype`, `manifest.json`) and converted checkpoints (`convert --dtype`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn kind(self) -> Kind {
        match self {
            Self::F32 => Kind::Float,
            Self::Bf16 => Kind::BFloat16,
            Self::F16 => Kind::Half,
        }
    }

    /// The dtype of tensors of `kind`, if it is one of these.
    pub fn of_kind(kind: Kind) -> Option<Self> {
        [Self::F32, Self::Bf16, Self::F16]
            .into_iter()
            .find(|dtype| dtype.kind() == kind)
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }

    /// The name HF's `torch_dtype` config field uses.
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
        }
    }
}
