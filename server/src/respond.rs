//! Engine events to responses: a whole response once every choice has ended ([`collect`]), or
//! Server-Sent Events as they come ([`stream_response`]), both through [`Fold`].

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Serialize;

use crate::api::{Choice, Usage};
use crate::engine::EventSource;
use crate::engine::ValidRequest;
use crate::error::ApiError;
use crate::fold::{merge, Delta, Fold};
use crate::metrics::Metrics;

/// Waits for every choice: the whole choices and the usage.
pub async fn collect(
    req: Arc<ValidRequest>,
    mut events: EventSource,
    metrics: &Metrics,
) -> Result<(Vec<Choice>, Usage), ApiError> {
    let mut fold = Fold::new(req);
    let mut choices = fold.empty_choices();
    while !fold.is_done() {
        // The engine dropped the request before its choices ended: its thread failed.
        let event = events.recv().await.ok_or(ApiError::EngineFailed)?;
        for delta in fold.apply(event)? {
            merge(&mut choices, delta);
        }
    }
    fold.fill_prompt_logprobs(&mut choices);
    let usage = fold.usage();
    metrics.completion_tokens.inc_by(usage.completion_tokens as u64);
    Ok((choices, usage))
}

/// A chunk of a stream, which can carry the usage so far (`continuous_usage_stats`).
pub trait Chunk: Serialize + Send + 'static {
    fn set_usage(&mut self, usage: Usage);
}

impl Chunk for crate::api::Completion {
    fn set_usage(&mut self, usage: Usage) {
        self.usage = Some(usage);
    }
}

impl Chunk for crate::api::ChatCompletionChunk {
    fn set_usage(&mut self, usage: Usage) {
        self.usage = Some(usage);
    }
}

/// Server-Sent Events: the `first` chunks, then the chunks `chunks` makes of each delta of the
/// fold, an error event if generation fails midway, the chunk `usage` makes if the request asked
/// for it, then `[DONE]`. With `continuous_usage`, every chunk carries the usage so far.
pub fn stream_response<C: Chunk>(
    req: Arc<ValidRequest>,
    events: EventSource,
    metrics: Arc<Metrics>,
    first: Vec<C>,
    mut chunks: impl FnMut(Delta) -> Vec<C> + Send + 'static,
    usage: impl Fn(Usage) -> C + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (include_usage, continuous) = (req.include_usage, req.continuous_usage);
    let mut fold = Fold::new(req);
    let mut ended = false;
    let data = |c: &C| Ok(SseEvent::default().data(serde_json::to_string(c).unwrap_or_default()));
    let mut first = first;
    if continuous {
        let start = fold.usage_so_far();
        first.iter_mut().for_each(|c| c.set_usage(start));
    }
    let first = stream::iter(first.iter().map(data).collect::<Vec<_>>());
    // Ends when the engine drops the request's last sender: after its last choice, or (its thread
    // failed) before, and then with an error event.
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = finished.clone();
    let body = events
        .into_stream()
        .map(move |event| {
            let mut out: Vec<Result<SseEvent, Infallible>> = Vec::new();
            if ended {
                return stream::iter(out);
            }
            match fold.apply(event) {
                Ok(deltas) => {
                    let so_far = continuous.then(|| fold.usage_so_far());
                    for d in deltas {
                        let mut made = chunks(d);
                        if let Some(so_far) = so_far {
                            made.iter_mut().for_each(|c| c.set_usage(so_far));
                        }
                        out.extend(made.iter().map(data));
                    }
                    ended = fold.is_done();
                    if ended {
                        let total = fold.usage();
                        metrics.completion_tokens.inc_by(total.completion_tokens as u64);
                        if include_usage {
                            out.push(data(&usage(total)));
                        }
                    }
                }
                Err(e) => {
                    ended = true;
                    out.push(Ok(SseEvent::default()
                        .event("error")
                        .data(serde_json::to_string(&e.body()).unwrap_or_default())));
                }
            }
            if ended {
                seen.store(true, std::sync::atomic::Ordering::SeqCst);
                out.push(Ok(SseEvent::default().data("[DONE]")));
            }
            stream::iter(out)
        })
        .flatten();
    let broken = stream::once(async move {
        let done = finished.load(std::sync::atomic::Ordering::SeqCst);
        let error = ApiError::EngineFailed.body();
        stream::iter(match done {
            true => Vec::new(),
            false => vec![
                Ok(SseEvent::default()
                    .event("error")
                    .data(serde_json::to_string(&error).unwrap_or_default())),
                Ok(SseEvent::default().data("[DONE]")),
            ],
        })
    })
    .flatten();
    Sse::new(first.chain(body).chain(broken)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
