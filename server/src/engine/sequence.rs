//! One choice being generated: its tokens, KV cache, sampler, text and stop state. A prompt's
//! choices start as one sequence that prefills the prompt and is then forked (a copy of its KV
//! cache per choice), so a prompt is prefilled once however many choices it has. Each sequence
//! sends its own events on its request's channel.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use gpt::speculative::ProposalLength;
use gpt::{KvCache, Sampler, Tokenizer};

use super::channel::EventSink;
use super::constraint::Constraint;
use super::runner::{top_k, PositionLogprob, StepInput, StepOutput};
use super::ValidRequest;
use super::{Detokenizer, TextStream};
use super::{Event, FinishReason, StopReason, TokenLogprob};
use crate::metrics::Metrics;
use gpt_kernels::log_sum_exp;

/// What every sequence needs to know of the model.
#[derive(Debug, Clone, Copy)]
pub struct ModelInfo {
    pub eos: Option<u32>,
    pub context: usize,
}

pub struct Sequence {
    pub request: Arc<ValidRequest>,
    /// Which prompt of the request, and which of its candidates.
    pub prompt: usize,
    pub candidate: usize,
    pub cache: KvCache,
    /// Tokens generated, the end-of-text or stop token that ended them included.
    output: Vec<u32>,
    /// The text of `output` so far, and its length in characters.
    decoded: String,
    decoded_chars: usize,
    sampler: Sampler,
    /// Where the output is in its grammar (structured outputs).
    constraint: Option<Constraint>,
    detokenizer: Detokenizer,
    text: TextStream,
    /// Σ log p of the sampled tokens under the model (for `best_of`).
    cumulative_logprob: f64,
    /// Characters before the generated text in the choice (the prompt, when echoed).
    text_start: usize,
    /// Candidates still to be forked from this one once the prompt is prefilled; `None` once it
    /// decodes.
    prefill: Option<usize>,
    /// Logprobs of the prompt's first tokens, from a reused prefix (see `prefix`).
    cached_logprobs: Vec<PositionLogprob>,
    pub events: EventSink,
    queued_at: Instant,
    last_token_at: Option<Instant>,
    /// Speculative decoding's state (see `speculate`).
    spec: SeqSpeculation,
}

/// A position's logits as a sequence gets them: the raw row, or greedy decoding's token taken
/// where the row was computed (`StepOutput::greedy`).
#[derive(Clone, Copy)]
enum Row<'a> {
    Logits(&'a [f32]),
    Greedy(u32),
}

/// What [`Sequence::choose`] made of a row: the token (with the row as the grammar masked it,
/// if it did), or the choice's end.
enum Chosen {
    Token(u32, Option<Vec<f32>>),
    Done(Status),
}

/// After a token: go on, or the choice is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Running,
    Finished(FinishReason),
}

impl Sequence {
    /// The sequence that prefills prompt `prompt` of `request` for all its candidates.
    pub fn prefill(
        request: Arc<ValidRequest>,
        prompt: usize,
        cache: KvCache,
        events: EventSink,
        queued_at: Instant,
    ) -> Self {
        let text_start = if request.echo {
            request.prompts[prompt].text.chars().count()
        } else {
            0
        };
        let candidates = request.best_of;
        Self {
            sampler: Sampler::new(request.sampling.clone()),
            constraint: request.constraint.as_ref().map(|c| c.start()),
            text: TextStream::new(request.stop.clone(), request.include_stop_str),
            detokenizer: Detokenizer::new(request.skip_special_tokens),
            request,
            prompt,
            candidate: 0,
            cache,
            output: Vec::new(),
            decoded: String::new(),
            decoded_chars: 0,
            cumulative_logprob: 0.0,
            text_start,
            prefill: Some(candidates - 1),
            cached_logprobs: Vec::new(),
            events,
            queued_at,
            last_token_at: None,
            spec: SeqSpeculation::default(),
        }
    }

    /// A sequence whose cache already holds a prefix of its prompt: `logprobs` are those of
    /// the prompt's tokens `1..=` that prefix's length (when the prompt's logprobs are wanted).
    pub fn with_cached_logprobs(mut self, logprobs: Vec<PositionLogprob>) -> Self {
        self.cached_logprobs = logprobs;
        self
    }

    pub fn take_cached_logprobs(&mut self) -> Vec<PositionLogprob> {
        std::mem::take(&mut self.cached_logprobs)
    }

    pub fn prompt_ids(&self) -> &[u32] {
        &self.request.prompts[self.prompt].ids
    }

    /// Batch slots it takes: a prefill stands for all the candidates it will fork into.
    pub fn slots(&self) -> usize {
        1 + self.prefill.unwrap_or(0)
    }

    pub fn is_prefill(&self) -> bool {
        self.prefill.is_some()
    }

    /// Its part in the next step: the prompt (what of it the cache does not hold yet), then the
    /// last token generated.
    /// With it, the sequence's grammar state, whose next mask can be computed while the model
    /// computes the step.
    /// With proposed tokens (speculative decoding), the last token and the proposals.
    pub fn step_input(&mut self) -> (StepInput<'_>, Option<&mut Constraint>) {
        let prompt_logprobs = self.wants_prompt_logprobs();
        let verify = self.prefill.is_none() && !self.spec.proposal.is_empty();
        let tokens: &[u32] = match (&self.prefill, self.output.last()) {
            (None, Some(&last)) if verify => {
                let spec = &mut self.spec;
                spec.input.clear();
                spec.input.push(last);
                spec.input.extend_from_slice(&spec.proposal);
                &spec.input
            }
            (None, Some(last)) => std::slice::from_ref(last),
            _ => {
                let ids = &self.request.prompts[self.prompt].ids;
                &ids[self.cache.len().min(ids.len().saturating_sub(1))..]
            }
        };
        // The token is the argmax of the raw row: no grammar, suppressed token, penalty or
        // logprob needs the row itself.
        let r = &self.request;
        let greedy = !verify
            && self.constraint.is_none()
            && self.sampler.is_argmax()
            && self.output.len() >= r.min_tokens
            && r.allowed_token_ids.is_none()
            && r.logprobs.is_none()
            && r.best_of <= r.n;
        let input = StepInput {
            tokens,
            cache: &mut self.cache,
            prompt_logprobs,
            verify,
            adapter: r.lora(),
            greedy,
            embed: false,
        };
        (input, self.constraint.as_mut())
    }

    /// The prompt and the output so far.
    pub fn tokens(&self) -> Vec<u32> {
        [self.prompt_ids(), &self.output].concat()
    }

    pub fn token_count(&self) -> usize {
        self.prompt_ids().len() + self.output.len()
    }

    pub fn speculation(&mut self) -> &mut SeqSpeculation {
        &mut self.spec
    }

    pub fn proposal_len(&self) -> usize {
        self.spec.proposal.len()
    }

    /// Tokens it may propose at most: each step adds one of the model's own after those kept,
    /// within `max_tokens` and the context.
    pub fn speculation_room(&self, context: usize) -> usize {
        let output_room = self.request.max_tokens.saturating_sub(self.output.len() + 1);
        output_room.min(context.saturating_sub(self.token_count()))
    }

    /// Whether it decodes (not a prefill) and so may speculate.
    pub fn decoding(&self) -> bool {
        self.prefill.is_none() && !self.output.is_empty()
    }

    /// Top-N of the prompt's own tokens wanted from the prefill (`echo` with `logprobs`, or
    /// `prompt_logprobs`).
    pub fn wants_prompt_logprobs(&self) -> Option<usize> {
        self.request.prompt_top_k().filter(|_| self.is_prefill())
    }

    /// After the prefill: this sequence and its forks, one per candidate, each sampling with its
    /// own seed (`seed + candidate`).
    pub fn fork_candidates(mut self) -> gpt::Result<Vec<Sequence>> {
        let forks = self.prefill.take().unwrap_or(0);
        let mut family = Vec::with_capacity(forks + 1);
        for candidate in 1..=forks {
            let mut sampling = self.request.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(candidate as u64);
            family.push(Sequence {
                request: self.request.clone(),
                prompt: self.prompt,
                candidate,
                cache: self.cache.fork()?,
                output: Vec::new(),
                decoded: String::new(),
                decoded_chars: 0,
                sampler: Sampler::new(sampling),
                constraint: self.constraint.clone(),
                detokenizer: Detokenizer::new(self.request.skip_special_tokens),
                text: TextStream::new(self.request.stop.clone(), self.request.include_stop_str),
                cumulative_logprob: 0.0,
                text_start: self.text_start,
                prefill: None,
                cached_logprobs: Vec::new(),
                events: self.events.clone(),
                queued_at: self.queued_at,
                last_token_at: None,
                spec: SeqSpeculation::default(),
            });
        }
        family.insert(0, self);
        Ok(family)
    }

    /// Takes its step's output: samples the next token from the raw logits of the last position
    /// and sends what it adds. After a check of proposals, each position in turn: a proposal the
    /// sampler accepts is the token there and the next position is read, until one is refused
    /// (the sampler's token takes its place) or the last, whose token is the model's own; the
    /// caches then drop the positions of the refused proposals.
    pub fn advance(
        &mut self,
        out: &StepOutput,
        tokenizer: &Tokenizer,
        model: ModelInfo,
        metrics: &Metrics,
    ) -> gpt::Result<Status> {
        let proposal = std::mem::take(&mut self.spec.proposal);
        if proposal.is_empty() {
            let row = match out.greedy {
                Some(token) => Row::Greedy(token),
                None => Row::Logits(&out.last),
            };
            return self.next_token(row, None, &mut false, tokenizer, model, metrics);
        }
        if out.drafted.len() != proposal.len() {
            // (The runner returns a row per proposal; without them the cache could not be
            // rolled back to what was kept.)
            return Err(gpt::Error::Device(format!(
                "speculative check: {} rows of logits for {} proposed tokens",
                out.drafted.len(),
                proposal.len()
            )));
        }
        let rows = out.drafted.iter().chain(std::iter::once(&out.last));
        let mut accepted = 0;
        let mut status = Status::Running;
        for (row, proposed) in rows.zip(proposal.iter().map(Some).chain([None])) {
            let mut kept = false;
            status = self.next_token(
                Row::Logits(row),
                proposed.copied(),
                &mut kept,
                tokenizer,
                model,
                metrics,
            )?;
            if status != Status::Running || !kept {
                break;
            }
            accepted += 1;
        }
        metrics.record_speculation(proposal.len(), accepted);
        self.spec.proposal = proposal;
        // The caches hold every token but the last (which the next step reads).
        let keep = self.token_count() - 1;
        self.spec.after_check(accepted, keep)?;
        if status == Status::Running {
            self.cache.truncate(keep)?;
        }
        Ok(status)
    }

    /// One position: its token sampled from the row (`proposed` checked against it, `kept` set
    /// when the sampler keeps it), or greedy's token taken on the device, and what it adds sent.
    fn next_token(
        &mut self,
        row: Row<'_>,
        proposed: Option<u32>,
        kept: &mut bool,
        tokenizer: &Tokenizer,
        model: ModelInfo,
        metrics: &Metrics,
    ) -> gpt::Result<Status> {
        let r = self.request.clone();
        let (token, logits) = match row {
            Row::Greedy(token) => (self.sampler.take(token), None),
            Row::Logits(logits) => match self.choose(logits, proposed, kept, tokenizer, model)? {
                Chosen::Token(token, masked) => (token, Some(masked.map_or(Cow::Borrowed(logits), Cow::Owned))),
                Chosen::Done(status) => return Ok(status),
            },
        };
        let now = Instant::now();
        match self.last_token_at {
            None => metrics
                .time_to_first_token
                .observe((now - self.queued_at).as_secs_f64()),
            Some(t) => metrics.inter_token_latency.observe((now - t).as_secs_f64()),
        }
        self.last_token_at = Some(now);
        metrics.generated_tokens.inc();

        let mut logprobs = Vec::new();
        if let Some(logits) = logits.filter(|_| r.logprobs.is_some() || r.best_of > r.n) {
            let logits = &logits[..];
            let lse = log_sum_exp(logits);
            let logprob = logits[token as usize] - lse;
            self.cumulative_logprob += f64::from(logprob);
            if let Some(k) = r.logprobs {
                logprobs.push(token_logprob(
                    tokenizer,
                    token,
                    &PositionLogprob {
                        logprob,
                        rank: None,
                        top: top_k(logits, k, lse),
                    },
                    self.text_start + self.decoded_chars,
                )?);
            }
        }
        self.output.push(token);
        if let Some(c) = &mut self.constraint {
            c.commit(token).map_err(grammar_error)?;
        }

        let stop_token = r.stop_token_ids.contains(&token);
        if (Some(token) == model.eos && !r.ignore_eos) || stop_token {
            // The token that ends the text counts and has its logprobs, but adds no text.
            let reason = stop_token.then_some(StopReason::Token(token));
            return self.finish(logprobs, String::new(), FinishReason::Stop, reason, tokenizer);
        }
        let new = self.detokenizer.push(token, tokenizer)?;
        self.decoded_chars += new.chars().count();
        self.decoded.push_str(&new);
        let (text, stopped) = self.text.push(&self.decoded, self.output.len() >= r.min_tokens);
        if let Some(stop) = stopped {
            self.send_text(text, logprobs);
            return self.done(FinishReason::Stop, Some(StopReason::Text(stop)));
        }
        if self.constraint.as_ref().is_some_and(Constraint::is_finished) {
            // The grammar is complete and allows nothing more.
            return self.finish(logprobs, text, FinishReason::Stop, None, tokenizer);
        }
        let at_limit =
            self.output.len() >= r.max_tokens || self.prompt_ids().len() + self.output.len() >= model.context;
        if at_limit {
            return self.finish(logprobs, text, FinishReason::Length, None, tokenizer);
        }
        self.send_text(text, logprobs);
        Ok(Status::Running)
    }

    /// The token sampled from a raw row (under a grammar, from the row masked by it, which is
    /// returned too), or the end of the choice where the grammar allows nothing more.
    fn choose(
        &mut self,
        logits: &[f32],
        proposed: Option<u32>,
        kept: &mut bool,
        tokenizer: &Tokenizer,
        model: ModelInfo,
    ) -> gpt::Result<Chosen> {
        let r = self.request.clone();
        // Under a grammar, what it does not allow next is out before anything else (sampling,
        // logprobs): `masked` holds the row with those at -inf.
        let mut masked = None;
        let logits = match &mut self.constraint {
            None => logits,
            Some(c) => {
                let mut row = logits.to_vec();
                let left = c.mask(&mut row).map_err(grammar_error)?;
                if left == 0 {
                    // Nothing of this vocabulary may follow: the grammar is complete (a vocabulary
                    // without an end token has none to choose), or a dead end, such as a
                    // character vocabulary that lacks the character the grammar needs next; the
                    // output is then cut short, as at max_tokens.
                    let reason = match c.may_end().map_err(grammar_error)? {
                        true => FinishReason::Stop,
                        false => dead_end(self.output.len()),
                    };
                    return self.ended(reason, tokenizer);
                }
                &masked.insert(row)[..]
            }
        };
        // Before min_tokens, neither the end-of-text token nor a stop token may be chosen; with
        // `allowed_token_ids`, nothing else may.
        let mut suppress: Vec<u32> = if self.output.len() < r.min_tokens {
            model.eos.iter().chain(&r.stop_token_ids).copied().collect()
        } else {
            Vec::new()
        };
        if self.constraint.is_some()
            && !suppress.is_empty()
            && (logits.iter().enumerate()).all(|(i, v)| !v.is_finite() || suppress.contains(&(i as u32)))
        {
            suppress.clear(); // the grammar allows only an end here: it wins over min_tokens
        }
        if let Some(allowed) = &r.allowed_token_ids {
            // Only ending tokens allowed before min_tokens: the allowed ones win (something must
            // be sampled).
            if allowed.iter().all(|id| suppress.contains(id)) {
                suppress.clear();
            }
            suppress.extend((0..logits.len() as u32).filter(|id| allowed.binary_search(id).is_err()));
        }
        let prompt = &r.prompts[self.prompt].ids;
        let token = match proposed {
            None => self.sampler.sample_row(logits, prompt, &self.output, &suppress)?,
            Some(p) => {
                let (token, accepted) = self.sampler.verify(logits, prompt, &self.output, &suppress, p)?;
                *kept = accepted;
                token
            }
        };
        if let Some(c) = &mut self.constraint {
            if !c.accepts(token) {
                let reason = dead_end(self.output.len());
                return self.ended(reason, tokenizer);
            }
        }
        Ok(Chosen::Token(token, masked))
    }

    /// [`Sequence::choose`]'s end of the choice with no token, where the grammar allows none.
    fn ended(&mut self, reason: FinishReason, tokenizer: &Tokenizer) -> gpt::Result<Chosen> {
        Ok(Chosen::Done(self.finish(
            Vec::new(),
            String::new(),
            reason,
            None,
            tokenizer,
        )?))
    }

    /// Ends the choice: the held text (a partial stop string, an unfinished character) is sent.
    fn finish(
        &mut self,
        logprobs: Vec<TokenLogprob>,
        mut text: String,
        reason: FinishReason,
        stop_reason: Option<StopReason>,
        tokenizer: &Tokenizer,
    ) -> gpt::Result<Status> {
        let held = self.detokenizer.finish(tokenizer)?;
        self.decoded.push_str(&held);
        text.push_str(&self.text.finish(&self.decoded));
        self.send_text(text, logprobs);
        self.done(reason, stop_reason)
    }

    fn send_text(&self, text: String, logprobs: Vec<TokenLogprob>) {
        if !text.is_empty() || !logprobs.is_empty() {
            let _ = self.events.send(Event::Text {
                prompt: self.prompt,
                candidate: self.candidate,
                text,
                logprobs,
                completion_tokens: self.output.len(),
            });
        }
    }

    /// Sends the choice's end.
    /// When the request was queued (its time limit counts from there).
    pub fn queued_at(&self) -> Instant {
        self.queued_at
    }

    pub fn done(&self, reason: FinishReason, stop_reason: Option<StopReason>) -> gpt::Result<Status> {
        let _ = self.events.send(Event::Done {
            prompt: self.prompt,
            candidate: self.candidate,
            finish_reason: reason,
            stop_reason,
            completion_tokens: self.output.len(),
            cumulative_logprob: self.cumulative_logprob,
        });
        Ok(Status::Finished(reason))
    }
}

/// A grammar that this vocabulary cannot continue (a character vocabulary without the character
/// it needs next): the output is cut short there, as at max_tokens.
fn dead_end(tokens: usize) -> FinishReason {
    tracing::warn!(
        tokens,
        "the grammar allows no token of this vocabulary here: output cut short"
    );
    FinishReason::Length
}

/// A failure inside the grammar engine (not the client's grammar: that was compiled and checked).
pub(crate) fn grammar_error(e: String) -> gpt::Error {
    gpt::Error::Candle(candle_core::Error::Msg(format!("structured output: {e}")))
}

/// A position's log-probabilities with its token and the alternatives as text.
pub fn token_logprob(
    tokenizer: &Tokenizer,
    token: u32,
    p: &PositionLogprob,
    offset: usize,
) -> gpt::Result<TokenLogprob> {
    Ok(TokenLogprob {
        id: token,
        token: tokenizer.decode(&[token])?,
        logprob: Some(p.logprob),
        rank: p.rank,
        top: p
            .top
            .iter()
            .map(|&(id, lp)| Ok((id, tokenizer.decode(&[id])?, lp)))
            .collect::<gpt::Result<_>>()?,
        offset,
    })
}

/// The prompt's tokens with their log-probabilities from the prefill (`positions[t]` is for
/// token `t + 1`; the first token has none), offsets counted in characters.
pub fn prompt_logprobs(
    tokenizer: &Tokenizer,
    ids: &[u32],
    positions: &[PositionLogprob],
) -> gpt::Result<Vec<TokenLogprob>> {
    let mut out = Vec::with_capacity(ids.len());
    let mut offset = 0;
    for (t, &id) in ids.iter().enumerate() {
        let entry = match t.checked_sub(1).and_then(|p| positions.get(p)) {
            Some(p) => token_logprob(tokenizer, id, p, offset)?,
            None => TokenLogprob {
                id,
                token: tokenizer.decode(&[id])?,
                logprob: None,
                rank: None,
                top: Vec::new(),
                offset,
            },
        };
        offset += entry.token.chars().count();
        out.push(entry);
    }
    Ok(out)
}

/// A sequence's part in speculative decoding (`super::speculate`): how many to propose next,
/// its draft cache, and the proposal of the step under way.
#[derive(Default)]
pub struct SeqSpeculation {
    pub(super) length: Option<ProposalLength>,
    pub(super) draft_cache: Option<KvCache>,
    pub proposal: Vec<u32>,
    /// The step's input: the last token, then the proposal.
    pub input: Vec<u32>,
}

impl SeqSpeculation {
    /// After the step: `accepted` of the proposal were kept, and the caches keep `len` positions.
    pub fn after_check(&mut self, accepted: usize, len: usize) -> gpt::Result<()> {
        if let Some(l) = &mut self.length {
            l.update(self.proposal.len(), accepted);
        }
        self.proposal.clear();
        if let Some(cache) = &mut self.draft_cache {
            cache.truncate(len)?;
        }
        Ok(())
    }
}
