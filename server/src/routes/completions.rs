//! `POST /v1/completions`: OpenAI's completions, whole or streamed.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::Stream;

use crate::api::*;
use crate::engine::EventSource;
use crate::engine::ValidRequest;
use crate::error::responses::{BodyTooLarge, InvalidRequest, QueueFull, Unauthorized, UnknownModel};
use crate::error::ApiError;
use crate::fold::Delta;
use crate::respond::{chunk_stream, collect, sse};
use crate::state::{blocking, AppState, ModelRequest};
use crate::validation::validate;

#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or with `stream: true` Server-Sent Events of `Completion` chunks ending with `data: [DONE]`",
            content((Completion = "application/json"), (String = "text/event-stream"))),
        InvalidRequest,
        Unauthorized,
        UnknownModel,
        BodyTooLarge,
        QueueFull,
    )
)]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    ModelRequest(request): ModelRequest<CompletionRequest>,
) -> Result<Response, ApiError> {
    let run = start(&state, request).await?;
    if run.valid.stream {
        Ok(sse(run.chunks(&state)).into_response())
    } else {
        Ok(Json(run.whole(&state).await?).into_response())
    }
}

/// A completions request under way in the engine (Ollama's raw `/api/generate` comes through
/// here too).
pub struct CompletionRun {
    pub valid: Arc<ValidRequest>,
    pub events: EventSource,
    /// The response's fields but its choices and usage.
    pub completion: Completion,
}

/// Validates (tokenising, off the async runtime) and submits a completions request.
pub async fn start(state: &Arc<AppState>, request: CompletionRequest) -> Result<CompletionRun, ApiError> {
    let adapter = state.adapter_for(request.model.as_deref())?;
    let state2 = state.clone();
    let mut valid =
        blocking(move || validate(request, &state2.tokenizer, &state2.limits, &state2.grammars, None)).await?;
    valid.adapter = adapter;
    let valid = Arc::new(valid);
    let events = state.engine.submit(valid.clone())?;
    let completion = Completion {
        id: super::response_id("cmpl", valid.request_id.as_deref()),
        object: "text_completion".into(),
        created: super::now(),
        model: state.served_name(valid.adapter.as_deref()),
        choices: Vec::new(),
        usage: None,
        system_fingerprint: state.fingerprint.clone(),
    };
    Ok(CompletionRun {
        valid,
        events,
        completion,
    })
}

impl CompletionRun {
    /// The whole completion, once every choice has ended.
    pub async fn whole(self, state: &AppState) -> Result<Completion, ApiError> {
        let (choices, usage) = collect(self.valid, self.events, state.metrics.clone()).await?;
        Ok(Completion {
            choices,
            usage: Some(usage),
            ..self.completion
        })
    }

    /// The completion's chunks as they come: one per delta, the usage if asked for.
    pub fn chunks(self, state: &AppState) -> impl Stream<Item = Result<Completion, ApiError>> + Send + 'static {
        let completion = self.completion;
        let usage_chunk = completion.clone();
        let chunk = move |d: Delta| {
            vec![Completion {
                choices: vec![Choice {
                    text: d.text,
                    index: d.index,
                    logprobs: d.logprobs,
                    prompt_logprobs: None,
                    finish_reason: d.finish_reason.map(|r| r.as_str().into()),
                    stop_reason: d.stop_reason.as_ref().map(crate::engine::StopReason::to_json),
                }],
                ..completion.clone()
            }]
        };
        let usage = move |u| Completion {
            usage: Some(u),
            ..usage_chunk.clone()
        };
        chunk_stream(self.valid, self.events, state.metrics.clone(), Vec::new(), chunk, usage)
    }
}
