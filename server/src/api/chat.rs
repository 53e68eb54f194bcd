//! `POST /v1/chat/completions`: messages, the request (the generation fields of completions
//! plus chat's own), and the response and its streamed chunks.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::*;

/// Fields of OpenAI's and vLLM's chat API that this server does not implement, beside
/// [`UNSUPPORTED`], with the reason.
pub const UNSUPPORTED_CHAT: &[(&str, &str)] = &[
    (
        "functions",
        "the deprecated `functions` are not supported; give them as `tools`",
    ),
    (
        "function_call",
        "the deprecated `function_call` is not supported; use `tool_choice`",
    ),
    ("audio", "the models are text-only"),
    ("modalities", "the models are text-only"),
    (
        "prediction",
        "predicted outputs (speculative decoding) are not implemented",
    ),
    ("reasoning_effort", "these models do not reason before answering"),
    ("include_reasoning", "these models do not reason before answering"),
    ("web_search_options", "the server does not search the web"),
    ("store", "completions are not stored"),
    ("metadata", "completions are not stored, so there is nothing to tag"),
    ("service_tier", "there is one tier"),
];

/// A message's content: a string, or text parts (`{"type": "text", "text": ...}`) joined with
/// newlines. (Its schema is written by [`crate::openapi`].)
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Content(pub String);

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let parts = match Value::deserialize(d)? {
            Value::String(s) => return Ok(Content(s)),
            Value::Null => return Ok(Content(String::new())),
            Value::Array(parts) => parts,
            other => {
                return Err(D::Error::custom(format!(
                    "content must be a string or an array of text parts, got {other}"
                )))
            }
        };
        let mut texts = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            match (
                part.get("type").and_then(Value::as_str),
                part.get("text").and_then(Value::as_str),
            ) {
                (Some("text"), Some(text)) if part.as_object().is_some_and(|o| o.len() == 2) => texts.push(text),
                (Some(kind), _) if kind != "text" => {
                    return Err(D::Error::custom(format!(
                        "content[{i}]: parts of type {kind:?} are not supported by this text-only model"
                    )))
                }
                _ => {
                    return Err(D::Error::custom(format!(
                        "content[{i}] must be {{\"type\": \"text\", \"text\": string}}, got {part}"
                    )))
                }
            }
        }
        Ok(Content(texts.join("\n")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    /// OpenAI's newer name for `system`.
    Developer,
    User,
    Assistant,
    /// A tool's result, answering the assistant's call `tool_call_id`.
    Tool,
}

impl Role {
    /// Its name in requests and chat templates.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// One turn of a conversation.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: Role,
    /// A string or an array of text parts; `null` or absent for an assistant turn of tool
    /// calls.
    #[serde(default)]
    #[schema(value_type = Object)]
    pub content: Content,
    /// Passed to the chat template.
    pub name: Option<String>,
    /// Accepted as the SDKs send it back with an assistant message, and ignored.
    pub refusal: Option<String>,
    /// An assistant turn's tool calls, as a response gave them; passed to the chat template.
    #[schema(value_type = Option<Vec<Object>>)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message's call it answers; passed to the chat template.
    pub tool_call_id: Option<String>,
}

generation_fields!(request_with_generation_fields! {
    /// `POST /v1/chat/completions`: the messages are rendered to a prompt by the checkpoint's chat
    /// template, then generated from as `/v1/completions` does; every shared field means what it
    /// means there.
    #[derive(Debug, Clone, Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ChatCompletionRequest {
        /// The conversation so far, at least one message.
        #[serde(deserialize_with = "json_object::vec")]
        pub messages: Vec<ChatMessage>,
        /// Tokens to generate at most; default: up to the cap and the context. `max_tokens` is
        /// the older name; `max_completion_tokens` wins when both are given.
        #[serde(default, deserialize_with = "json_int::option")]
        pub max_completion_tokens: Option<i64>,
        #[serde(default, deserialize_with = "json_int::option")]
        pub max_tokens: Option<i64>,
        /// Return each generated token's log-probability.
        pub logprobs: Option<bool>,
        /// With `logprobs`: also this many most likely tokens at each position.
        #[serde(default, deserialize_with = "json_int::option")]
        pub top_logprobs: Option<i64>,
        /// When the last message is the assistant's, its content starts the answer's (vLLM's).
        pub echo: Option<bool>,
        /// End the prompt with the template's start of an assistant turn; default true.
        pub add_generation_prompt: Option<bool>,
        /// Leave the last message open, for the model to continue it (a prefilled answer);
        /// not with `add_generation_prompt: true`.
        pub continue_final_message: Option<bool>,
        /// A Jinja chat template for this request instead of the model's.
        pub chat_template: Option<String>,
        /// More variables for the chat template.
        #[schema(value_type = Option<Object>)]
        pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
        /// Functions the model may call (`{"type": "function", "function": {"name", "description",
        /// "parameters"}}`); passed to the chat template as `tools`, as Hugging Face templates
        /// receive them. docs/http-api.md, "Tool calls".
        #[schema(value_type = Option<Vec<Object>>)]
        pub tools: Option<Vec<Value>>,
        /// `"auto"` (the default with tools: text or calls), `"none"`, `"required"` (one call or
        /// more), or `{"type": "function", "function": {"name": ...}}` (that function): the
        /// calls' arguments follow the function's parameter schema.
        #[schema(value_type = Option<Object>)]
        pub tool_choice: Option<Value>,
        /// Whether `"auto"` and `"required"` may make several calls in one turn (default true).
        pub parallel_tool_calls: Option<bool>,
        /// Documents for templates that take them (retrieval-augmented generation), as
        /// `documents` in the template.
        #[schema(value_type = Option<Vec<Object>>)]
        pub documents: Option<Vec<serde_json::Map<String, Value>>>,
    }
});

impl ChatCompletionRequest {
    /// The completions request this chat request becomes: its generation fields as they are,
    /// the rendered `prompt`, and the completion's own `max_tokens` and `logprobs`.
    pub fn completion(self, prompt: Prompt, max_tokens: Option<i64>, logprobs: Option<i64>) -> CompletionRequest {
        let chat = self;
        generation_fields!(completion_from_chat! {
            chat, { prompt, max_tokens, logprobs, echo: None, }
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    /// The token's text as UTF-8 bytes.
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position, most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatLogProbs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatResponseMessage {
    /// Always "assistant".
    pub role: String,
    /// The text; `null` when the turn is tool calls.
    pub content: Option<String>,
    /// The functions the assistant calls (with `tools`); absent otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One call of a function the request offered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    /// Always "function".
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text, valid against the function's parameter schema.
    pub arguments: String,
}

/// A tool call in a stream: the first delta of a call has its `id`, `type` and name; later ones
/// add to its `arguments`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    /// Which call of the turn.
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    /// `i` of the `n` choices.
    pub index: u32,
    pub message: ChatResponseMessage,
    pub logprobs: Option<ChatLogProbs>,
    /// "stop", "length", or "tool_calls" (the turn is calls).
    pub finish_reason: Option<String>,
    /// What stopped it (vLLM's field): the stop string or the stop token's id; `null` for end of
    /// text and the length limit.
    #[schema(value_type = Option<Object>)]
    pub stop_reason: Option<Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// Always "chat.completion".
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's: with `prompt_logprobs`, the rendered prompt's (see [`PromptLogprobs`]).
    #[schema(value_type = Option<Vec<Option<Object>>>)]
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// The server's version and the served model's configuration (OpenAI's field).
    pub system_fingerprint: String,
}

/// What a chunk adds to a choice: the role first, then content.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogProbs>,
    /// `null` but in a choice's last chunk.
    pub finish_reason: Option<String>,
    /// As in [`ChatChoice`], in a choice's last chunk.
    #[schema(value_type = Option<Object>)]
    pub stop_reason: Option<Value>,
}

/// One chunk of a streamed chat completion (`data: {...}` events, then `data: [DONE]`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// Always "chat.completion.chunk".
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    pub system_fingerprint: String,
}
