//! Llama (Touvron et al., 2023) and the families that share its layout: Mistral, Qwen2/2.5,
//! Qwen3 and Arcee (`LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM`, `ArceeForCausalLM`). Pre-norm blocks with RMSNorm, rotary positions
//! (half-split, as `transformers` rotates), a gated SiLU MLP, grouped-query attention; Qwen2 adds
//! biases on q, k and v, Qwen3 a per-head RMSNorm of q and k, Arcee an ungated MLP (`up` and
//! `down` only) of squared ReLU. The checkpoint's q, k and v (and gate and up) matrices are
//! loaded side by side into one product each, as vLLM's `QKVParallelLinear` does.

use candle_core::{DType, Tensor};
use candle_nn::VarBuilder;
use serde::Deserialize;

use super::names::{layer, names, GATE_UP, QKV};
use super::Family;
use crate::config::{Activation, Config, PositionEmbedding, Rope, RopeScaling, Variant};
use crate::layers::Weight;

/// The fields of `config.json` that every family here reads alike (Llama's layout and Gemma's).
#[derive(Debug, Deserialize)]
pub(super) struct Common {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// `transformers` 4; 5 writes it into `rope_parameters`.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    /// `transformers` 5: one object, or (Gemma 3) one per attention type.
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub bos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Each layer's attention (`transformers` 4.53 on): `sliding_attention` or `full_attention`.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
}

impl Common {
    /// The end-of-sequence ids (`eos_token_id` may be a list: Llama 3).
    pub(super) fn eos(&self) -> Result<Vec<u32>, String> {
        token_ids(&self.eos_token_id, "eos_token_id")
    }

    /// Key and value heads: `num_key_value_heads`, else one per query head.
    pub(super) fn n_kv_head(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// The config of a rotary family of these fields: its `variant`, no biases but the
    /// variant's, no dropout; the activation and the head's tying are GPT-2's until the family's
    /// file sets them.
    pub(super) fn config(&self, variant: Variant) -> Result<Config, String> {
        let (bos, eos) = (token_ids(&self.bos_token_id, "bos_token_id")?, self.eos()?);
        Ok(Config {
            n_inner: Some(self.intermediate_size),
            layer_norm_epsilon: self.rms_norm_eps,
            bos_token_id: bos.first().copied(),
            eos_token_id: eos.first().copied(),
            position_embedding: PositionEmbedding::Rope,
            bias: false,
            variant,
            ..Config::base(
                self.vocab_size,
                self.max_position_embeddings,
                self.hidden_size,
                self.num_hidden_layers,
                self.num_attention_heads,
            )
        })
    }
}

/// The fields of these families' `config.json` that shape the network (`transformers` 4 and 5).
#[derive(Debug, Deserialize)]
struct HfConfig {
    #[serde(flatten)]
    common: Common,
    #[serde(default)]
    head_dim: Option<usize>,
    /// `LlamaConfig` and the others here default to an untied head.
    #[serde(default)]
    tie_word_embeddings: bool,
    /// Default: SiLU (Arcee: squared ReLU), as `transformers`' configs default.
    #[serde(default)]
    hidden_act: Option<Activation>,
    #[serde(default)]
    mlp_bias: bool,
    /// Qwen2 and Qwen3: the window applies only where this is true, on the layers from
    /// `max_window_layers` on.
    #[serde(default)]
    use_sliding_window: Option<bool>,
    #[serde(default)]
    max_window_layers: Option<usize>,
}

fn default_rms_eps() -> f64 {
    1e-6
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
fn rope(cfg: &Common) -> Result<Rope, String> {
    let params = cfg.rope_parameters.as_ref().or(cfg.rope_scaling.as_ref());
    rope_of(params, cfg.rope_theta, 10_000.0)
}

/// The rotary frequencies of a `rope_scaling` or `rope_parameters` object (`params`; its
/// `rope_theta` before `theta`, then `default_theta`).
pub(super) fn rope_of(
    params: Option<&serde_json::Value>,
    theta: Option<f64>,
    default_theta: f64,
) -> Result<Rope, String> {
    let params = params.filter(|v| !v.is_null());
    let number = |key: &str| params.and_then(|p| p.get(key)).and_then(|v| v.as_f64());
    let theta = number("rope_theta").or(theta).unwrap_or(default_theta);
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

/// Which layers slide, from `layer_types` (`"sliding_attention"`, `"full_attention"`), else
/// from `fallback(i)`.
pub(super) fn sliding_layers(
    layer_types: &Option<Vec<String>>,
    n_layer: usize,
    fallback: impl Fn(usize) -> bool,
) -> Result<Vec<bool>, String> {
    match layer_types {
        None => Ok((0..n_layer).map(fallback).collect()),
        Some(types) if types.len() != n_layer => {
            Err(format!("layer_types has {} entries for {n_layer} layers", types.len()))
        }
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(format!(
                    "layer_types: `{other}` is not supported (supported: sliding_attention, full_attention)"
                )),
            })
            .collect(),
    }
}

pub fn config_from_hf(family: Family, value: serde_json::Value) -> Result<Config, String> {
    let hf: HfConfig = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let c = &hf.common;
    // Mistral's window applies to every layer; Qwen's where asked, from `max_window_layers` on.
    let window = match (family, hf.use_sliding_window) {
        (Family::Qwen2 | Family::Qwen3, Some(true)) | (Family::Mistral, _) => c.sliding_window,
        _ => None,
    };
    let first_sliding = match family {
        Family::Qwen2 | Family::Qwen3 => hf.max_window_layers.unwrap_or(28),
        _ => 0,
    };
    let sliding = match window {
        Some(_) => sliding_layers(&c.layer_types, c.num_hidden_layers, |i| i >= first_sliding)?,
        None => Vec::new(),
    };
    let variant = Variant {
        family,
        n_kv_head: Some(c.n_kv_head()),
        head_dim: Some(hf.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads.max(1))),
        rms_norm: true,
        gated_mlp: family.gated_mlp(),
        rope: Some(rope(c)?),
        // Qwen2 has biases on q, k and v whatever `attention_bias` says.
        qkv_bias: c.attention_bias || family == Family::Qwen2,
        o_bias: c.attention_bias,
        mlp_bias: hf.mlp_bias,
        qk_norm: family == Family::Qwen3,
        eos_token_ids: c.eos()?,
        sliding_window: window,
        sliding_layers: sliding,
        ..Variant::default()
    };
    Ok(Config {
        activation_function: hf.hidden_act.unwrap_or(family.activation()),
        tie_word_embeddings: hf.tie_word_embeddings,
        ..c.config(variant)?
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
    let mut map = shared_fields(cfg)?;
    let act = serde_json::to_value(cfg.activation_function).map_err(|e| e.to_string())?;
    map.extend([
        ("rope_theta".to_string(), rope.theta.into()),
        ("rope_scaling".to_string(), scaling),
        ("hidden_act".to_string(), act),
        ("attention_bias".to_string(), v.o_bias.into()),
        ("mlp_bias".to_string(), v.mlp_bias.into()),
    ]);
    Ok(serde_json::Value::Object(map))
}

/// The `config.json` fields that the Llama-layout families and Gemma's share: the sizes, the
/// head, the end tokens, the sliding window.
pub(super) fn shared_fields(cfg: &Config) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let v = &cfg.variant;
    let eos = match &cfg.eos_ids()[..] {
        [] => serde_json::Value::Null,
        [one] => (*one).into(),
        many => serde_json::json!(many),
    };
    let serde_json::Value::Object(mut map) = serde_json::json!({
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
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
    }) else {
        return Err("config.json is not an object".into());
    };
    if let Some(window) = v.sliding_window {
        map.extend(window_fields(cfg, window));
    }
    Ok(map)
}

/// The `config.json` fields of a sliding window: the window, and which layers have it
/// (`layer_types`, and Qwen's `use_sliding_window` and `max_window_layers` for older readers).
fn window_fields(cfg: &Config, window: usize) -> serde_json::Map<String, serde_json::Value> {
    let types: Vec<&str> = (0..cfg.n_layer)
        .map(|i| match cfg.window(i) {
            Some(_) => "sliding_attention",
            None => "full_attention",
        })
        .collect();
    let first = (0..cfg.n_layer)
        .find(|&i| cfg.window(i).is_some())
        .unwrap_or(cfg.n_layer);
    let mut map = serde_json::Map::new();
    map.insert("sliding_window".into(), window.into());
    map.insert("layer_types".into(), serde_json::json!(types));
    if matches!(cfg.variant.family, Family::Qwen2 | Family::Qwen3) {
        map.insert("use_sliding_window".into(), true.into());
        map.insert("max_window_layers".into(), first.into());
    }
    map
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
    /// The norms of the attention's and the MLP's outputs (Gemma).
    pub post_norms: Option<(Tensor, Tensor)>,
    /// gate and up side by side (up alone where the MLP is ungated).
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
/// start) in its dtype. Gemma's norm gains `w` are read as the `1 + w` they multiply by.
///
/// `trainable`: `vb` makes variables (a trainer's), and each is a tensor the decoder computes
/// with, updated in place by the optimizer: q, k and v one variable ([`QKV`]), gate and up one
/// ([`GATE_UP`]; up alone where the MLP is ungated), Gemma's gains held as `1 + w`. [`trainable_tensors`] maps a checkpoint onto
/// them.
pub(crate) fn weights_from_hf(vb: &VarBuilder, cfg: &Config, trainable: bool) -> candle_core::Result<FamilyWeights> {
    let (c, v) = (cfg.n_embd, &cfg.variant);
    let n = names(v.family);
    let dense = |(w, b): (Tensor, Tensor)| (Weight::Dense(w), b);
    // `1 + w` in f32, rounded once to the activations' dtype (as `transformers` computes it). A
    // trainer's new gains start at 1 (Gemma's `w` at 0).
    let norm = |len: usize, name: &str| -> candle_core::Result<Tensor> {
        match v.family.is_gemma() && !trainable {
            true => (vb.get_with_hints_dtype(len, name, Default::default(), DType::F32)? + 1.0)?.to_dtype(vb.dtype()),
            false => vb.get_with_hints(len, name, candle_nn::Init::Const(1.0)),
        }
    };
    // A trainer's new matrices are drawn as GPT-2's (the output projections' scaled down by the
    // depth); loaded ones are read whatever the hint.
    let (std, proj_std) = (0.02, 0.02 / (2.0 * cfg.n_layer as f64).sqrt());
    let layers = (0..cfg.n_layer)
        .map(|i| {
            let p = layer(i);
            let qk_norm = match v.qk_norm {
                true => Some((
                    norm(cfg.head_dim(), &format!("{p}.{}.weight", n.q_norm))?,
                    norm(cfg.head_dim(), &format!("{p}.{}.weight", n.k_norm))?,
                )),
                false => None,
            };
            let post_norms = match (v.post_norms, n.post_norms) {
                (true, Some((attn, mlp))) => Some((
                    norm(c, &format!("{p}.{attn}.weight"))?,
                    norm(c, &format!("{p}.{mlp}.weight"))?,
                )),
                (true, None) => candle_core::bail!("{:?} checkpoints have no norms after the layers", v.family),
                (false, _) => None,
            };
            let (qkv, gate_up) = match trainable {
                true => (
                    linear(vb, &format!("{p}.{QKV}"), c, cfg.qkv_width(), v.qkv_bias, std)?,
                    linear(vb, &format!("{p}.{GATE_UP}"), c, cfg.mlp_in_width(), v.mlp_bias, std)?,
                ),
                false => (qkv(vb, &p, cfg)?, gate_up(vb, &p, cfg)?),
            };
            Ok(LayerWeights {
                attn_norm: norm(c, &format!("{p}.{}.weight", n.attn_norm))?,
                qkv: dense(qkv),
                o: dense(linear(
                    vb,
                    &format!("{p}.{}", n.o),
                    cfg.q_width(),
                    c,
                    v.o_bias,
                    proj_std,
                )?),
                qk_norm,
                mlp_norm: norm(c, &format!("{p}.{}.weight", n.mlp_norm))?,
                post_norms,
                gate_up: dense(gate_up),
                down: dense(linear(
                    vb,
                    &format!("{p}.{}", n.down),
                    cfg.mlp_width(),
                    c,
                    v.mlp_bias,
                    proj_std,
                )?),
            })
        })
        .collect::<candle_core::Result<_>>()?;
    let head = match cfg.tie_word_embeddings {
        true => None,
        false => Some(Weight::Dense(vb.get_with_hints(
            (cfg.vocab_size, c),
            n.head,
            init(std),
        )?)),
    };
    Ok(FamilyWeights {
        embed: Weight::Dense(vb.get_with_hints((cfg.vocab_size, c), n.embed, init(std))?),
        layers,
        final_norm: norm(c, n.final_norm)?,
        head,
    })
}

/// A checkpoint's tensors (under `transformers`' names, as [`crate::Gpt::named_tensors`] gives
/// them) as the variables of a trainable model of `cfg` hold them ([`weights_from_hf`] with
/// `trainable`): q, k, v and gate, up stacked, Gemma's gains plus one. A tensor missing is an
/// error naming it.
pub fn trainable_tensors(
    cfg: &Config,
    mut tensors: std::collections::HashMap<String, Tensor>,
) -> crate::Result<std::collections::HashMap<String, Tensor>> {
    let v = &cfg.variant;
    let n = names(v.family);
    let mut take = |name: String| {
        tensors
            .remove(&name)
            .ok_or_else(|| crate::Error::InvalidConfig(format!("the checkpoint has no tensor `{name}`")))
    };
    let mut out = std::collections::HashMap::new();
    for i in 0..cfg.n_layer {
        let p = layer(i);
        let mut stack = |fused: &str, parts: &[&str], bias: bool| -> crate::Result<()> {
            let mut suffixes = vec!["weight"];
            if bias {
                suffixes.push("bias");
            }
            for suffix in suffixes {
                let parts = parts
                    .iter()
                    .map(|part| take(format!("{p}.{part}.{suffix}")))
                    .collect::<crate::Result<Vec<_>>>()?;
                out.insert(format!("{p}.{fused}.{suffix}"), Tensor::cat(&parts, 0)?);
            }
            Ok(())
        };
        stack(QKV, &[n.q, n.k, n.v], v.qkv_bias)?;
        stack(GATE_UP, &n.mlp_in(v.gated_mlp), v.mlp_bias)?;
    }
    for (name, t) in tensors {
        let gain = v.family.is_gemma() && name.ends_with("norm.weight");
        out.insert(name, if gain { (t + 1.0)? } else { t });
    }
    Ok(out)
}

fn init(stdev: f64) -> candle_nn::Init {
    candle_nn::Init::Randn { mean: 0.0, stdev }
}

/// A `(out, in)` weight `name.weight` (new ones drawn with standard deviation `std`) and, where `bias`, its `name.bias` (else zeros, not a
/// parameter), from `vb` in its dtype.
pub(crate) fn linear(
    vb: &VarBuilder,
    name: &str,
    d_in: usize,
    d_out: usize,
    bias: bool,
    std: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let w = vb.get_with_hints((d_out, d_in), &format!("{name}.weight"), init(std))?;
    let b = match bias {
        true => vb.get(d_out, &format!("{name}.bias"))?,
        false => Tensor::zeros(d_out, vb.dtype(), vb.device())?,
    };
    Ok((w, b))
}

/// q, k and v of layer `prefix` side by side: the `(q + 2 kv, C)` weight and its bias.
pub(crate) fn qkv(vb: &VarBuilder, prefix: &str, cfg: &Config) -> candle_core::Result<(Tensor, Tensor)> {
    let (c, q, kv, bias) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.variant.qkv_bias);
    let n = names(cfg.variant.family);
    let parts =
        [(n.q, q), (n.k, kv), (n.v, kv)].map(|(name, out)| linear(vb, &format!("{prefix}.{name}"), c, out, bias, 0.02));
    let [q, k, v] = parts;
    let (q, k, v) = (q?, k?, v?);
    Ok((
        Tensor::cat(&[&q.0, &k.0, &v.0], 0)?,
        Tensor::cat(&[&q.1, &k.1, &v.1], 0)?,
    ))
}

/// gate and up of layer `prefix` side by side: the `(2 I, C)` weight and its bias (`(I, C)`, up
/// alone, where the MLP is ungated).
pub(crate) fn gate_up(vb: &VarBuilder, prefix: &str, cfg: &Config) -> candle_core::Result<(Tensor, Tensor)> {
    let (c, w, bias) = (cfg.n_embd, cfg.mlp_width(), cfg.variant.mlp_bias);
    let parts = (names(cfg.variant.family).mlp_in(cfg.variant.gated_mlp).into_iter())
        .map(|part| linear(vb, &format!("{prefix}.{part}"), c, w, bias, 0.02))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let (weights, biases): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
    Ok((Tensor::cat(&weights, 0)?, Tensor::cat(&biases, 0)?))
}
