//! Llama (Touvron et al., 2023) and the families that share its layout: Mistral, Qwen2/2.5 and
//! Qwen3 (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`).
//! Pre-norm blocks with RMSNorm, rotary positions (half-split, as `transformers` rotates), a
//! gated SiLU MLP, grouped-query attention; Qwen2 adds biases on q, k and v, Qwen3 a per-head
//! RMSNorm of q and k. The checkpoint's q, k and v (and gate and up) matrices are loaded side by
//! side into one product each, as vLLM's `QKVParallelLinear` does.

use candle_core::Tensor;
use candle_nn::VarBuilder;
use serde::Deserialize;

use super::Family;
use crate::config::{Activation, Config, PositionEmbedding, Rope, RopeScaling, Variant};
use crate::layers::Weight;

/// The fields of these families' `config.json` that shape the network (`transformers` 4 and 5).
#[derive(Debug, Deserialize)]
struct HfConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    #[serde(default = "default_rms_eps")]
    rms_norm_eps: f64,
    /// `transformers` 4; 5 writes it into `rope_parameters`.
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    rope_parameters: Option<serde_json::Value>,
    /// `LlamaConfig` and the others here default to an untied head.
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default = "default_act")]
    hidden_act: Activation,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    mlp_bias: bool,
    #[serde(default)]
    bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    sliding_window: Option<usize>,
    /// Qwen2 and Qwen3: the window applies only where this is true.
    #[serde(default)]
    use_sliding_window: Option<bool>,
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_act() -> Activation {
    Activation::Silu
}

/// Token ids from `config.json`'s `bos_token_id`/`eos_token_id`: a number or a list of them.
fn token_ids(value: &Option<serde_json::Value>, field: &str) -> Result<Vec<u32>, String> {
    let id = |v: &serde_json::Value| {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("{field}: {v} is not a token id"))
    };
    match value {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(ids)) => ids.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}

/// The rotary frequencies from `rope_theta` and `rope_scaling` (`transformers` 4) or
/// `rope_parameters` (5).
fn rope(cfg: &HfConfig) -> Result<Rope, String> {
    let params = cfg
        .rope_parameters
        .as_ref()
        .or(cfg.rope_scaling.as_ref())
        .filter(|v| !v.is_null());
    let number = |key: &str| params.and_then(|p| p.get(key)).and_then(|v| v.as_f64());
    let theta = number("rope_theta").or(cfg.rope_theta).unwrap_or(10_000.0);
    let kind = params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let need = |key: &str| number(key).ok_or_else(|| format!("rope_scaling of type {kind} has no number `{key}`"));
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: need("factor")?,
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: need("factor")?,
            low_freq_factor: need("low_freq_factor")?,
            high_freq_factor: need("high_freq_factor")?,
            original_max_position_embeddings: need("original_max_position_embeddings")?,
        }),
        other => {
            return Err(format!(
                "rope_scaling of type `{other}` is not supported (supported: default, linear, llama3)"
            ))
        }
    };
    Ok(Rope { theta, scaling })
}

pub fn config_from_hf(family: Family, value: serde_json::Value) -> Result<Config, String> {
    let hf: HfConfig = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let eos = token_ids(&hf.eos_token_id, "eos_token_id")?;
    let bos = token_ids(&hf.bos_token_id, "bos_token_id")?;
    // A sliding window that applies caps the context: attention past it is not implemented yet,
    // and a longer context would attend where the model never did.
    let window = match (family, hf.use_sliding_window) {
        (Family::Qwen2 | Family::Qwen3, Some(true)) | (Family::Mistral, _) => hf.sliding_window,
        _ => None,
    };
    let n_positions = window.map_or(hf.max_position_embeddings, |w| w.min(hf.max_position_embeddings));
    let variant = Variant {
        family,
        n_kv_head: Some(hf.num_key_value_heads.unwrap_or(hf.num_attention_heads)),
        head_dim: Some(hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1))),
        rms_norm: true,
        gated_mlp: true,
        rope: Some(rope(&hf)?),
        // Qwen2 has biases on q, k and v whatever `attention_bias` says.
        qkv_bias: hf.attention_bias || family == Family::Qwen2,
        o_bias: hf.attention_bias,
        mlp_bias: hf.mlp_bias,
        qk_norm: family == Family::Qwen3,
        eos_token_ids: eos.clone(),
    };
    Ok(Config {
        vocab_size: hf.vocab_size,
        n_positions,
        n_embd: hf.hidden_size,
        n_layer: hf.num_hidden_layers,
        n_head: hf.num_attention_heads,
        n_inner: Some(hf.intermediate_size),
        layer_norm_epsilon: hf.rms_norm_eps,
        activation_function: hf.hidden_act,
        resid_pdrop: 0.0,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        tie_word_embeddings: hf.tie_word_embeddings,
        scale_attn_weights: true,
        scale_attn_by_inverse_layer_idx: false,
        bos_token_id: bos.first().copied(),
        eos_token_id: eos.first().copied(),
        position_embedding: PositionEmbedding::Rope,
        bias: false,
        variant,
    })
}

pub fn config_to_hf(cfg: &Config) -> Result<serde_json::Value, String> {
    let v = &cfg.variant;
    let rope = v
        .rope
        .as_ref()
        .ok_or("a Llama-family config without rotary embeddings")?;
    let scaling = match rope.scaling {
        None => serde_json::Value::Null,
        Some(RopeScaling::PerFrequency(_)) => {
            return Err("per-frequency rotary factors (llama.cpp's rope_freqs) have no config.json form".into())
        }
        Some(RopeScaling::Linear { factor }) => serde_json::json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => serde_json::json!({
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": original_max_position_embeddings as u64,
        }),
    };
    let act = serde_json::to_value(cfg.activation_function).map_err(|e| e.to_string())?;
    let eos = match &cfg.eos_ids()[..] {
        [] => serde_json::Value::Null,
        [one] => (*one).into(),
        many => serde_json::json!(many),
    };
    Ok(serde_json::json!({
        "model_type": v.family.model_type(),
        "architectures": [v.family.hf_class()],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_width(),
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head(),
        "head_dim": cfg.head_dim(),
        "max_position_embeddings": cfg.n_positions,
        "rms_norm_eps": cfg.layer_norm_epsilon,
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": act,
        "attention_bias": v.o_bias,
        "mlp_bias": v.mlp_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
    }))
}

/// The checkpoint names of layer `i`'s tensors (`model.layers.{i}.`), as `transformers` writes
/// them; llama.cpp's are in [`crate::gguf`].
pub const ATTN_NORM: &str = "input_layernorm";
pub const MLP_NORM: &str = "post_attention_layernorm";
pub const Q: &str = "self_attn.q_proj";
pub const K: &str = "self_attn.k_proj";
pub const V: &str = "self_attn.v_proj";
pub const O: &str = "self_attn.o_proj";
pub const Q_NORM: &str = "self_attn.q_norm";
pub const K_NORM: &str = "self_attn.k_norm";
pub const GATE: &str = "mlp.gate_proj";
pub const UP: &str = "mlp.up_proj";
pub const DOWN: &str = "mlp.down_proj";
pub const EMBED: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const HEAD: &str = "lm_head.weight";

pub fn layer(i: usize) -> String {
    format!("model.layers.{i}")
}

/// One block's weights, whatever file they came from: `(out, in)` matrices with their biases
/// (zeros where the family has none), the norms' gains.
pub(crate) struct LayerWeights {
    pub attn_norm: Tensor,
    /// q, k and v side by side.
    pub qkv: (Weight, Tensor),
    pub o: (Weight, Tensor),
    /// QK-norm's gains of q and k, `(head_dim)` each.
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub mlp_norm: Tensor,
    /// gate and up side by side.
    pub gate_up: (Weight, Tensor),
    pub down: (Weight, Tensor),
}

/// A whole network's weights ([`crate::Gpt::from_family_weights`]).
pub(crate) struct FamilyWeights {
    pub embed: Weight,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Tensor,
    /// The untied LM head; `None` where the embedding is the head.
    pub head: Option<Weight>,
}

/// The weights of a `transformers` checkpoint under its names, from `vb` (rooted at the names'
/// start) in its dtype.
pub(crate) fn weights_from_hf(vb: &VarBuilder, cfg: &Config) -> candle_core::Result<FamilyWeights> {
    let (c, v) = (cfg.n_embd, &cfg.variant);
    let dense = |(w, b): (Tensor, Tensor)| (Weight::Dense(w), b);
    let layers = (0..cfg.n_layer)
        .map(|i| {
            let p = layer(i);
            let qk_norm = match v.qk_norm {
                true => Some((
                    vb.get(cfg.head_dim(), &format!("{p}.{Q_NORM}.weight"))?,
                    vb.get(cfg.head_dim(), &format!("{p}.{K_NORM}.weight"))?,
                )),
                false => None,
            };
            Ok(LayerWeights {
                attn_norm: vb.get(c, &format!("{p}.{ATTN_NORM}.weight"))?,
                qkv: dense(qkv(vb, &p, cfg)?),
                o: dense(linear(vb, &format!("{p}.{O}"), cfg.q_width(), c, v.o_bias)?),
                qk_norm,
                mlp_norm: vb.get(c, &format!("{p}.{MLP_NORM}.weight"))?,
                gate_up: dense(gate_up(vb, &p, cfg)?),
                down: dense(linear(vb, &format!("{p}.{DOWN}"), cfg.mlp_width(), c, v.mlp_bias)?),
            })
        })
        .collect::<candle_core::Result<_>>()?;
    let head = match cfg.tie_word_embeddings {
        true => None,
        false => Some(Weight::Dense(vb.get((cfg.vocab_size, c), HEAD)?)),
    };
    Ok(FamilyWeights {
        embed: Weight::Dense(vb.get((cfg.vocab_size, c), EMBED)?),
        layers,
        final_norm: vb.get(c, FINAL_NORM)?,
        head,
    })
}

/// A `(out, in)` weight `name.weight` and, where `bias`, its `name.bias` (else zeros, not a
/// parameter), from `vb` in its dtype.
pub(crate) fn linear(
    vb: &VarBuilder,
    name: &str,
    d_in: usize,
    d_out: usize,
    bias: bool,
) -> candle_core::Result<(Tensor, Tensor)> {
    let w = vb.get((d_out, d_in), &format!("{name}.weight"))?;
    let b = match bias {
        true => vb.get(d_out, &format!("{name}.bias"))?,
        false => Tensor::zeros(d_out, vb.dtype(), vb.device())?,
    };
    Ok((w, b))
}

/// q, k and v of layer `prefix` side by side: the `(q + 2 kv, C)` weight and its bias.
pub(crate) fn qkv(vb: &VarBuilder, prefix: &str, cfg: &Config) -> candle_core::Result<(Tensor, Tensor)> {
    let (c, q, kv, bias) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.variant.qkv_bias);
    let parts = [(Q, q), (K, kv), (V, kv)].map(|(name, out)| linear(vb, &format!("{prefix}.{name}"), c, out, bias));
    let [q, k, v] = parts;
    let (q, k, v) = (q?, k?, v?);
    Ok((
        Tensor::cat(&[&q.0, &k.0, &v.0], 0)?,
        Tensor::cat(&[&q.1, &k.1, &v.1], 0)?,
    ))
}

/// gate and up of layer `prefix` side by side: the `(2 I, C)` weight and its bias.
pub(crate) fn gate_up(vb: &VarBuilder, prefix: &str, cfg: &Config) -> candle_core::Result<(Tensor, Tensor)> {
    let (c, w, bias) = (cfg.n_embd, cfg.mlp_width(), cfg.variant.mlp_bias);
    let (g, gb) = linear(vb, &format!("{prefix}.{GATE}"), c, w, bias)?;
    let (u, ub) = linear(vb, &format!("{prefix}.{UP}"), c, w, bias)?;
    Ok((Tensor::cat(&[&g, &u], 0)?, Tensor::cat(&[&gb, &ub], 0)?))
}
