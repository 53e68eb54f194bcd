//! Mean cross-entropy of logits against target ids, with its gradient, without `(N, V)`
//! temporaries.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::f32_slice;
use crate::simd::Simd;

/// A target that counts for nothing: its row adds no loss and gets no gradient, and the mean is
/// over the other rows (PyTorch's `ignore_index`, there -100). A batch of ignored rows only has
/// loss 0, not NaN. What chat fine-tuning gives every position but the assistant's.
pub const IGNORE: u32 = u32::MAX;

/// How many of `targets` count (are not [`IGNORE`]), at least 1: the mean's divisor.
pub(crate) fn counted(targets: &[u32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE).count().max(1)
}

/// Mean cross-entropy of rows of logits `(N, V)` against target ids `(N)`, with label smoothing
/// `eps` as PyTorch's `cross_entropy(label_smoothing=eps)`: the target distribution puts
/// `1 - eps + eps / V` on the target and `eps / V` on every other token, so per row the loss is
/// `logsumexp(x) - (1 - eps) x[target] - eps mean(x)` (plain NLL at `eps = 0`). Two passes over
/// the row and no `(N, V)` temporaries (candle's `cross_entropy` is log-softmax, gather and mean:
/// seven full-size passes each way at GPT-2's 50257-word vocabulary).
pub(crate) struct CrossEntropy {
    pub(crate) eps: f32,
}

impl CrossEntropy {
    /// The loss of one row.
    fn row_loss(&self, row: &[f32], target: usize) -> f64 {
        row_loss(row, target, self.eps)
    }
}

/// The loss of one row of logits against its target, with label smoothing `eps` (0 for an
/// [`IGNORE`]d target).
pub(crate) fn row_loss(row: &[f32], target: usize, eps: f32) -> f64 {
    if target == IGNORE as usize {
        return 0.0;
    }
    loss_of(row, target, eps, row_logsumexp(row))
}

/// [`row_loss`] given the row's max and log-sum-exp.
fn loss_of(row: &[f32], target: usize, eps: f32, (max, lse): (f32, f32)) -> f64 {
    let nll = (max + lse - row[target]) as f64;
    if eps == 0.0 {
        return nll;
    }
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / row.len() as f64;
    let uniform = (max + lse) as f64 - mean; // -mean(log p)
    (1.0 - eps as f64) * nll + eps as f64 * uniform
}

/// The loss of one row (as [`row_loss`]), and its gradient times `scale` written over the row
/// (as [`CrossEntropyGrad`] computes it); for an [`IGNORE`]d target, 0 and zeros.
pub(crate) fn row_loss_and_grad(row: &mut [f32], target: usize, eps: f32, scale: f32) -> f64 {
    if target == IGNORE as usize {
        row.fill(0.0);
        return 0.0;
    }
    let (max, lse) = row_logsumexp(row);
    let loss = loss_of(row, target, eps, (max, lse));
    let shift = max + lse;
    let smooth = eps / row.len() as f32;
    // `rows::exp` vectorises; libm's `expf` is a call per logit (50k of them a row).
    for v in row.iter_mut() {
        *v = scale * (crate::rows::exp(*v - shift) - smooth);
    }
    row[target] -= scale * (1.0 - eps);
    loss
}

/// Row `r`'s max and log of the sum of exp(x - max).
fn row_logsumexp(row: &[f32]) -> (f32, f32) {
    let (max, sum) = crate::rows::max_and_sum_exp(Simd::detect(), row);
    (max, sum.ln())
}

/// The target ids of rows of `vocab` logits, each checked against the vocabulary (or [`IGNORE`]).
pub(crate) fn targets_of<'a>(storage: &'a CpuStorage, layout: &Layout, vocab: usize) -> Result<&'a [u32]> {
    let data = storage.as_slice::<u32>()?;
    let ids = match layout.contiguous_offsets() {
        Some((start, end)) => &data[start..end],
        None => candle_core::bail!("cross-entropy: the targets must be contiguous"),
    };
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab && t != IGNORE) {
        candle_core::bail!("cross-entropy: target id {bad} is outside the vocabulary of {vocab}");
    }
    Ok(ids)
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "fused-cross-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "cross-entropy")?;
        let vocab = *l1.dims().last().unwrap_or(&1);
        let targets = targets_of(s2, l2, vocab)?;
        let total: f64 = x
            .chunks_exact(vocab)
            .zip(targets)
            .map(|(row, &t)| self.row_loss(row, t as usize))
            .sum();
        let mean = (total / counted(targets) as f64) as f32;
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rows = counted(&targets.flatten_all()?.to_vec1::<u32>()?);
        let scale = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / rows as f32;
        let dx = logits
            .contiguous()?
            .apply_op2_no_bwd(&targets.contiguous()?, &CrossEntropyGrad { scale, eps: self.eps })?;
        Ok((Some(dx), None))
    }
}

/// d loss / d logits = scale * (softmax(x) - (1 - eps) onehot(target) - eps / V), per row.
pub(crate) struct CrossEntropyGrad {
    pub(crate) scale: f32,
    pub(crate) eps: f32,
}

impl CustomOp2 for CrossEntropyGrad {
    fn name(&self) -> &'static str {
        "fused-cross-entropy-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "cross-entropy-grad")?;
        let vocab = *l1.dims().last().unwrap_or(&1);
        let targets = targets_of(s2, l2, vocab)?;
        let mut dx = vec![0f32; x.len()];
        for ((row, drow), &t) in x.chunks_exact(vocab).zip(dx.chunks_exact_mut(vocab)).zip(targets) {
            if t == IGNORE {
                continue; // no gradient: the row stays zero
            }
            let (max, lse) = row_logsumexp(row);
            let shift = max + lse;
            let smooth = self.eps / vocab as f32;
            for (d, &v) in drow.iter_mut().zip(row) {
                *d = self.scale * (crate::rows::exp(v - shift) - smooth);
            }
            drow[t as usize] -= self.scale * (1.0 - self.eps);
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}
