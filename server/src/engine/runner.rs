//! The model runner: builds one step from the running sequences, calls the model, and reduces
//! the logits on the host to what the sequences need: each sequence's last row (to sample from),
//! and for a prefill that asks for the prompt's log-probabilities, the log-probability of every
//! prompt token and the top alternatives at each position, from the same batched pass
//! (`LogitsFor::All`). The LM head runs in chunks of rows, so long prompts never hold a whole
//! `(tokens, vocab)` logits matrix.

use std::borrow::Cow;

use candle_core::{Device, Tensor};
use gpt::{Gpt, KvCache, LogitsFor, SeqStep};
use gpt_kernels::log_sum_exp;

/// Rows of logits computed at once: 256 x GPT-2's 50257 x 4 bytes is 51 MB.
const LM_HEAD_ROWS: usize = 256;

/// One sequence's part in a step.
pub struct StepInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
    /// `Some(k)`: also the log-probability of each of `tokens[1..]` and the top `k` at each
    /// position (a prompt's prefill, for `echo` with `logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// Speculative decoding's check: `tokens` are the last token and proposals, and every
    /// position's logits are wanted ([`StepOutput::drafted`]).
    pub verify: bool,
    /// The sequence's LoRA adapter, if any: its updates apply to the sequence's rows only.
    pub adapter: Option<&'a gpt::Adapter>,
    /// Only the last row's greedy choice is wanted ([`StepOutput::greedy`]), not its logits:
    /// on a GPU the argmax is taken there, and a token comes back instead of a row the size of
    /// the vocabulary (at batch 64 with GPT-2's, 13 MB a step through the host).
    pub greedy: bool,
    /// An embedding: the last row's final hidden state, L2-normalised, is wanted
    /// ([`StepOutput::embedding`]) and no logits (the LM head skips the row).
    pub embed: bool,
}

/// The log-probability of a token at one position, and the `k` most likely tokens there.
#[derive(Debug, Clone, PartialEq)]
pub struct PositionLogprob {
    pub logprob: f32,
    /// The token's rank in the vocabulary at this position (1 = most likely; tokens as likely
    /// count ahead of it, as vLLM counts), where it was computed: for prompt positions.
    pub rank: Option<u32>,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone)]
pub struct StepOutput {
    /// Raw logits of the last new token, `(vocab,)`; empty where [`StepOutput::greedy`] holds
    /// the choice instead.
    pub last: Vec<f32>,
    /// For `greedy`: the last row's most likely token, as `gpt::sampling::greedy` picks it (on
    /// a GPU, of equal maxima the one the device's argmax finds first). `None` where the row came
    /// back whole instead (`last`): a row with no finite value, left to the sampler to report.
    pub greedy: Option<u32>,
    /// For `prompt_logprobs`: positions 1.. of the new tokens (the first has no predecessor).
    pub prompt_logprobs: Vec<PositionLogprob>,
    /// For `verify`: the raw logits of every new token but the last, in order.
    pub drafted: Vec<Vec<f32>>,
    /// For `embed`: the last new token's final hidden state (the final norm's output), in f32,
    /// L2-normalised: the pooling of vLLM and of the decoder embedding models (E5-Mistral,
    /// Qwen3-Embedding) for causal decoders, where only the last position has read the whole text.
    pub embedding: Vec<f32>,
}

pub struct Runner {
    model: Gpt,
    /// Greedy rows reduced to their argmax where the logits are (a GPU) rather than on the host.
    device_argmax: bool,
}

impl Runner {
    pub fn new(model: Gpt) -> Self {
        let device_argmax = !model.device().is_cpu();
        Self { model, device_argmax }
    }

    pub fn model(&self) -> &Gpt {
        &self.model
    }

    /// Runs one step for all `inputs` together; one result per input. A sequence whose input the
    /// model refuses fails alone; if the batched pass itself fails, the caches are rolled back and
    /// each sequence runs alone, so that only the ones that fail on their own are dropped.
    pub fn step(&self, inputs: &mut [StepInput<'_>]) -> Vec<gpt::Result<StepOutput>> {
        let mut results: Vec<Option<gpt::Result<StepOutput>>> = Vec::with_capacity(inputs.len());
        for input in inputs.iter_mut() {
            let step = SeqStep {
                tokens: input.tokens,
                cache: &mut *input.cache,
            };
            results.push(self.model.check_step(&step).err().map(Err));
        }
        let valid: Vec<usize> = (0..inputs.len()).filter(|&i| results[i].is_none()).collect();
        let lens: Vec<usize> = valid.iter().map(|&i| inputs[i].cache.len()).collect();
        let mut batch: Vec<&mut StepInput> = inputs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| valid.contains(i))
            .map(|(_, input)| input)
            .collect();
        if !batch.is_empty() {
            match self.run(&mut batch) {
                Ok(outputs) => {
                    for (&i, out) in valid.iter().zip(outputs) {
                        results[i] = Some(Ok(out));
                    }
                }
                Err(e) if batch.len() == 1 => results[valid[0]] = Some(Err(e)),
                Err(e) => {
                    tracing::warn!(error = %e, sequences = batch.len(), "batched step failed; running its sequences one by one");
                    for ((&i, input), &len) in valid.iter().zip(batch.iter_mut()).zip(&lens) {
                        let alone = input
                            .cache
                            .truncate(len)
                            .map_err(gpt::Error::from)
                            .and_then(|()| self.run(&mut [&mut **input]))
                            .map(|mut out| out.remove(0));
                        results[i] = Some(alone);
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(gpt::Error::EmptyInput("sequence left out of the step"))))
            .collect()
    }

    fn run(&self, inputs: &mut [&mut StepInput<'_>]) -> gpt::Result<Vec<StepOutput>> {
        let which: Vec<LogitsFor> = inputs
            .iter()
            .map(|s| match (s.prompt_logprobs, s.verify) {
                _ if s.embed => LogitsFor::Last,
                (Some(_), _) | (_, true) => LogitsFor::All,
                (None, false) => LogitsFor::Last,
            })
            .collect();
        // Which input and position each hidden row that goes through the LM head belongs to, and
        // the hidden row of each embedding (which does not).
        let mut owners: Vec<Owner> = Vec::new();
        let (mut head_rows, mut embed_rows): (Vec<u32>, Vec<(usize, u32)>) = (Vec::new(), Vec::new());
        let mut row = 0u32;
        for (i, (input, w)) in inputs.iter().zip(&which).enumerate() {
            match w {
                LogitsFor::All => owners.extend((0..input.tokens.len()).map(|pos| (i, pos))),
                LogitsFor::Last if !input.embed => owners.push((i, input.tokens.len() - 1)),
                LogitsFor::Last => embed_rows.push((i, row)),
            }
            let rows = if *w == LogitsFor::All { input.tokens.len() } else { 1 } as u32;
            if !input.embed {
                head_rows.extend(row..row + rows);
            }
            row += rows;
        }
        let hidden = {
            let adapters: Vec<Option<&gpt::Adapter>> = if inputs.iter().any(|s| s.adapter.is_some()) {
                inputs.iter().map(|s| s.adapter).collect()
            } else {
                Vec::new()
            };
            let mut steps: Vec<SeqStep> = inputs
                .iter_mut()
                .map(|s| SeqStep {
                    tokens: s.tokens,
                    cache: &mut *s.cache,
                })
                .collect();
            self.model.forward_step_adapted(&mut steps, &which, &adapters)? // (rows, C)
        };
        let mut outputs: Vec<StepOutput> = inputs
            .iter()
            .map(|s| StepOutput {
                last: Vec::new(),
                greedy: None,
                prompt_logprobs: Vec::with_capacity(if s.prompt_logprobs.is_some() {
                    s.tokens.len() - 1
                } else {
                    0
                }),
                drafted: Vec::new(),
                embedding: Vec::new(),
            })
            .collect();
        let hidden = match embed_rows.is_empty() {
            true => hidden,
            false => {
                let picked: Vec<u32> = embed_rows.iter().map(|&(_, r)| r).collect();
                let picked = Tensor::new(picked.as_slice(), hidden.device())?;
                // (embeddings, C) f32 on the host.
                let vectors =
                    gpt::gpt::unit_rows(&hidden.index_select(&picked, 0)?.to_dtype(candle_core::DType::F32)?)?;
                for (&(i, _), v) in embed_rows.iter().zip(vectors.to_vec2::<f32>()?) {
                    outputs[i].embedding = v;
                }
                match head_rows.is_empty() {
                    true => return Ok(outputs),
                    false => hidden.index_select(&Tensor::new(head_rows.as_slice(), hidden.device())?, 0)?,
                }
            }
        };
        let vocab = self.model.config().vocab_size;
        for start in (0..owners.len()).step_by(LM_HEAD_ROWS) {
            let rows = LM_HEAD_ROWS.min(owners.len() - start);
            let logits = self.model.logits(&hidden.narrow(0, start, rows)?)?;
            let owners = &owners[start..start + rows];
            let greedy = |&(i, pos): &Owner| inputs[i].greedy && pos + 1 == inputs[i].tokens.len();
            let (logits, owners) = match self.device_argmax && owners.iter().any(greedy) {
                false => (logits, Cow::Borrowed(owners)),
                true => match reduce_greedy_rows(&logits, owners, greedy, &mut outputs)? {
                    Some((rest, whole)) => (rest, Cow::Owned(whole)),
                    None => continue,
                },
            };
            let rows = owners.len();
            let owners = &owners[..];
            // (rows, V) f32 on the host.
            let logits = logits.to_device(&Device::Cpu)?.contiguous()?;
            // Read in place (at 40 prompt positions a copy is 8 MB, ~3% of the request).
            let (storage, layout) = logits.storage_and_layout();
            let candle_core::Storage::Cpu(storage) = &*storage else {
                return Err(candle_core::Error::Msg("LM head: logits not on the host".into()).into());
            };
            let logits = gpt_kernels::f32_slice(storage, layout, "LM head")?;
            // Prompt positions' log-probabilities: a pass over the vocabulary each, independent,
            // so spread over candle's thread pool.
            let positions: Vec<std::sync::OnceLock<PositionLogprob>> =
                owners.iter().map(|_| Default::default()).collect();
            candle_core::utils::barrier_pool().execute_chunked(rows, |range| {
                for r in range {
                    let (i, pos) = owners[r];
                    let input = &inputs[i];
                    if let (true, Some(k)) = (pos + 1 < input.tokens.len(), input.prompt_logprobs) {
                        let row = &logits[r * vocab..(r + 1) * vocab];
                        let lse = log_sum_exp(row);
                        let next = input.tokens[pos + 1] as usize;
                        let _ = positions[r].set(PositionLogprob {
                            logprob: row[next] - lse,
                            rank: Some(rank(row, next)),
                            top: top_k(row, k, lse),
                        });
                    }
                }
            });
            for ((row, &(i, pos)), position) in logits.chunks_exact(vocab).zip(owners).zip(positions) {
                if pos + 1 == inputs[i].tokens.len() {
                    // Greedy on the host: the sampler's own pick, without copying the row.
                    match inputs[i].greedy.then(|| gpt::sampling::greedy(row)).flatten() {
                        Some(token) => outputs[i].greedy = Some(token),
                        None => outputs[i].last = row.to_vec(),
                    }
                } else if inputs[i].verify {
                    outputs[i].drafted.push(row.to_vec());
                } else if let Some(p) = position.into_inner() {
                    outputs[i].prompt_logprobs.push(p);
                }
            }
        }
        Ok(outputs)
    }
}

/// Which input a row of logits is of, and its position among the input's tokens.
type Owner = (usize, usize);

/// On a GPU: the rows of `logits` that `greedy` picks (`owners[r]` says whose row `r` is)
/// reduced there to their argmax, written to those inputs' outputs, so that only the other rows
/// come to the host (in one copy: a copy per row would be a synchronisation per row). Returns
/// those other rows and their owners, `None` if there are none. A picked row with no finite
/// value stays among them (the sampler reports it).
fn reduce_greedy_rows(
    logits: &Tensor,
    owners: &[Owner],
    greedy: impl Fn(&Owner) -> bool,
    outputs: &mut [StepOutput],
) -> gpt::Result<Option<(Tensor, Vec<Owner>)>> {
    let picked: Vec<u32> = (0..owners.len() as u32)
        .filter(|&r| greedy(&owners[r as usize]))
        .collect();
    let chosen = logits.index_select(&Tensor::new(picked.as_slice(), logits.device())?, 0)?;
    let tokens = chosen.argmax(1)?.to_vec1::<u32>()?;
    let maxima = chosen.max(1)?.to_vec1::<f32>()?;
    let mut reduced = vec![false; owners.len()];
    for ((&r, token), max) in picked.iter().zip(tokens).zip(maxima) {
        if max > f32::NEG_INFINITY {
            outputs[owners[r as usize].0].greedy = Some(token);
            reduced[r as usize] = true;
        }
    }
    let whole: Vec<u32> = (0..owners.len() as u32).filter(|&r| !reduced[r as usize]).collect();
    if whole.is_empty() {
        return Ok(None);
    }
    let rest = logits.index_select(&Tensor::new(whole.as_slice(), logits.device())?, 0)?;
    Ok(Some((rest, whole.iter().map(|&r| owners[r as usize]).collect())))
}

/// The rank of token `id` in a logits row: how many tokens are at least as likely (so >= 1),
/// vLLM's definition for prompt logprobs.
pub fn rank(row: &[f32], id: usize) -> u32 {
    let v = row[id];
    row.iter().filter(|&&x| x >= v).count() as u32
}

/// The `k` most likely tokens of a logits row as `(id, log-probability)`, most likely first
/// (ties: lower id first). One pass that keeps the best `k` seen in order: the API allows a small
/// `k` (logprobs <= 20), and past the first few tokens almost none enters.
pub fn top_k(row: &[f32], k: usize, lse: f32) -> Vec<(u32, f32)> {
    if k == 1 {
        // The common case (lm-eval asks `logprobs: 1`): a vectorised argmax, the same pick.
        return gpt_kernels::argmax(row)
            .map(|i| vec![(i as u32, row[i] - lse)])
            .unwrap_or_default();
    }
    let k = k.min(row.len());
    let mut best: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (i, &v) in row.iter().enumerate() {
        if best.len() == k && best.last().is_none_or(|&(_, w)| v.total_cmp(&w).is_le()) {
            continue;
        }
        // After every kept value at least as large (earlier ids win ties).
        let at = best.partition_point(|&(_, w)| w.total_cmp(&v).is_ge());
        best.insert(at, (i, v));
        best.truncate(k);
    }
    // Tokens a grammar rules out (-inf) have no probability: they are not among the likely ones.
    (best.into_iter())
        .filter(|&(_, v)| v != f32::NEG_INFINITY)
        .map(|(i, v)| (i as u32, v - lse))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_model() -> Gpt {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
        gpt::load_model(&dir, candle_core::DType::F32, &Device::Cpu).expect("fixture model")
    }

    #[test]
    fn a_sequence_the_model_refuses_fails_alone() {
        let runner = Runner::new(fixture_model());
        let model = runner.model();
        let (good, bad) = ([5u32, 6, 7], [5u32, 999]); // 999 is outside the 320-token vocabulary
        let mut caches = [model.new_cache(), model.new_cache(), model.new_cache()];
        let [c0, c1, c2] = &mut caches;
        let mut inputs = [
            StepInput {
                tokens: &good,
                cache: c0,
                prompt_logprobs: Some(2),
                verify: false,
                adapter: None,
                greedy: false,
                embed: false,
            },
            StepInput {
                tokens: &bad,
                cache: c1,
                prompt_logprobs: None,
                verify: false,
                adapter: None,
                greedy: false,
                embed: false,
            },
            StepInput {
                tokens: &good[..1],
                cache: c2,
                prompt_logprobs: None,
                verify: false,
                adapter: None,
                greedy: false,
                embed: false,
            },
        ];
        let out = runner.step(&mut inputs);
        assert!(
            matches!(&out[1], Err(gpt::Error::TokenOutOfVocab { id: 999, .. })),
            "{:?}",
            out[1].as_ref().err()
        );
        let first = out[0].as_ref().expect("the others run");
        assert_eq!(first.last.len(), 320);
        assert_eq!(first.prompt_logprobs.len(), 2, "tokens 1 and 2 of the prompt");
        assert!(first
            .prompt_logprobs
            .iter()
            .all(|p| p.logprob < 0.0 && p.top.len() == 2));
        assert!(out[2].is_ok());
        assert_eq!(
            (caches[0].len(), caches[1].len(), caches[2].len()),
            (3, 0, 1),
            "the refused cache is untouched"
        );
        // The same logits as a step of its own.
        let mut alone_cache = model.new_cache();
        let alone = runner.step(&mut [StepInput {
            tokens: &good,
            cache: &mut alone_cache,
            prompt_logprobs: None,
            verify: false,
            adapter: None,
            greedy: false,
            embed: false,
        }]);
        let alone = alone[0].as_ref().expect("runs");
        let diff = alone
            .last
            .iter()
            .zip(&first.last)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-4, "{diff}");
    }

    /// Greedy inputs get the argmax of the row the others get whole, in one step with prompt
    /// logprobs and a prefill beside them: on the host, and reduced where the logits are (the GPU
    /// path, taken here on the CPU).
    #[test]
    fn greedy_inputs_get_the_argmax_of_their_row() -> gpt::Result<()> {
        let prompts: [&[u32]; 4] = [&[5, 6, 7], &[9], &[11, 12], &[300, 2, 40, 41]];
        for device_argmax in [false, true] {
            let mut runner = Runner::new(fixture_model());
            runner.device_argmax = device_argmax;
            let model = runner.model();
            // Each prompt alone, its last row whole: the reference.
            let mut rows = Vec::new();
            for tokens in prompts {
                let mut cache = model.new_cache();
                let out = runner.step(&mut [StepInput {
                    tokens,
                    cache: &mut cache,
                    prompt_logprobs: None,
                    verify: false,
                    adapter: None,
                    greedy: false,
                    embed: false,
                }]);
                rows.push(out.into_iter().next().ok_or(gpt::Error::EmptyInput("no output"))??.last);
            }
            let mut caches: Vec<KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
            let greedy = [true, false, true, true];
            let mut inputs: Vec<StepInput> = (prompts.iter().zip(&mut caches).zip(greedy))
                .enumerate()
                .map(|(i, ((tokens, cache), greedy))| StepInput {
                    tokens,
                    cache,
                    prompt_logprobs: (i == 0).then_some(2),
                    verify: false,
                    adapter: None,
                    greedy,
                    embed: false,
                })
                .collect();
            let outs = runner.step(&mut inputs);
            for (i, out) in outs.into_iter().enumerate() {
                let out = out?;
                let want = gpt::sampling::greedy(&rows[i]);
                if greedy[i] {
                    assert!(want.is_some());
                    assert_eq!(
                        (out.greedy, out.last.len()),
                        (want, 0),
                        "input {i}, on the device: {device_argmax}"
                    );
                } else {
                    assert_eq!((out.greedy, out.last.len()), (None, 320), "input {i}");
                    let diff = (out.last.iter().zip(&rows[i]))
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(diff < 1e-4, "input {i}: {diff}");
                }
                assert_eq!(out.prompt_logprobs.len(), if i == 0 { 2 } else { 0 });
            }
        }
        Ok(())
    }

    /// Embeddings in a step beside a prefill with prompt logprobs and a decode: each the model's
    /// own whole-prompt embedding ([`Gpt::embeddings`], another code path), the others' logits as
    /// in a step without them.
    #[test]
    fn embeddings_share_a_step_with_generation() -> gpt::Result<()> {
        let runner = Runner::new(fixture_model());
        let model = runner.model();
        let prompts: [&[u32]; 4] = [&[5, 6, 7], &[9, 4, 100, 3], &[11], &[300, 2, 40, 41, 8]];
        let embed = [false, true, false, true];
        let run = |embedded: bool| -> gpt::Result<Vec<StepOutput>> {
            let mut caches: Vec<KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
            let mut inputs: Vec<StepInput> = (prompts.iter().zip(&mut caches).zip(embed))
                .enumerate()
                .filter(|&(_, (_, e))| embedded || !e)
                .map(|(i, ((tokens, cache), embed))| StepInput {
                    tokens,
                    cache,
                    prompt_logprobs: (i == 0).then_some(2),
                    verify: false,
                    adapter: None,
                    greedy: false,
                    embed,
                })
                .collect();
            runner.step(&mut inputs).into_iter().collect()
        };
        let with = run(true)?;
        let without = run(false)?;
        for (i, tokens) in prompts.iter().enumerate().filter(|&(i, _)| embed[i]) {
            let out = &with[i];
            assert!(
                out.last.is_empty() && out.prompt_logprobs.is_empty(),
                "input {i}: no logits"
            );
            let idx = Tensor::new(*tokens, &Device::Cpu)?.unsqueeze(0)?;
            let want = model.embeddings(&idx)?.flatten_all()?.to_vec1::<f32>()?;
            assert_eq!(out.embedding.len(), want.len());
            let diff = (out.embedding.iter().zip(&want))
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "input {i}: {diff}");
            let norm: f32 = out.embedding.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "input {i}: norm {norm}");
        }
        let generated: Vec<&StepOutput> = (with.iter().zip(embed)).filter(|&(_, e)| !e).map(|(o, _)| o).collect();
        assert_eq!(generated.len(), without.len());
        for (a, b) in generated.iter().zip(&without) {
            assert!(a.embedding.is_empty());
            assert_eq!((a.last.len(), &a.prompt_logprobs), (320, &b.prompt_logprobs));
            let diff = (a.last.iter().zip(&b.last))
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{diff}");
        }
        Ok(())
    }

    #[test]
    fn top_k_selects_what_a_full_sort_finds() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1009) as f32 / 10.0).collect();
        let lse = log_sum_exp(&row);
        let mut sorted: Vec<usize> = (0..row.len()).collect();
        sorted.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for k in [0, 1, 5, 20, 1000, 2000] {
            let want: Vec<(u32, f32)> = sorted.iter().take(k).map(|&i| (i as u32, row[i] - lse)).collect();
            assert_eq!(top_k(&row, k, lse), want, "k = {k}");
        }
        let probs: f32 = row.iter().map(|&x| (x - lse).exp()).sum();
        assert!((probs - 1.0).abs() < 1e-4);
        // Ties (lower id first), infinities and NaN, in the full sort's order too.
        let mut row: Vec<f32> = (0..500).map(|i| (i % 7) as f32).collect();
        row[3] = f32::NEG_INFINITY;
        row[10] = f32::INFINITY;
        row[20] = f32::NAN;
        let mut sorted: Vec<usize> = (0..row.len()).collect();
        sorted.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for k in [1, 3, 20, 500] {
            // (-inf, a token ruled out, is never listed.)
            let want: Vec<u32> = (sorted.iter().take(k).map(|&i| i as u32)).filter(|&i| i != 3).collect();
            let got: Vec<u32> = top_k(&row, k, 0.0).into_iter().map(|(i, _)| i).collect();
            assert_eq!(got, want, "k = {k}");
        }
    }
}
