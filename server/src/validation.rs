//! Turns a raw completion request into a valid one: one check per rule, each error naming the
//! parameter and the allowed range. Tokenises the prompt, so it runs off the async runtime.

use gpt::{SamplingParams, Tokenizer};

use crate::api::{CompletionRequest, Prompt, Stop};
use crate::error::ApiError;

/// What the served model and the operator allow.
#[derive(Debug, Clone)]
pub struct Limits {
    pub vocab_size: usize,
    /// The model's context length: prompt + max_tokens must fit.
    pub context: usize,
    pub max_tokens_cap: usize,
    pub max_n: usize,
    pub max_logprobs: usize,
    pub max_stop: usize,
}

#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub prompt: Vec<u32>,
    pub prompt_text: String,
    pub max_tokens: usize,
    /// For choice i the seed is `sampling.seed + i`.
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub n: usize,
    pub logprobs: Option<usize>,
    pub echo: bool,
    pub stream: bool,
    pub include_usage: bool,
}

fn in_range(
    param: &'static str,
    v: Option<f64>,
    default: f64,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<f64, ApiError> {
    let v = v.unwrap_or(default);
    if v.is_finite() && ok(v) {
        Ok(v)
    } else {
        Err(ApiError::invalid(param, format!("{param} must be {range}, got {v}")))
    }
}

pub fn validate(req: CompletionRequest, tokenizer: &Tokenizer, limits: &Limits) -> Result<ValidRequest, ApiError> {
    let (prompt, prompt_text) = match req.prompt {
        Prompt::Text(text) => {
            if text.is_empty() {
                return Err(ApiError::invalid("prompt", "prompt must not be empty"));
            }
            (tokenizer.encode(&text)?, text)
        }
        Prompt::Tokens(ids) => {
            if ids.is_empty() {
                return Err(ApiError::invalid("prompt", "prompt must not be empty"));
            }
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if id < 0 || id as usize >= limits.vocab_size {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!("token id {id} is outside the vocabulary [0, {})", limits.vocab_size),
                    ));
                }
                out.push(id as u32);
            }
            let text = tokenizer.decode(&out)?;
            (out, text)
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt encodes to no tokens"));
    }

    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens < 1 || max_tokens as usize > limits.max_tokens_cap {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "max_tokens must be between 1 and {}, got {max_tokens}",
                limits.max_tokens_cap
            ),
        ));
    }
    let max_tokens = max_tokens as usize;
    if prompt.len() + max_tokens > limits.context {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "this model's context length is {} tokens, but the prompt ({} tokens) plus max_tokens ({max_tokens}) \
                 needs {}; shorten the prompt or lower max_tokens",
                limits.context,
                prompt.len(),
                prompt.len() + max_tokens
            ),
        ));
    }

    let temperature = in_range("temperature", req.temperature, 1.0, |t| t >= 0.0, "a number >= 0")?;
    let top_p = in_range("top_p", req.top_p, 1.0, |p| p > 0.0 && p <= 1.0, "in (0, 1]")?;
    let top_k = match req.top_k.unwrap_or(-1) {
        -1 | 0 => None,
        k if k > 0 => Some(k as usize),
        k => {
            return Err(ApiError::invalid(
                "top_k",
                format!("top_k must be -1, 0 or positive, got {k}"),
            ))
        }
    };
    let repetition_penalty = in_range("repetition_penalty", req.repetition_penalty, 1.0, |p| p > 0.0, "> 0")?;
    let presence_penalty = in_range(
        "presence_penalty",
        req.presence_penalty,
        0.0,
        |p| (-2.0..=2.0).contains(&p),
        "in [-2, 2]",
    )?;
    let frequency_penalty = in_range(
        "frequency_penalty",
        req.frequency_penalty,
        0.0,
        |p| (-2.0..=2.0).contains(&p),
        "in [-2, 2]",
    )?;

    let n = req.n.unwrap_or(1);
    if n < 1 || n as usize > limits.max_n {
        return Err(ApiError::invalid(
            "n",
            format!("n must be between 1 and {}, got {n}", limits.max_n),
        ));
    }
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if k >= 0 && k as usize <= limits.max_logprobs => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                "logprobs",
                format!("logprobs must be between 0 and {}, got {k}", limits.max_logprobs),
            ))
        }
    };
    let stop = match req.stop {
        None => vec![],
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.len() > limits.max_stop || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            format!("stop must be up to {} non-empty strings", limits.max_stop),
        ));
    }
    let stream = req.stream.unwrap_or(false);
    if req.stream_options.is_some() && !stream {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed with stream: true",
        ));
    }
    Ok(ValidRequest {
        prompt,
        prompt_text,
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_p: Some(top_p),
            top_k,
            repetition_penalty: repetition_penalty as f32,
            presence_penalty: presence_penalty as f32,
            frequency_penalty: frequency_penalty as f32,
            seed: req.seed.map_or_else(rand::random, |s| s as u64),
        },
        stop,
        n: n as usize,
        logprobs,
        echo: req.echo.unwrap_or(false),
        stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
    })
}
