//! Beam search ("Attention Is All You Need", §6.1: beam 4, length penalty α = 0.6), as
//! `transformers`' `generate(num_beams=k, do_sample=False, length_penalty=α)` does it, so that
//! the two give the same tokens:
//!
//! - each step scores every continuation of every running beam by its summed log-probability,
//!   and keeps the best 2k candidates;
//! - a candidate that ends (the end-of-text token, or the length limit) is a finished hypothesis
//!   if it ranks among the first k, scored by its summed log-probability divided by
//!   (generated tokens)^α; the k best finished ones are kept;
//! - the k best candidates that do not end run on;
//! - the search stops when the best running beam, scored at its current length, can no longer
//!   beat the worst of k finished hypotheses (transformers' default `early_stopping=False`), or
//!   when every candidate ends.
//!
//! [`BeamSearch`] is the bookkeeping alone, driven one step at a time by whoever runs the model
//! (the server's engine batches the beams with other requests); [`beam_search`] drives it with
//! the model directly. Beams share the prompt's KV cache: each continuation forks its parent's.
//! Scores are kept in f32, as transformers keeps them.

use candle_core::{Device, Tensor};

use crate::error::Result;
use crate::gpt::{Gpt, LogitsFor, SeqStep};

/// transformers' stand-in for minus infinity in beam scores.
const NEG: f32 = -1.0e9;

#[derive(Debug, Clone, PartialEq)]
pub struct BeamParams {
    /// Beams kept (k).
    pub beams: usize,
    pub max_new_tokens: usize,
    /// α: finished hypotheses are scored by summed log-probability / generated^α.
    pub length_penalty: f32,
    pub eos: Option<u32>,
}

/// A finished hypothesis: the generated tokens (the end-of-text token included when it ended
/// there), their log-probabilities, and the length-penalised score.
#[derive(Debug, Clone, PartialEq)]
pub struct Hypothesis {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub score: f32,
    pub ended_by_eos: bool,
}

#[derive(Debug, Clone)]
struct Running {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    /// Summed log-probability (NEG for the placeholder beams of the first step).
    score: f32,
}

/// Which running beams continue, and how: `parents[i]` is the beam whose KV cache beam i forks
/// before its next step, and `tokens[i]` the token it adds.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    pub parents: Vec<usize>,
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct BeamSearch {
    params: BeamParams,
    running: Vec<Running>,
    /// The k best finished hypotheses, best first (fewer early on).
    finished: Vec<Hypothesis>,
    generated: usize,
    improvable: bool,
    done: bool,
}

impl BeamSearch {
    /// A search whose k beams all start as the prompt (only the first counts at the first step).
    pub fn new(params: BeamParams) -> Self {
        let k = params.beams.max(1);
        let running = (0..k)
            .map(|i| Running {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                score: if i == 0 { 0.0 } else { NEG },
            })
            .collect();
        Self {
            params: BeamParams { beams: k, ..params },
            running,
            finished: Vec::new(),
            generated: 0,
            improvable: true,
            done: false,
        }
    }

    pub fn beams(&self) -> usize {
        self.params.beams
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The last token of each running beam (its input to the next step).
    pub fn last_tokens(&self) -> Vec<u32> {
        self.running
            .iter()
            .map(|b| b.tokens.last().copied().unwrap_or(0))
            .collect()
    }

    /// One step: `logits[i]` are the raw logits of running beam i's next token. Returns how the
    /// beams continue, or `None` when the search is over (then see [`BeamSearch::finish`]).
    pub fn step(&mut self, logits: &[Vec<f32>]) -> Option<Selection> {
        let k = self.params.beams;
        let vocab = logits.first().map_or(0, Vec::len);
        // Every continuation's accumulated score: beam score + log-softmax, in f32.
        let mut scored: Vec<(f32, usize, u32, f32)> = Vec::with_capacity(k * vocab);
        for (b, (beam, row)) in self.running.iter().zip(logits).enumerate() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
            for (t, &x) in row.iter().enumerate() {
                let lp = x - lse;
                scored.push((beam.score + lp, b, t as u32, lp));
            }
        }
        // The best 2k (ties: lower flat index first).
        let keep = (2 * k).min(scored.len());
        let by_score = |a: &(f32, usize, u32, f32), b: &(f32, usize, u32, f32)| {
            b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2)))
        };
        if keep < scored.len() {
            scored.select_nth_unstable_by(keep - 1, by_score);
            scored.truncate(keep);
        }
        scored.sort_by(by_score);

        let at_limit = self.generated + 1 >= self.params.max_new_tokens;
        let ends = |t: u32| at_limit || Some(t) == self.params.eos;
        let length = (self.generated + 1) as f32;
        // Finished hypotheses: the ending candidates among the first k.
        if self.improvable {
            for &(score, b, t, lp) in scored.iter().take(k).filter(|c| ends(c.2)) {
                let parent = &self.running[b];
                let mut tokens = parent.tokens.clone();
                tokens.push(t);
                let mut logprobs = parent.logprobs.clone();
                logprobs.push(lp);
                self.finished.push(Hypothesis {
                    tokens,
                    logprobs,
                    score: score / length.powf(self.params.length_penalty),
                    ended_by_eos: Some(t) == self.params.eos,
                });
            }
            self.finished.sort_by(|a, b| b.score.total_cmp(&a.score));
            self.finished.truncate(k);
        }
        // Running beams: the best k candidates that do not end (transformers ranks the ending ones
        // last, at score - 1e9; there are always k others but at the length limit).
        let mut next: Vec<&(f32, usize, u32, f32)> = scored.iter().filter(|c| !ends(c.2)).collect();
        next.extend(scored.iter().filter(|c| ends(c.2)));
        next.truncate(k);
        let selection = Selection {
            parents: next.iter().map(|c| c.1).collect(),
            tokens: next.iter().map(|c| c.2).collect(),
        };
        self.running = next
            .iter()
            .map(|&&(score, b, t, lp)| {
                let parent = &self.running[b];
                let mut tokens = parent.tokens.clone();
                tokens.push(t);
                let mut logprobs = parent.logprobs.clone();
                logprobs.push(lp);
                Running {
                    tokens,
                    logprobs,
                    score: if ends(t) { score + NEG } else { score },
                }
            })
            .collect();
        self.generated += 1;

        // Can a running beam still beat the worst of k finished hypotheses? (Judged at its
        // current length, as transformers' heuristic does.)
        if self.improvable {
            let best_running = self.running[0].score / (self.generated as f32).powf(self.params.length_penalty);
            let worst_finished = match self.finished.len() == k {
                true => self.finished.iter().map(|h| h.score).fold(f32::INFINITY, f32::min),
                false => NEG,
            };
            self.improvable = best_running > worst_finished;
        }
        let all_end = scored.iter().all(|c| ends(c.2));
        self.done = !self.improvable || all_end;
        (!self.done).then_some(selection)
    }

    /// The finished hypotheses, best first.
    pub fn finish(self) -> Vec<Hypothesis> {
        self.finished
    }
}

/// Beam search after `prompt` with the model directly (one sequence; the server batches beams
/// with its other requests instead). Returns the finished hypotheses, best first.
pub fn beam_search(model: &Gpt, prompt: &[u32], params: &BeamParams) -> Result<Vec<Hypothesis>> {
    let mut search = BeamSearch::new(params.clone());
    let k = search.beams();
    let mut prompt_cache = model.new_cache();
    let logits = model.forward_step(
        &mut [SeqStep {
            tokens: prompt,
            cache: &mut prompt_cache,
        }],
        LogitsFor::Last,
    )?;
    let first = logits.squeeze(0)?.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    let mut rows = vec![first; k];
    let mut caches = vec![prompt_cache];
    let mut parents_are_prompt = true;
    while let Some(selection) = search.step(&rows) {
        // Each new beam forks its parent's cache (the first step's parents all share the prompt's);
        // a parent's last child takes it over instead.
        caches = reorder(caches, &selection.parents, parents_are_prompt)?;
        parents_are_prompt = false;
        let mut steps: Vec<SeqStep> = caches
            .iter_mut()
            .zip(&selection.tokens)
            .map(|(cache, t)| SeqStep {
                tokens: std::slice::from_ref(t),
                cache,
            })
            .collect();
        let logits = model.forward_step(&mut steps, LogitsFor::Last)?; // (k, V)
        rows = logits.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
    }
    Ok(search.finish())
}

/// The caches of the next step's beams: `parents[i]`'s cache for beam i, moved to its last child
/// and copied for the others (`from_one`: every parent is `caches[0]`, the prompt's).
pub fn reorder<T: Forkable>(mut caches: Vec<T>, parents: &[usize], from_one: bool) -> Result<Vec<T>> {
    let source = |p: usize| if from_one { 0 } else { p };
    let mut out: Vec<Option<T>> = (0..parents.len()).map(|_| None).collect();
    for (i, &p) in parents.iter().enumerate() {
        let last_use = !parents[i + 1..].iter().any(|&q| source(q) == source(p));
        let cache = &mut caches[source(p)];
        out[i] = Some(if last_use { cache.take() } else { cache.fork_copy()? });
    }
    Ok(out.into_iter().flatten().collect())
}

/// A per-beam state that can be copied for a second child or handed over to the last one.
pub trait Forkable: Sized {
    fn fork_copy(&self) -> Result<Self>;
    /// Takes the state, leaving an empty one behind.
    fn take(&mut self) -> Self;
}

impl Forkable for crate::kv_cache::KvCache {
    fn fork_copy(&self) -> Result<Self> {
        Ok(self.fork()?)
    }
    fn take(&mut self) -> Self {
        let empty = self.empty_like();
        std::mem::replace(self, empty)
    }
}

/// Rows of a `(k, V)` logits tensor on the host (for drivers of [`BeamSearch`]).
pub fn rows(logits: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(logits.to_device(&Device::Cpu)?.to_vec2::<f32>()?)
}
