//! `/v1/embeddings`' request and response (OpenAI's shapes).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::Prompt;

#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    /// A string, an array of strings, an array of token ids, or an array of arrays of token ids.
    #[schema(value_type = Object)]
    pub input: Prompt,
    pub model: Option<String>,
    /// `float` (the default) or `base64` (each embedding's little-endian f32 bytes).
    pub encoding_format: Option<String>,
    /// The embeddings' length: only the model's own (`n_embd`); a shorter one is refused.
    pub dimensions: Option<i64>,
    pub user: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingResponse {
    /// Always "list".
    pub object: String,
    #[schema(value_type = Vec<Object>)]
    pub data: Vec<Value>,
    pub model: String,
    #[schema(value_type = Object)]
    pub usage: Value,
}
