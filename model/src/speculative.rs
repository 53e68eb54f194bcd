//! Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a cheap proposer guesses the
//! next few tokens, the model scores all of them in one step (as a prefill does, reading its
//! weights once), and [`Sampler::verify`] keeps the longest prefix its rule accepts, then adds
//! one token of the model's own. At batch 1 a step costs about the same for one token or five,
//! so each accepted token is nearly free; the output is distributed as without speculation (and
//! is the same tokens under greedy decoding).
//!
//! Proposers: an n-gram lookup in the tokens so far (prompt lookup, as llama.cpp's and vLLM's
//! n-gram mode) and a smaller draft model with the same tokenizer, run greedily. Both propose a
//! point mass, the case the verification rule is written for.

use crate::error::{Error, Result};
use crate::gpt::{Gpt, LogitsFor, SeqStep};
use crate::kv_cache::KvCache;
use crate::sampling::Sampler;
use crate::tokenizer::Tokenizer;

/// Checks that `draft` can propose for `model`: the same vocabulary (every token the same text),
/// the same end-of-text token, on the same device. The error names the first difference.
pub fn check_draft(model: (&Gpt, &Tokenizer), draft: (&Gpt, &Tokenizer)) -> Result<()> {
    let ((m, mt), (d, dt)) = (model, draft);
    let mismatch = |what: String| Err(Error::DraftMismatch(what));
    if m.config().vocab_size != d.config().vocab_size {
        return mismatch(format!(
            "vocab_size {} against the model's {}",
            d.config().vocab_size,
            m.config().vocab_size
        ));
    }
    if mt.vocab_size() != dt.vocab_size() {
        return mismatch(format!(
            "its tokenizer has {} tokens against the model's {}",
            dt.vocab_size(),
            mt.vocab_size()
        ));
    }
    if mt.eos_token_id() != dt.eos_token_id() {
        return mismatch(format!(
            "end-of-text token {:?} against the model's {:?}",
            dt.eos_token_id(),
            mt.eos_token_id()
        ));
    }
    for id in 0..mt.vocab_size() as u32 {
        let (a, b) = (mt.inner().id_to_token(id), dt.inner().id_to_token(id));
        if a != b {
            return mismatch(format!("token {id} is {b:?} in its tokenizer and {a:?} in the model's"));
        }
    }
    if !m.device().same_device(d.device()) {
        return mismatch(format!("it is on {:?}, the model on {:?}", d.device(), m.device()));
    }
    Ok(())
}

/// Where proposals come from, as the command lines name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Off,
    /// Prompt lookup: [`ngram_proposal`].
    Ngram,
    /// A draft model: [`Draft`].
    Draft,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(Mode::Off),
            "ngram" => Ok(Mode::Ngram),
            "draft" => Ok(Mode::Draft),
            _ => Err(format!("`{s}`: expected off, ngram or draft")),
        }
    }
}

/// The longest n-gram looked up, then shorter ones down to [`NGRAM_MIN`].
pub const NGRAM_MAX: usize = 8;
pub const NGRAM_MIN: usize = 2;

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `tokens` (from [`NGRAM_MAX`] tokens down to [`NGRAM_MIN`]) found earlier in them; empty
/// when none recurs.
pub fn ngram_proposal(tokens: &[u32], k: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (NGRAM_MIN..=NGRAM_MAX.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - n..];
        // The most recent start before the suffix itself whose n tokens match it.
        if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == tail) {
            let from = start + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// How many tokens to propose, adapted as they are accepted: two more after a step that kept
/// them all, one fewer after one that did not (`transformers`' assisted generation's rule).
#[derive(Debug, Clone, Copy)]
pub struct ProposalLength {
    k: usize,
    max: usize,
}

impl ProposalLength {
    pub fn new(max: usize) -> Self {
        Self { k: max, max }
    }

    pub fn get(&self) -> usize {
        self.k
    }

    pub fn update(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.k = if accepted == proposed {
            (self.k + 2).min(self.max)
        } else {
            self.k.saturating_sub(1).max(1)
        };
    }
}

/// A draft model's state for one sequence: its cache, which follows the sequence's tokens.
pub struct Draft<'a> {
    model: &'a Gpt,
    cache: KvCache,
}

impl<'a> Draft<'a> {
    pub fn new(model: &'a Gpt) -> Self {
        Self {
            cache: model.new_cache(),
            model,
        }
    }

    /// Up to `k` greedy tokens after `tokens`: the draft first reads what of `tokens` its cache
    /// lacks, then one step per token. Fewer where its context ends.
    pub fn propose(&mut self, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        if self.cache.len() > tokens.len() {
            self.cache.truncate(tokens.len())?;
        }
        // The draft reads the tokens and each proposal but the last.
        let Some(room) = self.model.config().n_positions.checked_sub(tokens.len()) else {
            return Ok(Vec::new());
        };
        let k = k.min(room + 1);
        let mut out = Vec::with_capacity(k);
        let mut input = tokens[self.cache.len()..].to_vec();
        while out.len() < k && !input.is_empty() {
            let logits = self.model.forward_step(
                &mut [SeqStep {
                    tokens: &input,
                    cache: &mut self.cache,
                }],
                LogitsFor::Last,
            )?;
            let row = logits.squeeze(0)?.to_vec1::<f32>()?;
            let Some(token) = gpt_kernels::argmax(&row) else { break };
            out.push(token as u32);
            input = vec![token as u32];
        }
        Ok(out)
    }

    /// After the model's check: the draft's cache keeps only what the sequence kept.
    pub fn rollback(&mut self, len: usize) -> Result<()> {
        if self.cache.len() > len {
            self.cache.truncate(len)?;
        }
        Ok(())
    }
}

/// Where proposals come from.
pub enum Proposer<'a> {
    NGram,
    Draft(Draft<'a>),
}

impl Proposer<'_> {
    pub fn propose(&mut self, tokens: &[u32], k: usize) -> Result<Vec<u32>> {
        match self {
            Proposer::NGram => Ok(ngram_proposal(tokens, k)),
            Proposer::Draft(d) => d.propose(tokens, k),
        }
    }

    fn rollback(&mut self, len: usize) -> Result<()> {
        match self {
            Proposer::NGram => Ok(()),
            Proposer::Draft(d) => d.rollback(len),
        }
    }
}

/// Counts of a speculative generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Steps of the model that checked proposals.
    pub checks: usize,
    pub proposed: usize,
    pub accepted: usize,
}

/// [`crate::generate`] with speculation: the same tokens under greedy decoding, the same
/// distribution under sampling. Proposes up to `max_k` tokens a step, adapted to acceptance.
pub fn generate(
    model: &Gpt,
    proposer: &mut Proposer<'_>,
    max_k: usize,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    eos: Option<u32>,
) -> Result<(Vec<u32>, Stats)> {
    let context = model.config().n_positions;
    let mut stats = Stats::default();
    let mut length = ProposalLength::new(max_k.max(1));
    let mut cache = model.new_cache();
    let mut output: Vec<u32> = Vec::new();
    let mut tokens = prompt.to_vec();
    // The prompt, as without speculation.
    if max_new == 0 || prompt.len() > context {
        return Ok((output, stats));
    }
    let mut rows = vec![model
        .forward_step(
            &mut [SeqStep {
                tokens: prompt,
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )?
        .squeeze(0)?
        .to_vec1::<f32>()?];
    let mut proposals: Vec<u32> = Vec::new();
    loop {
        // The model's rows: row i checks proposal i; the last has none.
        let mut accepted = 0;
        for (i, row) in rows.iter().enumerate() {
            let (token, kept) = match proposals.get(i) {
                Some(&p) => sampler.verify(row, prompt, &output, &[], p)?,
                None => (sampler.sample_row(row, prompt, &output, &[])?, false),
            };
            if Some(token) == eos {
                return Ok((output, stats));
            }
            output.push(token);
            tokens.push(token);
            if output.len() >= max_new {
                return Ok((output, stats));
            }
            if !kept {
                break;
            }
            accepted += 1;
        }
        if !proposals.is_empty() {
            stats.checks += 1;
            stats.proposed += proposals.len();
            stats.accepted += accepted;
            length.update(proposals.len(), accepted);
        }
        // The cache holds every token but the last, which the next step reads.
        let kept = tokens.len() - 1;
        cache.truncate(kept)?;
        proposer.rollback(kept)?;
        if tokens.len() > context {
            return Ok((output, stats));
        }
        // Each step adds at least one token: propose no more than the output and context hold.
        let room = (max_new - output.len() - 1).min(context - tokens.len());
        proposals = proposer.propose(&tokens, length.get().min(room))?;
        let mut input = vec![tokens[kept]];
        input.extend_from_slice(&proposals);
        let logits = model.forward_step(
            &mut [SeqStep {
                tokens: &input,
                cache: &mut cache,
            }],
            LogitsFor::All,
        )?;
        rows = (0..input.len())
            .map(|r| logits.get(r).and_then(|row| row.to_vec1::<f32>()))
            .collect::<candle_core::Result<_>>()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_proposes_what_followed_the_latest_longest_match() {
        //            0  1  2  3  4  5  6  7  8  9
        let tokens = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3];
        // The suffix [1 2 3] last occurred at 4, followed by 7 1 2 3.
        assert_eq!(ngram_proposal(&tokens, 3), [7, 1, 2]);
        assert_eq!(ngram_proposal(&tokens, 10), [7, 1, 2, 3]);
        assert_eq!(ngram_proposal(&tokens, 0), Vec::<u32>::new());
        // A longer match wins over a more recent shorter one: [5 1 2] recurs at 0.
        let tokens = [5, 1, 2, 8, 8, 1, 2, 6, 5, 1, 2];
        assert_eq!(ngram_proposal(&tokens, 2), [8, 8]);
        // Nothing recurs.
        assert!(ngram_proposal(&[1, 2, 3, 4], 4).is_empty());
        assert!(ngram_proposal(&[7], 4).is_empty());
    }

    #[test]
    fn proposal_length_follows_acceptance() {
        let mut l = ProposalLength::new(6);
        assert_eq!(l.get(), 6);
        l.update(6, 2);
        l.update(5, 0);
        assert_eq!(l.get(), 4);
        l.update(4, 4);
        assert_eq!(l.get(), 6);
        for _ in 0..10 {
            l.update(1, 0);
        }
        assert_eq!(l.get(), 1, "never below one");
    }
}
