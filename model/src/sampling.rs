//! From logits to the next token: candle-transformers' `LogitsProcessor` (greedy, temperature,
//! top-k, top-p; seeded), after the repetition penalty (candle-transformers'
//! `apply_repeat_penalty`, over prompt and output, as vLLM applies it), OpenAI's presence and
//! frequency penalties and `logit_bias`, and vLLM's `min_p` (candle has no helper for these last
//! four, so they are written here).

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// Drop tokens less likely than `min_p` times the most likely one (after temperature); 0
    /// disables.
    pub min_p: f64,
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
            logit_bias: Vec::new(),
            min_p: 0.0,
            seed: 0,
        }
    }
}

pub struct Sampler {
    processor: LogitsProcessor,
    params: SamplingParams,
    counts: HashMap<u32, u32>, // output token → times generated
    /// Speculative checks' draws (see [`Sampler::verify`]), made when first needed.
    rng: Option<StdRng>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let temperature = params.temperature;
        let top_p = params.top_p.filter(|&p| p < 1.0);
        // As candle's `LogitsProcessor::new`: below 1e-7 the temperature is greedy decoding (and a
        // smaller one would overflow the scaled logits). A top_p too small for f32 keeps the most
        // likely token only, as any p > 0 does.
        let top_p = top_p.map(|p| p.max(f64::from(f32::MIN_POSITIVE)));
        // Above 1e30 every temperature samples uniformly in f32 (and 1/T would round to 0, turning
        // excluded tokens' -inf into NaN).
        let temperature = temperature.min(1e30);
        let sampling = match (temperature, params.top_k, top_p) {
            (t, _, _) if t < 1e-7 => Sampling::ArgMax,
            (temperature, Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
            (temperature, Some(k), None) => Sampling::TopK { k, temperature },
            (temperature, None, Some(p)) => Sampling::TopP { p, temperature },
            (temperature, None, None) => Sampling::All { temperature },
        };
        Self {
            processor: LogitsProcessor::from_sampling(params.seed, sampling),
            params,
            counts: HashMap::new(),
            rng: None,
        }
    }

    /// Applies the penalties and the logit bias to `logits` `(vocab,)`, given the prompt and the
    /// tokens generated so far. This is what sampling sees; `logprobs` are reported from the raw
    /// logits instead.
    pub fn penalised(&self, logits: &Tensor, prompt: &[u32], output: &[u32]) -> Result<Tensor> {
        let values = self.penalised_values(&logits.to_dtype(DType::F32)?.to_vec1::<f32>()?, prompt, output)?;
        Ok(Tensor::from_vec(values, logits.shape(), logits.device())?)
    }

    /// [`Sampler::penalised`] on the host: one copy of the row.
    fn penalised_values(&self, logits: &[f32], prompt: &[u32], output: &[u32]) -> Result<Vec<f32>> {
        let p = &self.params;
        let mut values = if p.repetition_penalty != 1.0 {
            let context: Vec<u32> = prompt.iter().chain(output).copied().collect();
            let row = Tensor::new(logits, &Device::Cpu)?;
            candle_transformers::utils::apply_repeat_penalty(&row, p.repetition_penalty, &context)?.to_vec1::<f32>()?
        } else {
            logits.to_vec()
        };
        if (p.presence_penalty != 0.0 || p.frequency_penalty != 0.0) && !self.counts.is_empty() {
            for (&token, &count) in &self.counts {
                if let Some(v) = values.get_mut(token as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
        }
        for &(token, bias) in &p.logit_bias {
            if let Some(v) = values.get_mut(token as usize) {
                *v += bias;
            }
        }
        Ok(values)
    }

    /// [`Sampler::sample_row`] for a `(vocab,)` tensor.
    pub fn sample(&mut self, logits: &Tensor, prompt: &[u32], output: &[u32], suppress: &[u32]) -> Result<u32> {
        self.sample_row(
            &logits.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            prompt,
            output,
            suppress,
        )
    }

    /// The next token for one sequence; `logits` is `(vocab,)`. `suppress` lists tokens that may
    /// not be chosen now (the end-of-text token before `min_tokens`, say).
    pub fn sample_row(&mut self, logits: &[f32], prompt: &[u32], output: &[u32], suppress: &[u32]) -> Result<u32> {
        let token = match self.prepare(logits, prompt, output, suppress)? {
            Prepared::Token(token) => token,
            Prepared::Values(values) => {
                let n = values.len();
                self.processor.sample(&Tensor::from_vec(values, n, &Device::Cpu)?)?
            }
        };
        *self.counts.entry(token).or_insert(0) += 1;
        Ok(token)
    }

    /// Speculative decoding's check of a proposed token at one position: the token chosen here
    /// and whether it is the proposal. Greedy decoding keeps the proposal when it is the choice;
    /// sampling keeps it with probability p(proposal), and otherwise draws from p without it,
    /// renormalised: the rejection rule of Leviathan et al. 2023 and Chen et al. 2023 for a
    /// proposal that is a point mass (an n-gram lookup, a greedy draft), so that the token is
    /// distributed as p, what [`Sampler::sample_row`] draws from. (candle's `LogitsProcessor`
    /// keeps its filtered probabilities to itself, so [`Sampler::distribution`] rebuilds them.)
    pub fn verify(
        &mut self,
        logits: &[f32],
        prompt: &[u32],
        output: &[u32],
        suppress: &[u32],
        proposed: u32,
    ) -> Result<(u32, bool)> {
        let (token, kept) = match self.prepare(logits, prompt, output, suppress)? {
            Prepared::Token(token) => (token, token == proposed),
            Prepared::Values(values) => {
                let mut weights = self.distribution(values);
                let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
                let at = proposed as usize;
                let p = weights.get(at).map_or(0.0, |&w| f64::from(w) / total);
                let rng = self
                    .rng
                    .get_or_insert_with(|| StdRng::seed_from_u64(self.params.seed ^ SPECULATIVE_STREAM));
                if rng.random::<f64>() < p {
                    (proposed, true)
                } else {
                    if let Some(w) = weights.get_mut(at) {
                        *w = 0.0;
                    }
                    match draw(&weights, rng) {
                        Some(token) => (token, false),
                        None => (proposed, true), // p(proposal) was 1 but for rounding
                    }
                }
            }
        };
        *self.counts.entry(token).or_insert(0) += 1;
        Ok((token, kept))
    }

    /// Whether the next token is the row's argmax ([`greedy`]) whatever the row: greedy decoding
    /// with no penalty or bias that would change the row first. A caller that knows this (and
    /// suppresses no token) may take the argmax where the logits are, on a GPU, and hand the token
    /// to [`Sampler::take`] instead of the row to [`Sampler::sample_row`].
    pub fn is_argmax(&self) -> bool {
        let p = &self.params;
        let unpenalised = p.repetition_penalty == 1.0
            && p.logit_bias.is_empty()
            && ((p.presence_penalty == 0.0 && p.frequency_penalty == 0.0) || self.counts.is_empty());
        p.temperature < 1e-7 && unpenalised
    }

    /// Records `token`, chosen as [`Sampler::is_argmax`] allows, as [`Sampler::sample_row`]
    /// records its own choice (for the frequency and presence penalties' counts).
    pub fn take(&mut self, token: u32) -> u32 {
        *self.counts.entry(token).or_insert(0) += 1;
        token
    }

    /// What sampling draws from at one position: greedy's token, or the row after penalties,
    /// bias, suppression and `min_p`, shifted so that its largest value is 0.
    fn prepare(&self, logits: &[f32], prompt: &[u32], output: &[u32], suppress: &[u32]) -> Result<Prepared> {
        if self.is_argmax() {
            // Greedy on the raw row: one pass, no copy (the general path below picks the same).
            let token =
                argmax(logits, suppress).ok_or(crate::Error::EmptyInput("every token is excluded from sampling"))?;
            return Ok(Prepared::Token(token));
        }
        let mut values = self.penalised_values(logits, prompt, output)?;
        for &token in suppress {
            if let Some(v) = values.get_mut(token as usize) {
                *v = f32::NEG_INFINITY;
            }
        }
        // Logits that overflowed (a tiny repetition penalty divides by it) share the mass.
        if values.contains(&f32::INFINITY) {
            values
                .iter_mut()
                .for_each(|v| *v = if *v == f32::INFINITY { 0.0 } else { f32::NEG_INFINITY });
        }
        // Shifted so that the largest is 0: no temperature can overflow them.
        let max = values
            .iter()
            .copied()
            .filter(|v| !v.is_nan())
            .fold(f32::NEG_INFINITY, f32::max);
        let max = if max == f32::NEG_INFINITY {
            // Penalties so large that they rule out every token left (an overflow to -inf): the
            // tokens not suppressed whose raw logits are finite stay, equally likely.
            let mut excluded = vec![false; values.len()];
            for &t in suppress {
                if let Some(e) = excluded.get_mut(t as usize) {
                    *e = true;
                }
            }
            let mut any = false;
            for ((v, &raw), &out) in values.iter_mut().zip(logits).zip(&excluded) {
                *v = if !out && raw.is_finite() {
                    0.0
                } else {
                    f32::NEG_INFINITY
                };
                any |= *v == 0.0;
            }
            if !any {
                return Err(crate::Error::EmptyInput("every token is excluded from sampling"));
            }
            0.0
        } else {
            max
        };
        let temperature = self.params.temperature;
        // min_p: p_i / p_max = exp((l_i - l_max) / T) < min_p  <=>  l_i - l_max < T ln(min_p).
        let floor = match self.params.min_p {
            m if m > 0.0 && temperature >= 1e-7 => (temperature * m.ln()) as f32,
            _ => f32::NEG_INFINITY,
        };
        for v in values.iter_mut() {
            *v = if v.is_nan() || *v - max < floor {
                f32::NEG_INFINITY
            } else {
                *v - max
            };
        }
        if temperature < 1e-7 {
            let token =
                argmax(&values, &[]).ok_or(crate::Error::EmptyInput("every token is excluded from sampling"))?;
            return Ok(Prepared::Token(token));
        }
        Ok(Prepared::Values(values))
    }

    /// The weights `LogitsProcessor` draws from for a prepared row (not normalised): the softmax
    /// at the temperature, then its top-k and top-p, as `LogitsProcessor::sample_f` applies them
    /// (top-p after top-k counts the kept tokens' probabilities unrenormalised, as it does).
    fn distribution(&self, values: Vec<f32>) -> Vec<f32> {
        let t = self.params.temperature.min(1e30) as f32;
        let mut probs: Vec<f32> = values.into_iter().map(|v| (v / t).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        let top_p = self
            .params
            .top_p
            .filter(|&p| p < 1.0)
            .map(|p| p.max(f64::from(f32::MIN_POSITIVE)) as f32);
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&i, &j| probs[j].total_cmp(&probs[i]));
        if let Some(k) = self.params.top_k.filter(|&k| k < probs.len()) {
            for &i in &order[k..] {
                probs[i] = 0.0;
            }
            order.truncate(k);
            let kept: f32 = order.iter().map(|&i| probs[i]).sum();
            if top_p.is_some_and(|p| p >= kept) {
                return probs;
            }
        }
        if let Some(p) = top_p.filter(|&p| p > 0.0) {
            let mut cumsum = 0.0;
            for &i in &order {
                if cumsum >= p {
                    probs[i] = 0.0;
                } else {
                    cumsum += probs[i];
                }
            }
        }
        probs
    }
}

/// A row ready to sample from (see [`Sampler::prepare`]).
enum Prepared {
    Token(u32),
    Values(Vec<f32>),
}

/// Seeds the generator of speculative checks apart from `LogitsProcessor`'s (same seed).
const SPECULATIVE_STREAM: u64 = 0x9e37_79b9_7f4a_7c15;

/// A token drawn in proportion to `weights`; `None` when they are all 0.
fn draw(weights: &[f32], rng: &mut StdRng) -> Option<u32> {
    let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
    if total <= 0.0 {
        return None;
    }
    let mut u = rng.random::<f64>() * total;
    let mut last = None;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            last = Some(i as u32);
            u -= f64::from(w);
            if u < 0.0 {
                return last;
            }
        }
    }
    last
}

/// Greedy decoding's choice from a raw row, as [`Sampler::sample_row`] makes it when
/// [`Sampler::is_argmax`] holds and nothing is suppressed: the first of equal maxima, NaN never
/// chosen; `None` when every logit is -inf or NaN.
pub fn greedy(logits: &[f32]) -> Option<u32> {
    argmax(logits, &[])
}

/// Greedy choice, as `LogitsProcessor`'s argmax: the first of equal maxima, NaN never chosen,
/// nor a token of `suppress`; `None` when every logit is -inf, NaN or suppressed.
fn argmax(logits: &[f32], suppress: &[u32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if v > f32::NEG_INFINITY && best.is_none_or(|(_, b)| b < v) && !suppress.contains(&(i as u32)) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Tensor {
        Tensor::new(&[1.0f32, 3.0, 2.0, 0.5, 2.9], &Device::Cpu).unwrap()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits(), &[], &[], &[]).unwrap(), 1);
    }

    /// `is_argmax` holds exactly where the pick is the raw row's argmax: greedy without a
    /// penalty or bias that changes the row, a presence or frequency penalty only once a token
    /// was taken (`take` counts it as `sample_row` does).
    #[test]
    fn the_argmax_alone_decides_only_for_unpenalised_greedy() {
        let row = [1.0f32, 3.0, 2.0, 0.5, 2.9];
        assert!(Sampler::new(SamplingParams::default()).is_argmax());
        let sampled = SamplingParams {
            temperature: 0.7,
            ..Default::default()
        };
        assert!(!Sampler::new(sampled).is_argmax());
        for params in [
            SamplingParams {
                repetition_penalty: 1.3,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(3, 10.0)],
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(params);
            assert!(!s.is_argmax());
            // And the row's argmax is indeed not what it picks.
            assert_ne!(Some(s.sample_row(&row, &[1], &[], &[]).unwrap()), greedy(&row));
        }
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 5.0,
            ..Default::default()
        });
        assert!(s.is_argmax(), "nothing generated yet: nothing to penalise");
        assert_eq!(s.take(1), 1);
        assert!(!s.is_argmax());
        assert_eq!(
            s.sample_row(&row, &[], &[1], &[]).unwrap(),
            4,
            "the taken token was counted"
        );
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
        assert_eq!(s.sample(&logits(), &[], &[], &[]).unwrap(), 1); // 3.0 - 0 wins
        let out = s.penalised(&logits(), &[], &[1]).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out[1], 3.0 - 1.5);
        let mut r = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        let out = r.penalised(&logits(), &[1], &[]).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(out[1], 1.5);
        assert_eq!(r.sample(&logits(), &[1], &[], &[]).unwrap(), 4);
    }

    #[test]
    fn penalties_that_overflow_every_token_left_leave_them_equally_likely() {
        // Every token but 0 and 2 suppressed; both negative and in the prompt, so a huge
        // repetition penalty sends them to -inf.
        let row = vec![-4.0f32, 5.0, -5.0, 4.0, 3.0];
        let suppress = [1, 3, 4];
        let mut drawn = std::collections::BTreeSet::new();
        for seed in 0..32 {
            let mut s = Sampler::new(SamplingParams {
                repetition_penalty: 1e38,
                temperature: 1.0,
                seed,
                ..Default::default()
            });
            drawn.insert(s.sample_row(&row, &[0, 2], &[], &suppress).unwrap());
        }
        assert_eq!(drawn.into_iter().collect::<Vec<_>>(), [0, 2]);
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 1e38,
            temperature: 1.0,
            ..Default::default()
        });
        assert!(
            s.sample_row(&row, &[0, 2], &[], &[0, 1, 2, 3, 4]).is_err(),
            "nothing left"
        );
    }

    #[test]
    fn logit_bias_suppression_and_min_p() {
        // A bias of +100 forces a token even under greedy decoding.
        let mut s = Sampler::new(SamplingParams {
            logit_bias: vec![(3, 100.0)],
            ..Default::default()
        });
        assert_eq!(s.sample(&logits(), &[], &[], &[]).unwrap(), 3);
        // A suppressed token is never chosen: greedy takes the runner-up.
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&logits(), &[], &[], &[1]).unwrap(), 4);
        // min_p = 0.5 at temperature 1 keeps tokens within ln 2 of the best logit: 1 (3.0) and 4 (2.9).
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: 3,
            ..Default::default()
        });
        let draws: Vec<u32> = (0..200).map(|_| s.sample(&logits(), &[], &[], &[]).unwrap()).collect();
        assert!(draws.iter().all(|&t| t == 1 || t == 4), "{draws:?}");
        assert!(draws.contains(&1) && draws.contains(&4));
    }

    /// Greedy decoding's one-pass path picks what the general path picks (forced here by a bias
    /// on a token outside the vocabulary): the first of tied maxima, never NaN, -inf or a
    /// suppressed token, the first +inf; and an error when nothing can be chosen.
    #[test]
    fn greedy_fast_path_agrees_with_the_general_path() {
        let nan = f32::NAN;
        let rows: [&[f32]; 6] = [
            &[1.0, 3.0, 3.0, 2.0],
            &[nan, 0.5, nan, 0.7],
            &[f32::NEG_INFINITY, -1e30, -2e30],
            &[0.0, f32::INFINITY, 1.0, f32::INFINITY],
            &[nan, f32::NEG_INFINITY],
            &[2.0, 1.0, 2.0],
        ];
        for row in rows {
            for suppress in [&[][..], &[1, 2][..], &[0][..]] {
                let mut fast = Sampler::new(SamplingParams::default());
                let mut general = Sampler::new(SamplingParams {
                    logit_bias: vec![(99, 1.0)],
                    ..Default::default()
                });
                let a = fast.sample_row(row, &[], &[], suppress).ok();
                let b = general.sample_row(row, &[], &[], suppress).ok();
                assert_eq!(a, b, "{row:?} suppress {suppress:?}");
            }
        }
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample_row(&[1.0, 3.0, 3.0], &[], &[], &[]).unwrap(), 1);
        assert!(s.sample_row(&[f32::NAN, f32::NEG_INFINITY], &[], &[], &[]).is_err());
    }

    #[test]
    fn extreme_parameters_still_sample() {
        let cases = [
            SamplingParams {
                temperature: 1.0,
                top_p: Some(5e-324),
                ..Default::default()
            },
            SamplingParams {
                temperature: 5e-324,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1e300,
                min_p: 5e-324,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                repetition_penalty: 1e-300,
                ..Default::default()
            },
        ];
        for params in cases {
            let mut s = Sampler::new(params.clone());
            let token = s.sample(&logits(), &[1, 4], &[], &[]);
            assert!(token.is_ok(), "{params:?}: {token:?}");
        }
        // A huge temperature with an excluded token (-inf) samples among the others.
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.8e278,
            top_k: Some(3),
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&logits(), &[], &[], &[1]).is_ok_and(|t| t != 1)));
        // A vanishing top_p keeps the most likely token only.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: Some(1e-30),
            seed: 9,
            ..Default::default()
        });
        assert!((0..20).all(|_| s.sample(&logits(), &[], &[], &[]).ok() == Some(1)));
        let mut s = Sampler::new(SamplingParams::default());
        assert!(
            s.sample(&logits(), &[], &[], &[0, 1, 2, 3, 4]).is_err(),
            "nothing left to sample"
        );
    }
}
