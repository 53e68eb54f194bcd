//! `POST /v1/attention`: the attention probabilities of every (or the selected) layer and head
//! over a prompt, from the model's own forward pass ([`gpt::Gpt::forward_with_attentions`]), for
//! the playground's heatmap and anyone studying the model.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use candle_core::{IndexOp, Tensor};

use crate::api::{AttentionRequest, AttentionResponse, Prompt};
use crate::error::responses::{BodyTooLarge, InvalidRequest, Unauthorized, UnknownModel};
use crate::error::ApiError;
use crate::state::{blocking, AppState, ModelRequest};

/// The longest prompt (tokens) the endpoint takes: its answer grows with the square of it.
pub const MAX_ATTENTION_TOKENS: usize = 256;

/// The indices `given` (all of `0..count` by default), each checked against `count`.
fn select(param: &str, given: Option<Vec<i64>>, count: usize) -> Result<Vec<usize>, ApiError> {
    let Some(given) = given else {
        return Ok((0..count).collect());
    };
    if given.is_empty() {
        return Err(ApiError::invalid(
            param,
            format!("{param} must not be empty (leave it out for all)"),
        ));
    }
    given
        .iter()
        .enumerate()
        .map(|(i, &v)| match usize::try_from(v) {
            Ok(v) if v < count => Ok(v),
            _ => Err(ApiError::invalid(
                param,
                format!("{param}[{i}] must be between 0 and {}, got {v}", count - 1),
            )),
        })
        .collect()
}

fn compute(state: &AppState, req: AttentionRequest) -> Result<AttentionResponse, ApiError> {
    let limits = &state.limits;
    let cap = limits.max_attention_tokens;
    let req_model = req.model.clone();
    let ids: Vec<u32> = match req.prompt {
        Prompt::Text(text) if !text.is_empty() => state
            .tokenizer
            .encode_prompt(&text)
            .map_err(|e| ApiError::invalid("prompt", format!("prompt: {e}")))?,
        Prompt::Tokens(ids) if !ids.is_empty() => ids
            .iter()
            .enumerate()
            .map(|(i, &id)| limits.token("prompt", &format!("prompt[{i}]"), id))
            .collect::<Result<_, _>>()?,
        Prompt::Text(_) | Prompt::Tokens(_) => return Err(ApiError::invalid("prompt", "prompt must not be empty")),
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt must be a string or an array of token ids (one prompt)",
            ))
        }
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt encodes to no tokens"));
    }
    if ids.len() > cap {
        return Err(ApiError::ContextLength {
            message: format!(
                "prompt has {} tokens, but /v1/attention takes at most {cap}: shorten it",
                ids.len()
            ),
            param: "prompt",
        });
    }
    let layers = select("layers", req.layers, limits.n_layer)?;
    let heads = select("heads", req.heads, limits.n_head)?;
    let internal = |e: gpt::Error| ApiError::Internal(e.to_string());
    // A LoRA adapter's model: the base's weights shared, its updates added.
    let model = state.model_for(state.adapter_for(req_model.as_deref())?.as_deref())?;
    let input = Tensor::new(ids.as_slice(), model.device())
        .and_then(|t| t.unsqueeze(0))
        .map_err(|e| internal(e.into()))?;
    let (_, all) = model.forward_with_attentions(&input).map_err(internal)?;
    let mut attentions = Vec::with_capacity(layers.len());
    for &l in &layers {
        let layer = all[l].i(0).map_err(|e| internal(e.into()))?; // (heads, T, T)
        let mut per_head = Vec::with_capacity(heads.len());
        for &h in &heads {
            per_head.push(
                layer
                    .i(h)
                    .and_then(|m| m.to_vec2::<f32>())
                    .map_err(|e| internal(e.into()))?,
            );
        }
        attentions.push(per_head);
    }
    let tokens = ids
        .iter()
        .map(|&id| state.tokenizer.decode(&[id]).map_err(internal))
        .collect::<Result<_, _>>()?;
    Ok(AttentionResponse {
        tokens,
        token_ids: ids,
        layers,
        heads,
        attentions,
    })
}

#[utoipa::path(
    post,
    path = "/v1/attention",
    request_body = AttentionRequest,
    responses(
        (status = 200, body = AttentionResponse),
        InvalidRequest,
        Unauthorized,
        UnknownModel,
        BodyTooLarge,
    )
)]
pub async fn attention(
    State(state): State<Arc<AppState>>,
    ModelRequest(req): ModelRequest<AttentionRequest>,
) -> Result<Json<AttentionResponse>, ApiError> {
    // A forward pass: CPU (or GPU) work, off the async runtime.
    let response = blocking(move || compute(&state, req)).await?;
    Ok(Json(response))
}
