//! Turns a raw completion request into a valid one: one check per rule, each error naming the
//! parameter (and for a prompt, its position) and the allowed range. The numeric ranges live in
//! one table, [`Limits::int_ranges`] and [`FLOAT_RANGES`], which the OpenAPI document states too.
//! Tokenises the prompts, so it runs off the async runtime.

use gpt::{SamplingParams, Tokenizer};

use crate::api::{ChatCompletionRequest, CompletionRequest, Prompt, Stop};
use crate::engine::constraint::Grammars;
use crate::engine::{ValidPrompt, ValidRequest};
use crate::error::ApiError;
use crate::structured::{self, Requested};

/// The request parameters' names, as clients send them and errors and the OpenAPI document name
/// them: one table, so that a rule, its range and its message cannot disagree on a name.
pub mod param {
    pub const MAX_TOKENS: &str = "max_tokens";
    pub const MIN_TOKENS: &str = "min_tokens";
    pub const TEMPERATURE: &str = "temperature";
    pub const TOP_P: &str = "top_p";
    pub const TOP_K: &str = "top_k";
    pub const MIN_P: &str = "min_p";
    pub const REPETITION_PENALTY: &str = "repetition_penalty";
    pub const PRESENCE_PENALTY: &str = "presence_penalty";
    pub const FREQUENCY_PENALTY: &str = "frequency_penalty";
    pub const LENGTH_PENALTY: &str = "length_penalty";
    pub const LOGIT_BIAS: &str = "logit_bias";
    pub const SEED: &str = "seed";
    pub const N: &str = "n";
    pub const BEST_OF: &str = "best_of";
    pub const LOGPROBS: &str = "logprobs";
    pub const PROMPT_LOGPROBS: &str = "prompt_logprobs";
    pub const STOP: &str = "stop";
    pub const STOP_TOKEN_IDS: &str = "stop_token_ids";
    pub const PROMPT: &str = "prompt";
}

/// What the served model and the operator allow.
#[derive(Debug, Clone)]
pub struct Limits {
    pub vocab_size: usize,
    /// The model's context length: a prompt may hold `context - 1` tokens.
    pub context: usize,
    pub max_tokens_cap: usize,
    pub max_n: usize,
    pub max_logprobs: usize,
    /// Stop strings, and stop token ids, per request.
    pub max_stop: usize,
    /// Stop strings a chat template adds to the request's own (beyond `max_stop`).
    pub template_stops: usize,
    /// Prompts per request.
    pub max_prompts: usize,
    /// A character-level vocabulary's characters: a prompt with any other is refused.
    pub alphabet: Option<Vec<char>>,
    pub n_layer: usize,
    pub n_head: usize,
    /// The longest prompt `/v1/attention` takes.
    pub max_attention_tokens: usize,
}

/// An integer parameter's allowed values, both ends included.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IntRange {
    pub param: &'static str,
    pub min: i64,
    pub max: i64,
}

/// A number parameter's allowed values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FloatRange {
    pub param: &'static str,
    pub min: f64,
    /// `min` itself is not allowed.
    pub exclusive_min: bool,
    pub max: Option<f64>,
}

pub const FLOAT_RANGES: [FloatRange; 7] = [
    FloatRange {
        param: param::TEMPERATURE,
        min: 0.0,
        exclusive_min: false,
        max: None,
    },
    FloatRange {
        param: param::TOP_P,
        min: 0.0,
        exclusive_min: true,
        max: Some(1.0),
    },
    FloatRange {
        param: param::MIN_P,
        min: 0.0,
        exclusive_min: false,
        max: Some(1.0),
    },
    FloatRange {
        param: param::REPETITION_PENALTY,
        min: 0.0,
        exclusive_min: true,
        max: None,
    },
    FloatRange {
        param: param::PRESENCE_PENALTY,
        min: -2.0,
        exclusive_min: false,
        max: Some(2.0),
    },
    FloatRange {
        param: param::FREQUENCY_PENALTY,
        min: -2.0,
        exclusive_min: false,
        max: Some(2.0),
    },
    FloatRange {
        param: param::LENGTH_PENALTY,
        min: -10.0,
        exclusive_min: false,
        max: Some(10.0),
    },
];

/// The parameters that beam search, being deterministic, does not take: each with the values that
/// mean "not given" (beside absence).
pub const NOT_WITH_BEAMS: [(&str, &[f64]); 8] = [
    (param::TEMPERATURE, &[0.0]),
    (param::TOP_P, &[1.0]),
    (param::TOP_K, &[-1.0, 0.0]),
    (param::MIN_P, &[0.0]),
    (param::REPETITION_PENALTY, &[1.0]),
    (param::PRESENCE_PENALTY, &[0.0]),
    (param::FREQUENCY_PENALTY, &[0.0]),
    (param::MIN_TOKENS, &[0.0]),
];

/// `logit_bias` values.
pub const LOGIT_BIAS: FloatRange = FloatRange {
    param: param::LOGIT_BIAS,
    min: -100.0,
    exclusive_min: false,
    max: Some(100.0),
};

impl Limits {
    pub fn int_ranges(&self) -> [IntRange; 8] {
        let cap = self.max_tokens_cap as i64;
        let int = |param, min, max| IntRange { param, min, max };
        [
            int(param::MAX_TOKENS, 0, cap),
            int(param::MIN_TOKENS, 0, cap),
            int(param::TOP_K, -1, self.vocab_size as i64),
            int(param::N, 1, self.max_n as i64),
            int(param::BEST_OF, 1, self.max_n as i64),
            int(param::LOGPROBS, 0, self.max_logprobs as i64),
            int(param::PROMPT_LOGPROBS, 0, self.max_logprobs as i64),
            int(param::SEED, i64::MIN, i64::MAX),
        ]
    }

    fn int(&self, param: &str, v: Option<i64>, default: i64) -> Result<i64, ApiError> {
        let r = self
            .int_ranges()
            .into_iter()
            .find(|r| r.param == param)
            .ok_or_else(|| ApiError::Internal(format!("no range for {param}")))?;
        let v = v.unwrap_or(default);
        if (r.min..=r.max).contains(&v) {
            Ok(v)
        } else {
            let msg = format!("{} must be between {} and {}, got {v}", r.param, r.min, r.max);
            Err(ApiError::invalid(r.param, msg))
        }
    }

    /// The token id `id` of `at` (a prompt position, say), in the vocabulary.
    pub(crate) fn token(&self, param: &'static str, at: &str, id: i64) -> Result<u32, ApiError> {
        if id < 0 || id as usize >= self.vocab_size {
            let msg = format!("{at}: token id {id} is outside the vocabulary [0, {})", self.vocab_size);
            return Err(ApiError::invalid(param, msg));
        }
        Ok(id as u32)
    }
}

impl FloatRange {
    pub fn contains(&self, v: f64) -> bool {
        let above = if self.exclusive_min {
            v > self.min
        } else {
            v >= self.min
        };
        v.is_finite() && above && self.max.is_none_or(|max| v <= max)
    }

    /// "in [-2, 2]", "in (0, 1]", ">= 0", "> 0".
    pub fn describe(&self) -> String {
        match (self.exclusive_min, self.max) {
            (false, Some(max)) => format!("in [{}, {max}]", self.min),
            (true, Some(max)) => format!("in ({}, {max}]", self.min),
            (false, None) => format!(">= {}", self.min),
            (true, None) => format!("> {}", self.min),
        }
    }

    fn check(&self, v: Option<f64>, default: f64) -> Result<f64, ApiError> {
        let v = v.unwrap_or(default);
        if self.contains(v) {
            Ok(v)
        } else {
            Err(ApiError::invalid(
                self.param,
                format!("{} must be {}, got {v}", self.param, self.describe()),
            ))
        }
    }
}

fn float(param: &str, v: Option<f64>, default: f64) -> Result<f64, ApiError> {
    FLOAT_RANGES
        .iter()
        .find(|r| r.param == param)
        .ok_or_else(|| ApiError::Internal(format!("no range for {param}")))?
        .check(v, default)
}

/// Tokenises and checks one prompt; `at` names it in errors (`prompt`, `prompt[3]`).
fn prompt_ids(
    text: Option<&str>,
    ids: Option<&[i64]>,
    at: &str,
    tokenizer: &Tokenizer,
    limits: &Limits,
    truncate: Option<usize>,
) -> Result<ValidPrompt, ApiError> {
    let prompt = match (text, ids) {
        (Some(text), _) => {
            if text.is_empty() {
                return Err(ApiError::invalid(param::PROMPT, format!("{at} must not be empty")));
            }
            let ids = tokenizer
                .encode_prompt(text)
                .map_err(|e| ApiError::invalid(param::PROMPT, format!("{at}: {e}")))?;
            ValidPrompt {
                ids,
                text: text.to_string(),
            }
        }
        (None, Some(ids)) => {
            if ids.is_empty() {
                return Err(ApiError::invalid(param::PROMPT, format!("{at} must not be empty")));
            }
            let ids = ids
                .iter()
                .enumerate()
                .map(|(i, &id)| limits.token(param::PROMPT, &format!("{at}[{i}]"), id))
                .collect::<Result<Vec<u32>, _>>()?;
            let text = tokenizer.decode(&ids)?;
            ValidPrompt { ids, text }
        }
        (None, None) => return Err(ApiError::invalid(param::PROMPT, format!("{at} must not be empty"))),
    };
    if prompt.ids.is_empty() {
        return Err(ApiError::invalid(param::PROMPT, format!("{at} encodes to no tokens")));
    }
    let mut prompt = prompt;
    if let Some(keep) = truncate.filter(|&k| k < prompt.ids.len()) {
        // The last `keep` tokens, as vLLM keeps them; the text is theirs (for `echo`).
        prompt.ids.drain(..prompt.ids.len() - keep);
        prompt.text = tokenizer.decode(&prompt.ids)?;
    }
    if prompt.ids.len() >= limits.context {
        return Err(ApiError::ContextLength {
            message: format!(
                "{at} has {} tokens, but this model's context length is {} tokens and a prompt must leave room for \
             one more: shorten it to at most {} tokens",
                prompt.ids.len(),
                limits.context,
                limits.context - 1
            ),
            param: param::PROMPT,
        });
    }
    Ok(prompt)
}

fn prompts(
    prompt: &Prompt,
    tokenizer: &Tokenizer,
    limits: &Limits,
    truncate: Option<usize>,
) -> Result<Vec<ValidPrompt>, ApiError> {
    let count = match prompt {
        Prompt::Texts(v) => v.len(),
        Prompt::TokenLists(v) => v.len(),
        _ => 1,
    };
    if count > limits.max_prompts {
        let msg = format!("at most {} prompts per request, got {count}", limits.max_prompts);
        return Err(ApiError::invalid(param::PROMPT, msg));
    }
    match prompt {
        Prompt::Text(text) => Ok(vec![prompt_ids(
            Some(text),
            None,
            param::PROMPT,
            tokenizer,
            limits,
            truncate,
        )?]),
        Prompt::Tokens(ids) => Ok(vec![prompt_ids(
            None,
            Some(ids),
            param::PROMPT,
            tokenizer,
            limits,
            truncate,
        )?]),
        Prompt::Texts(texts) => texts
            .iter()
            .enumerate()
            .map(|(i, t)| prompt_ids(Some(t), None, &format!("prompt[{i}]"), tokenizer, limits, truncate))
            .collect(),
        Prompt::TokenLists(lists) => {
            if lists.is_empty() {
                return Err(ApiError::invalid(param::PROMPT, "prompt must not be empty"));
            }
            lists
                .iter()
                .enumerate()
                .map(|(i, ids)| prompt_ids(None, Some(ids), &format!("prompt[{i}]"), tokenizer, limits, truncate))
                .collect()
        }
    }
}
/// The checks of a chat request that its completion request cannot make: `max_tokens` is
/// checked against its range even where `max_completion_tokens`, the newer name, wins. (The rest
/// of a chat request is validated as the completion request it becomes, by [`validate`].)
pub fn validate_chat(req: &ChatCompletionRequest, limits: &Limits) -> Result<(), ApiError> {
    if let (Some(_), Some(max_tokens)) = (req.max_completion_tokens, req.max_tokens) {
        limits.int(param::MAX_TOKENS, Some(max_tokens), 0)?;
    }
    Ok(())
}

/// `req` checked and tokenised, its structured-output constraint (or `tools`', from chat)
/// compiled by `grammars`.
pub fn validate(
    req: CompletionRequest,
    tokenizer: &Tokenizer,
    limits: &Limits,
    grammars: &Grammars,
    tools: Option<Requested>,
) -> Result<ValidRequest, ApiError> {
    let beam_search = match req.use_beam_search.unwrap_or(false) {
        true => Some(beam_search_settings(&req)? as f32),
        false => None,
    };
    let truncate = truncation(req.truncate_prompt_tokens, limits)?;
    let prompts = prompts(&req.prompt, tokenizer, limits, truncate)?;
    if let Some(p) = req.priority.filter(|&p| p != 0) {
        return Err(ApiError::invalid(
            "priority",
            format!("priority must be 0, got {p}: requests are served first come, first served"),
        ));
    }
    if req.cache_salt.as_deref() == Some("") {
        return Err(ApiError::invalid("cache_salt", "cache_salt must be a non-empty string"));
    }
    let allowed_token_ids = match &req.allowed_token_ids {
        None => None,
        Some(ids) if ids.is_empty() => {
            return Err(ApiError::invalid(
                "allowed_token_ids",
                "allowed_token_ids must not be empty",
            ))
        }
        Some(ids) => {
            let mut ids = (ids.iter().enumerate())
                .map(|(i, &id)| limits.token("allowed_token_ids", &format!("allowed_token_ids[{i}]"), id))
                .collect::<Result<Vec<u32>, _>>()?;
            ids.sort_unstable();
            ids.dedup();
            Some(ids)
        }
    };
    let max_tokens = limits.int(param::MAX_TOKENS, req.max_tokens, 16)? as usize;
    let min_tokens = limits.int(param::MIN_TOKENS, req.min_tokens, 0)? as usize;
    let mut sampling = sampling(&req, limits)?;
    let n = limits.int(param::N, req.n, 1)? as usize;
    let best_of = (limits.int(param::BEST_OF, req.best_of, n as i64)? as usize).max(n);
    let logprobs = match req.logprobs {
        None => None,
        some => Some(limits.int(param::LOGPROBS, some, 0)? as usize),
    };
    sampling.logit_bias = logit_bias(&req, limits)?;
    let constraint = structured::compile(&req, grammars, tools)?;
    if constraint.is_some() && beam_search.is_some() && !grammars.has_end_token() {
        return Err(ApiError::invalid(
            "use_beam_search",
            "beam search under a structured-output constraint needs a vocabulary with an end-of-text token, to \
             end a beam whose output is complete; this model's has none",
        ));
    }
    let (stop, stop_token_ids) = stops(req.stop, req.stop_token_ids, limits)?;
    let stream = req.stream.unwrap_or(false);
    let prompt_logprobs = prompt_logprobs(req.prompt_logprobs, stream, limits)?;
    let speculative_tokens = match req.num_speculative_tokens {
        Some(k) if !(0..=crate::engine::speculate::MAX_TOKENS as i64).contains(&k) => {
            return Err(ApiError::invalid(
                "num_speculative_tokens",
                format!(
                    "num_speculative_tokens must be between 0 and {}, got {k}",
                    crate::engine::speculate::MAX_TOKENS
                ),
            ))
        }
        k => k.map(|k| k as usize),
    };
    Ok(ValidRequest {
        prompts,
        max_tokens,
        min_tokens,
        sampling,
        stop,
        stop_token_ids,
        ignore_eos: req.ignore_eos.unwrap_or(false),
        n,
        best_of,
        logprobs,
        prompt_logprobs,
        echo: req.echo.unwrap_or(false),
        stream,
        include_usage: stream && req.stream_options.as_ref().is_some_and(|o| o.include_usage),
        continuous_usage: stream
            && (req.stream_options.as_ref()).is_some_and(|o| o.include_usage && o.continuous_usage_stats),
        beam_search,
        include_stop_str: req.include_stop_str_in_output.unwrap_or(false),
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
        allowed_token_ids,
        tokens_as_ids: req.return_tokens_as_token_ids.unwrap_or(false),
        request_id: req.request_id,
        cache_salt: req.cache_salt,
        adapter: None,
        constraint,
        speculative_tokens,
        embed: false,
    })
}

/// vLLM's `prompt_logprobs`: 0 to `max_logprobs` alternatives. As in vLLM, a stream cannot carry
/// them (0 is accepted there and returns nothing), and -1 (the whole vocabulary) is refused
/// beyond the server's limit, as vLLM refuses it beyond its `--max-logprobs`.
fn prompt_logprobs(k: Option<i64>, stream: bool, limits: &Limits) -> Result<Option<usize>, ApiError> {
    let Some(k) = k else { return Ok(None) };
    if stream && k != 0 {
        return Err(ApiError::invalid(
            param::PROMPT_LOGPROBS,
            "`prompt_logprobs` are not available when `stream=True`: a stream's chunks have no field for them",
        ));
    }
    if k == -1 {
        let msg = format!(
            "prompt_logprobs -1 asks for the whole vocabulary ({} tokens) at every position; at most {} are returned",
            limits.vocab_size, limits.max_logprobs
        );
        return Err(ApiError::invalid(param::PROMPT_LOGPROBS, msg));
    }
    let k = limits.int(param::PROMPT_LOGPROBS, Some(k), 0)? as usize;
    Ok((!stream).then_some(k))
}

/// `truncate_prompt_tokens`: k >= 1 tokens kept, or -1 for as many as the context allows.
fn truncation(k: Option<i64>, limits: &Limits) -> Result<Option<usize>, ApiError> {
    let most = limits.context.saturating_sub(1);
    match k {
        None => Ok(None),
        Some(-1) => Ok(Some(most)),
        Some(k) if (1..=most as i64).contains(&k) => Ok(Some(k as usize)),
        Some(k) => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!("truncate_prompt_tokens must be -1 or between 1 and {most} (the context less one), got {k}"),
        )),
    }
}

/// The sampling parameters, checked against their ranges; `logit_bias` is left empty (see
/// [`logit_bias`]). A request without a seed gets a random one.
fn sampling(req: &CompletionRequest, limits: &Limits) -> Result<SamplingParams, ApiError> {
    let temperature = float(param::TEMPERATURE, req.temperature, 1.0)?;
    let top_p = float(param::TOP_P, req.top_p, 1.0)?;
    let min_p = float(param::MIN_P, req.min_p, 0.0)?;
    let top_k = match limits.int(param::TOP_K, req.top_k, -1)? {
        k if k > 0 => Some(k as usize),
        _ => None,
    };
    let repetition_penalty = float(param::REPETITION_PENALTY, req.repetition_penalty, 1.0)?;
    let presence_penalty = float(param::PRESENCE_PENALTY, req.presence_penalty, 0.0)?;
    let frequency_penalty = float(param::FREQUENCY_PENALTY, req.frequency_penalty, 0.0)?;
    float(param::LENGTH_PENALTY, req.length_penalty, 1.0)?; // checked even where it is ignored
    let seed = limits.int(param::SEED, req.seed, 0)?;
    Ok(SamplingParams {
        temperature,
        top_p: Some(top_p),
        top_k,
        repetition_penalty: repetition_penalty as f32,
        presence_penalty: presence_penalty as f32,
        frequency_penalty: frequency_penalty as f32,
        logit_bias: Vec::new(),
        min_p,
        seed: match req.seed {
            Some(_) => seed as u64,
            None => rand::random(),
        },
    })
}

/// `logit_bias` as (token id, bias) pairs: keys that are token ids in decimal, within the
/// vocabulary, biases within [`LOGIT_BIAS`].
fn logit_bias(req: &CompletionRequest, limits: &Limits) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut out = Vec::new();
    for (key, &bias) in req.logit_bias.iter().flatten() {
        // Decimal without sign or leading zeros, as the document's pattern says.
        let id = key
            .parse::<i64>()
            .ok()
            .filter(|id| id.to_string() == *key)
            .ok_or_else(|| {
                ApiError::invalid(
                    param::LOGIT_BIAS,
                    format!("logit_bias keys must be token ids in decimal, got {key:?}"),
                )
            })?;
        let id = limits.token(param::LOGIT_BIAS, &format!("logit_bias[{key:?}]"), id)?;
        if !LOGIT_BIAS.contains(bias) {
            let msg = format!("logit_bias[{key:?}] must be {}, got {bias}", LOGIT_BIAS.describe());
            return Err(ApiError::invalid(param::LOGIT_BIAS, msg));
        }
        out.push((id, bias as f32));
    }
    Ok(out)
}

/// The stop strings and stop token ids, within the per-request limit.
fn stops(
    stop: Option<Stop>,
    stop_token_ids: Option<Vec<i64>>,
    limits: &Limits,
) -> Result<(Vec<String>, Vec<u32>), ApiError> {
    let stop = match stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > limits.max_stop + limits.template_stops || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            param::STOP,
            format!("stop must be up to {} non-empty strings", limits.max_stop),
        ));
    }
    let stop_token_ids = stop_token_ids.unwrap_or_default();
    if stop_token_ids.len() > limits.max_stop {
        let msg = format!("stop_token_ids must be up to {} token ids", limits.max_stop);
        return Err(ApiError::invalid(param::STOP_TOKEN_IDS, msg));
    }
    let stop_token_ids = stop_token_ids
        .iter()
        .enumerate()
        .map(|(i, &id)| limits.token(param::STOP_TOKEN_IDS, &format!("stop_token_ids[{i}]"), id))
        .collect::<Result<Vec<u32>, _>>()?;
    Ok((stop, stop_token_ids))
}

/// Beam search's length penalty, after checking that the request asks for nothing beam search
/// cannot do: sampling parameters ([`NOT_WITH_BEAMS`]), `logit_bias`, `stop_token_ids`.
/// (`ignore_eos` works as in vLLM's beam search: the end-of-text token is then an ordinary token.)
fn beam_search_settings(req: &CompletionRequest) -> Result<f64, ApiError> {
    let given: [(&str, Option<f64>); 8] = [
        (param::TEMPERATURE, req.temperature),
        (param::TOP_P, req.top_p),
        (param::TOP_K, req.top_k.map(|k| k as f64)),
        (param::MIN_P, req.min_p),
        (param::REPETITION_PENALTY, req.repetition_penalty),
        (param::PRESENCE_PENALTY, req.presence_penalty),
        (param::FREQUENCY_PENALTY, req.frequency_penalty),
        (param::MIN_TOKENS, req.min_tokens.map(|k| k as f64)),
    ];
    for ((param, value), (_, neutral)) in given.iter().zip(NOT_WITH_BEAMS) {
        if let Some(v) = value.filter(|v| !neutral.contains(v)) {
            return Err(ApiError::invalid(
                *param,
                format!("beam search is deterministic: {param} ({v}) cannot be used with use_beam_search"),
            ));
        }
    }
    let others = [
        (
            param::LOGIT_BIAS,
            req.logit_bias.as_ref().is_some_and(|b| !b.is_empty()),
        ),
        (
            param::STOP_TOKEN_IDS,
            req.stop_token_ids.as_ref().is_some_and(|t| !t.is_empty()),
        ),
    ];
    if let Some((param, _)) = others.iter().find(|(_, set)| *set) {
        let msg = format!("{param} cannot be used with use_beam_search");
        return Err(ApiError::invalid(*param, msg));
    }
    float(param::LENGTH_PENALTY, req.length_penalty, 1.0)
}
