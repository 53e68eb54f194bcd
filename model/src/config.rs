//! Model hyper-parameters: GPT-2's `config.json` fields, and the [`Variant`] by which the other
//! families' decoders differ from it. Reading and writing a `config.json` (`Config::from_file`,
//! `Config::to_hf_value`) is in `arch/`, with each family's file.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The MLP's non-linearity, named as in `transformers`' `ACT2FN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// GELU, tanh approximation: GPT-2's own (`gelu_new`).
    #[serde(rename = "gelu_new", alias = "gelu_pytorch_tanh", alias = "gelu_fast")]
    GeluNew,
    /// Exact GELU, with the error function.
    #[serde(rename = "gelu")]
    Gelu,
    #[serde(rename = "relu")]
    Relu,
    /// SiLU (swish), the gate of Llama's MLP.
    #[serde(rename = "silu", alias = "swish")]
    Silu,
    /// Squared ReLU, `relu(x)²` (Arcee's ungated MLP).
    #[serde(rename = "relu2")]
    Relu2,
}

/// How positions enter the model. `transformers` knows only the learned table; a sinusoidal
/// checkpoint is saved with its fixed table as `wpe.weight`, so it loads there unchanged too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PositionEmbedding {
    /// A learned `(n_positions, n_embd)` table, as GPT-2.
    #[default]
    Learned,
    /// The fixed sin/cos encoding of "Attention Is All You Need" (Vaswani et al., 2017), §3.5.
    Sinusoidal,
    /// Rotary embeddings of the queries and keys (Su et al., 2021, "RoFormer"), no table added to
    /// the input: [`Variant::rope`] holds their frequencies.
    Rope,
}

/// What sets a family's decoder apart from GPT-2's (whose values are the defaults). Not part of
/// GPT-2's `config.json`: each family's file in `arch/` reads and writes its own.
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
    /// Arcee's AFM (`ArceeForCausalLM`, llama.cpp's `arcee`): Llama's layout with an ungated
    /// MLP of squared ReLU, `down(relu(up x)²)` (So et al., 2021, "Primer"), the activation of
    /// modded-nanogpt and nanochat.
    Arcee,
    /// Qwen3: Llama's layout with a per-head RMSNorm of q and k (QK-norm) and its own head width.
    Qwen3,
    /// Gemma 2 (Gemma Team, 2024): norms after attention and the MLP too, `(1 + w)` gains, a
    /// gated GELU-tanh MLP, the embedding scaled by sqrt(hidden), sliding-window attention on
    /// every other layer, attention and final logits soft-capped.
    Gemma2,
    /// Gemma 3's text model (`gemma3_text`; `gemma3`'s `text_config`): Gemma 2's layout with
    /// QK-norm in place of soft-capping, five sliding-window layers to one global, and a RoPE
    /// base of their own for the local layers.
    Gemma3,
}

impl Family {
    pub const ALL: [Family; 8] = [
        Self::Gpt2,
        Self::Llama,
        Self::Mistral,
        Self::Qwen2,
        Self::Qwen3,
        Self::Arcee,
        Self::Gemma2,
        Self::Gemma3,
    ];

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Arcee => "arcee",
            Self::Gemma2 => "gemma2",
            Self::Gemma3 => "gemma3_text",
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
            Self::Arcee => "ArceeForCausalLM",
            Self::Gemma2 => "Gemma2ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == model_type)
    }

    /// The `model_type`s supported, for error messages.
    pub fn supported() -> String {
        Self::ALL.map(Self::model_type).join(", ")
    }

    /// Gemma's layout: the norms' gains stored as `w` for a gain of `1 + w`, norms after the
    /// attention and the MLP as well as before, the embedding scaled by sqrt(hidden).
    pub fn is_gemma(self) -> bool {
        matches!(self, Self::Gemma2 | Self::Gemma3)
    }

    /// Whether a Llama-layout family's MLP is gated (all but Arcee's).
    pub fn gated_mlp(self) -> bool {
        self != Self::Arcee
    }

    /// The family's MLP activation where its config does not name one (`transformers`' default;
    /// what llama.cpp's graph for it applies).
    pub fn activation(self) -> Activation {
        match self {
            Self::Gpt2 | Self::Gemma2 | Self::Gemma3 => Activation::GeluNew,
            Self::Arcee => Activation::Relu2,
            Self::Llama | Self::Mistral | Self::Qwen2 | Self::Qwen3 => Activation::Silu,
        }
    }

    /// Whether the family's decoder is GPT-2's (learned positions, LayerNorm, multi-head
    /// attention, `Conv1D` weights): the one the trainer's tape and fused training kernels run.
    pub fn is_gpt2(self) -> bool {
        self == Self::Gpt2
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Variant {
    pub family: Family,
    /// Key and value heads (grouped-query attention, Ainslie et al., 2023); `None`: one per
    /// query head.
    pub n_kv_head: Option<usize>,
    /// The width of a head; `None`: n_embd / n_head.
    pub head_dim: Option<usize>,
    /// RMSNorm (Zhang and Sennrich, 2019) in place of LayerNorm: no mean removed, no bias.
    pub rms_norm: bool,
    /// The MLP's up projection gated by a second one, `down(act(gate x) * up x)` (Shazeer, 2020).
    pub gated_mlp: bool,
    /// Rotary embeddings, with [`PositionEmbedding::Rope`].
    pub rope: Option<Rope>,
    /// Biases on q, k and v even where the other layers have none (Qwen2; Llama's
    /// `attention_bias`). GPT-2's biases follow [`Config::bias`] instead.
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP's projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// A per-head RMSNorm of the queries and keys before the rotation (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Every end-of-sequence id the checkpoint names (`eos_token_id` may be a list: Llama 3).
    pub eos_token_ids: Vec<u32>,
    /// RMSNorms of the attention's and the MLP's outputs before their residual adds (Gemma 2
    /// and 3: `post_attention_layernorm`, `post_feedforward_layernorm`).
    pub post_norms: bool,
    /// The token embedding multiplied by sqrt(n_embd) on its way in (Gemma), not as the head.
    pub embed_scale: bool,
    /// The attention scores scaled by `1 / sqrt(this)` rather than `1 / sqrt(head_dim)`
    /// (Gemma's `query_pre_attn_scalar`).
    pub query_pre_attn_scalar: Option<f64>,
    /// The attention scores soft-capped, `cap * tanh(s / cap)` (Gemma 2).
    pub attn_softcap: Option<f64>,
    /// The LM head's logits soft-capped the same way (Gemma 2).
    pub final_softcap: Option<f64>,
    /// Sliding-window attention: a query sees its own position and the `window - 1` before it
    /// (Mistral, Gemma), on the layers of [`Variant::sliding_layers`].
    pub sliding_window: Option<usize>,
    /// Which layers slide (`true`); empty: every layer, where there is a window.
    pub sliding_layers: Vec<bool>,
    /// The rotary frequencies of the sliding layers where they differ from the others' (Gemma
    /// 3's `rope_local_base_freq`).
    pub rope_local: Option<Rope>,
}

/// The rotary embedding's frequencies.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    /// The base of the frequencies, `rope_theta`.
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

/// A rescaling of the rotary frequencies for long contexts (`rope_scaling` in `config.json`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// `rope_type: "linear"`: positions divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type: "llama3"` (Llama 3.1 and later): low frequencies divided by `factor`, high ones
    /// kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// Each frequency divided by its own factor (llama.cpp's `rope_freqs` tensor, which holds
    /// Llama 3's rescaling so).
    PerFrequency(Vec<f64>),
}

impl Rope {
    /// The `head_dim / 2` inverse frequencies, as `transformers`' `ROPE_INIT_FUNCTIONS` compute
    /// them (`_compute_default_rope_parameters`, `_compute_llama3_parameters`).
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f64> {
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        match self.scaling.as_ref() {
            None => base,
            Some(&RopeScaling::Linear { factor }) => base.into_iter().map(|f| f / factor).collect(),
            Some(RopeScaling::PerFrequency(factors)) => base.iter().zip(factors).map(|(f, d)| f / d).collect(),
            Some(&RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }
}

/// The fields of GPT-2's `config.json` that shape the network. Other keys of the file (task
/// parameters, token ids for generation) are ignored on read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    /// Context length: the most positions one sequence can hold.
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// MLP width; `None` means 4 * n_embd.
    #[serde(default)]
    pub n_inner: Option<usize>,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_activation")]
    pub activation_function: Activation,
    /// Dropout probabilities, used in training only (`transformers` defaults: 0.1).
    #[serde(default = "default_pdrop")]
    pub resid_pdrop: f32,
    #[serde(default = "default_pdrop")]
    pub embd_pdrop: f32,
    #[serde(default = "default_pdrop")]
    pub attn_pdrop: f32,
    /// The LM head is the token embedding transposed; untied heads are not supported.
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    /// Must stay true: attention scores are divided by sqrt(head_dim).
    #[serde(default = "default_true")]
    pub scale_attn_weights: bool,
    /// Must stay false (a GPT-2 variant that also divides by the layer index).
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<u32>,
    /// Extension outside the GPT-2 set (`transformers` keeps it as an unused attribute).
    #[serde(default)]
    pub position_embedding: PositionEmbedding,
    /// Extension: false fixes every bias (linear layers and LayerNorms) at zero, untrained, as
    /// nanoGPT's `bias=False`. The zeros are saved, so `transformers` loads the same model.
    #[serde(default = "default_true")]
    pub bias: bool,
    /// How the family's decoder differs from GPT-2's (GPT-2's own by default).
    #[serde(skip)]
    pub variant: Variant,
}

fn default_eps() -> f64 {
    1e-5
}
fn default_activation() -> Activation {
    Activation::GeluNew
}
fn default_pdrop() -> f32 {
    0.1
}
fn default_true() -> bool {
    true
}

impl Config {
    /// Preset names accepted by [`Config::preset`].
    pub const PRESETS: [&'static str; 3] = ["tiny", "shakespeare-char", "gpt2"];

    /// GPT-2's defaults at these sizes, without dropout: what each family's config starts from.
    pub(crate) fn base(vocab_size: usize, n_positions: usize, n_embd: usize, n_layer: usize, n_head: usize) -> Self {
        Self {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            n_inner: None,
            layer_norm_epsilon: default_eps(),
            activation_function: Activation::GeluNew,
            resid_pdrop: 0.0,
            embd_pdrop: 0.0,
            attn_pdrop: 0.0,
            tie_word_embeddings: true,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
            bos_token_id: None,
            eos_token_id: None,
            position_embedding: PositionEmbedding::Learned,
            bias: true,
            variant: Variant::default(),
        }
    }

    /// A few-thousand-parameter model for tests.
    pub fn tiny(vocab_size: usize) -> Self {
        Self::base(vocab_size, 64, 32, 2, 4)
    }

    /// nanoGPT's `train_shakespeare_char` "baby GPT": 6 layers, 6 heads, 384 wide, block 256,
    /// dropout 0.2.
    pub fn shakespeare_char(vocab_size: usize) -> Self {
        let pdrop = 0.2;
        Self {
            resid_pdrop: pdrop,
            embd_pdrop: pdrop,
            attn_pdrop: pdrop,
            ..Self::base(vocab_size, 256, 384, 6, 6)
        }
    }

    /// GPT-2 small (124M parameters with its 50257-token vocabulary).
    pub fn gpt2_small() -> Self {
        Self {
            resid_pdrop: 0.1,
            embd_pdrop: 0.1,
            attn_pdrop: 0.1,
            bos_token_id: Some(50256),
            eos_token_id: Some(50256),
            ..Self::base(50257, 1024, 768, 12, 12)
        }
    }

    /// A preset by name; `vocab_size` replaces the preset's own where given.
    pub fn preset(name: &str, vocab_size: Option<usize>) -> Result<Self> {
        let cfg = match name {
            "tiny" => Self::tiny(vocab_size.unwrap_or(256)),
            "shakespeare-char" => Self::shakespeare_char(vocab_size.unwrap_or(65)),
            "gpt2" => Self {
                vocab_size: vocab_size.unwrap_or(50257),
                ..Self::gpt2_small()
            },
            other => {
                return Err(Error::InvalidConfig(format!(
                    "unknown preset {other:?}; expected one of {:?}",
                    Self::PRESETS
                )))
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn head_dim(&self) -> usize {
        self.variant.head_dim.unwrap_or(self.n_embd / self.n_head.max(1))
    }

    /// Key and value heads: `n_head` but with grouped-query attention.
    pub fn n_kv_head(&self) -> usize {
        self.variant.n_kv_head.unwrap_or(self.n_head)
    }

    /// The width of the queries, `n_head * head_dim` (GPT-2's: `n_embd`).
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim()
    }

    /// The width of the keys, and of the values: `n_kv_head * head_dim`.
    pub fn kv_width(&self) -> usize {
        self.n_kv_head() * self.head_dim()
    }

    /// The width of the fused q, k, v projection (`c_attn`'s output).
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// The bytes one position of one sequence takes in the KV cache, every layer's keys and
    /// values in activations of `dtype`.
    pub fn kv_bytes_per_token(&self, dtype: candle_core::DType) -> usize {
        2 * self.n_layer * self.kv_width() * dtype.size_in_bytes()
    }

    /// Whether this is GPT-2's own decoder (multi-head attention without rotations or norms of
    /// the heads, LayerNorm, an ungated MLP): the one the fused training paths run.
    pub fn is_gpt2_shaped(&self) -> bool {
        self.variant.family.is_gpt2()
    }

    /// The end-of-sequence ids, every one the checkpoint names.
    pub fn eos_ids(&self) -> Vec<u32> {
        match (&self.variant.eos_token_ids[..], self.eos_token_id) {
            ([], Some(id)) => vec![id],
            (ids, _) => ids.to_vec(),
        }
    }

    pub fn mlp_width(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
    }

    /// The width of the MLP's first product: gate and up side by side where it is gated.
    pub fn mlp_in_width(&self) -> usize {
        self.mlp_width() * if self.variant.gated_mlp { 2 } else { 1 }
    }

    /// The attention window of layer `layer` (positions a query sees, itself included), `None`
    /// where it sees its whole past.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let v = &self.variant;
        let slides = v.sliding_layers.is_empty() || v.sliding_layers.get(layer).copied().unwrap_or(false);
        v.sliding_window.filter(|_| slides)
    }

    /// The rotary frequencies of layer `layer`: the local ones on a sliding layer where the
    /// family has them.
    pub fn rope(&self, layer: usize) -> Option<&Rope> {
        match (&self.variant.rope_local, self.window(layer)) {
            (Some(local), Some(_)) => Some(local),
            _ => self.variant.rope.as_ref(),
        }
    }

    /// The factor of the attention scores: `1 / sqrt(head_dim)`, or of Gemma's
    /// `query_pre_attn_scalar`.
    pub fn attn_scale(&self) -> f64 {
        1.0 / self
            .variant
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim() as f64)
            .sqrt()
    }

    /// Checks the values that would otherwise fail deep inside a forward pass.
    pub fn validate(&self) -> Result<()> {
        let invalid = |msg: String| Err(Error::InvalidConfig(msg));
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("n_positions", self.n_positions),
            ("n_embd", self.n_embd),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_inner", self.mlp_width()),
        ] {
            if value == 0 {
                return invalid(format!("{name} must be at least 1"));
            }
        }
        if self.variant.head_dim.is_none() && !self.n_embd.is_multiple_of(self.n_head) {
            return invalid(format!(
                "n_embd ({}) must be divisible by n_head ({})",
                self.n_embd, self.n_head
            ));
        }
        if self.vocab_size > u32::MAX as usize {
            return invalid(format!(
                "vocab_size {} does not fit token ids of 32 bits",
                self.vocab_size
            ));
        }
        if !(self.layer_norm_epsilon > 0.0 && self.layer_norm_epsilon.is_finite()) {
            return invalid(format!(
                "layer_norm_epsilon must be positive, got {}",
                self.layer_norm_epsilon
            ));
        }
        for (name, p) in [
            ("resid_pdrop", self.resid_pdrop),
            ("embd_pdrop", self.embd_pdrop),
            ("attn_pdrop", self.attn_pdrop),
        ] {
            if !(0.0..1.0).contains(&p) {
                return invalid(format!("{name} must be in [0, 1), got {p}"));
            }
        }
        let kv = self.n_kv_head();
        if kv == 0 || !self.n_head.is_multiple_of(kv) {
            return invalid(format!(
                "the number of key/value heads ({kv}) must divide the number of heads ({})",
                self.n_head
            ));
        }
        if self.head_dim() == 0 {
            return invalid("head_dim must be at least 1".into());
        }
        if self.variant.rope.is_some() != (self.position_embedding == PositionEmbedding::Rope) {
            return invalid("rotary positions need their frequencies (rope_theta)".into());
        }
        if let Some(rope) = &self.variant.rope {
            if !self.head_dim().is_multiple_of(2) {
                return invalid(format!(
                    "rotary embeddings need an even head_dim, got {}",
                    self.head_dim()
                ));
            }
            if !(rope.theta > 0.0 && rope.theta.is_finite()) {
                return invalid(format!("rope_theta must be positive, got {}", rope.theta));
            }
        }
        let v = &self.variant;
        if v.sliding_window == Some(0) {
            return invalid("sliding_window must be at least 1".into());
        }
        if !v.sliding_layers.is_empty() && v.sliding_layers.len() != self.n_layer {
            return invalid(format!(
                "{} layer types for {} layers",
                v.sliding_layers.len(),
                self.n_layer
            ));
        }
        for (name, x) in [
            ("query_pre_attn_scalar", v.query_pre_attn_scalar),
            ("attn_logit_softcapping", v.attn_softcap),
            ("final_logit_softcapping", v.final_softcap),
        ] {
            if let Some(x) = x.filter(|x| !(*x > 0.0 && x.is_finite())) {
                return invalid(format!("{name} must be positive, got {x}"));
            }
        }
        if let Some(theta) = v
            .rope_local
            .as_ref()
            .map(|r| r.theta)
            .filter(|t| !(*t > 0.0 && t.is_finite()))
        {
            return invalid(format!("rope_local_base_freq must be positive, got {theta}"));
        }
        if !self.tie_word_embeddings && self.is_gpt2_shaped() {
            return invalid("tie_word_embeddings = false (an untied LM head) is not supported for GPT-2".into());
        }
        if !self.scale_attn_weights || self.scale_attn_by_inverse_layer_idx {
            return invalid(
                "only GPT-2's attention scaling is supported (scale_attn_weights = true, \
                 scale_attn_by_inverse_layer_idx = false)"
                    .into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_shaped_as_documented() {
        let gpt2 = Config::preset("gpt2", None).unwrap();
        assert_eq!(
            (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.n_positions),
            (12, 12, 768, 1024)
        );
        let baby = Config::preset("shakespeare-char", Some(65)).unwrap();
        assert_eq!(
            (baby.n_layer, baby.n_head, baby.n_embd, baby.n_positions),
            (6, 6, 384, 256)
        );
        assert!(Config::preset("tiny", None).is_ok());
        assert!(matches!(Config::preset("huge", None), Err(Error::InvalidConfig(_))));
    }

    #[test]
    fn invalid_values_are_rejected_with_the_field_named() {
        let mut cfg = Config::tiny(100);
        cfg.n_head = 5;
        let msg = cfg.validate().unwrap_err().to_string();
        assert!(msg.contains("divisible by n_head"), "{msg}");
        let mut cfg = Config::tiny(100);
        cfg.n_layer = 0;
        assert!(cfg.validate().unwrap_err().to_string().contains("n_layer"));
        let mut cfg = Config::tiny(100);
        cfg.attn_pdrop = 1.5;
        assert!(cfg.validate().unwrap_err().to_string().contains("attn_pdrop"));
    }

    #[test]
    fn hf_json_round_trips_and_unknown_activation_is_an_error() {
        let cfg = Config::gpt2_small();
        let json = cfg.to_hf_json().unwrap();
        assert!(json.contains("\"model_type\": \"gpt2\""));
        let back: Config = serde_json::from_str(&json).unwrap();
        assert_eq!(back, cfg);
        let bad = json.replace("gelu_new", "mish");
        let err = serde_json::from_str::<Config>(&bad).unwrap_err().to_string();
        assert!(err.contains("mish"), "{err}");
    }
}
