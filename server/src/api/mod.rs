//! Request and response types: OpenAI's completions API (what the `openai` SDKs and
//! lm-evaluation-harness send and expect), vLLM's sampling extensions and its tokenizer
//! endpoints. The limits that depend on the served model (vocabulary, context, caps) are added
//! to the OpenAPI document at start-up, from the same [`crate::validation::Limits`] that
//! validation enforces.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer};
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

/// `deserialize_with` helpers for fields whose type is a struct: serde's derived structs also
/// take a JSON array of their fields in order (so `"stream_options": []` would read as the
/// defaults), where the schema allows only an object.
pub mod json_object {
    use serde::de::DeserializeOwned;

    use super::*;

    pub fn option<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Option<T>, D::Error> {
        match Option::<Value>::deserialize(d)? {
            None | Some(Value::Null) => Ok(None),
            Some(v) => object(v).map(Some).map_err(D::Error::custom),
        }
    }

    pub fn vec<'de, D: Deserializer<'de>, T: DeserializeOwned>(d: D) -> Result<Vec<T>, D::Error> {
        Vec::<Value>::deserialize(d)?
            .into_iter()
            .enumerate()
            .map(|(i, v)| object(v).map_err(|e| D::Error::custom(format!("[{i}]{e}"))))
            .collect()
    }

    /// The error starts with the path inside the object (`.role: unknown variant ...`).
    fn object<T: DeserializeOwned>(v: Value) -> Result<T, String> {
        if !v.is_object() {
            return Err(format!(": expected an object, got {v}"));
        }
        serde_path_to_error::deserialize(v).map_err(|e| match e.path().to_string() {
            p if p == "." => format!(": {}", e.inner()),
            p => format!(".{p}: {}", e.inner()),
        })
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
            #[serde(default, deserialize_with = "json_object::option")]
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
            /// OpenAI's structured output: `{"type": "json_object"}` (any JSON object),
            /// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict":
            /// true}}` (JSON valid against the schema), or `{"type": "text"}` (no constraint).
            /// Enforced token by token; one constraint per request (docs/http-api.md, "Structured outputs").
            #[schema(value_type = Option<Object>)]
            response_format: Option<Value>,
            /// vLLM's structured outputs: one of `json` (a schema), `regex`, `choice` (an array
            /// of strings), `grammar` (llguidance's Lark, or GBNF) or `json_object: true`.
            #[schema(value_type = Option<Object>)]
            structured_outputs: Option<Value>,
            /// vLLM's older name for `structured_outputs.json`.
            #[schema(value_type = Option<Object>)]
            guided_json: Option<Value>,
            /// vLLM's older name for `structured_outputs.regex`.
            guided_regex: Option<String>,
            /// vLLM's older name for `structured_outputs.choice`.
            guided_choice: Option<Vec<String>>,
            /// vLLM's older name for `structured_outputs.grammar`.
            guided_grammar: Option<String>,
            /// llama.cpp's: a JSON schema the output follows.
            #[schema(value_type = Option<Object>)]
            json_schema: Option<Value>,
            /// llama.cpp's: a GBNF grammar the output follows (llguidance's Lark is taken too).
            grammar: Option<String>,
            /// With speculative decoding on (`--speculative`): tokens proposed per step at most
            /// for this request, up to the server's `--num-speculative-tokens`; 0 turns it off.
            /// The output is the same either way (greedy), or has the same distribution.
            #[serde(default, deserialize_with = "json_int::option")]
            num_speculative_tokens: Option<i64>,
        }
    };
}

/// Copies the generation fields from a chat request into the completions request it becomes.
macro_rules! completion_from_chat {
    (
        $chat:ident, { $($own:tt)* }
        $( $(#[$field_meta:meta])* $field:ident: $ty:ty, )*
    ) => {
        CompletionRequest { $($own)* $( $field: $chat.$field, )* }
    };
}

mod chat;
mod completions;
mod embeddings;
mod info;

pub use chat::*;
pub use completions::*;
pub use embeddings::*;
pub use info::*;

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
