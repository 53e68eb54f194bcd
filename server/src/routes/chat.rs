//! `POST /v1/chat/completions`: OpenAI's chat completions, whole or streamed, through the chat
//! template ([`crate::chat`]) and the completions path.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::*;
use crate::chat;
use crate::error::responses::{BodyTooLarge, InvalidRequest, QueueFull, Unauthorized, UnknownModel};
use crate::error::ApiError;
use crate::fold::Delta;
use crate::respond::{collect, stream_response};
use crate::state::{blocking, AppState, ModelRequest};
use crate::tools;
use crate::validation::{validate, validate_chat};

#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The chat completion, or with `stream: true` Server-Sent Events of `ChatCompletionChunk`s ending with `data: [DONE]`",
            content((ChatCompletion = "application/json"), (String = "text/event-stream"))),
        InvalidRequest,
        Unauthorized,
        UnknownModel,
        BodyTooLarge,
        QueueFull,
    )
)]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    ModelRequest(mut request): ModelRequest<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let used_max_completion_tokens = request.max_completion_tokens.is_some();
    let echo = chat::echoed(&request);
    let adapter = state.adapter_for(request.model.as_deref())?;
    let state2 = state.clone();
    // Rendering and tokenising are CPU work: off the async runtime.
    let valid = blocking(move || {
        validate_chat(&request, &state2.limits)?;
        let own;
        let template = match request.chat_template.take() {
            Some(source) => {
                own = state2.chat_template.with_source(&source)?;
                &own
            }
            None => &state2.chat_template,
        };
        let options = chat::render_options(&mut request);
        let tools = tools::plan(
            request.tools.as_deref(),
            request.tool_choice.as_ref(),
            request.parallel_tool_calls,
        )?;
        let prompt = template.render_with(&chat::messages(&request.messages), &options)?;
        let completion = chat::completion_request(request, prompt, &template.stop, state2.limits.max_tokens_cap)?;
        // The template's stop strings come on top of the request's own.
        let mut limits = state2.limits.clone();
        limits.template_stops = template.stop.len();
        let (mode, requested) = tools.unzip();
        let valid = validate(completion, &state2.tokenizer, &limits, &state2.grammars, requested)
            .map_err(|e| chat::chat_error(e, used_max_completion_tokens))?;
        Ok((valid, mode))
    })
    .await?;
    let (mut valid, mode) = valid;
    valid.adapter = adapter;
    let valid = Arc::new(valid);
    let events = state.engine.submit(valid.clone())?;
    let (id, created, model) = (
        super::response_id("chatcmpl", valid.request_id.as_deref()),
        super::now(),
        state.served_name(valid.adapter.as_deref()),
    );
    let system_fingerprint = state.fingerprint.clone();
    if valid.stream {
        let chunk = ChatCompletionChunk {
            id,
            object: "chat.completion.chunk".into(),
            created,
            model,
            choices: Vec::new(),
            usage: None,
            system_fingerprint,
        };
        let with =
            |choices: Vec<ChatChunkChoice>, c: &ChatCompletionChunk| ChatCompletionChunk { choices, ..c.clone() };
        let choices = valid.prompts.len() * valid.n;
        let first = (0..choices as u32)
            .map(|i| with(vec![chat::role_chunk(i, echo.as_deref())], &chunk))
            .collect();
        let usage_chunk = chunk.clone();
        // Under tools, each choice's stream so far.
        let mut streams: Vec<tools::StreamedChoice> = (0..choices).map(|_| Default::default()).collect();
        let chunks = move |d: Delta| {
            let stream = streams.get_mut(d.index as usize);
            chat::chat_chunks(d, mode.as_ref().zip(stream))
                .into_iter()
                .map(|c| with(vec![c], &chunk))
                .collect()
        };
        let usage = move |u| ChatCompletionChunk {
            usage: Some(u),
            ..usage_chunk.clone()
        };
        Ok(stream_response(valid, events, state.metrics.clone(), first, chunks, usage).into_response())
    } else {
        let (mut choices, usage) = collect(valid, events, state.metrics.clone()).await?;
        // One prompt, so every choice carries the same; vLLM puts them on the response.
        let prompt_logprobs = choices.first_mut().and_then(|c| c.prompt_logprobs.take()).flatten();
        Ok(Json(ChatCompletion {
            id,
            object: "chat.completion".into(),
            created,
            model,
            choices: (choices.into_iter())
                .map(|c| chat::chat_choice(c, echo.as_deref(), mode.as_ref()))
                .collect(),
            usage,
            prompt_logprobs,
            system_fingerprint,
        })
        .into_response())
    }
}
