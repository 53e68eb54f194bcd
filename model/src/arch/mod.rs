//! The model families: one file each, holding what maps a family's `config.json` onto the one
//! decoder ([`crate::Config`] and its [`crate::config::Variant`]), its tensor names, and its load
//! quirks, in the spirit of llama.cpp's per-architecture tables and vLLM's model registry. The
//! decoder itself (`crate::gpt`) is written once over the shared layers.

use crate::config::Config;

pub mod gpt2;
pub mod llama;

/// A family of decoders, as `transformers` names it in `config.json`'s `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Family {
    /// GPT-2 (Radford et al., 2019): learned positions, LayerNorm, a GELU MLP, fused `c_attn`.
    #[default]
    Gpt2,
    /// Llama 1-3 and the checkpoints that share its layout (SmolLM/SmolLM2, TinyLlama):
    /// RMSNorm, RoPE, a gated SiLU MLP, grouped-query attention.
    Llama,
    /// Mistral's `MistralForCausalLM`: Llama's layout with an optional sliding window.
    Mistral,
    /// Qwen2 and Qwen2.5: Llama's layout with biases on q, k and v.
    Qwen2,
    /// Qwen3: Llama's layout with a per-head RMSNorm of q and k (QK-norm) and its own head width.
    Qwen3,
}

impl Family {
    pub const ALL: [Family; 5] = [Self::Gpt2, Self::Llama, Self::Mistral, Self::Qwen2, Self::Qwen3];

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
        }
    }

    /// The `transformers` class that loads its checkpoints (`architectures` in `config.json`).
    pub fn hf_class(self) -> &'static str {
        match self {
            Self::Gpt2 => "GPT2LMHeadModel",
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == model_type)
    }

    /// The `model_type`s supported, for error messages.
    pub fn supported() -> String {
        Self::ALL.map(Self::model_type).join(", ")
    }

    /// Whether the family's decoder is GPT-2's (learned positions, LayerNorm, multi-head
    /// attention, `Conv1D` weights): the one the trainer's tape and fused training kernels run.
    pub fn is_gpt2(self) -> bool {
        self == Self::Gpt2
    }
}

/// The config of a `config.json` value, by its `model_type` (none: GPT-2, as older GPT-2
/// checkpoints have it); an unknown type is an error naming it and the supported ones.
pub fn config_from_hf(value: serde_json::Value) -> Result<Config, String> {
    let family = match value.get("model_type") {
        None | Some(serde_json::Value::Null) => Family::Gpt2,
        Some(serde_json::Value::String(t)) => Family::from_model_type(t).ok_or_else(|| {
            format!(
                "model_type `{t}` is not a supported architecture (supported: {})",
                Family::supported()
            )
        })?,
        Some(other) => return Err(format!("model_type is {other}, not a string")),
    };
    match family {
        Family::Gpt2 => gpt2::config_from_hf(value),
        _ => llama::config_from_hf(family, value),
    }
}

/// The `config.json` object that `transformers` reads for `cfg`'s family.
pub fn config_to_hf(cfg: &Config) -> Result<serde_json::Value, String> {
    match cfg.variant.family {
        Family::Gpt2 => gpt2::config_to_hf(cfg),
        _ => llama::config_to_hf(cfg),
    }
}
