//! `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`: vLLM's endpoints for serving LoRA
//! adapters that were not named at start (mounted with `--allow-runtime-lora-updating`). Their
//! answers are vLLM's: a line of plain text on success, the JSON error body otherwise.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::Json;

use crate::api::{LoadLoraAdapterRequest, UnloadLoraAdapterRequest};
use crate::error::responses::{InvalidRequest, Unauthorized};
use crate::error::ApiError;
use crate::state::{blocking, parse_body, AppState};

#[utoipa::path(post, path = "/v1/load_lora_adapter", request_body = LoadLoraAdapterRequest, responses(
    (status = 200, description = "The adapter is served under its name", body = String),
    InvalidRequest,
    Unauthorized,
))]
pub async fn load_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<String, ApiError> {
    let req: LoadLoraAdapterRequest = parse_body(body, &[])?;
    let name = req.lora_name.clone();
    // Reading the files (or a download) and the tensors' conversion: off the async runtime.
    let adapters = state.adapters.clone();
    blocking(move || {
        adapters.load(&req.lora_name, &req.lora_path, req.load_inplace)?;
        Ok(())
    })
    .await?;
    Ok(format!("Success: LoRA adapter '{name}' added successfully."))
}

#[utoipa::path(post, path = "/v1/unload_lora_adapter", request_body = UnloadLoraAdapterRequest, responses(
    (status = 200, description = "The adapter is no longer served", body = String),
    InvalidRequest,
    Unauthorized,
    (status = 404, description = "No adapter of that name is loaded", body = crate::api::ErrorResponse),
))]
pub async fn unload_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Result<Json<serde_json::Value>, JsonRejection>,
) -> Result<String, ApiError> {
    let req: UnloadLoraAdapterRequest = parse_body(body, &[])?;
    state.adapters.unload(&req.lora_name, req.lora_int_id)?;
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        req.lora_name
    ))
}
