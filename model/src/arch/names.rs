//! The families' tensor names as `transformers` writes them (`model.layers.{i}.self_attn.q_proj`,
//! ...), and the names of the products the decoder runs fused. Read by the families' files, the
//! decoder's checkpoint writer, the LoRA adapters and llama.cpp's export; it depends on nothing
//! of theirs.

use super::Family;

/// The checkpoint names of a layer's tensors (under `model.layers.{i}.`) and the model's, as
/// `transformers` writes them for a family; llama.cpp's are in `crate::llamacpp`.
#[derive(Debug)]
pub struct Names {
    pub attn_norm: &'static str,
    pub mlp_norm: &'static str,
    /// The norms of the attention's and the MLP's outputs, where the family has them.
    pub post_norms: Option<(&'static str, &'static str)>,
    pub q: &'static str,
    pub k: &'static str,
    pub v: &'static str,
    pub o: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    pub gate: &'static str,
    pub up: &'static str,
    pub down: &'static str,
    pub embed: &'static str,
    pub final_norm: &'static str,
    pub head: &'static str,
}

/// Llama's names, which Mistral, Qwen2 and Qwen3 share.
pub const NAMES: Names = Names {
    attn_norm: "input_layernorm",
    mlp_norm: "post_attention_layernorm",
    post_norms: None,
    q: "self_attn.q_proj",
    k: "self_attn.k_proj",
    v: "self_attn.v_proj",
    o: "self_attn.o_proj",
    q_norm: "self_attn.q_norm",
    k_norm: "self_attn.k_norm",
    gate: "mlp.gate_proj",
    up: "mlp.up_proj",
    down: "mlp.down_proj",
    embed: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    head: "lm_head.weight",
};

/// Gemma's names: the norm before the MLP is `pre_feedforward_layernorm`, and
/// `post_attention_layernorm` is the norm of the attention's output.
pub const GEMMA: Names = Names {
    attn_norm: "input_layernorm",
    mlp_norm: "pre_feedforward_layernorm",
    post_norms: Some(("post_attention_layernorm", "post_feedforward_layernorm")),
    ..NAMES
};

impl Names {
    /// The matrices that the MLP's first product stacks, in its order: gate and up, or up alone
    /// where the MLP is ungated (Arcee's).
    pub fn mlp_in(&self, gated: bool) -> Vec<&'static str> {
        match gated {
            true => vec![self.gate, self.up],
            false => vec![self.up],
        }
    }
}

/// The names of `family`'s checkpoints.
pub fn names(family: Family) -> &'static Names {
    match family.is_gemma() {
        true => &GEMMA,
        false => &NAMES,
    }
}

pub fn layer(i: usize) -> String {
    format!("model.layers.{i}")
}

/// The names of the products the decoder runs fused, for a trainer's variables (vLLM's names):
/// q, k and v side by side, and gate and up.
pub const QKV: &str = "self_attn.qkv_proj";
pub const GATE_UP: &str = "mlp.gate_up_proj";
