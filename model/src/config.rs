//! Model hyper-parameters, read from and written to a Hugging Face GPT-2 `config.json`.

use std::path::Path;

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

    fn base(vocab_size: usize, n_positions: usize, n_embd: usize, n_layer: usize, n_head: usize) -> Self {
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
        self.n_embd / self.n_head
    }

    pub fn mlp_width(&self) -> usize {
        self.n_inner.unwrap_or(4 * self.n_embd)
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
        if !self.n_embd.is_multiple_of(self.n_head) {
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
        if !self.tie_word_embeddings {
            return invalid("tie_word_embeddings = false (an untied LM head) is not supported".into());
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

    /// Parses and validates a `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let file_error = |reason: String| Error::ConfigFile {
            path: path.to_path_buf(),
            reason,
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| file_error(e.to_string()))?;
        if let Some(kind) = value
            .get("model_type")
            .and_then(|t| t.as_str())
            .filter(|&t| t != "gpt2")
        {
            return Err(file_error(format!(
                "model_type `{kind}` is not GPT-2's architecture: gpt-rs runs GPT-2-layout checkpoints (model_type \
                 gpt2, GPT2LMHeadModel)"
            )));
        }
        let cfg: Config = serde_json::from_value(value).map_err(|e| file_error(e.to_string()))?;
        cfg.validate().map_err(|e| match e {
            Error::InvalidConfig(reason) => file_error(reason),
            other => other,
        })?;
        Ok(cfg)
    }

    /// The JSON object that `transformers.GPT2Config` reads: these fields plus the model type.
    pub fn to_hf_value(&self) -> Result<serde_json::Value> {
        let mut value = serde_json::to_value(self).map_err(|e| Error::InvalidConfig(e.to_string()))?;
        if let Some(map) = value.as_object_mut() {
            map.insert("model_type".into(), "gpt2".into());
            map.insert("architectures".into(), serde_json::json!(["GPT2LMHeadModel"]));
            map.insert("n_ctx".into(), self.n_positions.into());
        }
        Ok(value)
    }

    /// [`Config::to_hf_value`] as pretty-printed text.
    pub fn to_hf_json(&self) -> Result<String> {
        serde_json::to_string_pretty(&self.to_hf_value()?).map_err(|e| Error::InvalidConfig(e.to_string()))
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
        let bad = json.replace("gelu_new", "swish");
        let err = serde_json::from_str::<Config>(&bad).unwrap_err().to_string();
        assert!(err.contains("swish"), "{err}");
    }
}
