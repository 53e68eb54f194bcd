//! `POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, as vLLM
//! and llama.cpp's server serve it, so that the `anthropic` SDK and the tools built on it run
//! against a local model. A request becomes a chat completion request (system prompt, text,
//! `tool_use` and `tool_result` blocks as OpenAI's messages; tools as functions) that runs through
//! the chat route's own path ([`super::chat::start`]); its result, whole or streamed, is written
//! back in Anthropic's shapes, and every error in its `{"type": "error", "error": {...}}`.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::api::{ChatCompletion, ChatCompletionChunk, ChatCompletionRequest};
use crate::error::ApiError;
use crate::respond::named_sse;
use crate::state::{parse_body, AppState, RequestBody};

/// An [`ApiError`] in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`, the
/// type by the status as Anthropic names them.
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

/// Anthropic's error type for a status.
fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    }
}

/// The body of an error in Anthropic's shape (also an `error` event's data mid-stream).
pub fn error_body(e: &ApiError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status()), "message": e.to_string()}})
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        // The status and headers (a 503's Retry-After) as the OpenAI routes give them.
        let (parts, _) = self.0.clone().into_response().into_parts();
        Response::from_parts(parts, axum::body::Body::from(error_body(&self.0).to_string()))
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// The request body as a JSON object, or the error that says why not (malformed JSON, another
/// type, over the size limit), as the OpenAI routes say it.
fn body_object(body: Result<Json<Value>, JsonRejection>) -> Result<Map<String, Value>, ApiError> {
    parse_body(body, &[])
}

/// The text of `content`: a string, or a list of blocks of which only `text` ones may appear
/// (`what` names the field in errors).
fn text_of(content: &Value, what: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (j, block) in blocks.iter().enumerate() {
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(
                        block
                            .get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| invalid(&format!("{what}[{j}].text"), "a text block needs its text"))?
                            .to_string(),
                    ),
                    other => {
                        return Err(invalid(
                            &format!("{what}[{j}].type"),
                            format!("{other:?} blocks are not supported here: only text"),
                        ))
                    }
                }
            }
            Ok(parts.join("\n"))
        }
        Value::Null => Ok(String::new()),
        _ => Err(invalid(what, "expected a string or a list of content blocks")),
    }
}

/// The OpenAI chat messages of an Anthropic conversation: the system prompt first, each
/// `tool_result` block a `tool` message, each assistant's `tool_use` blocks its `tool_calls`.
fn chat_messages(body: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match body.get("system") {
        None | Some(Value::Null) => {}
        Some(system) => out.push(json!({"role": "system", "content": text_of(system, "system")?})),
    }
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("messages", "messages: required, a list of {role, content}"))?;
    if messages.is_empty() {
        return Err(invalid("messages", "messages: at least one message is required"));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(invalid(
                &format!("messages[{i}].role"),
                format!("messages[{i}].role: {role:?}; expected \"user\" or \"assistant\""),
            ));
        }
        let content = m.get("content").unwrap_or(&Value::Null);
        let Value::Array(blocks) = content else {
            out.push(json!({"role": role, "content": text_of(content, &format!("messages[{i}].content"))?}));
            continue;
        };
        let (mut text, mut calls) = (Vec::new(), Vec::new());
        for (j, block) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            match (block.get("type").and_then(Value::as_str), role) {
                (Some("text"), _) => text.push(text_of(&Value::Array(vec![block.clone()]), &at)?),
                (Some("tool_use"), "assistant") => {
                    let field = |k: &str| block.get(k).and_then(Value::as_str).map(str::to_string);
                    let (Some(id), Some(name)) = (field("id"), field("name")) else {
                        return Err(invalid(&at, format!("{at}: a tool_use block needs its id and name")));
                    };
                    let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()}}));
                }
                (Some("tool_result"), "user") => {
                    let id = block.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                        invalid(&at, format!("{at}: a tool_result block needs its tool_use_id"))
                    })?;
                    let result = text_of(block.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
                }
                (kind, _) => {
                    return Err(invalid(
                        &format!("{at}.type"),
                        format!("{at}: {kind:?} blocks are not supported in a {role} message (text, tool_use from the assistant, tool_result from the user)"),
                    ))
                }
            }
        }
        match role {
            "assistant" => {
                let content = (!text.is_empty()).then(|| text.join("\n"));
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                out.push(message);
            }
            _ if !text.is_empty() => out.push(json!({"role": "user", "content": text.join("\n")})),
            _ => {}
        }
    }
    Ok(out)
}

/// The chat completion request of a Messages request (`counting`: for count_tokens, where
/// `max_tokens` is not asked for).
fn chat_request(body: &Map<String, Value>, counting: bool) -> Result<ChatCompletionRequest, ApiError> {
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(chat_messages(body)?));
    for key in ["model", "temperature", "top_p", "top_k", "stream"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), v.clone());
        }
    }
    match (body.get("max_tokens"), counting) {
        (Some(v), false) => _ = chat.insert("max_tokens".into(), v.clone()),
        (None, false) => return Err(invalid("max_tokens", "max_tokens: required")),
        (_, true) => _ = chat.insert("max_tokens".into(), json!(1)),
    }
    if let Some(stop) = body.get("stop_sequences").filter(|v| !v.is_null()) {
        chat.insert("stop".into(), stop.clone());
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if let Some(tools) = body.get("tools").filter(|v| !v.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| invalid("tools", "tools: expected a list of {name, description, input_schema}"))?;
        let functions = tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(&format!("tools[{i}].name"), format!("tools[{i}]: a tool needs its name")))?;
                let mut function = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or_else(|| json!({"type": "object"}))});
                if let Some(d) = t.get("description") {
                    function["description"] = d.clone();
                }
                Ok(json!({"type": "function", "function": function}))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        chat.insert("tools".into(), Value::Array(functions));
    }
    if let Some(choice) = body.get("tool_choice").filter(|v| !v.is_null()) {
        let kind = choice.get("type").and_then(Value::as_str).unwrap_or_default();
        let mapped = match kind {
            "auto" => json!("auto"),
            "any" => json!("required"),
            "none" => json!("none"),
            "tool" => {
                let name = choice
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid("tool_choice.name", "tool_choice of type tool needs the tool's name"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            other => {
                return Err(invalid(
                    "tool_choice.type",
                    format!("tool_choice.type {other:?}: expected auto, any, tool or none"),
                ))
            }
        };
        chat.insert("tool_choice".into(), mapped);
        if choice.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    parse_body(Ok(Json(Value::Object(chat))), ChatCompletionRequest::UNSUPPORTED)
}

/// Anthropic's `stop_reason` and `stop_sequence` of a choice's OpenAI finish reason and vLLM's
/// `stop_reason` (the stop string, or a stop token's id).
fn stop_reason(finish: Option<&str>, stop: Option<&Value>) -> (&'static str, Value) {
    match (finish, stop) {
        (Some("length"), _) => ("max_tokens", Value::Null),
        (Some("tool_calls"), _) => ("tool_use", Value::Null),
        (_, Some(Value::String(s))) => ("stop_sequence", Value::String(s.clone())),
        _ => ("end_turn", Value::Null),
    }
}

fn message_id() -> String {
    format!("msg_{:024x}", rand::random::<u128>() >> 32)
}

/// The arguments of a call as the `input` object Anthropic's `tool_use` holds.
fn input_of(arguments: &str) -> Value {
    serde_json::from_str(arguments).unwrap_or_else(|_| json!({}))
}

/// A whole chat completion as Anthropic's message.
fn message(done: ChatCompletion) -> Value {
    let choice = done.choices.into_iter().next();
    let mut content = Vec::new();
    let (mut reason, mut sequence) = ("end_turn", Value::Null);
    if let Some(c) = choice {
        if let Some(text) = c.message.content.filter(|t| !t.is_empty()) {
            content.push(json!({"type": "text", "text": text}));
        }
        for call in c.message.tool_calls {
            content.push(json!({"type": "tool_use", "id": call.id, "name": call.function.name,
                "input": input_of(&call.function.arguments)}));
        }
        (reason, sequence) = stop_reason(c.finish_reason.as_deref(), c.stop_reason.as_ref());
    }
    json!({
        "id": message_id(), "type": "message", "role": "assistant", "model": done.model,
        "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": {"input_tokens": done.usage.prompt_tokens, "output_tokens": done.usage.completion_tokens},
    })
}

/// Turns the chat stream's chunks into the Messages stream's events: `message_start`, each
/// content block's `content_block_start`, deltas (`text_delta`, `input_json_delta`) and
/// `content_block_stop`, then `message_delta` (the stop reason, the output tokens) and
/// `message_stop`.
struct Events {
    id: String,
    model: String,
    input_tokens: usize,
    started: bool,
    /// The open block: its index, and whether it is text.
    open: Option<(usize, bool)>,
    blocks: usize,
    stop: (&'static str, Value),
}

impl Events {
    fn event(name: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(name);
        SseEvent::default().event(name).data(data.to_string())
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((index, _)) = self.open.take() {
            out.push(Self::event("content_block_stop", json!({"index": index})));
        }
    }

    fn open(&mut self, text: bool, block: Value, out: &mut Vec<SseEvent>) -> usize {
        self.close(out);
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, text));
        out.push(Self::event(
            "content_block_start",
            json!({"index": index, "content_block": block}),
        ));
        index
    }

    fn chunk(&mut self, chunk: ChatCompletionChunk) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            out.push(Self::event(
                "message_start",
                json!({"message": {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}}),
            ));
        }
        for choice in chunk.choices {
            if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                let index = match self.open {
                    Some((index, true)) => index,
                    _ => self.open(true, json!({"type": "text", "text": ""}), &mut out),
                };
                out.push(Self::event(
                    "content_block_delta",
                    json!({"index": index, "delta": {"type": "text_delta", "text": text}}),
                ));
            }
            for call in choice.delta.tool_calls.unwrap_or_default() {
                let index = match (&call.id, self.open) {
                    (None, Some((index, false))) => index,
                    _ => {
                        let (id, name) = (call.id.clone().unwrap_or_default(), call.function.name.clone());
                        let block =
                            json!({"type": "tool_use", "id": id, "name": name.unwrap_or_default(), "input": {}});
                        self.open(false, block, &mut out)
                    }
                };
                if let Some(args) = call.function.arguments.filter(|a| !a.is_empty()) {
                    out.push(Self::event(
                        "content_block_delta",
                        json!({"index": index, "delta": {"type": "input_json_delta", "partial_json": args}}),
                    ));
                }
            }
            if choice.finish_reason.is_some() {
                self.close(&mut out);
                self.stop = stop_reason(choice.finish_reason.as_deref(), choice.stop_reason.as_ref());
            }
        }
        if let Some(usage) = chunk.usage {
            self.close(&mut out);
            out.push(Self::event(
                "message_delta",
                json!({"delta": {"stop_reason": self.stop.0, "stop_sequence": self.stop.1},
                    "usage": {"output_tokens": usage.completion_tokens}}),
            ));
            out.push(Self::event("message_stop", json!({})));
        }
        out
    }
}

#[utoipa::path(
    post,
    path = "/v1/messages",
    request_body(content = Object, description = "Anthropic's Messages request: `model`, `max_tokens`, `messages` (text, `tool_use` and `tool_result` blocks), `system`, `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools`, `tool_choice`, `stream`"),
    responses(
        (status = 200, description = "Anthropic's message, or with `stream: true` its Server-Sent Events (`message_start`, `content_block_start`, `content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`)",
            content((Object = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "`{\"type\": \"error\", \"error\": {\"type\": \"invalid_request_error\", \"message\"}}`, naming the field"),
        (status = 401, description = "No valid API key (`x-api-key` or `Authorization: Bearer`)"),
    )
)]
pub async fn messages(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, AnthropicError> {
    let body = body_object(body)?;
    let request = chat_request(&body, false)?;
    let run = super::chat::start(&state, request).await?;
    if !run.valid.stream {
        return Ok(Json(message(run.whole(&state).await?)).into_response());
    }
    let mut events = Events {
        id: message_id(),
        model: run.model.clone(),
        input_tokens: run.valid.prompts.iter().map(|p| p.ids.len()).sum(),
        started: false,
        open: None,
        blocks: 0,
        stop: ("end_turn", Value::Null),
    };
    let sse = named_sse(run.chunks(&state), move |chunk| match chunk {
        Ok(chunk) => events.chunk(chunk),
        Err(e) => vec![SseEvent::default().event("error").data(error_body(&e).to_string())],
    });
    Ok(sse.into_response())
}

#[utoipa::path(
    post,
    path = "/v1/messages/count_tokens",
    request_body(content = Object, description = "A Messages request (without `max_tokens`)"),
    responses(
        (status = 200, description = "`{\"input_tokens\": N}`: the prompt's tokens as the model's chat template renders it", content_type = "application/json"),
        (status = 400, description = "Anthropic's error, naming the field"),
    )
)]
pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, AnthropicError> {
    let body = body_object(body)?;
    let (valid, _) = super::chat::prepare(&state, chat_request(&body, true)?).await?;
    let tokens: usize = valid.prompts.iter().map(|p| p.ids.len()).sum();
    Ok(Json(json!({"input_tokens": tokens})).into_response())
}
