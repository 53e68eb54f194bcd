//! Routes: `POST /v1/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`,
//! `GET /openapi.json`. `app(state)` builds the router, so tests drive it without a socket.

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
use utoipa::OpenApi;

use crate::api::*;
use crate::engine::{Engine, Event};
use crate::error::ApiError;
use crate::metrics::Metrics;
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
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "gpt-server",
        description = "OpenAI-compatible completions for GPT checkpoints"
    ),
    paths(completions, models, health),
    components(schemas(
        CompletionRequest,
        Completion,
        Choice,
        LogProbs,
        Usage,
        ModelList,
        Model,
        ErrorResponse,
        ErrorDetail,
        Health
    ))
)]
struct ApiDoc;

pub fn app(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi))
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(state.body_limit))
        .with_state(state)
}

/// `Authorization: Bearer KEY` on `/v1/*` when the server has an API key.
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
        (status = 200, description = "The completion, or with `stream: true` Server-Sent Events of `Completion` chunks ending with `data: [DONE]`", body = Completion),
        (status = 400, description = "Invalid request", body = ErrorResponse),
        (status = 401, description = "Missing or wrong API key", body = ErrorResponse),
        (status = 404, description = "Unknown model", body = ErrorResponse),
        (status = 413, description = "Body too large", body = ErrorResponse),
        (status = 503, description = "Queue full; see Retry-After", body = ErrorResponse),
    )
)]
async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(request) = body.map_err(rejection)?;
    if let Some(model) = &request.model {
        if model != &state.model_name {
            return Err(ApiError::ModelNotFound(model.clone()));
        }
    }
    // Tokenising is CPU work: off the async runtime.
    let (tokenizer, limits) = (state.tokenizer.clone(), state.limits.clone());
    let valid = tokio::task::spawn_blocking(move || validate(request, &tokenizer, &limits))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let events = state.engine.submit(valid.clone()).map_err(ApiError::QueueFull)?;
    let id = format!("cmpl-{:016x}", rand::random::<u64>());
    if valid.stream {
        Ok(stream_response(state, valid, id, events).into_response())
    } else {
        Ok(Json(collect(state, valid, id, events).await?).into_response())
    }
}

fn logprobs_of(items: &[crate::engine::TokenLogprob]) -> LogProbs {
    let mut lp = LogProbs::default();
    for t in items {
        lp.tokens.push(t.token.clone());
        lp.token_logprobs.push(t.logprob);
        lp.top_logprobs
            .push((!t.top.is_empty() || t.logprob.is_some()).then(|| {
                // Most likely first; tokens that decode to the same text keep the likelier entry.
                let mut top = serde_json::Map::new();
                for (tok, p) in &t.top {
                    top.entry(tok.clone()).or_insert_with(|| serde_json::Value::from(*p));
                }
                top
            }));
        lp.text_offset.push(t.offset);
    }
    lp
}

fn append_logprobs(into: &mut Option<LogProbs>, more: LogProbs) {
    let lp = into.get_or_insert_with(LogProbs::default);
    lp.tokens.extend(more.tokens);
    lp.token_logprobs.extend(more.token_logprobs);
    lp.top_logprobs.extend(more.top_logprobs);
    lp.text_offset.extend(more.text_offset);
}

/// Waits for every choice and builds the whole response.
async fn collect(
    state: Arc<AppState>,
    req: ValidRequest,
    id: String,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> Result<Completion, ApiError> {
    let mut choices: Vec<Choice> = (0..req.n)
        .map(|index| Choice {
            text: if req.echo {
                req.prompt_text.clone()
            } else {
                String::new()
            },
            index: index as u32,
            logprobs: req.logprobs.map(|_| LogProbs::default()),
            finish_reason: None,
        })
        .collect();
    let mut completion_tokens = 0;
    let mut done = 0;
    while done < req.n {
        match events.recv().await {
            Some(Event::Text { index, text, logprobs }) => {
                choices[index].text.push_str(&text);
                if req.logprobs.is_some() {
                    append_logprobs(&mut choices[index].logprobs, logprobs_of(&logprobs));
                }
            }
            Some(Event::Done {
                index,
                finish_reason,
                completion_tokens: n,
            }) => {
                choices[index].finish_reason = Some(finish_reason.as_str().into());
                completion_tokens += n;
                done += 1;
            }
            Some(Event::Error(e)) => return Err(ApiError::Internal(e)),
            None => return Err(ApiError::ShuttingDown),
        }
    }
    Ok(Completion {
        id,
        object: "text_completion".into(),
        created: now(),
        model: state.model_name.clone(),
        choices,
        usage: Some(usage(req.prompt.len(), completion_tokens)),
    })
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Usage {
    Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
    }
}

/// Server-Sent Events: one chunk per engine event, an error event if generation fails midway,
/// the usage chunk if asked for, then `[DONE]`.
fn stream_response(
    state: Arc<AppState>,
    req: ValidRequest,
    id: String,
    events: mpsc::UnboundedReceiver<Event>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let created = now();
    let chunk = {
        let (id, model) = (id.clone(), state.model_name.clone());
        move |choices: Vec<Choice>, usage: Option<Usage>| Completion {
            id: id.clone(),
            object: "text_completion".into(),
            created,
            model: model.clone(),
            choices,
            usage,
        }
    };
    let data = |c: &Completion| SseEvent::default().data(serde_json::to_string(c).unwrap_or_default());
    let echo: Vec<Result<SseEvent, Infallible>> = if req.echo {
        (0..req.n)
            .map(|index| {
                let choice = Choice {
                    text: req.prompt_text.clone(),
                    index: index as u32,
                    logprobs: None,
                    finish_reason: None,
                };
                Ok(data(&chunk(vec![choice], None)))
            })
            .collect()
    } else {
        vec![]
    };
    let (n, prompt_tokens, include_usage, want_logprobs) =
        (req.n, req.prompt.len(), req.include_usage, req.logprobs.is_some());
    let chunk_for_events = chunk.clone();
    let mut finished = 0;
    let mut completion_tokens = 0;
    // Ends when the engine drops the request's last sender, after its last choice.
    let body = UnboundedReceiverStream::new(events)
        .map(move |event| {
            let (choice, error) = match event {
                Event::Text { index, text, logprobs } => (
                    Choice {
                        text,
                        index: index as u32,
                        logprobs: want_logprobs.then(|| logprobs_of(&logprobs)),
                        finish_reason: None,
                    },
                    None,
                ),
                Event::Done {
                    index,
                    finish_reason,
                    completion_tokens: c,
                } => {
                    finished += 1;
                    completion_tokens += c;
                    (
                        Choice {
                            text: String::new(),
                            index: index as u32,
                            logprobs: None,
                            finish_reason: Some(finish_reason.as_str().into()),
                        },
                        None,
                    )
                }
                Event::Error(e) => {
                    finished = n; // nothing more will come
                    let body = ApiError::Internal(e).body();
                    (
                        Choice {
                            text: String::new(),
                            index: 0,
                            logprobs: None,
                            finish_reason: None,
                        },
                        Some(body),
                    )
                }
            };
            let mut out = vec![match error {
                Some(body) => Ok(SseEvent::default()
                    .event("error")
                    .data(serde_json::to_string(&body).unwrap_or_default())),
                None => Ok(data(&chunk_for_events(vec![choice], None))),
            }];
            if finished >= n {
                if include_usage {
                    out.push(Ok(data(&chunk_for_events(
                        vec![],
                        Some(usage(prompt_tokens, completion_tokens)),
                    ))));
                }
                out.push(Ok(SseEvent::default().data("[DONE]")));
            }
            stream::iter(out)
        })
        .flatten();
    Sse::new(stream::iter(echo).chain(body)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

#[utoipa::path(get, path = "/v1/models", responses((status = 200, body = ModelList)))]
async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![Model {
            id: state.model_name.clone(),
            object: "model".into(),
            created: state.created,
            owned_by: "gpt-rs".into(),
        }],
    })
}

#[utoipa::path(get, path = "/health", responses((status = 200, body = Health)))]
async fn health(State(state): State<Arc<AppState>>) -> Json<Health> {
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

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}
