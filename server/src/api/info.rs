//! The other endpoints' types: attention, models, tokenizer endpoints, health, and the error
//! body every endpoint returns.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;

/// `POST /v1/attention`: the model's attention probabilities over a prompt.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttentionRequest {
    pub model: Option<String>,
    /// A string or an array of token ids, at most `max_attention_tokens` tokens (see
    /// `/openapi.json`).
    #[schema(value_type = Object)]
    pub prompt: Prompt,
    /// Layers to return, in this order (default: all).
    #[serde(default, deserialize_with = "json_int::option_vec")]
    pub layers: Option<Vec<i64>>,
    /// Heads to return, in this order (default: all).
    #[serde(default, deserialize_with = "json_int::option_vec")]
    pub heads: Option<Vec<i64>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AttentionResponse {
    /// Each token's text.
    pub tokens: Vec<String>,
    pub token_ids: Vec<u32>,
    /// The selected layers and heads, as numbered in the model.
    pub layers: Vec<usize>,
    pub heads: Vec<usize>,
    /// `[layer][head][query][key]`: how much each query token attends to each key token; each
    /// row sums to 1 and is 0 above the diagonal (a token sees only itself and earlier ones).
    pub attentions: Vec<Vec<Vec<Vec<f32>>>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Model {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// The context length in tokens (vLLM's field).
    pub max_model_len: usize,
    /// Where it was loaded from: a LoRA adapter's path or Hub id; the base model's name
    /// (vLLM's field).
    pub root: String,
    /// For a LoRA adapter, the base model it adapts; `null` for the base (vLLM's field).
    pub parent: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<Model>,
}

/// `POST /tokenize` (vLLM's shape).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: String,
    /// Accepted for vLLM's clients; this server's tokenizers add no special tokens either way.
    pub add_special_tokens: Option<bool>,
    /// Also return each token's text.
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize` (vLLM's shape).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    #[serde(deserialize_with = "json_int::vec")]
    pub tokens: Vec<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// `GET /tokenizer_info` (vLLM's shape): what a client needs to tokenize as the server does.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenizerInfo {
    pub tokenizer_class: String,
    /// `<|endoftext|>` where the vocabulary has it; a character-level vocabulary has none.
    pub eos_token: Option<String>,
    pub bos_token: Option<String>,
    pub pad_token: Option<String>,
    pub unk_token: Option<String>,
    pub model_max_length: usize,
    pub vocab_size: usize,
    pub chat_template: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

/// Every error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub model: String,
}

/// `POST /v1/load_lora_adapter` (vLLM's shape).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadLoraAdapterRequest {
    /// The model name requests will use for it.
    pub lora_name: String,
    /// A PEFT adapter directory on the server, a gpt-train LoRA run, or a Hub id.
    pub lora_path: String,
    /// Replace an adapter already loaded under this name (running requests keep the old one).
    #[serde(default)]
    pub load_inplace: bool,
}

/// `POST /v1/unload_lora_adapter` (vLLM's shape).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnloadLoraAdapterRequest {
    pub lora_name: String,
    /// Only the adapter loaded with this id (`/v1/models` lists none; vLLM's field).
    pub lora_int_id: Option<u64>,
}
