//! From engine events to a completion: one fold, shared by the whole response (which applies
//! every event and merges the deltas) and the stream (which sends each delta as a chunk).
//!
//! Choices are numbered as OpenAI numbers them: `index = prompt × n + i`. With `best_of > n` a
//! prompt's candidates are held until all are done; the `n` with the highest cumulative
//! log-probability are then released, best first.

use std::sync::Arc;

use crate::api::{Choice, LogProbs, PromptLogprob, PromptLogprobs, Usage};
use crate::engine::ValidRequest;
use crate::engine::{Event, FinishReason, StopReason, TokenLogprob};
use crate::error::ApiError;

/// New content for one choice.
#[derive(Debug, Clone)]
pub struct Delta {
    pub index: u32,
    pub text: String,
    /// `Some` when the request asked for logprobs.
    pub logprobs: Option<LogProbs>,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
}

/// A candidate held until its prompt's best are chosen.
#[derive(Debug, Default)]
struct Held {
    text: String,
    logprobs: Option<LogProbs>,
    finish: Option<FinishReason>,
    stop_reason: Option<StopReason>,
    tokens: usize,
    cumulative_logprob: f64,
}

pub struct Fold {
    request: Arc<ValidRequest>,
    /// `held[prompt][candidate]`, used when `best_of > n`.
    held: Vec<Vec<Held>>,
    finished: usize,
    completion_tokens: usize,
    /// Tokens generated so far by each candidate (`prompt × best_of + candidate`), returned or
    /// not: what a stream's continuous usage counts.
    generated: Vec<usize>,
    /// Each prompt's `prompt_logprobs`, once it is prefilled.
    prompt_logprobs: Vec<Option<PromptLogprobs>>,
}

impl Fold {
    pub fn new(request: Arc<ValidRequest>) -> Self {
        let held = match request.best_of > request.n {
            true => (0..request.prompts.len())
                .map(|_| (0..request.best_of).map(|_| Held::default()).collect())
                .collect(),
            false => Vec::new(),
        };
        let candidates = request.prompts.len() * request.best_of;
        Self {
            held,
            finished: 0,
            completion_tokens: 0,
            generated: vec![0; candidates],
            prompt_logprobs: vec![None; request.prompts.len()],
            request,
        }
    }

    fn prompt_tokens(&self) -> usize {
        self.request.prompts.iter().map(|p| p.ids.len()).sum()
    }

    /// The usage so far, while choices are still generating: every token generated yet.
    pub fn usage_so_far(&self) -> Usage {
        let prompt_tokens = self.prompt_tokens();
        let completion_tokens = self.generated.iter().sum();
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
        }
    }

    fn count(&mut self, prompt: usize, candidate: usize, tokens: usize) {
        if let Some(n) = self.generated.get_mut(prompt * self.request.best_of + candidate) {
            *n = (*n).max(tokens);
        }
    }

    /// Every choice has its finish reason.
    pub fn is_done(&self) -> bool {
        self.finished >= self.request.prompts.len() * self.request.n
    }

    pub fn usage(&self) -> Usage {
        let prompt_tokens = self.prompt_tokens();
        Usage {
            prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: prompt_tokens + self.completion_tokens,
            prompt_tokens_details: None,
        }
    }

    /// The choices with nothing in them yet, for the whole response to merge deltas into.
    pub fn empty_choices(&self) -> Vec<Choice> {
        (0..self.request.prompts.len() * self.request.n)
            .map(|index| Choice {
                text: String::new(),
                index: index as u32,
                logprobs: self.request.logprobs.map(|_| LogProbs::default()),
                prompt_logprobs: None,
                finish_reason: None,
                stop_reason: None,
            })
            .collect()
    }

    /// The whole response's choices get their prompt's `prompt_logprobs` (`null` when not asked).
    pub fn fill_prompt_logprobs(&self, choices: &mut [Choice]) {
        for c in choices {
            let prompt = c.index as usize / self.request.n.max(1);
            c.prompt_logprobs = Some(self.prompt_logprobs.get(prompt).cloned().flatten());
        }
    }

    pub fn apply(&mut self, event: Event) -> Result<Vec<Delta>, ApiError> {
        let want_logprobs = self.request.logprobs.is_some();
        let as_ids = self.request.tokens_as_ids;
        match event {
            Event::Prompt { prompt, logprobs } => {
                if let (Some(k), Some(slot)) = (self.request.prompt_logprobs, self.prompt_logprobs.get_mut(prompt)) {
                    *slot = Some(prompt_logprobs_of(&logprobs, k, as_ids));
                }
                if !self.request.echo {
                    return Ok(Vec::new());
                }
                let text = self.request.prompts[prompt].text.clone();
                // The prefill's top lists are as long as the larger of `logprobs` and
                // `prompt_logprobs` asked for: the echo's are cut to its own.
                let top = self.request.logprobs.unwrap_or(0);
                let logprobs = want_logprobs.then(|| {
                    let cut: Vec<TokenLogprob> = (logprobs.into_iter())
                        .map(|mut t| {
                            t.top.truncate(top);
                            t
                        })
                        .collect();
                    logprobs_of(&cut, as_ids)
                });
                let mut out = Vec::new();
                for candidate in 0..self.request.best_of {
                    out.extend(self.content(prompt, candidate, text.clone(), logprobs.clone()));
                }
                Ok(out)
            }
            Event::Text {
                prompt,
                candidate,
                text,
                logprobs,
                completion_tokens,
            } => {
                self.count(prompt, candidate, completion_tokens);
                let logprobs = want_logprobs.then(|| logprobs_of(&logprobs, as_ids));
                Ok(self.content(prompt, candidate, text, logprobs).into_iter().collect())
            }
            Event::Done {
                prompt,
                candidate,
                finish_reason,
                stop_reason,
                completion_tokens,
                cumulative_logprob,
            } => {
                self.count(prompt, candidate, completion_tokens);
                let end = End {
                    reason: finish_reason,
                    stop_reason,
                    tokens: completion_tokens,
                    cumulative_logprob,
                };
                Ok(self.done(prompt, candidate, end))
            }
            Event::Error(e) => Err(ApiError::Internal(e)),
            Event::TimedOut => Err(ApiError::Timeout),
            Event::Embedding { .. } => Err(ApiError::Internal("an embedding in a generation's events".into())),
        }
    }

    /// Text or logprobs for a candidate: passed on, or held.
    fn content(&mut self, prompt: usize, candidate: usize, text: String, logprobs: Option<LogProbs>) -> Option<Delta> {
        if let Some(held) = self.held.get_mut(prompt).and_then(|p| p.get_mut(candidate)) {
            held.text.push_str(&text);
            if let Some(more) = logprobs {
                append_logprobs(held.logprobs.get_or_insert_with(LogProbs::default), more);
            }
            return None;
        }
        Some(Delta {
            index: (prompt * self.request.n + candidate) as u32,
            text,
            logprobs,
            finish_reason: None,
            stop_reason: None,
        })
    }

    fn done(&mut self, prompt: usize, candidate: usize, end: End) -> Vec<Delta> {
        let n = self.request.n;
        let Some(candidates) = self.held.get_mut(prompt) else {
            self.finished += 1;
            self.completion_tokens += end.tokens;
            return vec![Delta {
                index: (prompt * n + candidate) as u32,
                text: String::new(),
                logprobs: None,
                finish_reason: Some(end.reason),
                stop_reason: end.stop_reason,
            }];
        };
        if let Some(held) = candidates.get_mut(candidate) {
            held.finish = Some(end.reason);
            held.stop_reason = end.stop_reason;
            held.tokens = end.tokens;
            held.cumulative_logprob = end.cumulative_logprob;
        }
        if candidates.iter().any(|c| c.finish.is_none()) {
            return Vec::new();
        }
        // All candidates are in: the n most likely, best first.
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_by(|&a, &b| {
            candidates[b]
                .cumulative_logprob
                .total_cmp(&candidates[a].cumulative_logprob)
        });
        let mut out = Vec::with_capacity(n);
        for (rank, &c) in order.iter().take(n).enumerate() {
            let held = std::mem::take(&mut candidates[c]);
            self.finished += 1;
            self.completion_tokens += held.tokens;
            out.push(Delta {
                index: (prompt * n + rank) as u32,
                text: held.text,
                logprobs: self.request.logprobs.map(|_| held.logprobs.unwrap_or_default()),
                finish_reason: held.finish,
                stop_reason: held.stop_reason,
            });
        }
        out
    }
}

/// How a candidate ended.
struct End {
    reason: FinishReason,
    stop_reason: Option<StopReason>,
    tokens: usize,
    cumulative_logprob: f64,
}

/// Adds a delta to the whole response's choices.
pub fn merge(choices: &mut [Choice], delta: Delta) {
    let Some(choice) = choices.get_mut(delta.index as usize) else {
        return;
    };
    choice.text.push_str(&delta.text);
    if let Some(more) = delta.logprobs {
        append_logprobs(choice.logprobs.get_or_insert_with(LogProbs::default), more);
    }
    if let Some(reason) = delta.finish_reason {
        choice.finish_reason = Some(reason.as_str().into());
        choice.stop_reason = delta.stop_reason.as_ref().map(StopReason::to_json);
    }
}

/// The API's logprobs of some positions; with `as_ids`, each token written `token_id:<id>`
/// (vLLM's `return_tokens_as_token_ids`).
pub fn logprobs_of(items: &[TokenLogprob], as_ids: bool) -> LogProbs {
    let name = |id: u32, text: &str| token_name(id, text, as_ids);
    let mut lp = LogProbs::default();
    for t in items {
        lp.tokens.push(name(t.id, &t.token));
        lp.token_logprobs.push(t.logprob);
        lp.top_logprobs.push(t.logprob.is_some().then(|| {
            // Most likely first; tokens that decode to the same text keep the likelier entry.
            let mut top = serde_json::Map::new();
            for (id, tok, p) in &t.top {
                top.entry(name(*id, tok)).or_insert_with(|| serde_json::Value::from(*p));
            }
            top
        }));
        lp.text_offset.push(t.offset);
    }
    lp
}

/// vLLM's `prompt_logprobs` of a prompt's positions: the token itself (with its rank) and the `k`
/// most likely (ranks 1..=k), keyed by id; `null` for the first token.
pub fn prompt_logprobs_of(items: &[TokenLogprob], k: usize, as_ids: bool) -> PromptLogprobs {
    let name = |id: u32, text: &str| token_name(id, text, as_ids);
    (items.iter())
        .map(|t| {
            let logprob = t.logprob?;
            let mut entries = std::collections::BTreeMap::new();
            for (rank, (id, text, lp)) in t.top.iter().take(k).enumerate() {
                let entry = PromptLogprob {
                    logprob: *lp,
                    rank: rank as u32 + 1,
                    decoded_token: name(*id, text),
                };
                entries.insert(*id, entry);
            }
            // The prompt's token, with its own rank (it may be one of the top as well).
            let own = PromptLogprob {
                logprob,
                rank: t.rank.unwrap_or(0),
                decoded_token: name(t.id, &t.token),
            };
            entries.insert(t.id, own);
            Some(entries)
        })
        .collect()
}

/// A token as logprobs name it: its text, or `token_id:<id>` with vLLM's
/// `return_tokens_as_token_ids`.
fn token_name(id: u32, text: &str, as_ids: bool) -> String {
    match as_ids {
        true => format!("token_id:{id}"),
        false => text.to_string(),
    }
}

fn append_logprobs(lp: &mut LogProbs, more: LogProbs) {
    lp.tokens.extend(more.tokens);
    lp.token_logprobs.extend(more.token_logprobs);
    lp.top_logprobs.extend(more.top_logprobs);
    lp.text_offset.extend(more.text_offset);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::ValidPrompt;

    pub(crate) fn request(prompts: usize, n: usize, best_of: usize, logprobs: Option<usize>) -> Arc<ValidRequest> {
        Arc::new(ValidRequest {
            max_tokens: 4,
            n,
            best_of,
            logprobs,
            ..ValidRequest::new(
                (0..prompts)
                    .map(|p| ValidPrompt {
                        ids: vec![1; p + 2],
                        text: format!("prompt{p}"),
                    })
                    .collect(),
            )
        })
    }

    pub(crate) fn text(prompt: usize, candidate: usize, text: &str) -> Event {
        Event::Text {
            prompt,
            candidate,
            text: text.into(),
            logprobs: vec![],
            completion_tokens: 1,
        }
    }

    pub(crate) fn done(prompt: usize, candidate: usize, tokens: usize, cumulative: f64) -> Event {
        Event::Done {
            prompt,
            candidate,
            finish_reason: FinishReason::Length,
            stop_reason: None,
            completion_tokens: tokens,
            cumulative_logprob: cumulative,
        }
    }

    /// Applies events and merges the deltas as the whole response does.
    fn fold(req: Arc<ValidRequest>, events: Vec<Event>) -> (Vec<Choice>, Usage, bool) {
        let mut f = Fold::new(req);
        let mut choices = f.empty_choices();
        for e in events {
            for d in f.apply(e).expect("no error") {
                merge(&mut choices, d);
            }
        }
        (choices, f.usage(), f.is_done())
    }

    #[test]
    fn choices_are_numbered_prompt_times_n_plus_i() {
        let events = vec![
            text(1, 1, "d"),
            text(0, 0, "a"),
            done(1, 1, 3, 0.0),
            text(0, 1, "b"),
            text(1, 0, "c"),
            done(0, 0, 1, 0.0),
            done(0, 1, 1, 0.0),
            done(1, 0, 2, 0.0),
        ];
        let (choices, usage, complete) = fold(request(2, 2, 2, None), events);
        let texts: Vec<&str> = choices.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(texts, ["a", "b", "c", "d"]);
        assert!(complete);
        assert_eq!(usage.prompt_tokens, 2 + 3);
        assert_eq!(usage.completion_tokens, 1 + 1 + 2 + 3);
        assert!(choices.iter().all(|c| c.finish_reason.as_deref() == Some("length")));
    }

    #[test]
    fn best_of_returns_the_n_most_likely_candidates_best_first() {
        let req = request(1, 2, 3, None);
        let mut f = Fold::new(req.clone());
        assert!(f.apply(text(0, 0, "worst")).expect("ok").is_empty(), "held");
        f.apply(text(0, 1, "best")).expect("ok");
        f.apply(text(0, 2, "middle")).expect("ok");
        assert!(f.apply(done(0, 0, 5, -9.0)).expect("ok").is_empty());
        assert!(f.apply(done(0, 1, 6, -1.0)).expect("ok").is_empty());
        let out = f.apply(done(0, 2, 7, -4.0)).expect("ok");
        let got: Vec<(u32, &str)> = out.iter().map(|d| (d.index, d.text.as_str())).collect();
        assert_eq!(got, [(0, "best"), (1, "middle")]);
        assert!(f.is_done());
        assert_eq!(f.usage().completion_tokens, 6 + 7, "usage counts the choices returned");
    }

    #[test]
    fn usage_so_far_counts_every_candidates_tokens_as_they_come() {
        let mut f = Fold::new(request(1, 1, 2, None));
        assert_eq!(f.usage_so_far().completion_tokens, 0);
        f.apply(text(0, 0, "a")).expect("ok");
        f.apply(text(0, 1, "b")).expect("ok");
        assert_eq!(f.usage_so_far().completion_tokens, 2);
        f.apply(done(0, 0, 5, -1.0)).expect("ok");
        assert_eq!(f.usage_so_far().completion_tokens, 6);
        assert_eq!(f.usage_so_far().prompt_tokens, 2);
    }

    #[test]
    fn an_engine_error_fails_the_request() {
        let mut f = Fold::new(request(1, 1, 1, None));
        assert!(f.apply(Event::Error("boom".into())).is_err());
    }
}
