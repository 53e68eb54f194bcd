//! `POST /v1/embeddings` (OpenAI's shape, as vLLM and llama.cpp's server offer it): each input's
//! embedding, the model's final hidden state at the input's last position, L2-normalised
//! ([`gpt::Gpt::embeddings`]: the pooling of vLLM and of the decoder embedding models for causal
//! decoders), computed by the engine in its steps beside the generations. Floats, or base64 of
//! their little-endian bytes. Ollama's `/api/embed` shares [`embed`].

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use serde_json::json;

use crate::api::{EmbeddingRequest, EmbeddingResponse, Prompt};
use crate::engine::{Event, ValidPrompt, ValidRequest};
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
/// (Ollama's default) rather than being refused. `param` names the input field in errors. The
/// inputs are tokenised off the async runtime and embedded by the engine, each a prefill in its
/// steps beside the generations (continuous batching, the queue's limits and timeouts as theirs).
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
    let shared = state.clone();
    let prompts = blocking(move || {
        let limits = &shared.limits;
        let mut prompts = Vec::with_capacity(inputs.len());
        for (i, input) in inputs.into_iter().enumerate() {
            let at = format!("{param}[{i}]");
            let mut ids: Vec<u32> = match input {
                Input::Text(text) => shared
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
            prompts.push(ValidPrompt {
                ids,
                text: String::new(),
            });
        }
        Ok(prompts)
    })
    .await?;
    let tokens = prompts.iter().map(|p| p.ids.len()).sum();
    let mut vectors: Vec<Option<Vec<f32>>> = vec![None; prompts.len()];
    let mut events = state
        .engine
        .submit(Arc::new(ValidRequest::embeddings(prompts, adapter)))?;
    let mut left = vectors.len();
    while left > 0 {
        match events.recv().await {
            Some(Event::Embedding { prompt, vector }) => {
                if let Some(slot) = vectors.get_mut(prompt).filter(|v| v.is_none()) {
                    *slot = Some(vector);
                    left -= 1;
                }
            }
            Some(Event::Error(e)) => return Err(ApiError::Internal(e)),
            Some(Event::TimedOut) => return Err(ApiError::Timeout),
            Some(_) => return Err(ApiError::Internal("a generation's event for an embedding".into())),
            // The engine dropped the request before its embeddings: its thread failed.
            None => return Err(ApiError::EngineFailed),
        }
    }
    Ok((vectors.into_iter().flatten().collect(), tokens))
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
