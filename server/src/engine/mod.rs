//! The inference engine: the model on its own thread, off the async runtime. A request's prompts
//! wait in the [`scheduler`]; between steps the worker admits what fits and the [`runner`] steps
//! every running [`sequence`] together: one `Gpt::forward_step` per step runs the new prompts'
//! prefill and every other sequence's next token through the weight-heavy layers at once
//! (continuous batching). Each request carries its own event channel; a sequence whose receiver
//! is gone (the client disconnected) is dropped before the next step.

pub mod beam;
pub mod channel;
pub mod constraint;
mod detokenize;
mod event;
pub mod prefix;
mod request;
pub mod runner;
pub mod scheduler;
pub mod sequence;
pub mod speculate;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpt::{Gpt, Tokenizer};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use beam::BeamGroup;
pub use channel::{EventSink, EventSource};
use constraint::Constraint;
pub use detokenize::{Detokenizer, TextStream};
pub(crate) use event::end_unstarted;
pub use event::{Event, FinishReason, Refused, StopReason, TokenLogprob};
use prefix::PrefixStore;
pub use request::{ValidPrompt, ValidRequest};
use runner::{Runner, StepInput, StepOutput};

use scheduler::{Queued, Scheduler};
use sequence::{ModelInfo, Sequence, Status};
use speculate::{SpeculateConfig, Speculator};

pub struct EngineConfig {
    pub max_batch_size: usize,
    pub max_queue: usize,
    /// Prompt tokens prefilled in one step, at most (one prompt longer than this still runs).
    pub max_prefill_tokens: usize,
    /// Bytes of KV cache the prefix store may hold (0: no prefix caching).
    pub prefix_cache_bytes: usize,
    /// A request that runs longer than this (from its arrival) is ended; `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// A stream whose client takes none of its waiting events for this long is dropped.
    pub stream_timeout: Duration,
    /// Speculative decoding, if on.
    pub speculate: Option<SpeculateConfig>,
}

/// A fault to inject, for the tests of failure handling only: `GPT_SERVER_FAULT=panic` makes the
/// engine thread panic at its first step, `GPT_SERVER_FAULT=fail-steps` makes every step fail for
/// every sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Panic,
    FailSteps,
}

impl Fault {
    fn from_env() -> Option<Self> {
        match std::env::var("GPT_SERVER_FAULT").ok()?.as_str() {
            "panic" => Some(Fault::Panic),
            "fail-steps" => Some(Fault::FailSteps),
            _ => None,
        }
    }
}

/// Consecutive steps that fail for every sequence before the engine declares itself failed.
const FAILED_STEPS: usize = 3;

/// Sequences held at once, paused ones included, in batches: a client that reads slowly keeps
/// its caches (until the stream timeout) without keeping others out of the batch, within this.
const PAUSED_BATCHES: usize = 4;

/// The handle the HTTP layer holds.
pub struct Engine {
    jobs: mpsc::UnboundedSender<Job>,
    /// Requests submitted and not yet wholly admitted.
    queued: Arc<AtomicUsize>,
    cut: Arc<AtomicBool>,
    /// The engine thread panicked, or its steps kept failing: it serves nothing more.
    failed: Arc<AtomicBool>,
    max_queue: usize,
    metrics: Arc<Metrics>,
}

struct Job {
    request: Arc<ValidRequest>,
    events: EventSink,
    queued_at: Instant,
}

impl Engine {
    /// Starts the model thread.
    pub fn start(model: Gpt, tokenizer: Tokenizer, cfg: EngineConfig, metrics: Arc<Metrics>) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let cut = Arc::new(AtomicBool::new(false));
        let failed = Arc::new(AtomicBool::new(false));
        let info = ModelInfo {
            eos: tokenizer.eos_token_id(),
            context: model.config().n_positions,
        };
        let c = model.config();
        let bytes_per_token = c.kv_bytes_per_token(model.kv_cache_dtype());
        let model_params = model.num_parameters();
        let worker = Worker {
            prefix: PrefixStore::new(cfg.prefix_cache_bytes, bytes_per_token),
            runner: Runner::new(model),
            tokenizer,
            info,
            scheduler: Scheduler::new(cfg.max_batch_size, cfg.max_prefill_tokens),
            speculator: cfg.speculate.map(|s| Speculator::new(s, model_params)),
            running: Vec::new(),
            max_batch: cfg.max_batch_size.max(1),
            metrics: metrics.clone(),
            queued: queued.clone(),
            cut: cut.clone(),
            request_timeout: cfg.request_timeout,
            stream_timeout: cfg.stream_timeout,
            fault: Fault::from_env(),
            failing_steps: 0,
            queue_peak: 0,
        };
        let flag = failed.clone();
        std::thread::Builder::new().name("gpt-engine".into()).spawn(move || {
            // A panic unwinds through the worker, dropping every request's events: their handlers
            // see the channel close before their choices end, and answer with an error.
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run(rx))) {
                Ok(Outcome::Closed) => {}
                Ok(Outcome::Failed) => flag.store(true, Ordering::SeqCst),
                Err(_) => {
                    tracing::error!("the engine thread panicked: failing every request in flight");
                    flag.store(true, Ordering::SeqCst);
                }
            }
        })?;
        Ok(Self {
            jobs,
            queued,
            cut,
            failed,
            max_queue: cfg.max_queue,
            metrics,
        })
    }

    /// Queues a request and returns its events.
    pub fn submit(&self, request: Arc<ValidRequest>) -> Result<EventSource, Refused> {
        if self.failed() {
            return Err(Refused::Failed);
        }
        let max = self.max_queue;
        self.queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |q| (q < max).then_some(q + 1))
            .map_err(|_| Refused::QueueFull(max))?;
        self.metrics.queue_depth.inc();
        let (events, rx) = channel::channel();
        let job = Job {
            request,
            events,
            queued_at: Instant::now(),
        };
        if self.jobs.send(job).is_err() {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.queue_depth.dec();
            return Err(Refused::Failed); // the engine thread is gone
        }
        Ok(rx)
    }

    /// Whether the engine thread has failed (it panicked, or its steps kept failing for every
    /// sequence): `/health` answers 503 and the process exits, for a supervisor to restart it.
    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    /// Ends every generation at the next step with `finish_reason: "length"` (the end of a
    /// shutdown's grace period).
    pub fn cut_all(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

/// One prompt of a request, waiting to be prefilled.
struct Group {
    request: Arc<ValidRequest>,
    prompt: usize,
    events: EventSink,
    queued_at: Instant,
    last: bool,
}

impl Queued for Group {
    fn slots(&self) -> usize {
        self.request.best_of
    }
    fn prefill_tokens(&self) -> usize {
        self.request.prompts[self.prompt].ids.len()
    }
    fn cancelled(&self) -> bool {
        self.events.is_closed()
    }
    fn ends_request(&self) -> bool {
        self.last
    }
}

/// What runs in a step: a sequence (sampling), a prompt's beams (beam search), or a prompt to
/// embed.
enum Active {
    Seq(Box<Sequence>),
    Beams(Box<BeamGroup>),
    Embed(Box<Embedding>),
}

/// A prompt to embed: prefilled in one step beside the generations (its cache dropped after),
/// its embedding sent as [`Event::Embedding`].
struct Embedding {
    request: Arc<ValidRequest>,
    prompt: usize,
    cache: gpt::KvCache,
    events: EventSink,
    queued_at: Instant,
}

impl Active {
    fn slots(&self) -> usize {
        match self {
            Active::Seq(s) => s.slots(),
            Active::Beams(b) => b.slots(),
            Active::Embed(_) => 1,
        }
    }

    fn events(&self) -> &EventSink {
        match self {
            Active::Seq(s) => &s.events,
            Active::Beams(b) => &b.events,
            Active::Embed(e) => &e.events,
        }
    }

    fn request(&self) -> &ValidRequest {
        match self {
            Active::Seq(s) => &s.request,
            Active::Beams(b) => &b.request,
            Active::Embed(e) => &e.request,
        }
    }

    fn queued_at(&self) -> Instant {
        match self {
            Active::Seq(s) => s.queued_at(),
            Active::Beams(b) => b.queued_at(),
            Active::Embed(e) => e.queued_at,
        }
    }

    fn cancelled(&self) -> bool {
        self.events().is_closed()
    }

    /// Ends it now with `finish_reason: "length"`, every candidate (a shutdown's cut, a streamed
    /// request's timeout).
    fn cut(self) {
        match self {
            Active::Seq(s) => {
                let _ = s.done(FinishReason::Length, None);
                // A prefill that never ran ends all its candidates.
                end_unstarted(&s.events, s.prompt, 1..s.slots());
            }
            Active::Beams(b) => b.cut(),
            Active::Embed(e) => {
                let _ = e.events.send(Event::Error("the server is shutting down".into()));
            }
        }
    }

    fn step_inputs(&mut self) -> (Vec<StepInput<'_>>, Vec<&mut Constraint>) {
        match self {
            Active::Seq(s) => {
                let (input, constraint) = s.step_input();
                (vec![input], constraint.into_iter().collect())
            }
            Active::Beams(b) => b.step_inputs(),
            Active::Embed(e) => {
                let input = StepInput {
                    tokens: &e.request.prompts[e.prompt].ids,
                    cache: &mut e.cache,
                    prompt_logprobs: None,
                    verify: false,
                    adapter: e.request.lora(),
                    greedy: false,
                    embed: true,
                };
                (vec![input], Vec::new())
            }
        }
    }
}

struct Worker {
    runner: Runner,
    speculator: Option<Speculator>,
    prefix: PrefixStore,
    tokenizer: Tokenizer,
    info: ModelInfo,
    scheduler: Scheduler<Group>,
    running: Vec<Active>,
    max_batch: usize,
    metrics: Arc<Metrics>,
    queued: Arc<AtomicUsize>,
    cut: Arc<AtomicBool>,
    request_timeout: Option<Duration>,
    stream_timeout: Duration,
    fault: Option<Fault>,
    /// Consecutive steps that failed for every sequence in them.
    failing_steps: usize,
    /// The most requests queued at once since the heap was last trimmed.
    queue_peak: usize,
}

/// How the worker's loop ended.
enum Outcome {
    /// The server dropped the engine.
    Closed,
    /// Steps kept failing for every sequence.
    Failed,
}

impl Worker {
    fn run(mut self, mut rx: mpsc::UnboundedReceiver<Job>) -> Outcome {
        loop {
            if self.running.is_empty() && self.scheduler.is_empty() {
                self.trim_after_burst();
                match rx.blocking_recv() {
                    Some(job) => self.enqueue(job),
                    None => return Outcome::Closed, // the server is gone
                }
            }
            while let Ok(job) = rx.try_recv() {
                self.enqueue(job);
            }
            self.queue_peak = self.queue_peak.max(self.queued.load(Ordering::SeqCst));
            self.drop_cancelled();
            self.end_late();
            if self.cut.load(Ordering::SeqCst) {
                self.cut_everything();
                continue;
            }
            // A request waiting for its client to read holds its caches but no step: it does
            // not count against the batch, up to PAUSED_BATCHES batches of them.
            let held: usize = self.running.iter().map(Active::slots).sum();
            let stepping: usize = self
                .running
                .iter()
                .filter(|a| !a.events().is_full())
                .map(Active::slots)
                .sum();
            if held < PAUSED_BATCHES * self.max_batch {
                for group in self.scheduler.admit(stepping) {
                    self.left_queue(&group);
                    self.start(group);
                }
            }
            if self.running.iter().any(|a| !a.events().is_full()) {
                self.step();
                if self.failing_steps >= FAILED_STEPS {
                    tracing::error!(
                        steps = self.failing_steps,
                        "every sequence failed in each of the last steps: the engine stops"
                    );
                    return Outcome::Failed;
                }
            } else if !self.running.is_empty() {
                // Every running request waits for its client to read: wait a little, then look
                // again (new requests, readers, timeouts).
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }

    /// Ends what ran past the request timeout: a streamed request's choices with `finish_reason:
    /// "length"`, a whole one with [`Event::TimedOut`] (a 504); waiting or running alike.
    fn end_late(&mut self) {
        let Some(limit) = self.request_timeout else { return };
        let late = |at: Instant| at.elapsed() > limit;
        let (gone, kept): (Vec<Active>, Vec<Active>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|a| late(a.queued_at()));
        self.running = kept;
        for active in gone {
            self.metrics.timeouts.inc();
            if active.request().stream {
                active.cut();
            } else {
                let _ = active.events().send(Event::TimedOut);
            }
        }
        for group in self.scheduler.take_where(|g| late(g.queued_at)) {
            self.left_queue(&group);
            self.metrics.timeouts.inc();
            if group.request.stream {
                end_unstarted(&group.events, group.prompt, 0..group.request.best_of);
            } else {
                let _ = group.events.send(Event::TimedOut);
            }
        }
    }

    /// Idle after a burst that queued more requests than a batch holds: hands the heap's free
    /// pages back to the OS. The burst's requests (prompts, events, response bodies) were freed
    /// between longer-lived blocks, and glibc keeps those pages: one burst to the queue's bound
    /// left 8.4 MiB more free in the heap and the server's RSS 5.1% higher for the 27 minutes
    /// after it (`BENCHMARKS.md`, "Soak"). Idle, so the trim (its walk of the heap, holding the
    /// arena's lock) delays no step.
    fn trim_after_burst(&mut self) {
        if self.queue_peak > self.max_batch {
            self.queue_peak = 0;
            gpt::device::trim_heap();
            self.metrics.heap_trims.inc();
        }
    }

    fn enqueue(&mut self, job: Job) {
        let prompts = job.request.prompts.len();
        self.metrics
            .prompt_tokens
            .inc_by(job.request.prompts.iter().map(|p| p.ids.len() as u64).sum());
        for prompt in 0..prompts {
            self.scheduler.push(Group {
                request: job.request.clone(),
                prompt,
                events: job.events.clone(),
                queued_at: job.queued_at,
                last: prompt + 1 == prompts,
            });
        }
    }

    fn left_queue(&self, group: &Group) {
        if group.last {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.metrics.queue_depth.dec();
        }
    }

    /// Drops what nobody waits for: requests whose client disconnected, and streams whose client
    /// has not read for the stream timeout (its sequences freed).
    fn drop_cancelled(&mut self) {
        // Counted as cancelled by their handlers (`respond::Watched`).
        for group in self.scheduler.drop_cancelled() {
            self.left_queue(&group);
        }
        let timeout = self.stream_timeout;
        for group in self.scheduler.take_where(|g| g.events.stalled(timeout)) {
            self.left_queue(&group);
            self.metrics.stream_timeouts.inc();
        }
        self.running.retain(|a| !a.cancelled());
        // Counted by stream: a request's candidates share one.
        let (stalled, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|a| a.events().stalled(timeout));
        self.running = running;
        let mut streams: Vec<usize> = stalled.iter().map(|a| a.events().channel_id()).collect();
        streams.sort_unstable();
        streams.dedup();
        let stalled = streams.len();
        if stalled > 0 {
            tracing::warn!(stalled, "dropped streams whose clients stopped reading");
            self.metrics.stream_timeouts.inc_by(stalled as u64);
        }
    }

    /// Ends everything, running and waiting, with `finish_reason: "length"`.
    fn cut_everything(&mut self) {
        for active in self.running.drain(..) {
            active.cut();
        }
        for group in self.scheduler.drain() {
            self.left_queue(&group);
            end_unstarted(&group.events, group.prompt, 0..group.request.best_of);
        }
    }

    /// Starts a prompt: a sequence that prefills it, or, when nothing is to be computed (no
    /// tokens asked for, no prompt logprobs), its answer at once.
    fn start(&mut self, group: Group) {
        let r = &group.request;
        if r.embed {
            self.running.push(Active::Embed(Box::new(Embedding {
                cache: self.runner.model().new_cache(),
                request: group.request,
                prompt: group.prompt,
                events: group.events,
                queued_at: group.queued_at,
            })));
            return;
        }
        if r.max_tokens == 0 && r.prompt_top_k().is_none() {
            if r.echo {
                let _ = group.events.send(Event::Prompt {
                    prompt: group.prompt,
                    logprobs: Vec::new(),
                });
            }
            end_unstarted(&group.events, group.prompt, 0..r.best_of);
            return;
        }
        let mut cache = self.runner.model().new_cache();
        let mut cached_logprobs = Vec::new();
        if r.beam_search.is_none() {
            let ids = &r.prompts[group.prompt].ids;
            let top_k = r.prompt_top_k();
            self.metrics.prefix_cache_lookups.inc();
            match self.prefix.lookup(ids, top_k, &r.prefix_scope()) {
                Ok(Some(hit)) => {
                    self.metrics.prefix_cache_hits.inc();
                    self.metrics.prefix_cache_reused_tokens.inc_by(hit.len as u64);
                    cache = hit.cache;
                    cached_logprobs = hit.logprobs;
                }
                Ok(None) => {}
                Err(e) => tracing::warn!(error = %e, "prefix cache lookup failed; prefilling the whole prompt"),
            }
        }
        // Room for the prompt and every token it may generate, at once (`KvCache::reserve`).
        let positions = (r.prompts[group.prompt].ids.len() + r.max_tokens).min(self.info.context);
        if let Err(e) = cache.reserve(positions) {
            tracing::warn!(error = %e, "reserving the KV cache failed; it grows as it fills");
        }
        self.running.push(match r.beam_search {
            Some(_) => Active::Beams(Box::new(BeamGroup::new(
                group.request,
                group.prompt,
                cache,
                group.events,
                group.queued_at,
                self.info,
            ))),
            None => Active::Seq(Box::new(
                Sequence::prefill(group.request, group.prompt, cache, group.events, group.queued_at)
                    .with_cached_logprobs(cached_logprobs),
            )),
        });
    }

    /// One step for every running sequence: prefill for the new ones, one token for the others.
    fn step(&mut self) {
        self.metrics
            .batch_size
            .set(self.running.iter().map(Active::slots).sum::<usize>() as i64);
        self.propose();
        let mut counts = Vec::with_capacity(self.running.len());
        let outputs = {
            let mut inputs: Vec<StepInput> = Vec::new();
            let mut constraints: Vec<&mut Constraint> = Vec::new();
            for active in self.running.iter_mut() {
                // A request whose client has a full buffer waits (see `channel`).
                if active.events().is_full() {
                    counts.push(None);
                    continue;
                }
                let (mine, grammars) = active.step_inputs();
                counts.push(Some(mine.len()));
                inputs.extend(mine);
                constraints.extend(grammars);
            }
            match self.fault {
                Some(Fault::Panic) => panic!("GPT_SERVER_FAULT=panic: the engine thread panics (a failure test)"),
                Some(Fault::FailSteps) => (0..inputs.len())
                    .map(|_| {
                        Err(gpt::Error::Device(
                            "GPT_SERVER_FAULT=fail-steps: the step failed".into(),
                        ))
                    })
                    .collect(),
                None => {
                    let _timer = self.metrics.step_duration.start_timer();
                    let runner = &mut self.runner;
                    constraint::prepare_while(constraints, || runner.step(&mut inputs))
                }
            }
        };
        let all_failed = !outputs.is_empty() && outputs.iter().all(|o| o.is_err());
        self.failing_steps = if all_failed { self.failing_steps + 1 } else { 0 };
        let mut outputs = outputs.into_iter();
        let mut next = Vec::with_capacity(self.max_batch);
        for (active, n) in std::mem::take(&mut self.running).into_iter().zip(counts) {
            let Some(n) = n else {
                next.push(active);
                continue;
            };
            let mine: gpt::Result<Vec<StepOutput>> = outputs.by_ref().take(n).collect();
            match active {
                Active::Seq(seq) => match mine.map(|mut o| o.remove(0)) {
                    Ok(out) => next.extend(self.advance(*seq, out).into_iter().map(|s| Active::Seq(Box::new(s)))),
                    Err(e) => {
                        let _ = seq.events.send(Event::Error(e.to_string()));
                    }
                },
                Active::Beams(mut beams) => match mine.and_then(|o| beams.advance(o, &self.tokenizer, &self.metrics)) {
                    Ok(Status::Running) => next.push(Active::Beams(beams)),
                    Ok(Status::Finished(_)) => {}
                    Err(e) => {
                        let _ = beams.events.send(Event::Error(e.to_string()));
                    }
                },
                Active::Embed(e) => {
                    let event = match mine.map(|mut o| o.remove(0)) {
                        Ok(out) => Event::Embedding {
                            prompt: e.prompt,
                            vector: out.embedding,
                        },
                        Err(err) => Event::Error(err.to_string()),
                    };
                    let _ = e.events.send(event);
                }
            }
        }
        self.running = next;
    }

    /// Speculative decoding's proposals for the decoding sequences that will step, while the
    /// batch is small enough for them to pay and is not growing: with requests waiting or
    /// prefilling, the draft's steps would hold up their admission, and the batch they make is
    /// one speculation does not pay at (at 32 concurrent sampled streams on the default model,
    /// the few speculative steps of each burst's start cost 4-8% of its tokens/s).
    fn propose(&mut self) {
        let Some(speculator) = &mut self.speculator else { return };
        let prefilling = (self.running.iter())
            .any(|a| matches!(a, Active::Embed(_)) || matches!(a, Active::Seq(s) if s.is_prefill()));
        if !self.scheduler.is_empty() || prefilling {
            return;
        }
        let stepping = |a: &Active| !a.events().is_full();
        let batch: usize = self.running.iter().filter(|a| stepping(a)).map(Active::slots).sum();
        if batch > speculator.max_batch {
            return;
        }
        let mut seqs: Vec<&mut Sequence> = (self.running.iter_mut())
            .filter(|a| stepping(a))
            .filter_map(|a| match a {
                Active::Seq(s) if s.decoding() => Some(&mut **s),
                _ => None,
            })
            .collect();
        if !seqs.is_empty() {
            speculator.propose(&mut seqs, self.info.context, self.metrics.speculation_totals());
        }
    }

    /// A sampled sequence after its step: forked into its candidates after a prefill, each given
    /// its next token. Returns those still running.
    fn advance(&mut self, seq: Sequence, out: StepOutput) -> Vec<Sequence> {
        let family = if seq.is_prefill() {
            match self.after_prefill(seq, &out.prompt_logprobs) {
                Ok(family) => family,
                Err((events, e)) => {
                    let _ = events.send(Event::Error(e.to_string()));
                    return Vec::new();
                }
            }
        } else {
            vec![seq]
        };
        let mut running = Vec::new();
        for mut s in family {
            if s.request.max_tokens == 0 {
                let _ = s.done(FinishReason::Length, None);
                continue;
            }
            match s.advance(&out, &self.tokenizer, self.info, &self.metrics) {
                Ok(Status::Running) => running.push(s),
                Ok(Status::Finished(_)) => {}
                Err(e) => {
                    let _ = s.events.send(Event::Error(e.to_string()));
                }
            }
        }
        running
    }

    /// Sends the prompt's echo (with its logprobs) and forks the prefilled sequence into one per
    /// candidate.
    #[allow(clippy::type_complexity)]
    fn after_prefill(
        &mut self,
        mut seq: Sequence,
        positions: &[runner::PositionLogprob],
    ) -> Result<Vec<Sequence>, (EventSink, gpt::Error)> {
        let events = seq.events.clone();
        // The prompt's logprobs: those of a reused prefix, then the prefill's.
        let mut all = seq.take_cached_logprobs();
        all.extend_from_slice(positions);
        let positions = &all[..];
        let top_k = seq.wants_prompt_logprobs();
        let stored = self.prefix.insert(
            seq.prompt_ids(),
            &seq.cache,
            top_k.map(|k| (k, positions)),
            &seq.request.prefix_scope(),
        );
        if let Err(e) = stored {
            tracing::warn!(error = %e, "prefix cache insert failed");
        }
        self.metrics.prefix_cache_bytes.set(self.prefix.used_bytes() as i64);
        if seq.request.sends_prompt() {
            let logprobs = match top_k {
                Some(_) => sequence::prompt_logprobs(&self.tokenizer, seq.prompt_ids(), positions)
                    .map_err(|e| (events.clone(), e))?,
                None => Vec::new(),
            };
            let _ = events.send(Event::Prompt {
                prompt: seq.prompt,
                logprobs,
            });
        }
        seq.fork_candidates().map_err(|e| (events, e))
    }
}
