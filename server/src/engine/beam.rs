//! A prompt decoded with beam search. Its k beams run in the engine's batched step beside every
//! other sequence; between steps the model crate's [`BeamSearch`] picks the continuations, and the
//! beams' KV caches follow their parents (forked for a second child, handed to the last). The
//! beams are known only at the end, so their text is sent then: every finished hypothesis as a
//! candidate with its score, of which the request's fold returns the `n` best.

use std::sync::Arc;
use std::time::Instant;

use gpt::beam::{reorder, BeamParams, BeamSearch, Hypothesis};
use gpt::{KvCache, Tokenizer};

use super::channel::EventSink;
use super::constraint::Constraint;
use super::runner::{StepInput, StepOutput};
use super::sequence::{grammar_error, prompt_logprobs, ModelInfo, Status};

use super::Detokenizer;
use super::ValidRequest;
use super::{end_unstarted, Event, FinishReason, StopReason, TokenLogprob};
use crate::metrics::Metrics;

pub struct BeamGroup {
    pub request: Arc<ValidRequest>,
    pub prompt: usize,
    pub events: EventSink,
    search: Option<BeamSearch>,
    caches: Vec<KvCache>,
    /// Each beam's next token; `None` until the prompt is prefilled.
    next: Option<Vec<u32>>,
    /// Each beam's place in the request's grammar (structured outputs), one per beam once the
    /// prompt is prefilled.
    constraints: Vec<Constraint>,
    queued_at: Instant,
}

impl BeamGroup {
    pub fn new(
        request: Arc<ValidRequest>,
        prompt: usize,
        cache: KvCache,
        events: EventSink,
        queued_at: Instant,
        model: ModelInfo,
    ) -> Self {
        let room = model.context - request.prompts[prompt].ids.len();
        let search = BeamSearch::new(BeamParams {
            beams: request.best_of,
            max_new_tokens: request.max_tokens.min(room),
            length_penalty: request.beam_search.unwrap_or(1.0),
            // vLLM's beam search with `ignore_eos`: the end-of-text token ends no hypothesis.
            eos: model.eos.filter(|_| !request.ignore_eos),
        });
        Self {
            request,
            prompt,
            events,
            search: Some(search),
            caches: vec![cache],
            next: None,
            constraints: Vec::new(),
            queued_at,
        }
    }

    /// Batch slots: one per beam.
    pub fn slots(&self) -> usize {
        self.request.best_of
    }

    /// The prompt (with its logprobs for `echo`), then one token per beam; and the beams' grammar
    /// states (see [`super::sequence::Sequence::step_input`]).
    pub fn step_inputs(&mut self) -> (Vec<StepInput<'_>>, Vec<&mut Constraint>) {
        let r = &self.request;
        let inputs = match &self.next {
            None => vec![StepInput {
                tokens: &r.prompts[self.prompt].ids,
                cache: &mut self.caches[0],
                prompt_logprobs: r.prompt_top_k(),
                verify: false,
                adapter: r.lora(),
                greedy: false,
                embed: false,
            }],
            Some(tokens) => self
                .caches
                .iter_mut()
                .zip(tokens)
                .map(|(cache, t)| StepInput {
                    tokens: std::slice::from_ref(t),
                    cache,
                    prompt_logprobs: None,
                    verify: false,
                    adapter: r.lora(),
                    greedy: false,
                    embed: false,
                })
                .collect(),
        };
        (inputs, self.constraints.iter_mut().collect())
    }

    /// Takes the step's outputs (one per input), picks the continuations, and when the search is
    /// over sends its results.
    pub fn advance(
        &mut self,
        outputs: Vec<StepOutput>,
        tokenizer: &Tokenizer,
        metrics: &Metrics,
    ) -> gpt::Result<Status> {
        let Some(search) = self.search.as_mut() else {
            return Ok(Status::Finished(FinishReason::Length));
        };
        let prefill = self.next.is_none();
        let mut rows: Vec<Vec<f32>> = match prefill {
            true => {
                metrics
                    .time_to_first_token
                    .observe(self.queued_at.elapsed().as_secs_f64());
                if self.request.sends_prompt() {
                    let positions = outputs.first().map_or(&[][..], |o| &o.prompt_logprobs[..]);
                    let logprobs = match self.request.prompt_top_k() {
                        Some(_) => prompt_logprobs(tokenizer, &self.request.prompts[self.prompt].ids, positions)?,
                        None => Vec::new(),
                    };
                    let _ = self.events.send(Event::Prompt {
                        prompt: self.prompt,
                        logprobs,
                    });
                }
                let last = outputs.into_iter().next().map(|o| o.last).unwrap_or_default();
                vec![last; search.beams()]
            }
            false => outputs.into_iter().map(|o| o.last).collect(),
        };
        metrics.generated_tokens.inc_by(search.beams() as u64);
        if let Some(compiled) = &self.request.constraint {
            // Each beam's row masked by its own grammar state, before the search scores it.
            if prefill {
                self.constraints = vec![compiled.start(); rows.len()];
            }
            for (row, c) in rows.iter_mut().zip(&mut self.constraints) {
                c.mask(row).map_err(grammar_error)?;
            }
        }
        match search.step(&rows) {
            Some(selection) => {
                if !self.constraints.is_empty() {
                    self.constraints = (selection.parents.iter().zip(&selection.tokens))
                        .map(|(&parent, &token)| {
                            let mut c = self.constraints[parent].clone();
                            c.commit(token).map_err(grammar_error)?;
                            Ok(c)
                        })
                        .collect::<gpt::Result<_>>()?;
                }
                let caches = std::mem::take(&mut self.caches);
                self.caches = reorder(caches, &selection.parents, prefill)?;
                self.next = Some(selection.tokens);
                Ok(Status::Running)
            }
            None => {
                let hypotheses = self.search.take().map(BeamSearch::finish).unwrap_or_default();
                self.send(&hypotheses, tokenizer)?;
                Ok(Status::Finished(FinishReason::Stop))
            }
        }
    }

    /// Every hypothesis as a candidate: its text (cut at a stop string), logprobs, and score.
    fn send(&self, hypotheses: &[Hypothesis], tokenizer: &Tokenizer) -> gpt::Result<()> {
        let r = &self.request;
        let text_start = match r.echo {
            true => r.prompts[self.prompt].text.chars().count(),
            false => 0,
        };
        for (candidate, h) in hypotheses.iter().enumerate() {
            let mut detokenizer = Detokenizer::new(r.skip_special_tokens);
            let (mut text, mut logprobs) = (String::new(), Vec::new());
            let last = h.tokens.len().saturating_sub(1);
            for (i, (&token, &lp)) in h.tokens.iter().zip(&h.logprobs).enumerate() {
                if r.logprobs.is_some() {
                    let token_text = tokenizer.decode(&[token])?;
                    logprobs.push(TokenLogprob {
                        id: token,
                        top: vec![(token, token_text.clone(), lp)],
                        token: token_text,
                        logprob: Some(lp),
                        rank: None,
                        offset: text_start + text.chars().count(),
                    });
                }
                if !(h.ended_by_eos && i == last) {
                    text.push_str(&detokenizer.push(token, tokenizer)?);
                }
            }
            text.push_str(&detokenizer.finish(tokenizer)?);
            // The first stop string in the text (the earliest, the longest there).
            let stop = (r.stop.iter())
                .filter_map(|s| text.find(s.as_str()).map(|at| (at, std::cmp::Reverse(s.len()), s)))
                .min();
            let (reason, stop_reason) = match (stop, h.ended_by_eos) {
                (Some((at, _, s)), _) => {
                    let cut = if r.include_stop_str { at + s.len() } else { at };
                    let chars = text[..cut].chars().count();
                    text.truncate(cut);
                    logprobs.retain(|l| l.offset < text_start + chars);
                    (FinishReason::Stop, Some(StopReason::Text(s.clone())))
                }
                (None, true) => (FinishReason::Stop, None),
                (None, false) => (FinishReason::Length, None),
            };
            let _ = self.events.send(Event::Text {
                prompt: self.prompt,
                candidate,
                text,
                logprobs,
                completion_tokens: h.tokens.len(),
            });
            let _ = self.events.send(Event::Done {
                prompt: self.prompt,
                candidate,
                finish_reason: reason,
                stop_reason,
                completion_tokens: h.tokens.len(),
                cumulative_logprob: f64::from(h.score),
            });
        }
        // (A search always ends with a hypothesis per beam; should one be missing, its candidate
        // still ends.)
        end_unstarted(&self.events, self.prompt, hypotheses.len()..r.best_of);
        Ok(())
    }

    /// Ends the search now (a shutdown's grace period is over): every candidate, with no text.
    /// When the request was queued (its time limit counts from there).
    pub fn queued_at(&self) -> Instant {
        self.queued_at
    }

    pub fn cut(&self) {
        end_unstarted(&self.events, self.prompt, 0..self.request.best_of);
    }
}
