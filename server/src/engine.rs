//! The inference engine: the model on its own thread, off the async runtime. Requests wait in a
//! bounded queue; the scheduler admits them between steps (up to `max_batch_size` sequences) and
//! steps every active sequence together: one `Gpt::forward_step` per step runs the new prompts'
//! prefill and every other sequence's next token through the weight-heavy layers at once
//! (continuous batching). Each request carries its own event channel; a sequence whose receiver
//! is gone (the client disconnected) is dropped before the next step.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{IndexOp, Tensor, D};
use gpt::{Gpt, KvCache, LogitsFor, Sampler, SeqStep, Tokenizer};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::stream::TextStream;
use crate::validation::ValidRequest;

/// Log-probabilities of one position: the chosen token and the most likely ones.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    /// `None` for the first prompt token (nothing predicts it).
    pub logprob: Option<f32>,
    pub top: Vec<(String, f32)>,
    /// Where the token starts in the choice's text.
    pub offset: usize,
}

/// What the engine tells a request's handler.
#[derive(Debug, Clone)]
pub enum Event {
    /// More text for choice `index` (possibly empty, when only logprobs are new).
    Text {
        index: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Choice `index` is complete.
    Done {
        index: usize,
        finish_reason: FinishReason,
        completion_tokens: usize,
    },
    Error(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

pub struct Job {
    pub request: ValidRequest,
    pub events: mpsc::UnboundedSender<Event>,
    pub queued_at: Instant,
}

/// One choice being generated.
struct Sequence {
    index: usize,
    prompt: Arc<Vec<u32>>,
    prompt_text_len: usize, // bytes of the prompt text when echoed, else 0
    output: Vec<u32>,
    /// `output` decoded, kept so each token is decoded once.
    decoded: String,
    cache: KvCache,
    sampler: Sampler,
    text: TextStream,
    max_tokens: usize,
    logprobs: Option<usize>,
    events: mpsc::UnboundedSender<Event>,
    queued_at: Instant,
    last_token_at: Option<Instant>,
    prefilled: bool,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub max_batch_size: usize,
    pub max_queue: usize,
}

/// The handle the HTTP layer holds.
pub struct Engine {
    queue: mpsc::Sender<Job>,
    cut: Arc<AtomicBool>,
    max_queue: usize,
    metrics: Arc<Metrics>,
}

impl Engine {
    /// Starts the model thread.
    pub fn start(model: Gpt, tokenizer: Tokenizer, cfg: EngineConfig, metrics: Arc<Metrics>) -> std::io::Result<Self> {
        let (queue, rx) = mpsc::channel(cfg.max_queue.max(1));
        let cut = Arc::new(AtomicBool::new(false));
        let worker = Worker {
            model,
            tokenizer,
            cfg: cfg.clone(),
            metrics: metrics.clone(),
            cut: cut.clone(),
            active: Vec::new(),
        };
        std::thread::Builder::new()
            .name("gpt-engine".into())
            .spawn(move || worker.run(rx))?;
        Ok(Self {
            queue,
            cut,
            max_queue: cfg.max_queue,
            metrics,
        })
    }

    /// Queues a request; `Err` with the queue's capacity when it is full.
    pub fn submit(&self, request: ValidRequest) -> Result<mpsc::UnboundedReceiver<Event>, usize> {
        let (events, rx) = mpsc::unbounded_channel();
        let job = Job {
            request,
            events,
            queued_at: Instant::now(),
        };
        self.queue.try_send(job).map_err(|_| self.max_queue)?;
        self.metrics.queue_depth.inc();
        Ok(rx)
    }

    /// Ends every active generation at the next step with `finish_reason: "length"` (the end of a
    /// shutdown's grace period).
    pub fn cut_all(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }
}

struct Worker {
    model: Gpt,
    tokenizer: Tokenizer,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    cut: Arc<AtomicBool>,
    active: Vec<Sequence>,
}

impl Worker {
    fn run(mut self, mut rx: mpsc::Receiver<Job>) {
        loop {
            if self.active.is_empty() {
                match rx.blocking_recv() {
                    Some(job) => self.admit(job),
                    None => return, // the server is gone
                }
            }
            while self.active.len() < self.cfg.max_batch_size {
                match rx.try_recv() {
                    Ok(job) => self.admit(job),
                    Err(_) => break,
                }
            }
            let before = self.active.len();
            self.active.retain(|s| !s.events.is_closed());
            self.metrics.cancelled.inc_by((before - self.active.len()) as u64);
            if self.cut.load(Ordering::SeqCst) {
                for s in self.active.drain(..) {
                    let _ = s.events.send(Event::Done {
                        index: s.index,
                        finish_reason: FinishReason::Length,
                        completion_tokens: s.output.len(),
                    });
                }
            }
            if !self.active.is_empty() {
                self.step();
            }
        }
    }

    fn admit(&mut self, job: Job) {
        self.metrics.queue_depth.dec();
        let req = job.request;
        self.metrics.prompt_tokens.inc_by(req.prompt.len() as u64);
        let prompt = Arc::new(req.prompt);
        if req.echo {
            if let Some(k) = req.logprobs {
                match self.prompt_logprobs(&prompt, k) {
                    Ok(lps) => {
                        for index in 0..req.n {
                            let _ = job.events.send(Event::Text {
                                index,
                                text: String::new(),
                                logprobs: lps.clone(),
                            });
                        }
                    }
                    Err(e) => {
                        let _ = job.events.send(Event::Error(e.to_string()));
                        return;
                    }
                }
            }
        }
        for index in 0..req.n {
            let mut sampling = req.sampling.clone();
            sampling.seed = sampling.seed.wrapping_add(index as u64);
            self.active.push(Sequence {
                index,
                prompt: prompt.clone(),
                prompt_text_len: if req.echo { req.prompt_text.len() } else { 0 },
                output: Vec::new(),
                decoded: String::new(),
                cache: self.model.new_cache(),
                sampler: Sampler::new(sampling),
                text: TextStream::new(req.stop.clone()),
                max_tokens: req.max_tokens,
                logprobs: req.logprobs,
                events: job.events.clone(),
                queued_at: job.queued_at,
                last_token_at: None,
                prefilled: false,
            });
        }
    }

    /// Log-probabilities of the prompt's own tokens (for `echo` with `logprobs`).
    fn prompt_logprobs(&self, prompt: &[u32], k: usize) -> gpt::Result<Vec<TokenLogprob>> {
        let idx = Tensor::new(prompt, self.model.device())?.unsqueeze(0)?;
        let logits = self.model.forward(&idx)?.squeeze(0)?; // (T, V)
        let log_probs = log_softmax(&logits)?;
        let mut out = Vec::with_capacity(prompt.len());
        let mut offset = 0;
        for (t, &id) in prompt.iter().enumerate() {
            let token = self.tokenizer.decode(&[id])?;
            let (logprob, top) = if t == 0 {
                (None, vec![])
            } else {
                let row = log_probs.i(t - 1)?.to_vec1::<f32>()?;
                (Some(row[id as usize]), self.top_k(&row, k)?)
            };
            out.push(TokenLogprob {
                offset,
                token: token.clone(),
                logprob,
                top,
            });
            offset += token.len();
        }
        Ok(out)
    }

    fn top_k(&self, log_probs: &[f32], k: usize) -> gpt::Result<Vec<(String, f32)>> {
        let mut order: Vec<usize> = (0..log_probs.len()).collect();
        order.sort_by(|&a, &b| log_probs[b].total_cmp(&log_probs[a]));
        order
            .into_iter()
            .take(k)
            .map(|i| Ok((self.tokenizer.decode(&[i as u32])?, log_probs[i])))
            .collect()
    }

    /// One step for every active sequence: prefill for the new ones, one token for the others.
    fn step(&mut self) {
        self.metrics.batch_size.set(self.active.len() as i64);
        let last_tokens: Vec<u32> = self
            .active
            .iter()
            .map(|s| s.output.last().copied().unwrap_or(0))
            .collect();
        let logits = {
            let mut steps: Vec<SeqStep> = self
                .active
                .iter_mut()
                .zip(&last_tokens)
                .map(|(s, last)| SeqStep {
                    tokens: if s.prefilled {
                        std::slice::from_ref(last)
                    } else {
                        s.prompt.as_slice()
                    },
                    cache: &mut s.cache,
                })
                .collect();
            // (n_seqs, V), brought to the host in f32 in one copy: sampling reads every row, and
            // on a GPU a copy per sequence would be a synchronisation per sequence.
            self.model.forward_step(&mut steps, LogitsFor::Last).and_then(|l| {
                Ok(l.to_dtype(candle_core::DType::F32)?
                    .to_device(&candle_core::Device::Cpu)?)
            })
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                for s in self.active.drain(..) {
                    let _ = s.events.send(Event::Error(e.to_string()));
                }
                return;
            }
        };
        let mut finished = vec![false; self.active.len()];
        for (i, done) in finished.iter_mut().enumerate() {
            *done = match logits
                .i(i)
                .map_err(gpt::Error::from)
                .and_then(|row| self.advance(i, &row))
            {
                Ok(done) => done,
                Err(e) => {
                    let _ = self.active[i].events.send(Event::Error(e.to_string()));
                    true
                }
            };
        }
        let mut i = 0;
        self.active.retain(|_| {
            i += 1;
            !finished[i - 1]
        });
    }

    /// Samples sequence `i`'s next token from its logits and sends what it adds; true when the
    /// sequence is finished.
    fn advance(&mut self, i: usize, logits: &Tensor) -> gpt::Result<bool> {
        let eos = self.tokenizer.eos_token_id();
        let top = match self.active[i].logprobs {
            Some(k) => Some((log_softmax(logits)?.to_vec1::<f32>()?, k)),
            None => None,
        };
        let s = &mut self.active[i];
        s.prefilled = true;
        let token = s.sampler.sample(logits, &s.prompt, &s.output)?;
        let now = Instant::now();
        match s.last_token_at {
            None => self
                .metrics
                .time_to_first_token
                .observe((now - s.queued_at).as_secs_f64()),
            Some(t) => self.metrics.inter_token_latency.observe((now - t).as_secs_f64()),
        }
        s.last_token_at = Some(now);
        if Some(token) == eos {
            let rest = s.text.finish(&s.decoded);
            return self.finish(i, rest, vec![], FinishReason::Stop);
        }
        self.metrics.generated_tokens.inc();
        let offset = s.prompt_text_len + s.decoded.len();
        s.output.push(token);
        s.decoded = self.tokenizer.decode(&s.output)?;
        let logprobs = match top {
            Some((row, k)) => vec![TokenLogprob {
                token: self.tokenizer.decode(&[token])?,
                logprob: Some(row[token as usize]),
                top: self.top_k(&row, k)?,
                offset,
            }],
            None => vec![],
        };
        let s = &mut self.active[i];
        let (text, stopped) = s.text.push(&s.decoded);
        if stopped {
            return self.finish(i, text, logprobs, FinishReason::Stop);
        }
        let at_limit =
            s.output.len() >= s.max_tokens || s.prompt.len() + s.output.len() >= self.model.config().n_positions;
        if at_limit {
            let rest = s.text.finish(&s.decoded);
            return self.finish(i, text + &rest, logprobs, FinishReason::Length);
        }
        if !text.is_empty() || !logprobs.is_empty() {
            let _ = s.events.send(Event::Text {
                index: s.index,
                text,
                logprobs,
            });
        }
        Ok(false)
    }

    fn finish(
        &mut self,
        i: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
        reason: FinishReason,
    ) -> gpt::Result<bool> {
        let s = &self.active[i];
        if !text.is_empty() || !logprobs.is_empty() {
            let _ = s.events.send(Event::Text {
                index: s.index,
                text,
                logprobs,
            });
        }
        let _ = s.events.send(Event::Done {
            index: s.index,
            finish_reason: reason,
            completion_tokens: s.output.len(),
        });
        Ok(true)
    }
}

fn log_softmax(logits: &Tensor) -> gpt::Result<Tensor> {
    Ok(candle_nn::ops::log_softmax(
        &logits.to_dtype(candle_core::DType::F32)?,
        D::Minus1,
    )?)
}
