//! A request's events, engine to handler, with flow control. The engine never waits on a client
//! (one slow reader must not stall the batch), so the channel itself is unbounded; what bounds it
//! is the engine, which counts the events a handler has not yet taken: a sequence whose request
//! has [`STREAM_BUFFER`] events waiting is not stepped until they drain (its client reads slower
//! than it generates), and one whose events have waited longer than the stream timeout with
//! nothing read (a client that stopped reading) is dropped and its sequence freed.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Event;

/// Events waiting for a request's handler before its sequences pause.
pub const STREAM_BUFFER: usize = 64;

/// What both ends share.
#[derive(Debug, Default)]
struct Flow {
    /// Events sent and not yet taken.
    unread: AtomicUsize,
    /// When the oldest unread event began waiting (ms since [`epoch`]), or since the reader last
    /// took one: the reader's silence while events wait.
    waiting_since: AtomicU64,
}

fn epoch() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

/// A new request's channel.
pub fn channel() -> (EventSink, EventSource) {
    let (tx, rx) = mpsc::unbounded_channel();
    let flow = Arc::new(Flow::default());
    (EventSink { tx, flow: flow.clone() }, EventSource { rx, flow })
}

/// The engine's end (cloned for each of a request's sequences).
#[derive(Debug, Clone)]
pub struct EventSink {
    tx: mpsc::UnboundedSender<Event>,
    flow: Arc<Flow>,
}

impl EventSink {
    /// Sends an event; `Err` when the handler is gone.
    pub fn send(&self, event: Event) -> Result<(), mpsc::error::SendError<Event>> {
        if self.flow.unread.fetch_add(1, Ordering::SeqCst) == 0 {
            self.flow.waiting_since.store(now_ms(), Ordering::SeqCst);
        }
        self.tx.send(event)
    }

    /// The same for every sink of one request (its channel's address).
    pub fn channel_id(&self) -> usize {
        Arc::as_ptr(&self.flow) as usize
    }

    /// The handler is gone (the client disconnected, or its stream was dropped).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// As many events wait as the stream buffer holds: generate no more until they drain.
    pub fn is_full(&self) -> bool {
        self.flow.unread.load(Ordering::SeqCst) >= STREAM_BUFFER
    }

    /// Events have waited for longer than `timeout` without the handler taking any.
    pub fn stalled(&self, timeout: Duration) -> bool {
        self.flow.unread.load(Ordering::SeqCst) > 0
            && now_ms().saturating_sub(self.flow.waiting_since.load(Ordering::SeqCst)) > timeout.as_millis() as u64
    }
}

/// The handler's end.
#[derive(Debug)]
pub struct EventSource {
    rx: mpsc::UnboundedReceiver<Event>,
    flow: Arc<Flow>,
}

impl EventSource {
    /// The next event; `None` once every sink is gone.
    pub async fn recv(&mut self) -> Option<Event> {
        let event = self.rx.recv().await;
        if event.is_some() {
            self.flow.unread.fetch_sub(1, Ordering::SeqCst);
            self.flow.waiting_since.store(now_ms(), Ordering::SeqCst);
        }
        event
    }

    /// The events as a stream.
    pub fn into_stream(self) -> impl futures_util::Stream<Item = Event> {
        futures_util::stream::unfold(self, |mut source| async move {
            let event = source.recv().await?;
            Some((event, source))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::FinishReason;

    fn done() -> Event {
        Event::Done {
            prompt: 0,
            candidate: 0,
            finish_reason: FinishReason::Stop,
            stop_reason: None,
            completion_tokens: 0,
            cumulative_logprob: 0.0,
        }
    }

    #[tokio::test]
    async fn unread_events_fill_the_buffer_and_a_silent_reader_stalls() {
        let (sink, mut source) = channel();
        assert!(!sink.stalled(Duration::ZERO), "nothing waits: no stall");
        for _ in 0..STREAM_BUFFER {
            sink.send(done()).expect("open");
        }
        assert!(sink.is_full());
        std::thread::sleep(Duration::from_millis(20));
        assert!(sink.stalled(Duration::from_millis(10)));
        assert!(!sink.stalled(Duration::from_secs(60)));
        source.recv().await.expect("an event");
        assert!(!sink.is_full(), "one taken: room again");
        assert!(!sink.stalled(Duration::from_millis(10)), "the reader just read");
        drop(source);
        assert!(sink.is_closed());
    }
}
