//! What the engine takes: a request that validation has checked and tokenised
//! ([`crate::validation::validate`] makes it), its prompts as token ids.

use std::sync::Arc;

use gpt::SamplingParams;

use super::constraint::Compiled;

/// One prompt: its token ids, and its text (as given, or decoded from the ids).
#[derive(Debug, Clone)]
pub struct ValidPrompt {
    pub ids: Vec<u32>,
    pub text: String,
}

#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub prompts: Vec<ValidPrompt>,
    pub max_tokens: usize,
    /// Tokens generated before the end-of-text token, a stop token or a stop string may end a
    /// choice.
    pub min_tokens: usize,
    /// For candidate i of a prompt the seed is `sampling.seed + i`.
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Choices returned per prompt.
    pub n: usize,
    /// Candidates generated per prompt (>= n); the n with the highest cumulative logprob are
    /// returned.
    pub best_of: usize,
    pub logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: each prompt token's log-probability and rank, with this many
    /// most likely tokens at its position (not with `stream`).
    pub prompt_logprobs: Option<usize>,
    pub echo: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Every chunk of the stream carries the usage so far (`continuous_usage_stats`).
    pub continuous_usage: bool,
    /// Beam search instead of sampling: `best_of` beams, scored with this length penalty.
    pub beam_search: Option<f32>,
    /// The stop string that ends a choice stays in its text.
    pub include_stop_str: bool,
    pub skip_special_tokens: bool,
    /// Sample only among these ids (sorted, no duplicates).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Logprobs' tokens as `token_id:<id>`.
    pub tokens_as_ids: bool,
    /// The client's id for the request (the response's id is made from it).
    pub request_id: Option<String>,
    /// Prefix-cache entries are shared only with requests of the same salt.
    pub cache_salt: Option<String>,
    /// The grammar every choice follows (structured outputs), compiled.
    pub constraint: Option<Arc<Compiled>>,
    /// Speculative decoding: tokens proposed per step at most for this request (`None`: the
    /// server's setting; 0: none).
    pub speculative_tokens: Option<usize>,
    /// The LoRA adapter the request's `model` names (`None`: the base model).
    pub adapter: Option<Arc<crate::adapters::ServedAdapter>>,
    /// The prompts are embedded, not continued: each prompt's prefill sends its
    /// [`super::Event::Embedding`] and nothing else ([`ValidRequest::embeddings`]).
    pub embed: bool,
}

impl ValidRequest {
    /// A request for `prompts` with every option at its default: greedy, no tokens, one choice,
    /// nothing returned beyond the text.
    pub fn new(prompts: Vec<ValidPrompt>) -> Self {
        Self {
            prompts,
            max_tokens: 0,
            min_tokens: 0,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            n: 1,
            best_of: 1,
            logprobs: None,
            prompt_logprobs: None,
            echo: false,
            stream: false,
            include_usage: false,
            continuous_usage: false,
            beam_search: None,
            include_stop_str: false,
            skip_special_tokens: true,
            allowed_token_ids: None,
            tokens_as_ids: false,
            request_id: None,
            cache_salt: None,
            constraint: None,
            speculative_tokens: None,
            adapter: None,
            embed: false,
        }
    }

    /// A request for the embeddings of `prompts` (under `adapter`), which the engine prefills in
    /// its steps beside generation.
    pub fn embeddings(prompts: Vec<ValidPrompt>, adapter: Option<Arc<crate::adapters::ServedAdapter>>) -> Self {
        Self {
            adapter,
            embed: true,
            ..Self::new(prompts)
        }
    }

    /// Top-N wanted at each prompt position from the prefill: for `echo` with `logprobs`, for
    /// `prompt_logprobs`, or the larger of the two.
    pub fn prompt_top_k(&self) -> Option<usize> {
        let echoed = self.logprobs.filter(|_| self.echo);
        match (echoed, self.prompt_logprobs) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// Which prefix-cache entries the request may share: those of its adapter and salt.
    pub fn prefix_scope(&self) -> super::prefix::Scope {
        super::prefix::Scope {
            adapter: self.adapter.as_ref().map(|a| a.id),
            salt: self.cache_salt.clone(),
        }
    }

    /// The LoRA adapter's update, if the request has one.
    pub fn lora(&self) -> Option<&gpt::Adapter> {
        self.adapter.as_ref().map(|a| &a.adapter)
    }

    /// The engine tells the handler about the prompt once it is prefilled.
    pub fn sends_prompt(&self) -> bool {
        self.echo || self.prompt_logprobs.is_some()
    }
}
