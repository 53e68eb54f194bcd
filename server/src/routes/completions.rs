//! `POST /v1/completions`: OpenAI's completions, whole or streamed.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::Stream;

use crate::api::*;
use crate::engine::EventSource;
use crate::engine::ValidRequest;
use crate::error::responses::{BodyTooLarge, InvalidRequest, QueueFull, Unauthorized, UnknownModel};
use crate::error::ApiError;
use crate::fold::Delta;
use crate::respond::{collect, stream_response};
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
    let adapter = state.adapter_for(request.model.as_deref())?;
    // Tokenising is CPU work: off the async runtime.
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
    if valid.stream {
        Ok(completion_stream(valid, completion, events, state.metrics.clone()).into_response())
    } else {
        let (choices, usage) = collect(valid, events, state.metrics.clone()).await?;
        Ok(Json(Completion {
            choices,
            usage: Some(usage),
            ..completion
        })
        .into_response())
    }
}

/// The completions stream: a `Completion` chunk per delta.
fn completion_stream(
    req: Arc<ValidRequest>,
    completion: Completion,
    events: EventSource,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
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
    stream_response(req, events, metrics, Vec::new(), chunk, usage)
}
