//! `POST /v1/embeddings` (OpenAI's shape, as vLLM and llama.cpp's server offer it): each input's
//! embedding, the model's final hidden state at the input's last position, L2-normalised
//! ([`gpt::Gpt::embeddings`]: the pooling of vLLM and of the decoder embedding models for causal
//! decoders). Floats, or base64 of their little-endian bytes. Ollama's `/api/embed` shares
//! [`embed`].

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use candle_core::Tensor;
use serde_json::json;

use crate::api::{EmbeddingRequest, EmbeddingResponse, Prompt};
use crate::error::ApiError;
use crate::state::{blocking, AppState, ModelRequest};

/// Inputs per request at most (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// One input, as text or token ids.
pub enum Input {
    Text(String),
    Tokens(Vec<i64>),
}

/// The inputs of an OpenAI `input` field.
fn inputs(prompt: Prompt) -> Vec<Input> {
    match prompt {
        Prompt::Text(t) => vec![Input::Text(t)],
        Prompt::Texts(ts) => ts.into_iter().map(Input::Text).collect(),
        Prompt::Tokens(ids) => vec![Input::Tokens(ids)],
        Prompt::TokenLists(lists) => lists.into_iter().map(Input::Tokens).collect(),
    }
}

/// The embeddings of `inputs` under `model` (the served model or one of its adapters), and the
/// tokens they held; `truncate`: an input longer than the context keeps its first tokens
/// (Ollama's default) rather than being refused. `param` names the input field in errors.
pub async fn embed(
    state: &Arc<AppState>,
    model: Option<&str>,
    inputs: Vec<Input>,
    truncate: bool,
    param: &'static str,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    if inputs.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("{param}: at least one input is required"),
        ));
    }
    if inputs.len() > MAX_INPUTS {
        return Err(ApiError::invalid(
            param,
            format!("{param}: {} inputs; at most {MAX_INPUTS} a request", inputs.len()),
        ));
    }
    let adapter = state.adapter_for(model)?;
    let state = state.clone();
    // Tokenising and the forward passes are CPU work: off the async runtime.
    blocking(move || {
        let limits = &state.limits;
        let internal = |e: gpt::Error| ApiError::Internal(e.to_string());
        let model = state.model_for(adapter.as_deref())?;
        let (mut out, mut tokens) = (Vec::with_capacity(inputs.len()), 0);
        for (i, input) in inputs.into_iter().enumerate() {
            let at = format!("{param}[{i}]");
            let mut ids: Vec<u32> = match input {
                Input::Text(text) => state
                    .tokenizer
                    .encode_prompt(&text)
                    .map_err(|e| ApiError::invalid(param, format!("{at}: {e}")))?,
                Input::Tokens(ids) => ids
                    .iter()
                    .enumerate()
                    .map(|(j, &id)| limits.token(param, &format!("{at}[{j}]"), id))
                    .collect::<Result<_, _>>()?,
            };
            if ids.is_empty() {
                return Err(ApiError::invalid(param, format!("{at}: empty: nothing to embed")));
            }
            if ids.len() > limits.context {
                match truncate {
                    true => ids.truncate(limits.context),
                    false => {
                        return Err(ApiError::ContextLength {
                            message: format!(
                                "{at} has {} tokens, more than the model's context of {}",
                                ids.len(),
                                limits.context
                            ),
                            param,
                        })
                    }
                }
            }
            tokens += ids.len();
            let idx = Tensor::new(ids.as_slice(), model.device())
                .and_then(|t| t.unsqueeze(0))
                .map_err(|e| internal(e.into()))?;
            let e = model.embeddings(&idx).map_err(internal)?;
            out.push(
                e.flatten_all()
                    .and_then(|e| e.to_vec1::<f32>())
                    .map_err(|e| internal(e.into()))?,
            );
        }
        Ok((out, tokens))
    })
    .await
}

#[utoipa::path(
    post,
    path = "/v1/embeddings",
    request_body = EmbeddingRequest,
    responses(
        (status = 200, description = "`{\"object\": \"list\", \"data\": [{\"object\": \"embedding\", \"index\", \"embedding\"}], \"model\", \"usage\"}`: each input's final hidden state at its last token, L2-normalised", body = EmbeddingResponse),
        (status = 400, description = "A bad input, naming it; `dimensions` other than the model's; an input longer than the context"),
        (status = 401, description = "No valid API key"),
        (status = 404, description = "Another model"),
    )
)]
pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    ModelRequest(request): ModelRequest<EmbeddingRequest>,
) -> Result<Response, ApiError> {
    let width = state.attention_model.config().n_embd;
    if let Some(d) = request.dimensions.filter(|&d| d != width as i64) {
        return Err(ApiError::invalid(
            "dimensions",
            format!("dimensions: {d}; this model's embeddings have {width} and cannot be shortened"),
        ));
    }
    let base64 = match request.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("encoding_format {other:?}: expected float or base64"),
            ))
        }
    };
    let adapter = state.adapter_for(request.model.as_deref())?;
    let (vectors, tokens) = embed(&state, request.model.as_deref(), inputs(request.input), false, "input").await?;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = match base64 {
                true => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
                false => json!(v),
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(Json(EmbeddingResponse {
        object: "list".into(),
        data,
        model: state.served_name(adapter.as_deref()),
        usage: json!({"prompt_tokens": tokens, "total_tokens": tokens}),
    })
    .into_response())
}
