//! What every handler shares: the server's state, and the opening of every request to the model
//! (the JSON body parsed into its type with unknown and unsupported fields refused by name, its
//! `model` checked) as one axum extractor, [`ModelRequest`]; and [`blocking`] for CPU work.

use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::Json;
use gpt::Tokenizer;

use crate::api::{
    self, AttentionRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
};
use crate::engine::Engine;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::validation::Limits;
use gpt::chat::ChatTemplate;

pub struct AppState {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub limits: Limits,
    pub model_name: String,
    pub api_key: Option<String>,
    /// Required on `/metrics` when set.
    pub metrics_key: Option<String>,
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
    /// Responses' `system_fingerprint`.
    pub fingerprint: String,
    /// Structured outputs' grammars, compiled against this tokenizer (and cached).
    pub grammars: Arc<crate::engine::constraint::Grammars>,
    /// LoRA adapters served beside the model, each a model name of its own.
    pub adapters: Arc<crate::adapters::Adapters>,
    /// The routes that load and unload adapters are mounted.
    pub runtime_lora_updating: bool,
}

impl AppState {
    /// The adapter a request's `model` names: `None` for the base model (or no `model`), a 404
    /// for a name that is neither the base's nor a loaded adapter's.
    pub fn adapter_for(&self, model: Option<&str>) -> Result<Option<Arc<crate::adapters::ServedAdapter>>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.model_name => Ok(None),
            Some(m) => self
                .adapters
                .get(m)
                .map(Some)
                .ok_or_else(|| ApiError::ModelNotFound(m.to_string())),
        }
    }

    /// The name responses give for a request with `adapter`.
    /// The model for passes outside the engine (the attention view): the served
    /// one, or with an adapter's updates added (the base's weights shared).
    pub fn model_for(
        &self,
        adapter: Option<&crate::adapters::ServedAdapter>,
    ) -> Result<std::borrow::Cow<'_, gpt::Gpt>, ApiError> {
        let Some(served) = adapter else {
            return Ok(std::borrow::Cow::Borrowed(&self.attention_model));
        };
        let mut model = self.attention_model.clone();
        model
            .set_adapter(Some(&served.adapter))
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        Ok(std::borrow::Cow::Owned(model))
    }

    pub fn served_name(&self, adapter: Option<&crate::adapters::ServedAdapter>) -> String {
        adapter.map_or_else(|| self.model_name.clone(), |a| a.name.clone())
    }
}

/// A request body that names the model it is for.
pub trait RequestBody: serde::de::DeserializeOwned {
    /// Fields the server knows but does not implement, refused by name (`suffix`, say).
    const UNSUPPORTED: &'static [&'static [(&'static str, &'static str)]] = &[];

    /// The `model` the request names, if any.
    fn model(&self) -> Option<&str>;
}

/// The body of a request to the model, parsed into `T` and for the served model or one of its
/// adapters: a 400 that names the field for malformed JSON, a wrong type, an unknown or
/// unsupported field; a 413 for a body over the limit; a 404 for another model.
pub struct ModelRequest<T>(pub T);

impl<T: RequestBody> FromRequest<Arc<AppState>> for ModelRequest<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let body = Json::<serde_json::Value>::from_request(req, state).await;
        let parsed: T = parse_body(body, T::UNSUPPORTED)?;
        state.adapter_for(parsed.model())?;
        Ok(Self(parsed))
    }
}

/// Runs CPU work (tokenising, rendering, a forward pass) off the async runtime.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
}

/// Parses a JSON body into `T`, refusing fields that the server knows but does not implement by
/// name (`suffix`, say; the `unsupported` list), and any other unknown field.
pub(crate) fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Json<serde_json::Value>, JsonRejection>,
    unsupported: &[&[(&str, &str)]],
) -> Result<T, ApiError> {
    let Json(value) = body.map_err(rejection)?;
    // (serde's derived structs would also take an array of the fields in order.)
    if !value.is_object() {
        return Err(ApiError::InvalidRequest {
            message: format!("the request body must be a JSON object, got {}", json_kind(&value)),
            param: None,
        });
    }
    if let Some((field, why)) = value.as_object().and_then(|o| {
        unsupported
            .iter()
            .flat_map(|list| list.iter())
            .find(|(f, _)| o.contains_key(*f))
    }) {
        return Err(ApiError::invalid(
            *field,
            format!("`{field}` is not supported by this server: {why}"),
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

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
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

/// Each request type names its model, and what it knows but does not implement.
macro_rules! request_body {
    ($($t:ty $(=> $unsupported:expr)?),* $(,)?) => {$(
        impl RequestBody for $t {
            $(const UNSUPPORTED: &'static [&'static [(&'static str, &'static str)]] = $unsupported;)?
            fn model(&self) -> Option<&str> {
                self.model.as_deref()
            }
        }
    )*};
}

request_body!(
    CompletionRequest => &[api::UNSUPPORTED],
    ChatCompletionRequest => &[api::UNSUPPORTED, api::UNSUPPORTED_CHAT],
    AttentionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    api::EmbeddingRequest,
);
