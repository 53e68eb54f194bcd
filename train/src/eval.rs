//! Evaluation: the loss a training run estimates at each evaluation ([`estimate_loss`], as
//! nanoGPT's), and the perplexity of a checkpoint on a text ([`perplexity`]).
//!
//! Perplexity is taken over the whole text with a strided sliding window (the
//! method of the `transformers` perplexity guide): every token after the first is scored exactly
//! once. The first window scores the first `block_size` tokens; each later window scores the next
//! `stride`, reading the `block_size` tokens before its last one, so up to block_size − stride
//! tokens of context carry over from the previous window.

use std::ops::Range;
use std::path::Path;

use anyhow::{bail, Result};
use candle_core::{DType, Device, IndexOp, Tensor, D};
use gpt::Gpt;
use serde::Serialize;

use crate::config::RunConfig;
use crate::data::{self, Corpus};
use crate::distributed::World;
use crate::step::{in_threads, loss};

/// Random streams of `data::batch_rng`: training micro-batches use their index; evaluation
/// batches use these offsets, so evaluating never shifts the training batches.
const EVAL_TRAIN_STREAM: u64 = 1 << 32;
const EVAL_VAL_STREAM: u64 = 2 << 32;

/// Mean loss over `run.eval_iters` batches of each split, drawn for `step`, the batches spread
/// over the job's ranks (batch i on rank i mod N) and each rank's over `threads` threads, then
/// summed in batch order: the result does not depend on either.
pub fn estimate_loss(
    model: &Gpt,
    data: &Corpus,
    run: &RunConfig,
    step: usize,
    device: &Device,
    threads: usize,
    world: &World,
) -> Result<(f64, f64)> {
    // Conversations are few: every evaluation draws the same batches of them, so that one
    // evaluation compares with the next (with the batches of each step, the noise of a few
    // hundred draws hid the change). A text corpus draws anew each time, as nanoGPT does.
    let draws_for = match data {
        Corpus::Chat(_) => 0,
        Corpus::Text(_) => step,
    };
    // Detached: the variables would make every pass build candle's graph and hold its
    // activations until its loss is dropped.
    let model = &model.detached();
    let batch_loss = |train: bool, stream: u64, i: usize| -> Result<f64> {
        let mut rng = data::batch_rng(run.seed, draws_for, stream + i as u64);
        let batch = data.batch(train, run.batch_size, run.block_size(), &mut rng, device)?;
        Ok(loss(model, &batch, None, 0.0)?.to_scalar::<f32>()? as f64) // plain NLL, smoothing or not
    };
    let mean = |train: bool, stream: u64| -> Result<f64> {
        let mine: Vec<usize> = (world.rank()..run.eval_iters).step_by(world.size()).collect();
        let threads = threads.clamp(1, mine.len().max(1));
        let losses = in_threads(threads, |t| -> Result<Vec<(usize, f64)>> {
            mine.iter()
                .skip(t)
                .step_by(threads)
                .map(|&i| Ok((i, batch_loss(train, stream, i)?)))
                .collect()
        })?;
        // Each batch's loss in its place, zero elsewhere: the sum over ranks puts every one back.
        let mut ordered = vec![0.0; run.eval_iters];
        for (i, l) in losses.into_iter().flatten() {
            ordered[i] = l;
        }
        world.sum_f64(&mut ordered);
        Ok(ordered.iter().sum::<f64>() / run.eval_iters as f64)
    };
    Ok((mean(true, EVAL_TRAIN_STREAM)?, mean(false, EVAL_VAL_STREAM)?))
}

#[derive(Debug, Clone, Serialize)]
pub struct Perplexity {
    pub tokens_scored: usize,
    /// Mean negative log-likelihood, nats per token.
    pub mean_nll: f64,
    pub perplexity: f64,
    /// Total NLL in bits over the UTF-8 bytes of the text.
    pub bits_per_byte: f64,
    pub bytes: usize,
    pub block_size: usize,
    pub stride: usize,
}

/// One window: it reads `inputs` and scores the tokens `targets`.
struct Window {
    inputs: Range<usize>,
    targets: Range<usize>,
}

fn windows(n_tokens: usize, block_size: usize, stride: usize) -> Vec<Window> {
    let mut out = Vec::new();
    let mut start = 1; // token 0 has no context: it is never scored
    while start < n_tokens {
        let step = if start == 1 { block_size } else { stride };
        let end = (start + step).min(n_tokens);
        // Token t is predicted from the logits after token t - 1: inputs end at end - 2.
        out.push(Window {
            inputs: (end - 1).saturating_sub(block_size)..end - 1,
            targets: start..end,
        });
        start = end;
    }
    out
}

/// Evaluates `tokens` (the encoding of a text of `bytes` UTF-8 bytes). Windows of equal length
/// run in batches of `batch_size`.
pub fn perplexity(
    model: &Gpt,
    tokens: &[u32],
    bytes: usize,
    block_size: usize,
    stride: usize,
    batch_size: usize,
) -> Result<Perplexity> {
    let max = model.config().n_positions;
    if block_size == 0 || block_size > max {
        bail!("--block-size {block_size} must be between 1 and the model's context length {max}");
    }
    if stride == 0 || stride > block_size {
        bail!("--stride {stride} must be between 1 and the block size {block_size}");
    }
    if tokens.len() < 2 {
        bail!(
            "the text has {} token(s); at least 2 are needed to score one",
            tokens.len()
        );
    }
    let device = model.device().clone();
    let all = windows(tokens.len(), block_size, stride);
    let mut total_nll = 0f64;
    let mut scored = 0usize;
    // Consecutive windows of equal length share a batch (all but the last are full length).
    for group in all.chunk_by(|a, b| a.inputs.len() == b.inputs.len()) {
        for chunk in group.chunks(batch_size.max(1)) {
            let len = chunk[0].inputs.len();
            let ids: Vec<u32> = chunk
                .iter()
                .flat_map(|w| tokens[w.inputs.clone()].iter().copied())
                .collect();
            let x = Tensor::from_vec(ids, (chunk.len(), len), &device)?;
            let logits = model.forward(&x, None)?; // (b, len, V), f32
            let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1)?; // (b, len, V)
            for (i, w) in chunk.iter().enumerate() {
                // Input position j predicts token inputs.start + j + 1.
                let first = w.targets.start - w.inputs.start - 1;
                let n = w.targets.len();
                let lp = log_probs.i(i)?.narrow(0, first, n)?; // (n, V)
                let targets = Tensor::from_slice(&tokens[w.targets.clone()], (n, 1), &device)?;
                let picked = lp
                    .gather(&targets, 1)?
                    .sum_all()?
                    .to_dtype(DType::F64)?
                    .to_scalar::<f64>()?;
                total_nll -= picked;
                scored += n;
            }
        }
    }
    let mean_nll = total_nll / scored as f64;
    Ok(Perplexity {
        tokens_scored: scored,
        mean_nll,
        perplexity: mean_nll.exp(),
        bits_per_byte: total_nll / std::f64::consts::LN_2 / bytes.max(1) as f64,
        bytes,
        block_size,
        stride,
    })
}

/// `gpt-train eval`: loads the checkpoint and evaluates `data` (a text file, JSON lines,
/// parquet, a directory or Hub dataset of them, or token files; see [`crate::data::tokens_of`]).
pub fn eval_file(
    checkpoint: &Path,
    data: &Path,
    reading: &crate::data::Reading,
    block_size: Option<usize>,
    stride: Option<usize>,
    weights: Option<gpt::WeightFormat>,
    device: &Device,
) -> Result<Perplexity> {
    let (model, tokenizer) = gpt::load_dir_as(checkpoint, weights, device)?;
    let (tokens, bytes) = crate::data::tokens_of(data, reading, &tokenizer)?;
    if tokens.len() < 2 {
        bail!("{}: {} tokens, nothing to score", data.display(), tokens.len());
    }
    let block_size = block_size.unwrap_or(model.config().n_positions);
    let stride = stride.unwrap_or((block_size / 2).max(1));
    perplexity(&model, &tokens, bytes, block_size, stride, 8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_token_but_the_first_is_scored_once_with_the_promised_context() {
        for (n, block, stride) in [
            (100, 16, 16),
            (100, 16, 5),
            (17, 16, 8),
            (16, 16, 1),
            (5, 32, 16),
            (2, 4, 4),
        ] {
            let mut seen = vec![0; n];
            for (k, w) in windows(n, block, stride).iter().enumerate() {
                assert!(w.inputs.len() <= block && w.targets.end == w.inputs.end + 1);
                for t in w.targets.clone() {
                    seen[t] += 1;
                    assert!(t > w.inputs.start, "token {t} needs a token before it in the window");
                    if k > 0 && n > block {
                        // block - stride tokens carried, plus the window's own tokens before t
                        assert!(t - w.inputs.start > block - stride, "{n} {block} {stride}: token {t}");
                    }
                }
            }
            assert_eq!(seen[0], 0);
            assert!(seen[1..].iter().all(|&c| c == 1), "{n} {block} {stride}: {seen:?}");
        }
    }
}
