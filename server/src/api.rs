//! Request and response types: OpenAI's completions API (what the `openai` SDKs and
//! lm-evaluation-harness send and expect), vLLM's sampling extensions and its tokenizer
//! endpoints. The limits that depend on the served model (vocabulary, context, caps) are added
//! to the OpenAPI document at start-up, from the same [`crate::validation::Limits`] that
//! validation enforces.

use std::collections::BTreeMap;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// A prompt in any of OpenAI's forms. (Its schema, a oneOf of the four with the model's limits,
/// is written by [`crate::openapi`].)
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

pub const PROMPT_FORMS: &str =
    "prompt must be a string, an array of strings, an array of token ids, or an array of arrays of token ids";

/// A JSON integer: JSON Schema's `integer` counts `2.0` as one, so such numbers are taken too,
/// while they are exact (|x| <= 2^53; a larger one may be a rounded integer beyond i64).
fn int_of(v: &Value) -> Option<i64> {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    v.as_i64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() <= EXACT)
            .map(|f| f as i64)
    })
}

/// `deserialize_with` helpers for integer fields, taking integers written as `2.0` too.
pub mod json_int {
    use super::*;

    pub fn option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
        match Option::<Value>::deserialize(d)? {
            None | Some(Value::Null) => Ok(None),
            Some(v) => int_of(&v)
                .map(Some)
                .ok_or_else(|| D::Error::custom(format!("expected an integer, got {v}"))),
        }
    }

    pub fn option_vec<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<i64>>, D::Error> {
        match Option::<Vec<Value>>::deserialize(d)? {
            None => Ok(None),
            Some(items) => ints(&items).map(Some).map_err(D::Error::custom),
        }
    }

    pub fn vec<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<i64>, D::Error> {
        ints(&Vec::<Value>::deserialize(d)?).map_err(D::Error::custom)
    }

    fn ints(items: &[Value]) -> Result<Vec<i64>, String> {
        items
            .iter()
            .enumerate()
            .map(|(i, v)| int_of(v).ok_or_else(|| format!("[{i}]: expected an integer, got {v}")))
            .collect()
    }
}

impl Prompt {
    fn from_value(v: Value) -> Result<Self, String> {
        let ids = |items: &[Value], at: &str| -> Result<Vec<i64>, String> {
            items
                .iter()
                .enumerate()
                .map(|(i, v)| int_of(v).ok_or_else(|| format!("{at}[{i}] must be an integer token id, got {v}")))
                .collect()
        };
        match v {
            Value::String(s) => Ok(Prompt::Text(s)),
            Value::Array(items) => match items.first() {
                None => Ok(Prompt::Tokens(Vec::new())),
                Some(Value::String(_)) => items
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok(s),
                        other => Err(format!("prompt[{i}] must be a string like prompt[0], got {other}")),
                    })
                    .collect::<Result<_, _>>()
                    .map(Prompt::Texts),
                Some(Value::Number(_)) => ids(&items, "prompt").map(Prompt::Tokens),
                Some(Value::Array(_)) => items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::Array(inner) => ids(inner, &format!("prompt[{i}]")),
                        other => Err(format!(
                            "prompt[{i}] must be an array of token ids like prompt[0], got {other}"
                        )),
                    })
                    .collect::<Result<_, _>>()
                    .map(Prompt::TokenLists),
                Some(_) => Err(PROMPT_FORMS.into()),
            },
            _ => Err(PROMPT_FORMS.into()),
        }
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Prompt::from_value(Value::deserialize(d)?).map_err(D::Error::custom)
    }
}

/// One stop string or several. (Its schema is written by [`crate::openapi`].)
#[derive(Debug, Clone)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) => Ok(Stop::One(s)),
            Value::Array(items) => items
                .into_iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(D::Error::custom("stop must be a string or an array of strings")),
                })
                .collect::<Result<_, _>>()
                .map(Stop::Many),
            _ => Err(D::Error::custom("stop must be a string or an array of strings")),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
    /// With `include_usage`: every chunk carries the counts so far too (vLLM's extension).
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

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
        "response_format",
        "structured output (JSON mode, JSON schema) is not implemented",
    ),
    ("guided_json", "structured output is not implemented"),
    ("guided_regex", "structured output is not implemented"),
    ("guided_choice", "structured output is not implemented"),
    ("guided_grammar", "structured output is not implemented"),
    ("guided_decoding_backend", "structured output is not implemented"),
    ("guided_whitespace_pattern", "structured output is not implemented"),
    ("structural_tag", "structured output is not implemented"),
    ("structured_outputs", "structured output is not implemented"),
    ("logits_processors", "the server runs no user-supplied code"),
    (
        "kv_transfer_params",
        "there is no disaggregated prefill to transfer a KV cache to",
    ),
    ("vllm_xargs", "there are no custom extensions to pass them to"),
    ("mm_processor_kwargs", "the models are text-only"),
    ("lora_request", "there are no LoRA adapters"),
];

/// Declares a request type with its own fields and the generation fields that completions and
/// chat completions share, written once here ([`generation_fields`]). (serde's `flatten` would
/// nest them in a struct of their own, but it cannot be combined with `deny_unknown_fields`.)
macro_rules! request_with_generation_fields {
    (
        $(#[$meta:meta])*
        pub struct $name:ident { $($own:tt)* }
        $( $(#[$field_meta:meta])* $field:ident: $ty:ty, )*
    ) => {
        $(#[$meta])*
        pub struct $name {
            $($own)*
            $( $(#[$field_meta])* pub $field: $ty, )*
        }
    };
}

/// The generation fields of completions and chat completions (each means the same in both),
/// passed to `$then!` after `$($args)*`; and [`ChatCompletionRequest::completion`] copies them
/// from a chat request into a completions one.
macro_rules! generation_fields {
    ($then:ident! { $($args:tt)* }) => {
        $then! {
            $($args)*
            /// The served model's name (see `GET /v1/models`); may be omitted.
            model: Option<String>,
            /// Tokens generated before end-of-text, a stop token or a stop string may end a choice.
            #[serde(default, deserialize_with = "json_int::option")]
            min_tokens: Option<i64>,
            /// 0 is greedy; default 1.
            temperature: Option<f64>,
            /// In (0, 1]; default 1.
            top_p: Option<f64>,
            /// Keep the k most likely tokens; 0 or -1 disables (vLLM's convention).
            #[serde(default, deserialize_with = "json_int::option")]
            top_k: Option<i64>,
            /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
            min_p: Option<f64>,
            /// > 0; 1 disables (vLLM's convention).
            repetition_penalty: Option<f64>,
            /// In [-2, 2].
            presence_penalty: Option<f64>,
            /// In [-2, 2].
            frequency_penalty: Option<f64>,
            /// Token id (as a string) → a bias in [-100, 100] added to its logit before sampling.
            #[schema(value_type = Option<Object>)]
            logit_bias: Option<BTreeMap<String, f64>>,
            /// Makes sampling reproducible.
            #[serde(default, deserialize_with = "json_int::option")]
            seed: Option<i64>,
            /// A string or an array of strings that end a choice (not included in its text; in
            /// chat, beside the chat template's own).
            #[schema(value_type = Option<Object>)]
            stop: Option<Stop>,
            /// Token ids that end a choice (in its logprobs and usage, not in its text).
            #[serde(default, deserialize_with = "json_int::option_vec")]
            stop_token_ids: Option<Vec<i64>>,
            /// Keep generating after the end-of-text token.
            ignore_eos: Option<bool>,
            /// Choices per prompt.
            #[serde(default, deserialize_with = "json_int::option")]
            n: Option<i64>,
            /// Candidates generated per prompt (a value below `n` counts as `n`); the `n` with the
            /// highest cumulative log-probability are returned, best first. With
            /// `use_beam_search`, the beam width.
            #[serde(default, deserialize_with = "json_int::option")]
            best_of: Option<i64>,
            /// Beam search (vLLM's extension) instead of sampling: `best_of` beams (default `n`),
            /// the `n` best returned; deterministic, so it takes no sampling parameter.
            use_beam_search: Option<bool>,
            /// With beam search: finished beams are scored by summed log-probability / length^α
            /// (default 1; the original transformer used 0.6). Ignored otherwise.
            length_penalty: Option<f64>,
            stream: Option<bool>,
            /// With `stream`; ignored otherwise.
            stream_options: Option<StreamOptions>,
            /// Accepted and ignored, as by OpenAI.
            user: Option<String>,
            /// Keep the stop string that ended a choice at the end of its text (vLLM's field).
            include_stop_str_in_output: Option<bool>,
            /// Leave special tokens (`<|endoftext|>`) out of the text; default true (vLLM's).
            skip_special_tokens: Option<bool>,
            /// vLLM's; the byte-level and character tokenizers here decode with no spaces
            /// between special tokens either way, as vLLM's fast tokenizers do.
            spaces_between_special_tokens: Option<bool>,
            /// Keep only the prompt's last k tokens (k >= 1, or -1 for as many as the context
            /// allows), vLLM's field.
            #[serde(default, deserialize_with = "json_int::option")]
            truncate_prompt_tokens: Option<i64>,
            /// Sample only among these token ids (vLLM's field).
            #[serde(default, deserialize_with = "json_int::option_vec")]
            allowed_token_ids: Option<Vec<i64>>,
            /// Add the tokenizer's special tokens to the prompt. Default true for completions and
            /// false for chat (vLLM's defaults); the tokenizers here add none either way.
            add_special_tokens: Option<bool>,
            /// Scheduling priority (vLLM's field): requests are served first come, first served,
            /// so only 0 is accepted.
            #[serde(default, deserialize_with = "json_int::option")]
            priority: Option<i64>,
            /// The response's id becomes `cmpl-<request_id>` (`chatcmpl-` in chat), as in vLLM.
            request_id: Option<String>,
            /// With logprobs: tokens written as `token_id:<id>` instead of their text (vLLM's).
            return_tokens_as_token_ids: Option<bool>,
            /// vLLM's: each prompt token's log-probability and rank, with this many most likely
            /// tokens at its position, in the response's `prompt_logprobs` (`null` for the first
            /// token). Not with `stream` (0 is accepted there and returns nothing).
            #[serde(default, deserialize_with = "json_int::option")]
            prompt_logprobs: Option<i64>,
            /// The prefix cache shares a prompt's cached prefix only with requests of the same
            /// salt (vLLM's field; a non-empty string).
            cache_salt: Option<String>,
        }
    };
}

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

/// Copies the generation fields from a chat request into the completions request it becomes.
macro_rules! completion_from_chat {
    (
        $chat:ident, { $($own:tt)* }
        $( $(#[$field_meta:meta])* $field:ident: $ty:ty, )*
    ) => {
        CompletionRequest { $($own)* $( $field: $chat.$field, )* }
    };
}

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

/// Fields of OpenAI's and vLLM's chat API that this server does not implement, beside
/// [`UNSUPPORTED`], with the reason.
pub const UNSUPPORTED_CHAT: &[(&str, &str)] = &[
    ("tools", "these models were not trained to call tools"),
    ("tool_choice", "these models were not trained to call tools"),
    ("parallel_tool_calls", "these models were not trained to call tools"),
    ("functions", "these models were not trained to call functions"),
    ("function_call", "these models were not trained to call functions"),
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
#[derive(Debug, Clone, PartialEq)]
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
}

/// One turn of a conversation.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: Role,
    /// A string or an array of text parts; `null` only for an assistant turn.
    #[schema(value_type = Object)]
    pub content: Content,
    /// Passed to the chat template.
    pub name: Option<String>,
    /// Accepted as the SDKs send it back with an assistant message, and ignored.
    pub refusal: Option<String>,
}

generation_fields!(request_with_generation_fields! {
    /// `POST /v1/chat/completions`: the messages are rendered to a prompt by the checkpoint's chat
    /// template, then generated from as `/v1/completions` does; every shared field means what it
    /// means there.
    #[derive(Debug, Clone, Deserialize, ToSchema)]
    #[serde(deny_unknown_fields)]
    pub struct ChatCompletionRequest {
        /// The conversation so far, at least one message.
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
    pub content: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    /// `i` of the `n` choices.
    pub index: u32,
    pub message: ChatResponseMessage,
    pub logprobs: Option<ChatLogProbs>,
    /// "stop" or "length".
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn prompt(v: Value) -> Result<Prompt, String> {
        Prompt::from_value(v)
    }

    #[test]
    fn the_four_prompt_forms_and_their_errors() {
        assert_eq!(prompt(json!("hi")), Ok(Prompt::Text("hi".into())));
        assert_eq!(
            prompt(json!(["a", "b"])),
            Ok(Prompt::Texts(vec!["a".into(), "b".into()]))
        );
        assert_eq!(prompt(json!([1, 2])), Ok(Prompt::Tokens(vec![1, 2])));
        assert_eq!(
            prompt(json!([[1], [2, 3]])),
            Ok(Prompt::TokenLists(vec![vec![1], vec![2, 3]]))
        );
        assert_eq!(prompt(json!([])), Ok(Prompt::Tokens(vec![])));
        let err = |v: Value| prompt(v).err().unwrap_or_default();
        assert!(err(json!(["a", 1])).contains("prompt[1] must be a string"));
        assert!(err(json!([1, "a"])).contains("prompt[1] must be an integer token id"));
        assert!(err(json!([1, 2.5])).contains("prompt[1] must be an integer"));
        assert_eq!(
            prompt(json!([1, 2.0])),
            Ok(Prompt::Tokens(vec![1, 2])),
            "2.0 is an integer in JSON Schema"
        );
        assert!(err(json!([[1], [2, "x"]])).contains("prompt[1][1] must be an integer"));
        assert!(err(json!([[1], 2])).contains("prompt[1] must be an array of token ids"));
        assert!(err(json!({"text": "hi"})).contains("array of arrays of token ids"));
        assert!(err(json!([null])).contains("array of arrays of token ids"));
    }
}
