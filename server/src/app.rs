//! The router: every route mounted on its handler ([`crate::routes`]; the adapter-loading ones
//! only with `--allow-runtime-lora-updating`), and the middleware around them (the API key on
//! `/v1/*`, request counts, the body limit, CORS when origins are given, a
//! log line per request with a request id). `app(state)` builds it, so tests drive it without a
//! socket.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderName, HeaderValue, Method};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use subtle::ConstantTimeEq;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;

use crate::error::ApiError;
use crate::routes::{attention, chat, completions, embeddings, info, lora, messages, ollama, responses, tokenize};
pub use crate::state::AppState;

/// The response header that carries each request's id (also in its log line).
pub const REQUEST_ID: &str = "x-request-id";

pub fn app(state: Arc<AppState>) -> Router {
    // Everything that reads the model needs the API key when the server has one.
    let mut keyed = Router::new()
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(ollama::embed_route))
        .route("/api/embeddings", post(ollama::embeddings_legacy))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/ps", get(ollama::ps))
        .route("/api/version", get(ollama::version))
        .route("/api/pull", post(ollama::not_here))
        .route("/api/push", post(ollama::not_here))
        .route("/api/create", post(ollama::not_here))
        .route("/api/copy", post(ollama::not_here))
        .route("/api/delete", axum::routing::delete(ollama::not_here))
        .route("/v1/messages", post(messages::messages))
        .route("/v1/messages/count_tokens", post(messages::count_tokens))
        .route("/v1/attention", post(attention::attention))
        .route("/v1/models", get(info::models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/tokenizer_info", get(tokenize::tokenizer_info));
    if state.runtime_lora_updating {
        keyed = keyed
            .route("/v1/load_lora_adapter", post(lora::load_lora_adapter))
            .route("/v1/unload_lora_adapter", post(lora::unload_lora_adapter));
    }
    let keyed = keyed.route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    let metrics = Router::new()
        .route("/metrics", get(info::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize_metrics));
    Router::new()
        .route("/", get(info::playground))
        .merge(keyed)
        .merge(metrics)
        .route("/health", get(info::health))
        .route("/openapi.json", get(info::openapi))
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
        .allow_headers([
            header::AUTHORIZATION,
            header::CONTENT_TYPE,
            HeaderName::from_static("x-api-key"),
            HeaderName::from_static("anthropic-version"),
        ])
        .expose_headers([HeaderName::from_static(REQUEST_ID)])
        .max_age(Duration::from_secs(3600))
}

/// `Authorization: Bearer KEY` on every route that reads the model (`/v1/*` and the tokenizer
/// endpoints) when the server has an API key.
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    match refused(state.api_key.as_deref(), &request) {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}

/// `/metrics` with its own key (`--metrics-key`), open without one.
async fn authorize_metrics(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    match refused(state.metrics_key.as_deref(), &request) {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}

/// The 401 for a request without `key`, if one is required.
fn refused(key: Option<&str>, request: &Request) -> Option<Response> {
    let key = key?;
    let headers = request.headers();
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Anthropic's clients send `x-api-key` instead.
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    // In constant time: how much of a guess matches must not show in the response time.
    let matches = [bearer, x_api_key]
        .into_iter()
        .flatten()
        .any(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())));
    let msg = "a valid API key is required: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)";
    let refusal = ApiError::Unauthorized(msg.into());
    let path = request.uri().path();
    (!matches).then(|| {
        if path.starts_with("/v1/messages") {
            messages::AnthropicError(refusal).into_response()
        } else if path.starts_with("/api/") {
            ollama::OllamaError(refusal).into_response()
        } else {
            refusal.into_response()
        }
    })
}

/// The routes that run the model, each counted in `gpt_requests_total` by route and status.
const COUNTED_ROUTES: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/api/chat",
    "/api/generate",
    "/api/embed",
];

async fn count_requests(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = COUNTED_ROUTES.iter().find(|&&r| r == request.uri().path());
    let response = next.run(request).await;
    if let Some(route) = route {
        state
            .metrics
            .requests
            .with_label_values(&[route, response.status().as_str()])
            .inc();
    }
    response
}
