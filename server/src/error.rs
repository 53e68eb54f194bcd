//! One error type for the HTTP layer, mapped to OpenAI's JSON error shape and a status code.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::{ErrorDetail, ErrorResponse};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// A prompt longer than the model's context (OpenAI's `context_length_exceeded`); the
    /// parameter that holds it (`prompt`, or chat's `messages`).
    #[error("{message}")]
    ContextLength { message: String, param: &'static str },
    #[error("{0}")]
    Unauthorized(String),
    #[error("The model `{0}` does not exist")]
    ModelNotFound(String),
    /// Something else a request names that the server does not have (an adapter to unload).
    #[error("{message}")]
    NotFound { message: String, param: &'static str },
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("the server is at capacity ({0} requests queued); retry shortly")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The engine thread failed (it panicked, or its steps kept failing) before the request ended.
    #[error("the model failed while serving this request; the server is restarting")]
    EngineFailed,
    /// The request ran past `--request-timeout-secs`.
    #[error("the request ran past the server's time limit (--request-timeout-secs) and was stopped")]
    Timeout,
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidRequest { .. } | ApiError::ContextLength { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::QueueFull(_) | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) | ApiError::EngineFailed => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Timeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    pub fn body(&self) -> ErrorResponse {
        let (kind, code, param) = match self {
            ApiError::InvalidRequest { param, .. } => ("invalid_request_error", None, param.clone()),
            ApiError::ContextLength { param, .. } => (
                "invalid_request_error",
                Some("context_length_exceeded"),
                Some(param.to_string()),
            ),
            ApiError::Unauthorized(_) => ("invalid_request_error", Some("invalid_api_key"), None),
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found"), Some("model".into())),
            ApiError::NotFound { param, .. } => ("invalid_request_error", Some("not_found"), Some(param.to_string())),
            ApiError::PayloadTooLarge(_) => ("invalid_request_error", Some("payload_too_large"), None),
            ApiError::QueueFull(_) | ApiError::ShuttingDown => ("server_error", Some("overloaded"), None),
            ApiError::Internal(_) => ("server_error", None, None),
            ApiError::EngineFailed => ("server_error", Some("engine_failed"), None),
            ApiError::Timeout => ("server_error", Some("timeout"), None),
        };
        ErrorResponse {
            error: ErrorDetail {
                message: self.to_string(),
                kind: kind.into(),
                param,
                code: code.map(str::to_string),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        if matches!(self, ApiError::QueueFull(_) | ApiError::ShuttingDown) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

impl From<crate::engine::Refused> for ApiError {
    fn from(r: crate::engine::Refused) -> Self {
        match r {
            crate::engine::Refused::QueueFull(n) => ApiError::QueueFull(n),
            crate::engine::Refused::Failed => ApiError::EngineFailed,
        }
    }
}

impl From<crate::adapters::AdapterError> for ApiError {
    fn from(e: crate::adapters::AdapterError) -> Self {
        use crate::adapters::AdapterError;
        match e {
            AdapterError::NotLoaded(_) => ApiError::NotFound {
                message: e.to_string(),
                param: "lora_name",
            },
            AdapterError::Load { .. } => ApiError::invalid("lora_path", e.to_string()),
            AdapterError::Exists(_) | AdapterError::BaseName(_) | AdapterError::EmptyName => {
                ApiError::invalid("lora_name", e.to_string())
            }
        }
    }
}

impl From<gpt::Error> for ApiError {
    fn from(e: gpt::Error) -> Self {
        match e {
            gpt::Error::UnknownCharacter { .. } | gpt::Error::Tokenize(_) => ApiError::invalid("prompt", e.to_string()),
            gpt::Error::ChatTemplate { param, reason } => ApiError::invalid(param, reason),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

/// The error responses the endpoints document, each declared once here for the OpenAPI
/// document (`responses(..., InvalidRequest, Unauthorized, ...)` in each route's `utoipa::path`);
/// every body is an [`ErrorResponse`].
pub mod responses {
    use utoipa::IntoResponses;

    use crate::api::ErrorResponse;

    #[derive(IntoResponses)]
    #[response(status = 400, description = "Invalid request")]
    pub struct InvalidRequest(pub ErrorResponse);

    #[derive(IntoResponses)]
    #[response(status = 401, description = "Missing or wrong API key")]
    pub struct Unauthorized(pub ErrorResponse);

    #[derive(IntoResponses)]
    #[response(status = 404, description = "Unknown model")]
    pub struct UnknownModel(pub ErrorResponse);

    #[derive(IntoResponses)]
    #[response(status = 413, description = "Body too large")]
    pub struct BodyTooLarge(pub ErrorResponse);

    #[derive(IntoResponses)]
    #[response(status = 503, description = "Queue full; see Retry-After")]
    pub struct QueueFull(pub ErrorResponse);
}
