//! vLLM's tokenizer endpoints, `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`,
//! in its request and response shapes: lm-evaluation-harness detects them and then tokenizes
//! with the server's own tokenizer (no Hugging Face download; character-level checkpoints work).

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use gpt::tokenizer::END_OF_TEXT;

use crate::api::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse, TokenizerInfo};
use crate::error::responses::{BodyTooLarge, InvalidRequest, UnknownModel};
use crate::error::ApiError;
use crate::state::{blocking, AppState, ModelRequest};

#[utoipa::path(
    post,
    path = "/tokenize",
    request_body = TokenizeRequest,
    responses(
        (status = 200, body = TokenizeResponse),
        InvalidRequest,
        UnknownModel,
        BodyTooLarge,
    )
)]
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    ModelRequest(req): ModelRequest<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let (tokenizer, max_model_len) = (state.tokenizer.clone(), state.limits.context);
    let response = blocking(move || {
        let tokens = tokenizer
            .encode_prompt(&req.prompt)
            .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
        // As vLLM: the vocabulary's own strings (GPT-2's byte-level `Ġ` for a space, say).
        let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
            tokens
                .iter()
                .map(|&id| tokenizer.inner().id_to_token(id).unwrap_or_default())
                .collect()
        });
        Ok(TokenizeResponse {
            count: tokens.len(),
            max_model_len,
            tokens,
            token_strs,
        })
    })
    .await?;
    Ok(Json(response))
}

#[utoipa::path(
    post,
    path = "/detokenize",
    request_body = DetokenizeRequest,
    responses(
        (status = 200, body = DetokenizeResponse),
        InvalidRequest,
        UnknownModel,
        BodyTooLarge,
    )
)]
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    ModelRequest(req): ModelRequest<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let vocab = state.limits.vocab_size;
    let ids = req
        .tokens
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            u32::try_from(id)
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tokens",
                        format!("tokens[{i}]: token id {id} is outside the vocabulary [0, {vocab})"),
                    )
                })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    let tokenizer = state.tokenizer.clone();
    let prompt = blocking(move || Ok(tokenizer.decode(&ids)?)).await?;
    Ok(Json(DetokenizeResponse { prompt }))
}

#[utoipa::path(get, path = "/tokenizer_info", responses((status = 200, body = TokenizerInfo)))]
pub async fn tokenizer_info(State(state): State<Arc<AppState>>) -> Json<TokenizerInfo> {
    // GPT-2's convention: `<|endoftext|>` both ends and begins a text.
    let eot = state.tokenizer.eos_token_id().map(|_| END_OF_TEXT.to_string());
    Json(TokenizerInfo {
        tokenizer_class: "PreTrainedTokenizerFast".into(),
        eos_token: eot.clone(),
        bos_token: eot,
        pad_token: None,
        unk_token: None,
        model_max_length: state.limits.context,
        vocab_size: state.limits.vocab_size,
        chat_template: Some(state.chat_template.source.clone()),
    })
}
