//! `POST /v1/completions`: the request (its generation fields shared with chat, see
//! [`super`]), the fields refused with a reason, and the response.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::*;

/// Fields of OpenAI's or vLLM's completions API that this server does not implement, each with
/// the reason: a request with one is refused with a message that names it and says why, rather
/// than silently served without it. (Other unknown fields are refused as unknown.)
pub const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "suffix",
        "these GPT-2-layout models have no fill-in-the-middle training",
    ),
    (
        "prompt_embeds",
        "prompts are text or token ids; embeddings are not accepted",
    ),
    (
        "early_stopping",
        "beam search runs every beam to its end (vLLM's own beam search does too)",
    ),
    (
        "bad_words",
        "banning multi-token words needs lookahead this sampler does not have",
    ),
    (
        "guided_decoding_backend",
        "there is one structured-output engine, llguidance",
    ),
    (
        "guided_whitespace_pattern",
        "JSON is written compactly, as the schema allows",
    ),
    (
        "structural_tag",
        "structural tags are not supported; use a JSON schema or a grammar",
    ),
    ("logits_processors", "the server runs no user-supplied code"),
    (
        "kv_transfer_params",
        "there is no disaggregated prefill to transfer a KV cache to",
    ),
    ("vllm_xargs", "there are no custom extensions to pass them to"),
    ("mm_processor_kwargs", "the models are text-only"),
    (
        "lora_request",
        "choose a LoRA adapter by its name in `model` (see /v1/models)",
    ),
];

generation_fields!(request_with_generation_fields! {
    /// `POST /v1/completions`. Numbers are taken as JSON numbers of any range, so that an
    /// out-of-range value gets a message naming the allowed range rather than a type error. Every
    /// range is stated in the OpenAPI document.
    #[derive(Debug, Clone, Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct CompletionRequest {
        /// A string, an array of strings, an array of token ids, or an array of arrays of token
        /// ids: one prompt or several, each with `n` choices numbered `prompt × n + i`. A prompt
        /// must leave room in the context for one token.
        #[schema(value_type = Object)]
        pub prompt: Prompt,
        /// Tokens to generate at most (default 16); generation also ends at the context length.
        /// 0 generates nothing (with `echo`, the prompt alone is returned).
        #[serde(default, deserialize_with = "json_int::option")]
        pub max_tokens: Option<i64>,
        /// Return the log-probabilities of this many most likely tokens at each position.
        #[serde(default, deserialize_with = "json_int::option")]
        pub logprobs: Option<i64>,
        /// Include the prompt in the returned text (and its tokens in `logprobs`).
        pub echo: Option<bool>,
    }
});

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct LogProbs {
    pub tokens: Vec<String>,
    /// `null` for the first prompt token when echoing.
    pub token_logprobs: Vec<Option<f32>>,
    /// The most likely tokens at each position, most likely first.
    #[schema(value_type = Vec<Option<Object>>)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    /// Where each token starts in the choice's text, in characters.
    pub text_offset: Vec<usize>,
}

/// One entry of vLLM's `prompt_logprobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PromptLogprob {
    pub logprob: f32,
    /// 1 for the most likely token at the position; tokens as likely count ahead.
    pub rank: u32,
    /// The token's text (`token_id:<id>` with `return_tokens_as_token_ids`).
    pub decoded_token: String,
}

/// vLLM's `prompt_logprobs`: per prompt position, `null` for the first, else token id → entry
/// for the prompt's token and the `prompt_logprobs` most likely there.
pub type PromptLogprobs = Vec<Option<BTreeMap<u32, PromptLogprob>>>;

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Choice {
    pub text: String,
    /// `prompt × n + i`.
    pub index: u32,
    pub logprobs: Option<LogProbs>,
    /// vLLM's: with `prompt_logprobs`, the prompt's (see [`PromptLogprobs`]); `null` without
    /// it; absent from stream chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Option<Object>>>)]
    pub prompt_logprobs: Option<Option<PromptLogprobs>>,
    /// "stop" (a stop string, a stop token or end of text) or "length"; `null` in all but a
    /// stream's last chunk for this choice.
    pub finish_reason: Option<String>,
    /// What stopped it (vLLM's field): the stop string, or the stop token's id; `null` for
    /// end of text, the length limit, and in all but a stream's last chunk.
    #[schema(value_type = Option<Object>)]
    pub stop_reason: Option<Value>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// `null`, as from vLLM unless it runs with `--enable-prompt-tokens-details`.
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

/// The response, and each chunk of a stream (`data: {...}` events, then `data: [DONE]`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Completion {
    pub id: String,
    /// Always "text_completion".
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The server's version and the served model's configuration (OpenAI's field).
    pub system_fingerprint: String,
}
