//! Routes: `POST /v1/completions`, `GET /v1/models`, the tokenizer endpoints (in [`tokenize`]),
//! `GET /health`, `GET /metrics`, `GET /openapi.json`. `app(state)` builds the router, so tests
//! drive it without a socket.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use gpt::Tokenizer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::*;
use crate::engine::{Engine, Event};
use crate::error::ApiError;
use crate::fold::{merge, Fold};
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
}

pub fn app(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(v1)
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
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
        if given != Some(key.as_str()) {
            let msg = "a valid API key is required: send `Authorization: Bearer <key>`";
            return ApiError::Unauthorized(msg.into()).into_response();
        }
    }
    next.run(request).await
}

async fn count_requests(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let counted = request.uri().path() == "/v1/completions";
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

/// A request's `model`, if given, must be the served one.
pub fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.model_name => Err(ApiError::ModelNotFound(m.to_string())),
        _ => Ok(()),
    }
}

/// Parses a JSON body into `T`, refusing fields that the server knows but does not implement by
/// name (`suffix`, say), and any other unknown field.
pub fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<T, ApiError> {
    let Json(value) = body.map_err(rejection)?;
    if let Some(field) = value
        .as_object()
        .and_then(|o| UNSUPPORTED.iter().find(|f| o.contains_key(**f)))
    {
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
    let request: CompletionRequest = parse_body(body)?;
    check_model(&state, request.model.as_deref())?;
    // Tokenising is CPU work: off the async runtime.
    let (tokenizer, limits) = (state.tokenizer.clone(), state.limits.clone());
    let valid = tokio::task::spawn_blocking(move || validate(request, &tokenizer, &limits))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
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
        Ok(stream_response(valid, completion, events).into_response())
    } else {
        Ok(Json(collect(valid, completion, events).await?).into_response())
    }
}

/// Waits for every choice and builds the whole response.
async fn collect(
    req: Arc<ValidRequest>,
    mut completion: Completion,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> Result<Completion, ApiError> {
    let mut fold = Fold::new(req);
    let mut choices = fold.empty_choices();
    while !fold.is_done() {
        let event = events.recv().await.ok_or(ApiError::ShuttingDown)?;
        for delta in fold.apply(event)? {
            merge(&mut choices, delta);
        }
    }
    completion.choices = choices;
    completion.usage = Some(fold.usage());
    Ok(completion)
}

/// Server-Sent Events: a chunk per delta of the fold, an error event if generation fails midway,
/// the usage chunk if asked for, then `[DONE]`.
fn stream_response(
    req: Arc<ValidRequest>,
    completion: Completion,
    events: mpsc::UnboundedReceiver<Event>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let include_usage = req.include_usage;
    let mut fold = Fold::new(req);
    let mut ended = false;
    let data = |c: &Completion| SseEvent::default().data(serde_json::to_string(c).unwrap_or_default());
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
                        let chunk = Completion {
                            choices: vec![Choice {
                                text: d.text,
                                index: d.index,
                                logprobs: d.logprobs,
                                finish_reason: d.finish_reason.map(|r| r.as_str().into()),
                            }],
                            ..completion.clone()
                        };
                        out.push(Ok(data(&chunk)));
                    }
                    ended = fold.is_done();
                    if ended && include_usage {
                        let usage = Completion {
                            usage: Some(fold.usage()),
                            ..completion.clone()
                        };
                        out.push(Ok(data(&usage)));
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
    Sse::new(body).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
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
