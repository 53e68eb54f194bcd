//! Engine events to responses: a whole response once every choice has ended ([`collect`]), or
//! Server-Sent Events as they come ([`stream_response`]), both through [`Fold`].

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::{Choice, Usage};
use crate::engine::Event;
use crate::error::ApiError;
use crate::fold::{merge, Delta, Fold};
use crate::validation::ValidRequest;

/// Waits for every choice: the whole choices and the usage.
pub async fn collect(
    req: Arc<ValidRequest>,
    mut events: mpsc::UnboundedReceiver<Event>,
) -> Result<(Vec<Choice>, Usage), ApiError> {
    let mut fold = Fold::new(req);
    let mut choices = fold.empty_choices();
    while !fold.is_done() {
        let event = events.recv().await.ok_or(ApiError::ShuttingDown)?;
        for delta in fold.apply(event)? {
            merge(&mut choices, delta);
        }
    }
    Ok((choices, fold.usage()))
}

/// Server-Sent Events: the `first` chunks, then the chunks `chunks` makes of each delta of the
/// fold, an error event if generation fails midway, the chunk `usage` makes if the request asked
/// for it, then `[DONE]`.
pub fn stream_response<C: Serialize + Send + 'static>(
    req: Arc<ValidRequest>,
    events: mpsc::UnboundedReceiver<Event>,
    first: Vec<C>,
    mut chunks: impl FnMut(Delta) -> Vec<C> + Send + 'static,
    usage: impl Fn(Usage) -> C + Send + 'static,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let include_usage = req.include_usage;
    let mut fold = Fold::new(req);
    let mut ended = false;
    let data = |c: &C| Ok(SseEvent::default().data(serde_json::to_string(c).unwrap_or_default()));
    let first = stream::iter(first.iter().map(data).collect::<Vec<_>>());
    // Ends when the engine drops the request's last sender, after its last choice.
    let body = UnboundedReceiverStream::new(events)
        .map(move |event| {
            let mut out: Vec<Result<SseEvent, Infallible>> = Vec::new();
            if ended {
                return stream::iter(out);
            }
            match fold.apply(event) {
                Ok(deltas) => {
                    for d in deltas {
                        out.extend(chunks(d).iter().map(data));
                    }
                    ended = fold.is_done();
                    if ended && include_usage {
                        out.push(data(&usage(fold.usage())));
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
                out.push(Ok(SseEvent::default().data("[DONE]")));
            }
            stream::iter(out)
        })
        .flatten();
    Sse::new(first.chain(body)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}
