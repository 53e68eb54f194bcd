//! Engine events to responses: a whole response once every choice has ended ([`collect`]), or
//! chunks as they come ([`chunk_stream`], as OpenAI's Server-Sent Events by [`sse`], other
//! protocols' by [`named_sse`]), all through [`Fold`].

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Serialize;

use crate::api::{Choice, Usage};
use crate::engine::ValidRequest;
use crate::engine::{Event, EventSource};
use crate::error::ApiError;
use crate::fold::{merge, Delta, Fold};
use crate::metrics::Metrics;

/// A response in the making: its fold over the engine's events, counted as cancelled if it is
/// dropped (its client went away: axum drops the handler's future, hyper the stream) before its
/// last choice ended while the engine still held it. Counted here rather than where the engine
/// frees the sequences: the engine may have finished a sequence whose events still wait for a
/// client that then leaves, and such a request is cancelled too, as the client sees it.
struct Watched {
    fold: Fold,
    metrics: Arc<Metrics>,
    /// The engine dropped its end first (its thread failed, or it dropped a stalled stream).
    engine_gone: bool,
}

impl Watched {
    fn new(req: Arc<ValidRequest>, metrics: Arc<Metrics>) -> Self {
        Self {
            fold: Fold::new(req),
            metrics,
            engine_gone: false,
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        if !self.fold.is_done() && !self.engine_gone {
            self.metrics.cancelled.inc();
        }
    }
}

/// Waits for every choice: the whole choices and the usage.
pub async fn collect(
    req: Arc<ValidRequest>,
    mut events: EventSource,
    metrics: Arc<Metrics>,
) -> Result<(Vec<Choice>, Usage), ApiError> {
    let mut watched = Watched::new(req, metrics);
    let mut choices = watched.fold.empty_choices();
    while !watched.fold.is_done() {
        let Some(event) = events.recv().await else {
            // The engine dropped the request before its choices ended: its thread failed.
            watched.engine_gone = true;
            return Err(ApiError::EngineFailed);
        };
        let deltas = watched.fold.apply(event);
        // An error event: generation failed, and the engine ended the request.
        watched.engine_gone |= deltas.is_err();
        for delta in deltas? {
            merge(&mut choices, delta);
        }
    }
    watched.fold.fill_prompt_logprobs(&mut choices);
    let usage = watched.fold.usage();
    watched.metrics.completion_tokens.inc_by(usage.completion_tokens as u64);
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

/// Server-Sent Events of OpenAI's streams: a `data:` event per chunk, an `error` event if
/// generation fails midway, then `[DONE]`.
pub fn sse<C: Serialize>(
    chunks: impl Stream<Item = Result<C, ApiError>> + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let body = chunks
        .map(|chunk| {
            Ok(match chunk {
                Ok(c) => SseEvent::default().data(serde_json::to_string(&c).unwrap_or_default()),
                Err(e) => SseEvent::default()
                    .event("error")
                    .data(serde_json::to_string(&e.body()).unwrap_or_default()),
            })
        })
        .chain(stream::once(async { Ok(SseEvent::default().data("[DONE]")) }));
    Sse::new(body).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// Server-Sent Events of another protocol's stream (Anthropic's, the Responses API's): the
/// events `events` makes of each chunk, or of the error that ends the stream; no `[DONE]`.
pub fn named_sse<C: Send + 'static>(
    chunks: impl Stream<Item = Result<C, ApiError>> + Send + 'static,
    mut events: impl FnMut(Result<C, ApiError>) -> Vec<SseEvent> + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let body = chunks.flat_map(move |chunk| stream::iter(events(chunk).into_iter().map(Ok)));
    Sse::new(body).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// The chunks of a streamed response as they come: the `first` chunks, then the chunks `chunks`
/// makes of each delta of the fold, the chunk `usage` makes if the request asked for it (with
/// `continuous_usage`, every chunk carries the usage so far); an error, last, if generation fails
/// midway. Each API's stream ([`sse`] of OpenAI's, [`named_sse`] of the other protocols') is
/// made of these.
pub fn chunk_stream<C: Chunk>(
    req: Arc<ValidRequest>,
    events: EventSource,
    metrics: Arc<Metrics>,
    first: Vec<C>,
    mut chunks: impl FnMut(Delta) -> Vec<C> + Send + 'static,
    usage: impl Fn(Usage) -> C + Send + 'static,
) -> impl Stream<Item = Result<C, ApiError>> + Send + 'static {
    let (include_usage, continuous) = (req.include_usage, req.continuous_usage);
    let watched = Watched::new(req, metrics);
    let mut first = first;
    if continuous {
        let start = watched.fold.usage_so_far();
        first.iter_mut().for_each(|c| c.set_usage(start));
    }
    let first = stream::iter(first.into_iter().map(Ok).collect::<Vec<_>>());
    // Ends after the last choice's events, or (the engine dropped the request first: its thread
    // failed) with an error; `watched` lives in the stream's state, so that hyper dropping the
    // stream before then counts the request as cancelled.
    let chunks_of = move |watched: &mut Watched, event: Option<Event>| {
        let mut out: Vec<Result<C, ApiError>> = Vec::new();
        match event.map(|event| watched.fold.apply(event)) {
            Some(Ok(deltas)) => {
                let so_far = continuous.then(|| watched.fold.usage_so_far());
                for d in deltas {
                    let mut made = chunks(d);
                    if let Some(so_far) = so_far {
                        made.iter_mut().for_each(|c| c.set_usage(so_far));
                    }
                    out.extend(made.into_iter().map(Ok));
                }
                if watched.fold.is_done() {
                    let total = watched.fold.usage();
                    watched.metrics.completion_tokens.inc_by(total.completion_tokens as u64);
                    if include_usage {
                        out.push(Ok(usage(total)));
                    }
                }
            }
            Some(Err(e)) => {
                watched.engine_gone = true;
                out.push(Err(e));
            }
            None => {
                watched.engine_gone = true;
                out.push(Err(ApiError::EngineFailed));
            }
        }
        let ended = watched.fold.is_done() || watched.engine_gone;
        (out, ended)
    };
    let body = stream::unfold(Some((events, watched, chunks_of)), |state| async move {
        let (mut events, mut watched, mut chunks_of) = state?;
        let (out, ended) = chunks_of(&mut watched, events.recv().await);
        Some((stream::iter(out), (!ended).then_some((events, watched, chunks_of))))
    })
    .flatten();
    first.chain(body)
}

#[cfg(test)]
mod tests {
    use axum::response::IntoResponse;
    use futures_util::FutureExt;
    use http_body_util::BodyExt;

    use super::*;
    use crate::engine::channel::channel;
    use crate::fold::tests::{done, request, text};

    #[derive(Serialize)]
    struct Piece;

    impl Chunk for Piece {
        fn set_usage(&mut self, _: Usage) {}
    }

    /// A stream of one choice whose engine has sent two tokens and its end (`finished`) or only
    /// the tokens and then dropped the request (its thread failed); the client reads `frames`
    /// frames, then goes. Returns the cancellations counted.
    async fn cancelled_after(frames: Option<usize>, finished: bool) -> u64 {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let (sink, source) = channel();
        for event in [text(0, 0, "a"), text(0, 0, "b")] {
            sink.send(event).expect("open");
        }
        if finished {
            sink.send(done(0, 0, 2, 0.0)).expect("open");
        }
        drop(sink);
        let sse = sse(chunk_stream(
            request(1, 1, 1, None),
            source,
            metrics.clone(),
            vec![],
            |_| vec![Piece],
            |_| Piece,
        ));
        let mut body = sse.into_response().into_body();
        match frames {
            Some(frames) => {
                for _ in 0..frames {
                    body.frame().await.expect("a frame").expect("no error");
                }
            }
            None => while body.frame().await.is_some() {},
        }
        drop(body);
        metrics.cancelled.get()
    }

    #[tokio::test]
    async fn a_stream_dropped_before_its_end_is_cancelled_even_once_the_engine_finished() {
        assert_eq!(cancelled_after(Some(1), true).await, 1, "left after the first chunk");
        assert_eq!(cancelled_after(None, true).await, 0, "read to [DONE]");
        assert_eq!(
            cancelled_after(None, false).await,
            0,
            "the engine failed, the error read"
        );
        assert_eq!(cancelled_after(Some(1), false).await, 1, "left before the error came");
    }

    #[tokio::test]
    async fn a_whole_response_whose_client_left_is_cancelled() {
        let metrics = Arc::new(Metrics::new().expect("metrics"));
        let (sink, source) = channel();
        sink.send(text(0, 0, "a")).expect("open");
        // One poll, waiting for more, then dropped: axum's handler future when the client goes.
        let waiting = collect(request(1, 1, 1, None), source, metrics.clone()).now_or_never();
        assert!(waiting.is_none(), "still waiting for the end");
        assert_eq!(metrics.cancelled.get(), 1);

        let (sink, source) = channel();
        for event in [text(0, 0, "a"), done(0, 0, 1, 0.0)] {
            sink.send(event).expect("open");
        }
        let whole = collect(request(1, 1, 1, None), source, metrics.clone()).now_or_never();
        assert!(matches!(whole, Some(Ok(_))), "ended whole");
        assert_eq!(metrics.cancelled.get(), 1, "not counted again");
        drop(sink);
    }
}
