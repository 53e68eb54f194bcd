//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, the tokenizer
//! endpoints (in [`tokenize`]), `POST /v1/attention` (in [`crate::attention`]), `GET /health`, `GET /metrics`, `GET /openapi.json`. `app(state)`
//! builds the router, so tests drive it without a socket; around it, CORS (when origins are
//! given) and a log line per request with a request id.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use gpt::Tokenizer;
use serde::Serialize;
use subtle::ConstantTimeEq;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

use crate::api::*;
use crate::chat::{self, ChatTemplate};
use crate::engine::{Engine, Event};
use crate::error::ApiError;
use crate::fold::{merge, Delta, Fold};
use crate::metrics::Metrics;
use crate::tokenize;
use crate::validation::{validate, Limits, ValidRequest};

pub struct AppState {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub limits: Limits,
    pub model_name: String,
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
    pub body_limit: usize,
    pub created: u64,
    /// The OpenAPI document, with this model's limits.
    pub openapi: serde_json::Value,
    pub chat_template: ChatTemplate,
    /// The engine's model (its weights shared), for `/v1/attention`'s whole-prompt passes.
    pub attention_model: gpt::Gpt,
    /// Origins allowed to call the API from a browser (`*`: any); none by default.
    pub cors_origins: Vec<String>,
}

/// The response header that carries each request's id (also in its log line).
pub const REQUEST_ID: &str = "x-request-id";

pub fn app(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/attention", post(crate::attention::attention))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/", get(playground))
        .merge(v1)
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .layer(cors(&state.cors_origins))
        .layer(PropagateRequestIdLayer::new(HeaderName::from_static(REQUEST_ID)))
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(|request: &Request| {
                    let id = request
                        .headers()
                        .get(REQUEST_ID)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("-");
                    tracing::info_span!("request", id, method = %request.method(), path = %request.uri().path())
                })
                .on_request(())
                .on_response(DefaultOnResponse::new().level(Level::INFO)),
        )
        // Outermost: a client's own id is kept, otherwise a new one.
        .layer(SetRequestIdLayer::new(
            HeaderName::from_static(REQUEST_ID),
            MakeRequestUuid,
        ))
        .with_state(state)
}

/// CORS for the given origins (`*` for any): the methods and headers the API uses, the request id
/// readable by the page. No origin, no CORS headers: browsers then refuse cross-origin calls.
fn cors(origins: &[String]) -> CorsLayer {
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| HeaderValue::from_str(o).ok()))
    };
    if origins.is_empty() {
        return CorsLayer::new();
    }
    CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
        .expose_headers([HeaderName::from_static(REQUEST_ID)])
        .max_age(Duration::from_secs(3600))
}

/// `Authorization: Bearer KEY` on `/v1/*` when the server has an API key. (The tokenizer
/// endpoints stay open, as vLLM's do: lm-evaluation-harness probes them without a key.)
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // In constant time: how much of a guess matches must not show in the response time.
        let matches = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())));
        if !matches {
            let msg = "a valid API key is required: send `Authorization: Bearer <key>`";
            return ApiError::Unauthorized(msg.into()).into_response();
        }
    }
    next.run(request).await
}

async fn count_requests(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let counted = matches!(request.uri().path(), "/v1/completions" | "/v1/chat/completions");
    let response = next.run(request).await;
    if counted {
        state
            .metrics
            .requests
            .with_label_values(&[response.status().as_str()])
            .inc();
    }
    response
}

/// Runs CPU work (tokenising, rendering, a forward pass) off the async runtime.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
}

/// A request's `model`, if given, must be the served one.
pub fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.model_name => Err(ApiError::ModelNotFound(m.to_string())),
        _ => Ok(()),
    }
}

/// Parses a JSON body into `T`, refusing fields that the server knows but does not implement by
/// name (`suffix`, say; the `unsupported` list), and any other unknown field.
pub fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Json<serde_json::Value>, JsonRejection>,
    unsupported: &[&[&str]],
) -> Result<T, ApiError> {
    let Json(value) = body.map_err(rejection)?;
    if let Some(field) = value.as_object().and_then(|o| {
        unsupported
            .iter()
            .flat_map(|list| list.iter())
            .find(|f| o.contains_key(**f))
    }) {
        return Err(ApiError::invalid(
            *field,
            format!("`{field}` is not supported by this server"),
        ));
    }
    // The path names the parameter in the message ("temperature: invalid type ...").
    serde_path_to_error::deserialize(value).map_err(|e| {
        let param = e.path().iter().next().and_then(|s| match s {
            serde_path_to_error::Segment::Map { key } => Some(key.clone()),
            _ => None,
        });
        let (path, inner) = (e.path().to_string(), e.inner().to_string());
        let message = match param.as_deref() {
            Some(p) if !inner.starts_with(p) => format!("{path}: {inner}"),
            _ => inner,
        };
        ApiError::InvalidRequest { message, param }
    })
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Malformed JSON, wrong types and oversized bodies as OpenAI-shaped errors (axum's own
/// rejections are plain text).
fn rejection(e: JsonRejection) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge(format!("request body is larger than the limit: {}", e.body_text()))
    } else {
        ApiError::InvalidRequest {
            message: format!("invalid JSON body: {}", e.body_text()),
            param: None,
        }
    }
}

#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or with `stream: true` Server-Sent Events of `Completion` chunks ending with `data: [DONE]`",
            content((Completion = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorResponse),
        (status = 401, description = "Missing or wrong API key", body = ErrorResponse),
        (status = 404, description = "Unknown model", body = ErrorResponse),
        (status = 413, description = "Body too large", body = ErrorResponse),
        (status = 503, description = "Queue full; see Retry-After", body = ErrorResponse),
    )
)]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse_body(body, &[UNSUPPORTED])?;
    check_model(&state, request.model.as_deref())?;
    // Tokenising is CPU work: off the async runtime.
    let (tokenizer, limits) = (state.tokenizer.clone(), state.limits.clone());
    let valid = blocking(move || validate(request, &tokenizer, &limits)).await?;
    let valid = Arc::new(valid);
    let events = state.engine.submit(valid.clone()).map_err(ApiError::QueueFull)?;
    let id = format!("cmpl-{:016x}", rand::random::<u64>());
    let completion = Completion {
        id,
        object: "text_completion".into(),
        created: now(),
        model: state.model_name.clone(),
        choices: Vec::new(),
        usage: None,
    };
    if valid.stream {
        Ok(completion_stream(valid, completion, events).into_response())
    } else {
        let (choices, usage) = collect(valid, events).await?;
        Ok(Json(Completion {
            choices,
            usage: Some(usage),
            ..completion
        })
        .into_response())
    }
}

/// Waits for every choice: the whole choices and the usage.
async fn collect(
    req: Arc<ValidRequest>,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> Result<(Vec<Choice>, Usage), ApiError> {
    let mut fold = Fold::new(req);
    let mut choices = fold.empty_choices();
    while !fold.is_done() {
        let event = events.recv().await.ok_or(ApiError::ShuttingDown)?;
        for delta in fold.apply(event)? {
            merge(&mut choices, delta);
        }
    }
    Ok((choices, fold.usage()))
}

/// Server-Sent Events: the `first` chunks, then the chunks `chunks` makes of each delta of the
/// fold, an error event if generation fails midway, the chunk `usage` makes if the request asked
/// for it, then `[DONE]`.
fn stream_response<C: Serialize + Send + 'static>(
    req: Arc<ValidRequest>,
    events: mpsc::UnboundedReceiver<Event>,
    first: Vec<C>,
    mut chunks: impl FnMut(Delta) -> Vec<C> + Send + 'static,
    usage: impl Fn(Usage) -> C + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let include_usage = req.include_usage;
    let mut fold = Fold::new(req);
    let mut ended = false;
    let data = |c: &C| Ok(SseEvent::default().data(serde_json::to_string(c).unwrap_or_default()));
    let first = stream::iter(first.iter().map(data).collect::<Vec<_>>());
    // Ends when the engine drops the request's last sender, after its last choice.
    let body = UnboundedReceiverStream::new(events)
        .map(move |event| {
            let mut out: Vec<Result<SseEvent, Infallible>> = Vec::new();
            if ended {
                return stream::iter(out);
            }
            match fold.apply(event) {
                Ok(deltas) => {
                    for d in deltas {
                        out.extend(chunks(d).iter().map(data));
                    }
                    ended = fold.is_done();
                    if ended && include_usage {
                        out.push(data(&usage(fold.usage())));
                    }
                }
                Err(e) => {
                    ended = true;
                    out.push(Ok(SseEvent::default()
                        .event("error")
                        .data(serde_json::to_string(&e.body()).unwrap_or_default())));
                }
            }
            if ended {
                out.push(Ok(SseEvent::default().data("[DONE]")));
            }
            stream::iter(out)
        })
        .flatten();
    Sse::new(first.chain(body)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// The completions stream: a `Completion` chunk per delta.
fn completion_stream(
    req: Arc<ValidRequest>,
    completion: Completion,
    events: mpsc::UnboundedReceiver<Event>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let usage_chunk = completion.clone();
    let chunk = move |d: Delta| {
        vec![Completion {
            choices: vec![Choice {
                text: d.text,
                index: d.index,
                logprobs: d.logprobs,
                finish_reason: d.finish_reason.map(|r| r.as_str().into()),
            }],
            ..completion.clone()
        }]
    };
    let usage = move |u| Completion {
        usage: Some(u),
        ..usage_chunk.clone()
    };
    stream_response(req, events, Vec::new(), chunk, usage)
}

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The chat completion, or with `stream: true` Server-Sent Events of `ChatCompletionChunk`s ending with `data: [DONE]`",
            content((ChatCompletion = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorResponse),
        (status = 401, description = "Missing or wrong API key", body = ErrorResponse),
        (status = 404, description = "Unknown model", body = ErrorResponse),
        (status = 413, description = "Body too large", body = ErrorResponse),
        (status = 503, description = "Queue full; see Retry-After", body = ErrorResponse),
    )
)]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let request: ChatCompletionRequest = parse_body(body, &[UNSUPPORTED, UNSUPPORTED_CHAT])?;
    check_model(&state, request.model.as_deref())?;
    let used_max_completion_tokens = request.max_completion_tokens.is_some();
    let state2 = state.clone();
    // Rendering and tokenising are CPU work: off the async runtime.
    let valid = blocking(move || {
        let template = &state2.chat_template;
        let prompt = template.render(&request.messages)?;
        let completion = chat::completion_request(request, prompt, &template.stop, state2.limits.max_tokens_cap)?;
        // The template's stop strings come on top of the request's own.
        let mut limits = state2.limits.clone();
        limits.max_stop += template.stop.len();
        validate(completion, &state2.tokenizer, &limits).map_err(|e| chat::chat_error(e, used_max_completion_tokens))
    })
    .await?;
    let valid = Arc::new(valid);
    let events = state.engine.submit(valid.clone()).map_err(ApiError::QueueFull)?;
    let (id, created, model) = (
        format!("chatcmpl-{:016x}", rand::random::<u64>()),
        now(),
        state.model_name.clone(),
    );
    if valid.stream {
        let chunk = ChatCompletionChunk {
            id,
            object: "chat.completion.chunk".into(),
            created,
            model,
            choices: Vec::new(),
            usage: None,
        };
        let with =
            |choices: Vec<ChatChunkChoice>, c: &ChatCompletionChunk| ChatCompletionChunk { choices, ..c.clone() };
        let choices = valid.prompts.len() * valid.n;
        let first = (0..choices as u32)
            .map(|i| with(vec![chat::role_chunk(i)], &chunk))
            .collect();
        let usage_chunk = chunk.clone();
        let chunks = move |d: Delta| {
            chat::chat_chunks(d)
                .into_iter()
                .map(|c| with(vec![c], &chunk))
                .collect()
        };
        let usage = move |u| ChatCompletionChunk {
            usage: Some(u),
            ..usage_chunk.clone()
        };
        Ok(stream_response(valid, events, first, chunks, usage).into_response())
    } else {
        let (choices, usage) = collect(valid, events).await?;
        Ok(Json(ChatCompletion {
            id,
            object: "chat.completion".into(),
            created,
            model,
            choices: choices.into_iter().map(chat::chat_choice).collect(),
            usage,
        })
        .into_response())
    }
}

#[utoipa::path(get, path = "/v1/models", responses(
    (status = 200, body = ModelList),
    (status = 401, description = "Missing or wrong API key", body = ErrorResponse),
))]
pub async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![Model {
            id: state.model_name.clone(),
            object: "model".into(),
            created: state.created,
            owned_by: "gpt-rs".into(),
            max_model_len: state.limits.context,
        }],
    })
}

/// The playground page, compiled into the binary (no JavaScript build step), with what it needs
/// to know about the served model.
const PLAYGROUND: &str = include_str!("../static/playground.html");

async fn playground(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let config = serde_json::json!({
        "model": state.model_name,
        "context": state.limits.context,
        "n_layer": state.limits.n_layer,
        "n_head": state.limits.n_head,
        "max_tokens_cap": state.limits.max_tokens_cap,
        "max_attention_tokens": state.limits.max_attention_tokens,
        "api_key_required": state.api_key.is_some(),
    });
    // `<` escaped: the JSON sits in a <script> element.
    let config = config.to_string().replace('<', "\\u003c");
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        PLAYGROUND.replacen("/*CONFIG*/null", &config, 1),
    )
}

#[utoipa::path(get, path = "/health", responses((status = 200, body = Health)))]
pub async fn health(State(state): State<Arc<AppState>>) -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        model: state.model_name.clone(),
    })
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

async fn openapi(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(state.openapi.clone())
}
