//! Ollama's API, so that the `ollama` client and what is built on it (Open WebUI, Continue,
//! LangChain's `ChatOllama`) find the served model: `/api/chat` and `/api/generate` (newline-
//! delimited JSON streams by default, `options` mapped to the sampler, `format` as `"json"` or a
//! schema, `tools`), `/api/embed` (and the older `/api/embeddings`), `/api/tags`, `/api/show`,
//! `/api/ps`, `/api/version`. Chat runs on the chat route's path ([`super::chat::start`]), raw
//! generation on the completions route's. What cannot apply to a server of one model
//! (`/api/pull`, `/api/create`, ...) answers with an error that says so. Every error is Ollama's
//! `{"error": "..."}`.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Map, Value};

use super::embeddings::{embed, Input};
use crate::api::{ChatCompletionRequest, CompletionRequest, Usage};
use crate::error::ApiError;
use crate::state::{parse_body, AppState, RequestBody};

/// The Ollama API version this server speaks (what `/api/version` reports: clients check it).
pub const OLLAMA_VERSION: &str = "0.12.0";

/// An [`ApiError`] in Ollama's shape, `{"error": "..."}`, with its status.
pub struct OllamaError(pub ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let (parts, _) = self.0.clone().into_response().into_parts();
        Response::from_parts(parts, Body::from(json!({"error": self.0.to_string()}).to_string()))
    }
}

type Result<T> = std::result::Result<T, OllamaError>;

/// A generation's text pieces as they come, with the finish reason where one ends, and the
/// usage at the end.
type Piece = (String, Option<String>, Option<Usage>);
type Pieces = std::pin::Pin<Box<dyn futures_util::Stream<Item = std::result::Result<Piece, ApiError>> + Send>>;

/// A request's body, whatever its `Content-Type` (Ollama's clients, and `curl -d` in its
/// documentation, send JSON without one).
type Body_ = std::result::Result<Bytes, BytesRejection>;

/// The body as a JSON object, or the error that says why not.
fn object(body: Body_) -> std::result::Result<Map<String, Value>, ApiError> {
    let bytes = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::PayloadTooLarge(format!("request body is larger than the limit: {e}"))
        }
        _ => ApiError::invalid("body", format!("the request body could not be read: {e}")),
    })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::invalid("body", "the request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid("body", format!("invalid JSON body: {e}"))),
    }
}

fn invalid(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(param, message)
}

/// Now as Ollama writes it (RFC 3339 with nanoseconds, UTC).
fn now() -> String {
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    chrono::DateTime::from_timestamp(since.as_secs() as i64, since.subsec_nanos())
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

/// The model a request names: Ollama's clients add the tag `:latest` to a name without one.
fn model_name(body: &Map<String, Value>) -> Option<String> {
    let name = body.get("model").or_else(|| body.get("name"))?.as_str()?;
    Some(name.strip_suffix(":latest").unwrap_or(name).to_string())
}

/// The served model's and its adapters' names.
fn names(state: &AppState) -> Vec<String> {
    let mut names = vec![state.model_name.clone()];
    names.extend(state.adapters.list().iter().map(|a| a.name.clone()));
    names
}

/// Ollama's `details` of a model.
fn details(state: &AppState) -> Value {
    let cfg = state.attention_model.config();
    let params = state.attention_model.num_parameters();
    let size = match params {
        p if p >= 1_000_000_000 => format!("{:.1}B", p as f64 / 1e9),
        p => format!("{}M", (p as f64 / 1e6).round()),
    };
    json!({"parent_model": "", "format": "gguf", "family": cfg.variant.family.model_type(),
        "families": [cfg.variant.family.model_type()], "parameter_size": size,
        "quantization_level": format!("{:?}", state.attention_model.dtype()).to_uppercase()})
}

/// The weights' bytes, about (parameters times the activations' width).
fn size(state: &AppState) -> usize {
    state.attention_model.num_parameters() * state.attention_model.dtype().size_in_bytes()
}

fn digest(state: &AppState) -> String {
    format!("{:0>64}", state.fingerprint.trim_start_matches("fp_"))
}

/// `GET /api/version`.
#[utoipa::path(
    get,
    path = "/api/version",
    responses(
        (status = 200, description = "`{\"version\"}`: the Ollama API version this server speaks", content_type = "application/json"),
    )
)]
pub async fn version() -> Json<Value> {
    Json(json!({"version": OLLAMA_VERSION}))
}

/// `GET /api/tags`: the served model and its adapters.
#[utoipa::path(
    get,
    path = "/api/tags",
    responses(
        (status = 200, description = "`{\"models\": [{name, model, modified_at, size, digest, details}]}`: the served model and its adapters", content_type = "application/json"),
    )
)]
pub async fn tags(State(state): State<Arc<AppState>>) -> Json<Value> {
    let modified = chrono::DateTime::from_timestamp(state.created as i64, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let models: Vec<Value> = names(&state)
        .into_iter()
        .map(|name| {
            json!({"name": name, "model": name, "modified_at": modified, "size": size(&state),
                "digest": digest(&state), "details": details(&state)})
        })
        .collect();
    Json(json!({"models": models}))
}

/// `GET /api/ps`: the models in memory (all of them, always).
#[utoipa::path(
    get,
    path = "/api/ps",
    responses(
        (status = 200, description = "`{\"models\": [...]}`: the models in memory", content_type = "application/json"),
    )
)]
pub async fn ps(State(state): State<Arc<AppState>>) -> Json<Value> {
    let models: Vec<Value> = names(&state)
        .into_iter()
        .map(|name| {
            json!({"name": name, "model": name, "size": size(&state), "digest": digest(&state),
                "details": details(&state), "expires_at": "2999-01-01T00:00:00Z",
                "size_vram": 0, "context_length": state.limits.context})
        })
        .collect();
    Json(json!({"models": models}))
}

/// `POST /api/show`: the model's details, its chat template, its shape and what it can do.
#[utoipa::path(
    post,
    path = "/api/show",
    request_body(content = Object, description = "`{\"model\"}`"),
    responses(
        (status = 200, description = "The model's details, chat template, `model_info` and `capabilities`", content_type = "application/json"),
        (status = 400, description = "`{\"error\": \"...\"}` naming the field"),
        (status = 404, description = "Another model"),
    )
)]
pub async fn show(State(state): State<Arc<AppState>>, body: Body_) -> Result<Json<Value>> {
    let body = object(body)?;
    state.adapter_for(model_name(&body).as_deref())?;
    let cfg = state.attention_model.config();
    let arch = cfg.variant.family.model_type();
    Ok(Json(json!({
        "license": "", "modelfile": "", "parameters": "", "template": state.chat_template.source,
        "details": details(&state),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": state.attention_model.num_parameters(),
            format!("{arch}.context_length"): state.limits.context,
            format!("{arch}.embedding_length"): cfg.n_embd,
            format!("{arch}.block_count"): cfg.n_layer,
            format!("{arch}.attention.head_count"): cfg.n_head,
            format!("{arch}.attention.head_count_kv"): cfg.n_kv_head(),
            format!("{arch}.vocab_size"): cfg.vocab_size,
        },
        "capabilities": ["completion", "tools", "embedding"],
        "modified_at": now(),
    })))
}

/// The routes of a server that pulls and builds models, which this one does not.
pub async fn not_here() -> Response {
    let message = "gpt-server serves the one model it was started with (and its LoRA adapters): it cannot pull, \
                   push, create, copy or delete models; start it with --checkpoint MODEL instead";
    (StatusCode::NOT_IMPLEMENTED, Json(json!({"error": message}))).into_response()
}

/// The sampler's settings of Ollama's `options` into `chat` (OpenAI's names; vLLM's extensions).
fn options(body: &Map<String, Value>, chat: &mut Map<String, Value>) -> std::result::Result<(), ApiError> {
    let Some(options) = body.get("options").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let options = options
        .as_object()
        .ok_or_else(|| invalid("options", "options: expected an object"))?;
    for (ours, theirs) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "seed"),
        ("stop", "stop"),
        ("repeat_penalty", "repetition_penalty"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
    ] {
        if let Some(v) = options.get(ours).filter(|v| !v.is_null()) {
            chat.insert(theirs.into(), v.clone());
        }
    }
    // num_predict: -1 (no limit) and -2 (fill the context) leave the server's cap.
    if let Some(n) = options.get("num_predict").filter(|v| !v.is_null()) {
        match n.as_i64() {
            Some(n) if n >= 0 => _ = chat.insert("max_tokens".into(), json!(n)),
            Some(-1 | -2) => {}
            _ => {
                return Err(invalid(
                    "options.num_predict",
                    format!("options.num_predict {n}: expected a count, -1 or -2"),
                ))
            }
        }
    }
    Ok(())
}

/// `format`: `"json"` or a JSON schema, as OpenAI's `response_format`.
fn format(body: &Map<String, Value>, chat: &mut Map<String, Value>) -> std::result::Result<(), ApiError> {
    match body.get("format") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) if s == "json" => {
            _ = chat.insert("response_format".into(), json!({"type": "json_object"}))
        }
        Some(schema @ Value::Object(_)) => {
            _ = chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}),
            )
        }
        Some(other) => {
            return Err(invalid(
                "format",
                format!("format {other}: expected \"json\" or a JSON schema"),
            ))
        }
    }
    Ok(())
}

/// The OpenAI chat messages of Ollama's: an assistant's `tool_calls` (arguments as objects) get
/// ids, and each `tool` message answers the next call not yet answered.
fn chat_messages(body: &Map<String, Value>) -> std::result::Result<Vec<Value>, ApiError> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| invalid("messages", "messages: required, a list of {role, content}"))?;
    let (mut out, mut calls, mut answered) = (Vec::new(), Vec::<String>::new(), 0);
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if m.get("images")
            .is_some_and(|v| !v.is_null() && v.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(invalid(
                &format!("{at}.images"),
                format!("{at}.images: this model reads text only"),
            ));
        }
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(_) => {
                return Err(invalid(
                    &format!("{at}.content"),
                    format!("{at}.content: expected a string"),
                ))
            }
        };
        match role {
            "system" | "user" => out.push(json!({"role": role, "content": content})),
            "assistant" => {
                let mut message = json!({"role": "assistant", "content": content});
                if let Some(list) = m.get("tool_calls").and_then(Value::as_array).filter(|l| !l.is_empty()) {
                    let mut tool_calls = Vec::new();
                    for (j, call) in list.iter().enumerate() {
                        let f = call.get("function").unwrap_or(&Value::Null);
                        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                            invalid(
                                &format!("{at}.tool_calls[{j}]"),
                                format!("{at}.tool_calls[{j}]: a call needs its function's name"),
                            )
                        })?;
                        let arguments = match f.get("arguments") {
                            Some(Value::String(s)) => s.clone(),
                            Some(v) => v.to_string(),
                            None => "{}".into(),
                        };
                        let id = format!("call_{}", calls.len());
                        calls.push(id.clone());
                        tool_calls.push(
                            json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}),
                        );
                    }
                    message["tool_calls"] = Value::Array(tool_calls);
                }
                out.push(message);
            }
            "tool" => {
                let mut message = json!({"role": "tool", "content": content});
                if let Some(id) = calls.get(answered) {
                    message["tool_call_id"] = json!(id);
                    answered += 1;
                }
                out.push(message);
            }
            other => {
                return Err(invalid(
                    &format!("{at}.role"),
                    format!("{at}.role {other:?}: expected system, user, assistant or tool"),
                ))
            }
        }
    }
    Ok(out)
}

/// The chat completion request of an `/api/chat` request, or of `/api/generate`'s prompt (with
/// its `system`) when not raw; streams by default, as Ollama does.
fn chat_request(
    body: &Map<String, Value>,
    messages: Vec<Value>,
) -> std::result::Result<ChatCompletionRequest, ApiError> {
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(model) = model_name(body) {
        chat.insert("model".into(), json!(model));
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(true);
    chat.insert("stream".into(), json!(stream));
    if stream {
        chat.insert("stream_options".into(), json!({"include_usage": true}));
    }
    options(body, &mut chat)?;
    format(body, &mut chat)?;
    // `tool_choice` is not Ollama's: this server's extension (OpenAI's forms), to force a call.
    for key in ["tools", "tool_choice"] {
        if let Some(v) = body.get(key).filter(|v| !v.is_null()) {
            chat.insert(key.into(), v.clone());
        }
    }
    parse_body(Ok(Json(Value::Object(chat))), ChatCompletionRequest::UNSUPPORTED)
}

/// What a reply's last line says of the run: why it ended, and Ollama's counts and durations
/// (nanoseconds; the prompt's share of the time is not measured apart and reads 0).
fn done_fields(finish: Option<&str>, usage: &Usage, started: Instant) -> Map<String, Value> {
    let total = started.elapsed().as_nanos() as u64;
    let reason = match finish {
        Some("length") => "length",
        _ => "stop",
    };
    let Value::Object(map) = json!({"done": true, "done_reason": reason, "total_duration": total,
        "load_duration": 0, "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": 0,
        "eval_count": usage.completion_tokens, "eval_duration": total})
    else {
        return Map::new();
    };
    map
}

/// A reply's last object: `reply` with [`done_fields`].
fn with_done(mut reply: Value, finish: Option<&str>, usage: &Usage, started: Instant) -> Value {
    if let Value::Object(map) = &mut reply {
        map.extend(done_fields(finish, usage, started));
    }
    reply
}

/// Ollama's tool calls (arguments as objects) of OpenAI's.
fn tool_calls(calls: &[(String, String)]) -> Vec<Value> {
    calls
        .iter()
        .map(|(name, args)| {
            let arguments: Value = serde_json::from_str(args).unwrap_or_else(|_| json!({}));
            json!({"function": {"name": name, "arguments": arguments}})
        })
        .collect()
}

/// A newline-delimited JSON response of `lines`, an error line if the stream fails midway.
fn ndjson(lines: impl futures_util::Stream<Item = Vec<Value>> + Send + 'static) -> Response {
    let body = lines.flat_map(|values| {
        stream::iter(
            values
                .into_iter()
                .map(|v| Ok::<_, std::convert::Infallible>(format!("{v}\n"))),
        )
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `POST /api/chat`.
#[utoipa::path(
    post,
    path = "/api/chat",
    request_body(content = Object, description = "Ollama's chat request: `model`, `messages` (system, user, assistant with `tool_calls`, tool), `tools`, `format` (`\"json\"` or a schema), `options`, `stream`"),
    responses(
        (status = 200, description = "The reply, or (the default, `stream` not false) newline-delimited JSON of its pieces, the last with `done: true` and the counts", content((Object = "application/json"), (String = "application/x-ndjson"))),
        (status = 400, description = "`{\"error\": \"...\"}` naming the field"),
        (status = 404, description = "Another model"),
    )
)]
pub async fn chat(State(state): State<Arc<AppState>>, body: Body_) -> Result<Response> {
    let started = Instant::now();
    let body = object(body)?;
    let request = chat_request(&body, chat_messages(&body)?)?;
    let run = super::chat::start(&state, request).await?;
    let model = run.model.clone();
    if !run.valid.stream {
        let done = run.whole(&state).await?;
        let choice = done.choices.into_iter().next();
        let (content, calls, finish) = match choice {
            Some(c) => (
                c.message.content.unwrap_or_default(),
                c.message
                    .tool_calls
                    .into_iter()
                    .map(|t| (t.function.name, t.function.arguments))
                    .collect::<Vec<_>>(),
                c.finish_reason,
            ),
            None => (String::new(), Vec::new(), None),
        };
        let mut message = json!({"role": "assistant", "content": content});
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(tool_calls(&calls));
        }
        let reply = with_done(
            json!({"model": model, "created_at": now(), "message": message}),
            finish.as_deref(),
            &done.usage,
            started,
        );
        return Ok(Json(reply).into_response());
    }
    // Calls come whole, in the line where they end (as Ollama sends them).
    let (mut calls, mut finish): (Vec<(String, String)>, Option<String>) = (Vec::new(), None);
    let lines = run.chunks(&state).map(move |chunk| {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(e) => return vec![json!({"error": e.to_string()})],
        };
        let mut out = Vec::new();
        for choice in chunk.choices {
            for call in choice.delta.tool_calls.unwrap_or_default() {
                if call.id.is_some() || calls.is_empty() {
                    calls.push((call.function.name.unwrap_or_default(), String::new()));
                }
                if let (Some(last), Some(args)) = (calls.last_mut(), call.function.arguments) {
                    last.1.push_str(&args);
                }
            }
            if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                out.push(json!({"model": model, "created_at": now(),
                    "message": {"role": "assistant", "content": text}, "done": false}));
            }
            if choice.finish_reason.is_some() {
                finish = choice.finish_reason;
                if !calls.is_empty() {
                    out.push(json!({"model": model, "created_at": now(),
                        "message": {"role": "assistant", "content": "", "tool_calls": tool_calls(&calls)}, "done": false}));
                }
            }
        }
        if let Some(usage) = chunk.usage {
            let last = with_done(json!({"model": model, "created_at": now(), "message": {"role": "assistant", "content": ""}}), finish.as_deref(), &usage, started);
            out.push(last);
        }
        out
    });
    Ok(ndjson(lines))
}

/// `POST /api/generate`: the prompt through the chat template (with `system`), or as it is with
/// `raw`; an empty prompt only loads the model, as Ollama's does.
#[utoipa::path(
    post,
    path = "/api/generate",
    request_body(content = Object, description = "Ollama's generate request: `model`, `prompt`, `system`, `raw`, `format`, `options`, `stream`"),
    responses(
        (status = 200, description = "The generation, or newline-delimited JSON of its pieces", content((Object = "application/json"), (String = "application/x-ndjson"))),
        (status = 400, description = "`{\"error\": \"...\"}` naming the field"),
        (status = 404, description = "Another model"),
    )
)]
pub async fn generate(State(state): State<Arc<AppState>>, body: Body_) -> Result<Response> {
    let started = Instant::now();
    let body = object(body)?;
    for (field, why) in [
        ("suffix", "fill-in-the-middle is not supported"),
        ("images", "this model reads text only"),
        (
            "context",
            "the deprecated context tokens are not kept; send the conversation to /api/chat",
        ),
        ("template", "the model's own chat template serves (or raw: true)"),
    ] {
        if body
            .get(field)
            .is_some_and(|v| !v.is_null() && v != "" && v.as_array().is_none_or(|a| !a.is_empty()))
        {
            return Err(invalid(field, format!("{field}: {why}")).into());
        }
    }
    let prompt = match body.get("prompt") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(invalid("prompt", "prompt: expected a string").into()),
    };
    let name = model_name(&body);
    let served = state.served_name(state.adapter_for(name.as_deref())?.as_deref());
    if prompt.is_empty() {
        return Ok(Json(
            json!({"model": served, "created_at": now(), "response": "", "done": true, "done_reason": "load"}),
        )
        .into_response());
    }
    let raw = body.get("raw").and_then(Value::as_bool) == Some(true);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(true);
    // Either way the engine streams; a whole reply is its pieces folded.
    let mut streamed = body.clone();
    streamed.insert("stream".into(), json!(true));
    let pieces: Pieces = if raw {
        let mut completion = Map::new();
        completion.insert("prompt".into(), json!(prompt));
        options(&body, &mut completion)?;
        format(&body, &mut completion)?;
        if let Some(n) = name {
            completion.insert("model".into(), json!(n));
        }
        completion
            .entry("max_tokens")
            .or_insert(json!(state.limits.max_tokens_cap));
        completion.insert("stream".into(), json!(true));
        completion.insert("stream_options".into(), json!({"include_usage": true}));
        let request: CompletionRequest =
            parse_body(Ok(Json(Value::Object(completion))), CompletionRequest::UNSUPPORTED)?;
        let run = super::completions::start(&state, request).await?;
        Box::pin(run.chunks(&state).map(|chunk| {
            chunk.map(|c| {
                let choice = c.choices.into_iter().next();
                let text = choice.as_ref().map(|c| c.text.clone()).unwrap_or_default();
                (text, choice.and_then(|c| c.finish_reason), c.usage)
            })
        }))
    } else {
        let mut messages = Vec::new();
        if let Some(system) = body.get("system").and_then(Value::as_str) {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        let run = super::chat::start(&state, chat_request(&streamed, messages)?).await?;
        Box::pin(run.chunks(&state).map(|chunk| {
            chunk.map(|c| {
                let choice = c.choices.into_iter().next();
                let text = choice
                    .as_ref()
                    .and_then(|c| c.delta.content.clone())
                    .unwrap_or_default();
                (text, choice.and_then(|c| c.finish_reason), c.usage)
            })
        }))
    };
    let model = served;
    if !stream {
        let (mut text, mut finish, mut usage) = (String::new(), None, Usage::default());
        let mut pieces = pieces;
        while let Some(piece) = pieces.next().await {
            let (more, reason, total) = piece?;
            text.push_str(&more);
            finish = reason.or(finish);
            usage = total.unwrap_or(usage);
        }
        let reply = with_done(
            json!({"model": model, "created_at": now(), "response": text}),
            finish.as_deref(),
            &usage,
            started,
        );
        return Ok(Json(reply).into_response());
    }
    let mut finish: Option<String> = None;
    let lines = pieces.map(move |piece| {
        let (text, reason, usage) = match piece {
            Ok(p) => p,
            Err(e) => return vec![json!({"error": e.to_string()})],
        };
        finish = reason.or(finish.take());
        let mut out = Vec::new();
        if !text.is_empty() {
            out.push(json!({"model": model, "created_at": now(), "response": text, "done": false}));
        }
        if let Some(usage) = usage {
            let last = with_done(
                json!({"model": model, "created_at": now(), "response": ""}),
                finish.as_deref(),
                &usage,
                started,
            );
            out.push(last);
        }
        out
    });
    Ok(ndjson(lines))
}

/// `POST /api/embed`: `input` a string or strings; `truncate` (default true) cuts an input to
/// the context rather than refusing it.
#[utoipa::path(
    post,
    path = "/api/embed",
    request_body(content = Object, description = "`{\"model\", \"input\": string or strings, \"truncate\"}`"),
    responses(
        (status = 200, description = "`{\"model\", \"embeddings\": [[...]], \"prompt_eval_count\", ...}`", content_type = "application/json"),
        (status = 400, description = "`{\"error\": \"...\"}` naming the field"),
        (status = 404, description = "Another model"),
    )
)]
pub async fn embed_route(State(state): State<Arc<AppState>>, body: Body_) -> Result<Json<Value>> {
    let started = Instant::now();
    let body = object(body)?;
    let inputs = match body.get("input") {
        Some(Value::String(s)) => vec![Input::Text(s.clone())],
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_str()
                    .map(|s| Input::Text(s.to_string()))
                    .ok_or_else(|| invalid("input", format!("input[{i}]: expected a string")))
            })
            .collect::<std::result::Result<_, _>>()?,
        _ => return Err(invalid("input", "input: required, a string or a list of strings").into()),
    };
    let width = state.attention_model.config().n_embd as u64;
    if let Some(d) = body
        .get("dimensions")
        .filter(|v| !v.is_null())
        .filter(|d| d.as_u64() != Some(width))
    {
        return Err(invalid(
            "dimensions",
            format!("dimensions {d}: this model's embeddings have {width}"),
        )
        .into());
    }
    let truncate = body.get("truncate").and_then(Value::as_bool).unwrap_or(true);
    let name = model_name(&body);
    let served = state.served_name(state.adapter_for(name.as_deref())?.as_deref());
    let (vectors, tokens) = embed(&state, name.as_deref(), inputs, truncate, "input").await?;
    Ok(Json(json!({"model": served, "embeddings": vectors,
        "total_duration": started.elapsed().as_nanos() as u64, "load_duration": 0, "prompt_eval_count": tokens})))
}

/// `POST /api/embeddings`, Ollama's older form: one `prompt`, one `embedding`.
pub async fn embeddings_legacy(State(state): State<Arc<AppState>>, body: Body_) -> Result<Json<Value>> {
    let body = object(body)?;
    let prompt = body
        .get("prompt")
        .and_then(Value::as_str)
        .ok_or_else(|| invalid("prompt", "prompt: required, a string"))?;
    let name = model_name(&body);
    let (mut vectors, _) = embed(
        &state,
        name.as_deref(),
        vec![Input::Text(prompt.to_string())],
        true,
        "prompt",
    )
    .await?;
    Ok(Json(json!({"embedding": vectors.pop().unwrap_or_default()})))
}
