//! The server's own endpoints: `GET /v1/models`, `/health`, `/metrics`, `/openapi.json`, and the
//! playground page at `/`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;

use crate::api::*;
use crate::error::responses::Unauthorized;
use crate::state::AppState;

#[utoipa::path(get, path = "/v1/models", responses(
    (status = 200, body = ModelList),
    Unauthorized,
))]
pub async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let base = Model {
        id: state.model_name.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "gpt-rs".into(),
        max_model_len: state.limits.context,
        root: state.model_name.clone(),
        parent: None,
    };
    let adapters = state.adapters.list().into_iter().map(|a| Model {
        id: a.name.clone(),
        created: a.created,
        root: a.source.clone(),
        parent: Some(state.model_name.clone()),
        ..base.clone()
    });
    Json(ModelList {
        object: "list".into(),
        data: std::iter::once(base.clone()).chain(adapters).collect(),
    })
}

/// The playground page, compiled into the binary (no JavaScript build step), with what it needs
/// to know about the served model.
const PLAYGROUND: &str = include_str!("../../static/playground.html");

pub async fn playground(State(state): State<Arc<AppState>>) -> impl IntoResponse {
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

#[utoipa::path(get, path = "/health", responses((status = 200, body = Health), (status = 503, body = Health, description = "The engine failed; the process is exiting")))]
/// 200 while the engine serves; 503 once its thread has failed (the process is then exiting, for
/// its supervisor to restart it).
pub async fn health(State(state): State<Arc<AppState>>) -> (axum::http::StatusCode, Json<Health>) {
    let (code, status) = match state.engine.failed() {
        false => (axum::http::StatusCode::OK, "ok"),
        true => (axum::http::StatusCode::SERVICE_UNAVAILABLE, "failed"),
    };
    (
        code,
        Json(Health {
            status: status.into(),
            model: state.model_name.clone(),
        }),
    )
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

pub async fn openapi(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(state.openapi.clone())
}
