//! From logits to the next token: candle-transformers' `LogitsProcessor` (greedy, temperature,
//! top-k, top-p; seeded), after the repetition penalty (candle-transformers'
//! `apply_repeat_penalty`, over prompt and output, as vLLM applies it) and OpenAI's presence and
//! frequency penalties (over the output; candle has no such helper, so they are written here).

use std::collections::HashMap;

use candle_core::{DType, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::error::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    pub top_p: Option<f64>,
    /// Keep the `top_k` most likely tokens.
    pub top_k: Option<usize>,
    /// > 1 discourages tokens already in the prompt or output (1 disables).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated.
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: None,
            top_k: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    processor: LogitsProcessor,
    params: SamplingParams,
    counts: HashMap<u32, u32>, // output token → times generated
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let temperature = params.temperature;
        let top_p = params.top_p.filter(|&p| p < 1.0);
        let sampling = match (temperature, params.top_k, top_p) {
            (t, _, _) if t <= 0.0 => Sampling::ArgMax,
            (temperature, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
            (temperature, Some(k), None) => Sampling::TopK { k, temperature },
            (temperature, None, Some(p)) => Sampling::TopP { p, temperature },
            (temperature, None, None) => Sampling::All { temperature },
        };
        Self {
            processor: LogitsProcessor::from_sampling(params.seed, sampling),
            params,
            counts: HashMap::new(),
        }
    }

    /// Applies the penalties to `logits` `(vocab,)`, given the prompt and the tokens generated so
    /// far. Also what `logprobs` should not see: they are reported from the raw logits.
    pub fn penalised(&self, logits: &Tensor, prompt: &[u32], output: &[u32]) -> Result<Tensor> {
        let p = &self.params;
        let mut logits = logits.to_dtype(DType::F32)?;
        if p.repetition_penalty != 1.0 {
            let context: Vec<u32> = prompt.iter().chain(output).copied().collect();
            logits = candle_transformers::utils::apply_repeat_penalty(&logits, p.repetition_penalty, &context)?;
        }
        if (p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) && !self.counts.is_empty() {
            let mut values = logits.to_vec1::<f32>()?;
            for (&token, &count) in &self.counts {
                if let Some(v) = values.get_mut(token as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
            logits = Tensor::from_vec(values, logits.shape(), logits.device())?;
        }
        Ok(logits)
    }

    /// The next token for one sequence; `logits` is `(vocab,)`.
    pub fn sample(&mut self, logits: &Tensor, prompt: &[u32], output: &[u32]) -> Result<u32> {
        let logits = self.penalised(logits, prompt, output)?;
        let token = self.processor.sample(&logits)?;
        *self.counts.entry(token).or_insert(0) += 1;
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn logits() -> Tensor {
        Tensor::new(&[1.0f32, 3.0, 2.0, 0.5, 2.9], &Device::Cpu).unwrap()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits(), &[], &[]).unwrap(), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_restricts() {
        let params = SamplingParams {
            temperature: 1.5,
            top_k: Some(2),
            seed: 42,
            ..Default::default()
        };
        let draw = |params: SamplingParams| -> Vec<u32> {
            let mut s = Sampler::new(params);
            (0..50).map(|_| s.processor.sample(&logits()).unwrap()).collect()
        };
        let (a, b) = (draw(params.clone()), draw(params.clone()));
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t == 1 || t == 4), "top-2 only: {a:?}");
        assert!(a.contains(&1) && a.contains(&4));
        assert_ne!(a, draw(SamplingParams { seed: 43, ..params }));
    }

    #[test]
    fn penalties_lower_repeated_tokens() {
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 1.0,
            presence_penalty: 0.5,
            ..Default::default()
        });
        assert_eq!(s.sample(&logits(), &[], &[]).unwrap(), 1); // 3.0 - 0 wins
        let out = s.penalised(&logits(), &[], &[1]).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out[1], 3.0 - 1.5);
        let mut r = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let out = r.penalised(&logits(), &[1], &[]).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out[1], 1.5);
        assert_eq!(r.sample(&logits(), &[1], &[]).unwrap(), 4);
    }
}
