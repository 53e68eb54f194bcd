//! Request and response types of the OpenAI completions API (what the `openai` SDKs send and
//! expect), plus the vLLM-style extensions `top_k` and `repetition_penalty`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A prompt: text, or token ids of this model's vocabulary.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<i64>),
}

/// One stop string or several.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/completions`. Numbers are taken as JSON numbers of any range, so that an
/// out-of-range value gets a message naming the allowed range rather than a type error.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// The served model's name (see `GET /v1/models`); may be omitted.
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Tokens to generate, at least 1 (default 16).
    pub max_tokens: Option<i64>,
    /// 0 is greedy; default 1.
    pub temperature: Option<f64>,
    /// In (0, 1]; default 1.
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens; 0 or -1 disables (vLLM's convention).
    pub top_k: Option<i64>,
    /// > 0; 1 disables (vLLM's convention).
    pub repetition_penalty: Option<f64>,
    /// In [-2, 2].
    pub presence_penalty: Option<f64>,
    /// In [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// Makes sampling reproducible.
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// Completions per prompt.
    pub n: Option<i64>,
    /// Return the log-probabilities of this many most likely tokens at each position.
    pub logprobs: Option<i64>,
    /// Include the prompt in the returned text.
    pub echo: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Accepted and ignored, as by OpenAI.
    pub user: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct LogProbs {
    pub tokens: Vec<String>,
    /// `null` for the first prompt token when echoing.
    pub token_logprobs: Vec<Option<f32>>,
    /// The most likely tokens at each position, most likely first.
    #[schema(value_type = Vec<Option<Object>>)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, serde_json::Value>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Choice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<LogProbs>,
    /// "stop" (a stop string or end of text) or "length"; `null` in all but a stream's last
    /// chunk for this choice.
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
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
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Model {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<Model>,
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
