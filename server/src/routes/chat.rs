//! `POST /v1/chat/completions`: OpenAI's chat completions, whole or streamed, through the chat
//! template ([`crate::chat`]) and the completions path.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::Stream;

use crate::api::*;
use crate::chat;
use crate::engine::{EventSource, ValidRequest};
use crate::error::responses::{BodyTooLarge, InvalidRequest, QueueFull, Unauthorized, UnknownModel};
use crate::error::ApiError;
use crate::fold::Delta;
use crate::respond::{chunk_stream, collect, sse};
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
    ModelRequest(request): ModelRequest<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    let run = start(&state, request).await?;
    if run.valid.stream {
        Ok(sse(run.chunks(&state)).into_response())
    } else {
        Ok(Json(run.whole(&state).await?).into_response())
    }
}

/// A chat request validated, rendered with the chat template and tokenised: the completion
/// request the engine runs, and the tool calls' plan. Each protocol that speaks chat (OpenAI's
/// chat completions and Responses, Anthropic's Messages, Ollama's chat) comes through here.
pub async fn prepare(
    state: &Arc<AppState>,
    mut request: ChatCompletionRequest,
) -> Result<(ValidRequest, Option<tools::Mode>), ApiError> {
    let used_max_completion_tokens = request.max_completion_tokens.is_some();
    let adapter = state.adapter_for(request.model.as_deref())?;
    let state2 = state.clone();
    // Rendering and tokenising are CPU work: off the async runtime.
    let (mut valid, mode) = blocking(move || {
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
    valid.adapter = adapter;
    Ok((valid, mode))
}

/// A chat request under way in the engine, with what its responses are made of.
pub struct ChatRun {
    pub valid: Arc<ValidRequest>,
    pub events: EventSource,
    /// The tool calls' plan, when the request offered tools.
    pub mode: Option<tools::Mode>,
    /// The assistant's prefilled start, echoed (vLLM's `echo`).
    pub echo: Option<String>,
    pub id: String,
    pub created: u64,
    /// The name the response gives the model (an adapter's, or the served name).
    pub model: String,
}

/// [`prepare`]s the request and submits it to the engine.
pub async fn start(state: &Arc<AppState>, request: ChatCompletionRequest) -> Result<ChatRun, ApiError> {
    let echo = chat::echoed(&request);
    let (valid, mode) = prepare(state, request).await?;
    let valid = Arc::new(valid);
    let events = state.engine.submit(valid.clone())?;
    Ok(ChatRun {
        id: super::response_id("chatcmpl", valid.request_id.as_deref()),
        created: super::now(),
        model: state.served_name(valid.adapter.as_deref()),
        valid,
        events,
        mode,
        echo,
    })
}

impl ChatRun {
    /// The whole chat completion, once every choice has ended.
    pub async fn whole(self, state: &AppState) -> Result<ChatCompletion, ApiError> {
        let (mut choices, usage) = collect(self.valid, self.events, state.metrics.clone()).await?;
        // One prompt, so every choice carries the same; vLLM puts them on the response.
        let prompt_logprobs = choices.first_mut().and_then(|c| c.prompt_logprobs.take()).flatten();
        Ok(ChatCompletion {
            id: self.id,
            object: "chat.completion".into(),
            created: self.created,
            model: self.model,
            choices: (choices.into_iter())
                .map(|c| chat::chat_choice(c, self.echo.as_deref(), self.mode.as_ref()))
                .collect(),
            usage,
            prompt_logprobs,
            system_fingerprint: state.fingerprint.clone(),
        })
    }

    /// The chunks of the streamed chat completion as they come: each choice's role, its text or
    /// tool calls' deltas, the usage if asked for; an error, last, if generation fails midway.
    pub fn chunks(
        self,
        state: &AppState,
    ) -> impl Stream<Item = Result<ChatCompletionChunk, ApiError>> + Send + 'static {
        let chunk = ChatCompletionChunk {
            id: self.id,
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model,
            choices: Vec::new(),
            usage: None,
            system_fingerprint: state.fingerprint.clone(),
        };
        let with =
            |choices: Vec<ChatChunkChoice>, c: &ChatCompletionChunk| ChatCompletionChunk { choices, ..c.clone() };
        let choices = self.valid.prompts.len() * self.valid.n;
        let echo = self.echo;
        let first = (0..choices as u32)
            .map(|i| with(vec![chat::role_chunk(i, echo.as_deref())], &chunk))
            .collect();
        let usage_chunk = chunk.clone();
        // Under tools, each choice's stream so far.
        let mut streams: Vec<tools::StreamedChoice> = (0..choices).map(|_| Default::default()).collect();
        let mode = self.mode;
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
        chunk_stream(self.valid, self.events, state.metrics.clone(), first, chunks, usage)
    }
}
