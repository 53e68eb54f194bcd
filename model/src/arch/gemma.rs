//! Gemma 2 and Gemma 3's text model (Gemma Team, 2024 and 2025; `Gemma2ForCausalLM`,
//! `Gemma3ForCausalLM`, and the text part of `Gemma3ForConditionalGeneration`). Llama's layout
//! with: RMSNorms whose gains are stored as `w` for `1 + w` (read as `1 + w` here, written back
//! as `w`), norms after the attention and the MLP as well as before, a gated GELU-tanh MLP, the
//! embedding scaled by sqrt(hidden), attention scores scaled by `query_pre_attn_scalar`,
//! sliding-window attention on some layers (every other one in Gemma 2, five of six in Gemma 3,
//! or as `layer_types` says), and Gemma 2's soft-capping of the attention scores and of the
//! logits; Gemma 3 adds QK-norm and a RoPE base of its own for the sliding layers.

use serde::Deserialize;

use super::llama::{rope_of, shared_fields, sliding_layers, Common};
use super::Family;
use crate::config::{Activation, Config, Variant};

/// The fields of Gemma 2's and Gemma 3's `config.json` that shape the network (`transformers` 4
/// and 5).
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(flatten)]
    common: Common,
    #[serde(default = "default_head_dim")]
    head_dim: usize,
    /// Gemma 3 in `transformers` 4: the sliding layers' RoPE base.
    #[serde(default)]
    rope_local_base_freq: Option<f64>,
    #[serde(default = "default_true")]
    tie_word_embeddings: bool,
    #[serde(default)]
    hidden_activation: Option<Activation>,
    #[serde(default)]
    hidden_act: Option<Activation>,
    #[serde(default = "default_query_scalar")]
    query_pre_attn_scalar: f64,
    /// Gemma 3 in `transformers` 4: every `n`th layer global, the others sliding.
    #[serde(default)]
    sliding_window_pattern: Option<usize>,
    #[serde(default)]
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    final_logit_softcapping: Option<f64>,
    /// EmbeddingGemma's encoder: not a decoder.
    #[serde(default)]
    use_bidirectional_attention: Option<bool>,
}

fn default_head_dim() -> usize {
    256
}
fn default_true() -> bool {
    true
}
fn default_query_scalar() -> f64 {
    256.0
}

/// The config of a Gemma 2 or 3 `config.json` value; `gemma3`'s (the multimodal model's) is
/// its `text_config`.
pub fn config_from_hf(family: Family, value: serde_json::Value) -> Result<Config, String> {
    let hf: HfConfig = serde_json::from_value(value).map_err(|e| e.to_string())?;
    if hf.use_bidirectional_attention == Some(true) {
        return Err("use_bidirectional_attention = true (EmbeddingGemma's encoder) is not a decoder".into());
    }
    let c = &hf.common;
    let gemma3 = family == Family::Gemma3;
    // Gemma 2: every other layer slides, the first among them; Gemma 3: all but every sixth.
    let pattern = hf.sliding_window_pattern.unwrap_or(if gemma3 { 6 } else { 2 }).max(1);
    let sliding = match c.sliding_window {
        Some(_) => sliding_layers(&c.layer_types, c.num_hidden_layers, |i| (i + 1) % pattern != 0)?,
        None => Vec::new(),
    };
    // `rope_parameters` per attention type (Gemma 3 in `transformers` 5), or one for all.
    let params = c.rope_parameters.as_ref().filter(|v| !v.is_null());
    let per_type = params.and_then(|p| p.get("full_attention")).is_some();
    let (global, local) = match per_type {
        true => (
            params.and_then(|p| p.get("full_attention")),
            params.and_then(|p| p.get("sliding_attention")),
        ),
        false => (params.or(c.rope_scaling.as_ref()), None),
    };
    let rope = rope_of(global, c.rope_theta, if gemma3 { 1_000_000.0 } else { 10_000.0 })?;
    let rope_local = match gemma3 {
        true => Some(rope_of(local, hf.rope_local_base_freq, 10_000.0)?),
        false => None,
    };
    let variant = Variant {
        family,
        n_kv_head: Some(c.n_kv_head()),
        head_dim: Some(hf.head_dim),
        rms_norm: true,
        gated_mlp: true,
        rope: Some(rope),
        qkv_bias: c.attention_bias,
        o_bias: c.attention_bias,
        mlp_bias: false,
        qk_norm: gemma3,
        eos_token_ids: c.eos()?,
        post_norms: true,
        embed_scale: true,
        query_pre_attn_scalar: Some(hf.query_pre_attn_scalar),
        attn_softcap: hf.attn_logit_softcapping,
        final_softcap: hf.final_logit_softcapping,
        sliding_window: c.sliding_window,
        sliding_layers: sliding,
        rope_local,
    };
    Ok(Config {
        activation_function: hf.hidden_activation.or(hf.hidden_act).unwrap_or(family.activation()),
        tie_word_embeddings: hf.tie_word_embeddings,
        ..c.config(variant)?
    })
}

pub fn config_to_hf(cfg: &Config) -> Result<serde_json::Value, String> {
    let v = &cfg.variant;
    let rope_params = |rope: &crate::config::Rope| -> Result<serde_json::Value, String> {
        Ok(match rope.scaling {
            None => serde_json::json!({"rope_type": "default", "rope_theta": rope.theta}),
            Some(crate::config::RopeScaling::Linear { factor }) => {
                serde_json::json!({"rope_type": "linear", "factor": factor, "rope_theta": rope.theta})
            }
            Some(_) => return Err("Gemma's config.json takes default or linear rotary scaling only".into()),
        })
    };
    let global = v.rope.as_ref().ok_or("a Gemma config without rotary embeddings")?;
    let act = serde_json::to_value(cfg.activation_function).map_err(|e| e.to_string())?;
    // `transformers` 4 reads `rope_theta` and `rope_local_base_freq`; 5 reads `rope_parameters`
    // (per attention type for Gemma 3) and converts the older keys too.
    let mut map = shared_fields(cfg)?;
    map.extend([
        ("rope_theta".to_string(), global.theta.into()),
        ("hidden_activation".to_string(), act),
        ("attention_bias".to_string(), v.qkv_bias.into()),
        // An integer where it is one: `transformers` 5 checks the field's type.
        (
            "query_pre_attn_scalar".to_string(),
            match v.query_pre_attn_scalar.unwrap_or(cfg.head_dim() as f64) {
                x if x.fract() == 0.0 && x < u32::MAX as f64 => (x as u64).into(),
                x => x.into(),
            },
        ),
        ("attn_logit_softcapping".to_string(), v.attn_softcap.into()),
        ("final_logit_softcapping".to_string(), v.final_softcap.into()),
    ]);
    match &v.rope_local {
        Some(local) => {
            map.insert("rope_local_base_freq".into(), local.theta.into());
            map.insert(
                "rope_parameters".into(),
                serde_json::json!({"full_attention": rope_params(global)?, "sliding_attention": rope_params(local)?}),
            );
        }
        None => {
            map.insert("rope_parameters".into(), rope_params(global)?);
        }
    }
    Ok(serde_json::Value::Object(map))
}
