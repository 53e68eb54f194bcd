//! Speculative decoding in the engine ([`gpt::speculative`] has the rule and the proposers): before
//! a step, each sampled sequence that is decoding gets up to k proposed tokens, from an n-gram
//! lookup in its tokens or from the draft model (one batched draft step per proposed token, for
//! all of them together); the step then runs each such sequence's last token and its proposals
//! (`StepInput::verify`), and the sequence keeps what [`gpt::Sampler::verify`] accepts
//! ([`super::sequence::Sequence::advance`]). Above `max_batch` sequences the step is plain: a
//! batched step already reads each weight once for many tokens, and proposals only add rows. So is
//! it while requests wait or prefill (the engine's `propose`), and for a sequence whose measured
//! gain over its remaining tokens would not pay for the draft's reading of what its cache lacks
//! ([`Speculator::pays`]).

use gpt::speculative::{ngram_proposal, ProposalLength};
use gpt::Gpt;

use super::runner::{Runner, StepInput};
use super::sequence::Sequence;

/// Sequences up to which speculation pays by default, with a draft model and with n-grams: on
/// the default model and its draft (2 cores, EPYC), the draft's proposals gave 1.07x plain at 8
/// streams and 1.03-1.08x at 16; the n-grams' 0.98-1.01x at 8 and 0.90-1.01x at 16
/// (BENCHMARKS.md, "Speculative decoding").
pub const DRAFT_MAX_BATCH: usize = 8;
pub const NGRAM_MAX_BATCH: usize = 4;

/// The most tokens proposed per step (`--num-speculative-tokens`, a request's
/// `num_speculative_tokens`).
pub const MAX_TOKENS: usize = 16;

pub enum Proposer {
    Ngram,
    /// The draft model, its runner (its caches are the sequences'); boxed, as the model is large
    /// beside the n-gram lookup's nothing.
    Draft(Box<Runner>),
}

pub struct SpeculateConfig {
    /// `None`: the n-gram lookup.
    pub draft: Option<Gpt>,
    /// Tokens proposed per step at most.
    pub max_tokens: usize,
    /// Speculate only while at most this many sequences run.
    pub max_batch: usize,
}

pub struct Speculator {
    proposer: Proposer,
    pub max_tokens: usize,
    pub max_batch: usize,
    /// What a token the draft reads costs, in decode steps of the model: the draft's parameters
    /// over the model's, times [`PREFILL_PER_STEP`].
    draft_cost: f64,
    /// The checks and accepted tokens counted at the start of the current window, and the mean
    /// tokens a check kept over the last whole window ([`Speculator::kept_per_check`]).
    window: (u64, u64),
    kept: Option<f64>,
}

/// Checks per window of the measured acceptance.
const WINDOW: u64 = 256;

/// A token of a prefill against a decode step of the same model, in time: on the default model
/// (2 cores, Zen 5) a prefill reads 512 tokens in about the time of 24 decode steps.
const PREFILL_PER_STEP: f64 = 1.0 / 20.0;

impl Speculator {
    pub fn new(cfg: SpeculateConfig, model_params: usize) -> Self {
        let draft_cost = match &cfg.draft {
            Some(draft) => draft.num_parameters() as f64 / model_params.max(1) as f64 * PREFILL_PER_STEP,
            None => 0.0,
        };
        Self {
            proposer: match cfg.draft {
                Some(draft) => Proposer::Draft(Box::new(Runner::new(draft))),
                None => Proposer::Ngram,
            },
            max_tokens: cfg.max_tokens.clamp(1, MAX_TOKENS),
            max_batch: cfg.max_batch,
            draft_cost,
            window: (0, 0),
            kept: None,
        }
    }

    /// Tokens a check keeps, its accepted proposals and the model's own one, as measured over
    /// the last window of [`WINDOW`] checks (`totals`: the server's checks and accepted tokens so
    /// far); 2 until a window is whole (an optimistic start, so that it is measured at all).
    fn kept_per_check(&mut self, (checks, accepted): (u64, u64)) -> f64 {
        let (c0, a0) = self.window;
        if checks >= c0 + WINDOW {
            self.kept = Some(1.0 + accepted.saturating_sub(a0) as f64 / (checks - c0) as f64);
            self.window = (checks, accepted);
        }
        self.kept.unwrap_or(2.0)
    }

    /// Whether a sequence pays for the draft's reading of the `lack` tokens its cache lacks:
    /// the model steps speculation saves over its `remaining` tokens, at `kept` tokens a step,
    /// against that reading, `lack` tokens of the draft. (At the tail of a batch of long
    /// sequences the draft would read each one's whole text for a few steps: the cost the
    /// speculative issue measured at 32 sampled streams, 0.79-0.88x of no speculation.)
    fn pays(&self, kept: f64, lack: usize, remaining: usize) -> bool {
        let saved = remaining as f64 * (1.0 - 1.0 / kept.max(1.0));
        saved > lack as f64 * self.draft_cost
    }

    /// Proposals for `seqs` (decoding, sampled ones), each up to what its request allows and
    /// what its output and the context have room for. A draft step that fails leaves its
    /// sequences without proposals; the step then runs as usual.
    pub fn propose(&mut self, seqs: &mut [&mut Sequence], context: usize, totals: (u64, u64)) {
        let kept = self.kept_per_check(totals);
        let draft = matches!(self.proposer, Proposer::Draft(_));
        let wants: Vec<usize> = seqs
            .iter_mut()
            .map(|s| {
                let k = s
                    .request
                    .speculative_tokens
                    .unwrap_or(self.max_tokens)
                    .min(self.max_tokens);
                let room = s.speculation_room(context);
                let lack =
                    (s.token_count()).saturating_sub(s.speculation().draft_cache.as_ref().map_or(0, |c| c.len()));
                let spec = s.speculation();
                spec.proposal.clear();
                if k == 0 || (draft && !self.pays(kept, lack, room)) {
                    return 0;
                }
                spec.length
                    .get_or_insert_with(|| ProposalLength::new(k))
                    .get()
                    .min(room)
            })
            .collect();
        match &self.proposer {
            Proposer::Ngram => {
                for (s, &k) in seqs.iter_mut().zip(&wants) {
                    if k > 0 {
                        let proposal = ngram_proposal(&s.tokens(), k);
                        s.speculation().proposal = proposal;
                    }
                }
            }
            Proposer::Draft(runner) => draft_proposals(runner, seqs, &wants),
        }
    }
}

/// Greedy proposals from the draft model, one batched step per token: the first reads what of
/// each sequence its draft cache lacks (the whole prompt at first), the next ones the token just
/// proposed.
fn draft_proposals(runner: &Runner, seqs: &mut [&mut Sequence], wants: &[usize]) {
    let draft_context = runner.model().config().n_positions;
    let mut inputs: Vec<Vec<u32>> = seqs
        .iter_mut()
        .zip(wants)
        .map(|(s, &k)| {
            let tokens = s.tokens();
            // The draft reads the tokens and each proposal but the last.
            if k == 0 || tokens.len() > draft_context {
                return Vec::new();
            }
            let model = runner.model();
            let cache = s.speculation().draft_cache.get_or_insert_with(|| model.new_cache());
            let held = cache.len().min(tokens.len() - 1);
            if cache.truncate(held).is_err() {
                return Vec::new();
            }
            tokens[held..].to_vec()
        })
        .collect();
    let wants: Vec<usize> = (seqs.iter())
        .zip(wants)
        .map(|(s, &k)| k.min(draft_context + 1 - s.token_count().min(draft_context)))
        .collect();
    loop {
        let active: Vec<usize> = (0..seqs.len())
            .filter(|&i| !inputs[i].is_empty() && seqs[i].proposal_len() < wants[i])
            .collect();
        if active.is_empty() {
            return;
        }
        let outputs = {
            let mut steps: Vec<StepInput> = Vec::with_capacity(active.len());
            let mut want = active.iter().peekable();
            for (i, (s, input)) in seqs.iter_mut().zip(&inputs).enumerate() {
                if want.peek() == Some(&&i) {
                    want.next();
                    if let Some(cache) = s.speculation().draft_cache.as_mut() {
                        steps.push(StepInput {
                            tokens: input,
                            cache,
                            prompt_logprobs: None,
                            verify: false,
                            // The draft proposes as the base would; the check applies the
                            // sequence's adapter, so output is the adapter's either way.
                            adapter: None,
                            // The draft's own greedy pick is its proposal.
                            greedy: true,
                            embed: false,
                        });
                    }
                }
            }
            runner.step(&mut steps)
        };
        for (&i, out) in active.iter().zip(outputs) {
            let next = out
                .ok()
                .and_then(|o| o.greedy.or_else(|| gpt_kernels::argmax(&o.last).map(|t| t as u32)));
            match next {
                Some(token) => {
                    seqs[i].speculation().proposal.push(token);
                    inputs[i] = vec![token];
                }
                None => inputs[i].clear(),
            }
        }
    }
}
