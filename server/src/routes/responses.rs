//! `POST /v1/responses`: OpenAI's Responses API (what the `openai` SDK's `responses.create` and
//! its Agents SDK call). `input` as a string or items (messages, `function_call` and
//! `function_call_output`), `instructions`, `text.format` and function `tools` become a chat
//! completion request that runs through the chat route's own path ([`super::chat::start`]); the
//! result, whole or streamed with the API's typed events, is written back as a `response`. The
//! server keeps no responses: `store` is reported `false`, and `previous_response_id` and
//! `background` are 400s that say so (the conversation goes in `input` instead).

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::api::{ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, Usage};
use crate::error::ApiError;
use crate::respond::named_sse;
use crate::state::{parse_body, AppState, RequestBody};

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

fn random_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

/// The text of a message item's `content`: a string, or parts of type `input_text` /
/// `output_text` (`text` too).
fn text_of(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => out.push(
                        part.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                invalid(
                                    &format!("{at}[{j}].text"),
                                    format!("{at}[{j}]: a text part needs its text"),
                                )
                            })?
                            .to_string(),
                    ),
                    other => {
                        return Err(invalid(
                            &format!("{at}[{j}].type"),
                            format!("{at}[{j}]: {other:?} parts are not supported: this model reads text"),
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
        }
        _ => Err(invalid(
            at,
            format!("{at}: expected a string or a list of content parts"),
        )),
    }
}

/// The chat messages of `instructions` and `input`: function calls in a row become one
/// assistant message's `tool_calls`, each output a `tool` message.
fn chat_messages(body: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(instructions) = body.get("instructions").filter(|v| !v.is_null()) {
        let text = instructions
            .as_str()
            .ok_or_else(|| invalid("instructions", "instructions: expected a string"))?;
        out.push(json!({"role": "system", "content": text}));
    }
    let items = match body.get("input") {
        Some(Value::String(s)) => return Ok([out, vec![json!({"role": "user", "content": s})]].concat()),
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => {
            return Err(invalid(
                "input",
                "input: required, a string or a non-empty list of items",
            ))
        }
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or(if item.get("role").is_some() { "message" } else { "" });
        let field = |k: &str| item.get(k).and_then(Value::as_str).map(str::to_string);
        match kind {
            "message" => {
                let role = field("role").unwrap_or_default();
                if !["user", "assistant", "system", "developer"].contains(&role.as_str()) {
                    return Err(invalid(
                        &format!("{at}.role"),
                        format!("{at}.role: {role:?}; expected user, assistant, system or developer"),
                    ));
                }
                let content = text_of(item.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
                out.push(json!({"role": role, "content": content}));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (field("call_id"), field("name")) else {
                    return Err(invalid(
                        &at,
                        format!("{at}: a function_call needs its call_id and name"),
                    ));
                };
                let call = json!({"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": field("arguments").unwrap_or_else(|| "{}".into())}});
                // Calls in a row are one assistant turn.
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = field("call_id").ok_or_else(|| {
                    invalid(
                        &format!("{at}.call_id"),
                        format!("{at}: a function_call_output needs its call_id"),
                    )
                })?;
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => text_of(other, &format!("{at}.output"))?,
                    None => {
                        return Err(invalid(
                            &format!("{at}.output"),
                            format!("{at}: a function_call_output needs its output"),
                        ))
                    }
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            other => {
                return Err(invalid(
                    &format!("{at}.type"),
                    format!("{at}.type {other:?}: expected message, function_call or function_call_output"),
                ))
            }
        }
    }
    Ok(out)
}

/// The chat completion request of a Responses request.
fn chat_request(body: &Map<String, Value>) -> Result<ChatCompletionRequest, ApiError> {
    for (field, why) in [
        (
            "previous_response_id",
            "this server keeps no responses; send the conversation as input items",
        ),
        (
            "conversation",
            "this server keeps no conversations; send the conversation as input items",
        ),
    ] {
        if body.get(field).is_some_and(|v| !v.is_null()) {
            return Err(invalid(field, format!("{field}: {why}")));
        }
    }
    if body.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(invalid(
            "background",
            "background: not supported; the response comes in this request",
        ));
    }
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(chat_messages(body)?));
    for key in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "user",
        "seed",
        "top_k",
    ] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), v.clone());
        }
    }
    // Log-probabilities of the output text: `include` asks for them, `top_logprobs` for the
    // alternatives (as OpenAI's Responses API takes them).
    let mut logprobs = false;
    if let Some(include) = body.get("include").filter(|v| !v.is_null()) {
        let items = include
            .as_array()
            .ok_or_else(|| invalid("include", "include: expected a list"))?;
        for item in items {
            match item.as_str() {
                Some("message.output_text.logprobs") => logprobs = true,
                other => {
                    return Err(invalid(
                        "include",
                        format!("include {other:?}: this server has message.output_text.logprobs only"),
                    ))
                }
            }
        }
    }
    if let Some(top) = body.get("top_logprobs").filter(|v| !v.is_null()) {
        logprobs = true;
        chat.insert("top_logprobs".into(), top.clone());
    }
    if logprobs {
        chat.insert("logprobs".into(), json!(true));
    }
    if let Some(v) = body.get("max_output_tokens").filter(|v| !v.is_null()) {
        chat.insert("max_tokens".into(), v.clone());
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    if let Some(format) = body.get("text").and_then(|t| t.get("format")).filter(|v| !v.is_null()) {
        let response_format = match format.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(json!({"type": "json_object"})),
            Some("json_schema") => {
                let mut schema = json!({"name": format.get("name").cloned().unwrap_or_else(|| json!("response")),
                    "schema": format.get("schema").cloned().unwrap_or(Value::Null)});
                if let Some(strict) = format.get("strict") {
                    schema["strict"] = strict.clone();
                }
                Some(json!({"type": "json_schema", "json_schema": schema}))
            }
            other => {
                return Err(invalid(
                    "text.format.type",
                    format!("text.format.type {other:?}: expected text, json_object or json_schema"),
                ))
            }
        };
        if let Some(f) = response_format {
            chat.insert("response_format".into(), f);
        }
    }
    if let Some(tools) = body.get("tools").filter(|v| !v.is_null()) {
        let tools = tools
            .as_array()
            .ok_or_else(|| invalid("tools", "tools: expected a list of function tools"))?;
        let functions = tools
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.get("type").and_then(Value::as_str) != Some("function") {
                    return Err(invalid(
                        &format!("tools[{i}].type"),
                        format!("tools[{i}].type {:?}: only function tools are supported", t.get("type")),
                    ));
                }
                let name = t.get("name").and_then(Value::as_str).ok_or_else(|| {
                    invalid(
                        &format!("tools[{i}].name"),
                        format!("tools[{i}]: a function needs its name"),
                    )
                })?;
                let mut function = json!({"name": name,
                    "parameters": t.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}))});
                for key in ["description", "strict"] {
                    if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                        function[key] = v.clone();
                    }
                }
                Ok(json!({"type": "function", "function": function}))
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        chat.insert("tools".into(), Value::Array(functions));
    }
    if let Some(choice) = body.get("tool_choice").filter(|v| !v.is_null()) {
        let mapped = match choice {
            Value::String(_) => choice.clone(),
            _ => match (choice.get("type").and_then(Value::as_str), choice.get("name")) {
                (Some("function"), Some(name)) => json!({"type": "function", "function": {"name": name}}),
                _ => {
                    return Err(invalid(
                        "tool_choice",
                        "tool_choice: auto, none, required or {\"type\": \"function\", \"name\"}",
                    ))
                }
            },
        };
        chat.insert("tool_choice".into(), mapped);
    }
    parse_body(Ok(Json(Value::Object(chat))), ChatCompletionRequest::UNSUPPORTED)
}

/// The Responses API's usage of the chat's.
fn usage(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens})
}

/// What a response echoes of its request, and its identity.
struct Shell {
    id: String,
    created_at: u64,
    model: String,
    body: Map<String, Value>,
}

impl Shell {
    /// The `response` object with `status`, `output` and `usage`.
    fn response(&self, status: &str, output: Vec<Value>, usage: Value, incomplete: Option<&str>) -> Value {
        let echo = |k: &str, default: Value| self.body.get(k).filter(|v| !v.is_null()).cloned().unwrap_or(default);
        json!({
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": null,
            "incomplete_details": incomplete.map(|reason| json!({"reason": reason})),
            "instructions": echo("instructions", Value::Null),
            "max_output_tokens": echo("max_output_tokens", Value::Null),
            "temperature": echo("temperature", json!(1.0)), "top_p": echo("top_p", json!(1.0)),
            "tools": echo("tools", json!([])), "tool_choice": echo("tool_choice", json!("auto")),
            "parallel_tool_calls": echo("parallel_tool_calls", json!(true)),
            "text": echo("text", json!({"format": {"type": "text"}})),
            "metadata": echo("metadata", json!({})), "store": false, "previous_response_id": null,
            "truncation": "disabled", "reasoning": null, "user": echo("user", Value::Null),
        })
    }
}

/// Log-probabilities as JSON, each number as the chat endpoint writes it: the f32's shortest
/// decimal (`json!` would widen it to f64 first, -2.8372684 becoming -2.837268352508545).
fn logprob_values(logprobs: &[crate::api::ChatTokenLogprob]) -> Vec<Value> {
    logprobs
        .iter()
        .map(|l| {
            serde_json::to_string(l)
                .ok()
                .and_then(|text| serde_json::from_str(&text).ok())
                .unwrap_or(Value::Null)
        })
        .collect()
}

/// A whole chat completion as a response.
fn whole(shell: &Shell, done: ChatCompletion) -> Value {
    let mut output = Vec::new();
    let mut incomplete = None;
    if let Some(c) = done.choices.into_iter().next() {
        let logprobs = logprob_values(&c.logprobs.map(|l| l.content).unwrap_or_default());
        if let Some(text) = c.message.content.filter(|t| !t.is_empty()) {
            output.push(
                json!({"type": "message", "id": random_id("msg"), "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}]}),
            );
        }
        for call in c.message.tool_calls {
            output.push(
                json!({"type": "function_call", "id": random_id("fc"), "call_id": call.id,
                "name": call.function.name, "arguments": call.function.arguments, "status": "completed"}),
            );
        }
        if c.finish_reason.as_deref() == Some("length") {
            incomplete = Some("max_output_tokens");
        }
    }
    let status = if incomplete.is_some() {
        "incomplete"
    } else {
        "completed"
    };
    shell.response(status, output, usage(&done.usage), incomplete)
}

/// The stream's typed events from the chat stream's chunks: `response.created` and
/// `response.in_progress`; per output item `response.output_item.added`, its deltas
/// (`response.output_text.delta` in a `response.content_part`, or
/// `response.function_call_arguments.delta`), their `.done` events and
/// `response.output_item.done`; then `response.completed` (or `response.incomplete` at the
/// length limit) with the whole response.
struct Events {
    shell: Shell,
    sequence: u64,
    started: bool,
    /// The items so far; the last one is open while `open`.
    items: Vec<Value>,
    open: bool,
    incomplete: bool,
    /// Log-probabilities of tokens whose text has not come yet.
    logprobs: Vec<Value>,
}

impl Events {
    fn event(&mut self, name: &str, mut data: Value) -> SseEvent {
        data["type"] = json!(name);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        SseEvent::default().event(name).data(data.to_string())
    }

    /// Ends the open item: its `.done` events and `response.output_item.done`.
    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if !self.open {
            return;
        }
        self.open = false;
        let index = self.items.len() - 1;
        let item = &mut self.items[index];
        item["status"] = json!("completed");
        if item["type"] == "message" {
            // The last tokens' log-probabilities, whose text never came (an unfinished character).
            let pending = std::mem::take(&mut self.logprobs);
            if let Some(all) = item["content"][0]["logprobs"].as_array_mut() {
                all.extend(pending);
            }
        }
        let item = item.clone();
        let id = item["id"].clone();
        if item["type"] == "message" {
            let part = item["content"][0].clone();
            let e = self.event(
                "response.output_text.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "text": part["text"], "logprobs": part["logprobs"]}),
            );
            out.push(e);
            let e = self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
            out.push(e);
        } else {
            let e = self.event(
                "response.function_call_arguments.done",
                json!({"item_id": id, "output_index": index, "name": item["name"], "arguments": item["arguments"]}),
            );
            out.push(e);
        }
        let e = self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
    }

    /// Opens a new item (closing the open one).
    fn open(&mut self, item: Value, out: &mut Vec<SseEvent>) -> usize {
        self.close(out);
        self.items.push(item.clone());
        self.open = true;
        let index = self.items.len() - 1;
        let e = self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        out.push(e);
        index
    }

    fn chunk(&mut self, chunk: ChatCompletionChunk) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            let shell = self.shell.response("in_progress", vec![], Value::Null, None);
            let e = self.event("response.created", json!({"response": shell}));
            out.push(e);
            let e = self.event("response.in_progress", json!({"response": shell}));
            out.push(e);
        }
        for mut choice in chunk.choices {
            if let Some(l) = choice.logprobs.take() {
                self.logprobs.extend(logprob_values(&l.content));
            }
            if let Some(text) = choice.delta.content.take().filter(|t| !t.is_empty()) {
                let open_message = self.open && self.items.last().is_some_and(|i| i["type"] == "message");
                let index = match open_message {
                    true => self.items.len() - 1,
                    false => {
                        let item = json!({"type": "message", "id": random_id("msg"), "status": "in_progress",
                            "role": "assistant", "content": []});
                        let index = self.open(item, &mut out);
                        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
                        self.items[index]["content"] = json!([part.clone()]);
                        let id = self.items[index]["id"].clone();
                        let e = self.event(
                            "response.content_part.added",
                            json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                        );
                        out.push(e);
                        index
                    }
                };
                if let Value::String(so_far) = &mut self.items[index]["content"][0]["text"] {
                    so_far.push_str(&text);
                }
                // The log-probabilities of the tokens this text completes (with `include` or
                // `top_logprobs`): a token that ends within a character comes without text.
                let logprobs: Vec<Value> = std::mem::take(&mut self.logprobs);
                if let Some(all) = self.items[index]["content"][0]["logprobs"].as_array_mut() {
                    all.extend(logprobs.iter().cloned());
                }
                let id = self.items[index]["id"].clone();
                let e = self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": text, "logprobs": logprobs}),
                );
                out.push(e);
            }
            for call in choice.delta.tool_calls.unwrap_or_default() {
                let open_call = self.open && self.items.last().is_some_and(|i| i["type"] == "function_call");
                let index = match (&call.id, open_call) {
                    (None, true) => self.items.len() - 1,
                    _ => {
                        let item = json!({"type": "function_call", "id": random_id("fc"),
                            "call_id": call.id.clone().unwrap_or_default(),
                            "name": call.function.name.clone().unwrap_or_default(), "arguments": "",
                            "status": "in_progress"});
                        self.open(item, &mut out)
                    }
                };
                if let Some(args) = call.function.arguments.filter(|a| !a.is_empty()) {
                    if let Value::String(so_far) = &mut self.items[index]["arguments"] {
                        so_far.push_str(&args);
                    }
                    let id = self.items[index]["id"].clone();
                    let e = self.event(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": index, "delta": args}),
                    );
                    out.push(e);
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.close(&mut out);
                self.incomplete |= reason == "length";
            }
        }
        if let Some(u) = chunk.usage {
            self.close(&mut out);
            let (status, name, incomplete) = match self.incomplete {
                true => ("incomplete", "response.incomplete", Some("max_output_tokens")),
                false => ("completed", "response.completed", None),
            };
            let response = self.shell.response(status, self.items.clone(), usage(&u), incomplete);
            let e = self.event(name, json!({"response": response}));
            out.push(e);
        }
        out
    }
}

#[utoipa::path(
    post,
    path = "/v1/responses",
    request_body(content = Object, description = "OpenAI's Responses request: `model`, `input` (a string, or message, `function_call` and `function_call_output` items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `text.format`, `tools` (functions), `tool_choice`, `parallel_tool_calls`, `stream`"),
    responses(
        (status = 200, description = "The `response` object, or with `stream: true` Server-Sent Events of its typed events (`response.created` ... `response.completed`)",
            content((Object = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "OpenAI's error, naming the field (`previous_response_id` and `background` among them: this server keeps no responses)"),
        (status = 401, description = "No valid API key"),
    )
)]
pub async fn responses(
    State(state): State<Arc<AppState>>,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let body: Map<String, Value> = parse_body(body, &[])?;
    let request = chat_request(&body)?;
    let run = super::chat::start(&state, request).await?;
    let shell = Shell {
        id: random_id("resp"),
        created_at: super::now(),
        model: run.model.clone(),
        body,
    };
    if !run.valid.stream {
        return Ok(Json(whole(&shell, run.whole(&state).await?)).into_response());
    }
    let mut events = Events {
        shell,
        sequence: 0,
        started: false,
        items: Vec::new(),
        open: false,
        incomplete: false,
        logprobs: Vec::new(),
    };
    let sse = named_sse(run.chunks(&state), move |chunk| match chunk {
        Ok(chunk) => events.chunk(chunk),
        Err(e) => {
            let error = json!({"code": e.body().error.code, "message": e.to_string()});
            vec![events.event("error", error)]
        }
    });
    Ok(sse.into_response())
}
