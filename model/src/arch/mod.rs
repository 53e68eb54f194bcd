//! The model families: one file each, holding what maps a family's `config.json` onto the one
//! decoder ([`crate::Config`] and its [`crate::config::Variant`]), its tensor names, and its load
//! quirks, in the spirit of llama.cpp's per-architecture tables and vLLM's model registry. The
//! decoder itself (`crate::gpt`) is written once over the shared layers.

use std::path::Path;

use crate::config::Config;
pub use crate::config::Family;
use crate::error::Error;

pub mod gemma;
pub mod gpt2;
pub mod llama;
pub mod names;

/// The config of a `config.json` value, by its `model_type` (none: GPT-2, as older GPT-2
/// checkpoints have it); an unknown type is an error naming it and the supported ones. Gemma 3's
/// multimodal `gemma3` is read as its `text_config` (the text model; the vision tower is not
/// loaded).
pub fn config_from_hf(mut value: serde_json::Value) -> Result<Config, String> {
    if value.get("model_type").and_then(|t| t.as_str()) == Some("gemma3") {
        let mut text = value
            .get_mut("text_config")
            .map(serde_json::Value::take)
            .filter(|t| t.is_object())
            .ok_or("model_type `gemma3` without a `text_config` object")?;
        if let Some(map) = text.as_object_mut() {
            map.insert("model_type".into(), Family::Gemma3.model_type().into());
            // The multimodal config keeps the vocabulary's size and the end tokens at its top.
            for key in ["vocab_size", "eos_token_id", "bos_token_id"] {
                if let (false, Some(v)) = (map.contains_key(key), value.get(key)) {
                    map.insert(key.into(), v.clone());
                }
            }
        }
        value = text;
    }
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
        Family::Gemma2 | Family::Gemma3 => gemma::config_from_hf(family, value),
        _ => llama::config_from_hf(family, value),
    }
}

/// A checkpoint's tensors (as [`crate::Gpt::named_tensors`] names them) by the names of the
/// variables of a trainable model of `cfg` ([`crate::Gpt::new_trainable`]): GPT-2's without
/// their `transformer.` prefix, the other families' as [`llama::trainable_tensors`] stacks them.
pub fn trainable_tensors(
    cfg: &Config,
    tensors: std::collections::HashMap<String, candle_core::Tensor>,
) -> crate::Result<std::collections::HashMap<String, candle_core::Tensor>> {
    match cfg.variant.family {
        Family::Gpt2 => Ok(tensors
            .into_iter()
            .map(|(name, t)| (name.trim_start_matches("transformer.").to_string(), t))
            .collect()),
        _ => llama::trainable_tensors(cfg, tensors),
    }
}

/// A config of `family` at `shape`'s sizes (its layers, heads, width, context, vocabulary and
/// dropout: a GPT-2 preset with the trainer's flags) for training from scratch: RMSNorm, rotary
/// positions (base 10000), a gated MLP of about 8/3 the width (a multiple of 32, as Llama's
/// SwiGLU keeps 4x's parameters), `n_kv_head` key/value heads, a tied head, and the family's own
/// choices: q, k, v biases (Qwen2), QK-norm (Qwen3, Gemma 3), Gemma's norms after the layers,
/// scaled embedding, GELU-tanh gate and (Gemma 2) soft-caps at its defaults, Arcee's ungated
/// squared-ReLU MLP of 4x the width (the same parameters). No sliding windows.
pub fn from_scratch(family: Family, shape: &Config, n_kv_head: Option<usize>) -> crate::Result<Config> {
    if family.is_gpt2() {
        return Ok(shape.clone());
    }
    let head_dim = shape.n_embd / shape.n_head.max(1);
    let gemma = family.is_gemma();
    let variant = crate::config::Variant {
        family,
        n_kv_head: Some(n_kv_head.unwrap_or(shape.n_head)),
        head_dim: Some(head_dim),
        rms_norm: true,
        gated_mlp: family.gated_mlp(),
        rope: Some(crate::config::Rope {
            theta: 10_000.0,
            scaling: None,
        }),
        qkv_bias: family == Family::Qwen2,
        qk_norm: matches!(family, Family::Qwen3 | Family::Gemma3),
        post_norms: gemma,
        embed_scale: gemma,
        query_pre_attn_scalar: gemma.then_some(head_dim as f64),
        attn_softcap: (family == Family::Gemma2).then_some(50.0),
        final_softcap: (family == Family::Gemma2).then_some(30.0),
        rope_local: (family == Family::Gemma3).then_some(crate::config::Rope {
            theta: 10_000.0,
            scaling: None,
        }),
        ..Default::default()
    };
    let cfg = Config {
        n_inner: Some(match family.gated_mlp() {
            true => (8 * shape.n_embd / 3).div_ceil(32) * 32,
            false => 4 * shape.n_embd,
        }),
        layer_norm_epsilon: if gemma { 1e-6 } else { 1e-5 },
        activation_function: family.activation(),
        position_embedding: crate::config::PositionEmbedding::Rope,
        bias: false,
        tie_word_embeddings: true,
        variant,
        ..shape.clone()
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The `config.json` object that `transformers` reads for `cfg`'s family.
pub fn config_to_hf(cfg: &Config) -> Result<serde_json::Value, String> {
    match cfg.variant.family {
        Family::Gpt2 => gpt2::config_to_hf(cfg),
        Family::Gemma2 | Family::Gemma3 => gemma::config_to_hf(cfg),
        _ => llama::config_to_hf(cfg),
    }
}

/// Reading and writing a `config.json` of any family, where the families are.
impl Config {
    /// Parses and validates a `config.json`, of any family in [`crate::arch`] (by its
    /// `model_type`).
    pub fn from_file(path: &Path) -> crate::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let file_error = |reason: String| Error::ConfigFile {
            path: path.to_path_buf(),
            reason,
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_error(e.to_string()))?;
        let cfg = config_from_hf(value).map_err(file_error)?;
        cfg.validate().map_err(|e| match e {
            Error::InvalidConfig(reason) => file_error(reason),
            other => other,
        })?;
        Ok(cfg)
    }

    /// The `config.json` object that `transformers` reads for this model's family (GPT-2's:
    /// these fields plus the model type).
    pub fn to_hf_value(&self) -> crate::Result<serde_json::Value> {
        config_to_hf(self).map_err(Error::InvalidConfig)
    }

    /// [`Config::to_hf_value`] as pretty-printed text.
    pub fn to_hf_json(&self) -> crate::Result<String> {
        serde_json::to_string_pretty(&self.to_hf_value()?).map_err(|e| Error::InvalidConfig(e.to_string()))
    }
}
