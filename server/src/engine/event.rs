//! What the engine emits: per-request [`Event`]s on the request's channel, and why a request was
//! [`Refused`] before it was queued.

use super::EventSink;

/// Log-probabilities of one position: the chosen token and the most likely ones.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub token: String,
    /// `None` for the first prompt token (nothing predicts it).
    pub logprob: Option<f32>,
    /// Its rank at this position (1 = most likely), for prompt tokens.
    pub rank: Option<u32>,
    /// The most likely tokens: id, text, log-probability.
    pub top: Vec<(u32, String, f32)>,
    /// Where the token starts in the choice's text, in characters.
    pub offset: usize,
}

/// What the engine tells a request's handler. Choices are named by prompt and candidate; the
/// handler's [`crate::fold::Fold`] numbers them as the API does.
#[derive(Debug, Clone)]
pub enum Event {
    /// Prompt `prompt` was prefilled; `logprobs` are its own tokens' (empty unless `echo` with
    /// `logprobs` or `prompt_logprobs` asked for them, then with the larger top-N of the two).
    /// Sent once per prompt, before its candidates' text, when `echo` or `prompt_logprobs` is on.
    Prompt {
        prompt: usize,
        logprobs: Vec<TokenLogprob>,
    },
    /// More text for a candidate (possibly empty, when only logprobs are new), and how many
    /// tokens it has generated so far.
    Text {
        prompt: usize,
        candidate: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
        completion_tokens: usize,
    },
    /// A candidate is complete.
    Done {
        prompt: usize,
        candidate: usize,
        finish_reason: FinishReason,
        /// The stop string or stop token that ended it, if one did.
        stop_reason: Option<StopReason>,
        completion_tokens: usize,
        cumulative_logprob: f64,
    },
    /// Prompt `prompt`'s embedding (a request with [`super::ValidRequest::embed`]): its final
    /// hidden state at its last token, L2-normalised.
    Embedding {
        prompt: usize,
        vector: Vec<f32>,
    },
    Error(String),
    /// A whole (not streamed) request ran past the server's request timeout; its sequences are
    /// freed. (A streamed one ends its choices with `finish_reason: "length"` instead.)
    TimedOut,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

/// What ended a choice with `finish_reason: "stop"`, when it was not the end-of-text token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

impl StopReason {
    /// As vLLM writes it: the string, or the token id as a number.
    pub fn to_json(&self) -> serde_json::Value {
        match self {
            StopReason::Text(s) => s.clone().into(),
            StopReason::Token(id) => (*id).into(),
        }
    }
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Why a request was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The queue holds this many requests.
    QueueFull(usize),
    /// The engine thread has failed; the process is about to exit.
    Failed,
}

/// Ends candidates that generated nothing, with `finish_reason: "length"`.
pub(crate) fn end_unstarted(events: &EventSink, prompt: usize, candidates: std::ops::Range<usize>) {
    for candidate in candidates {
        let _ = events.send(Event::Done {
            prompt,
            candidate,
            finish_reason: FinishReason::Length,
            stop_reason: None,
            completion_tokens: 0,
            cumulative_logprob: 0.0,
        });
    }
}
