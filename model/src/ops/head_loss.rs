//! The LM head and the cross-entropy fused, forward and backward, in chunks of rows (as llm.c and
//! Liger-Kernel do): the `(N, V)` logits and their softmax are never held whole, only a chunk's
//! `(R, V)`. With GPT-2's 50257 tokens and 1024 positions the whole logits are 206 MB, and their
//! gradient as much again, every step.
//!
//! The loss is the graph's last node, so its gradient is known in the forward pass: with
//! gradients asked for, each chunk's logits become their gradient in place (softmax less the
//! target distribution, over the rows), and the chunk's contributions to `d hidden` and `d W`
//! are taken then, as Liger-Kernel's fused linear cross-entropy does; the backward pass only
//! scales them by the loss's upstream gradient. Products on the packed kernel; chunks in order,
//! so a run is repeatable.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::cross_entropy::{row_loss, row_loss_and_grad, targets_of};
use super::packed::PackedMatrix;
use super::simd::Simd;

/// Rows per chunk: the chunk's logits (`ROWS x V` f32, 26 MB at GPT-2's vocabulary) in place of
/// the whole batch's; under glibc's 32 MB threshold for fresh pages from the kernel, so the
/// chunks' buffers are reused rather than faulted in anew.
const ROWS: usize = 128;

/// Mean cross-entropy (label smoothing `eps`, as [`super::cross_entropy`]) of the logits
/// `hidden @ W^T` against `targets`, for `hidden` `(N, C)` and the head `W` `(V, C)` (any layout),
/// f32 on the CPU, u32 targets. Differentiable in `hidden` and `W` when `with_grad` (the
/// gradients are taken in this pass; without it, the loss alone, as evaluation needs).
pub fn lm_head_loss(hidden: &Tensor, w: &Tensor, targets: &Tensor, eps: f32, with_grad: bool) -> Result<Tensor> {
    let op = HeadLoss {
        eps,
        with_grad,
        grads: Mutex::new(None),
    };
    let (hidden, targets) = (hidden.contiguous()?, targets.contiguous()?);
    if with_grad {
        hidden.apply_op3(w, &targets, op)
    } else {
        hidden.apply_op3_no_bwd(w, &targets, &op)
    }
}

struct HeadLoss {
    eps: f32,
    with_grad: bool,
    /// `d loss / d hidden` and `d loss / d W`, taken in the forward pass, for `bwd`.
    grads: Mutex<Option<(Tensor, Tensor)>>,
}

impl CustomOp3 for HeadLoss {
    fn name(&self) -> &'static str {
        "fused-lm-head-loss"
    }

    fn cpu_fwd(
        &self,
        sh: &CpuStorage,
        lh: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        st: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let h = super::f32_slice(sh, lh, "lm-head-loss")?;
        let (n, c) = lh.shape().dims2()?;
        let (vocab, cw) = lw.shape().dims2()?;
        let targets = targets_of(st, lt, vocab)?;
        if cw != c || targets.len() != n {
            candle_core::bail!(
                "lm-head-loss: hidden ({n}, {c}), head ({vocab}, {cw}), {} targets",
                targets.len()
            )
        }
        let (wdata, stride) = (sw.as_slice::<f32>()?, lw.stride());
        let w_rows = PackedMatrix::from_strided_f32(wdata, lw.start_offset(), (vocab, c), (stride[0], stride[1]));
        // `W^T` `(C, V)` for `d hidden = d logits @ W`.
        let w_cols = self
            .with_grad
            .then(|| PackedMatrix::from_strided_f32(wdata, lw.start_offset(), (c, vocab), (stride[1], stride[0])));
        let simd = Simd::detect();
        let scale = 1.0 / n.max(1) as f32;
        let mut total = 0f64;
        let mut dh = Vec::with_capacity(if self.with_grad { n * c } else { 0 });
        let mut dw_t: Option<Vec<f32>> = None;
        for (chunk, h_chunk) in h.chunks(ROWS * c.max(1)).enumerate() {
            let rows = h_chunk.len() / c.max(1);
            let mut logits = w_rows.matmul_with(h_chunk, rows, simd); // (R, V)
            let chunk_targets = &targets[chunk * ROWS..chunk * ROWS + rows];
            let Some(w_cols) = &w_cols else {
                for (row, &t) in logits.chunks_exact(vocab).zip(chunk_targets) {
                    total += row_loss(row, t as usize, self.eps);
                }
                continue;
            };
            for (row, &t) in logits.chunks_exact_mut(vocab).zip(chunk_targets) {
                total += row_loss_and_grad(row, t as usize, self.eps, scale);
            }
            // d hidden (R, C) = d logits (R, V) @ W (V, C).
            dh.extend(w_cols.matmul_with(&logits, rows, simd));
            // d W^T (C, V) += hidden^T (C, R) @ d logits (R, V): `a @ B^T` with a = hidden^T and
            // B = d logits^T, packed straight from the logits' rows.
            let h_t = super::linear::transpose(h_chunk, rows, c);
            let dlogits_t = PackedMatrix::from_strided_f32(&logits, 0, (vocab, rows), (1, vocab));
            let part = dlogits_t.matmul_with(&h_t, c, simd);
            match &mut dw_t {
                None => dw_t = Some(part),
                Some(acc) => acc.iter_mut().zip(&part).for_each(|(a, p)| *a += p),
            }
        }
        if self.with_grad {
            let dev = candle_core::Device::Cpu;
            let dw = match dw_t {
                Some(dw_t) => super::linear::transpose(&dw_t, c, vocab),
                None => vec![0f32; vocab * c],
            };
            // Contiguous (V, C): candle's sum with the embedding's gradient reads a transposed
            // view element by element, across cache lines.
            let grads = (
                Tensor::from_vec(dh, (n, c), &dev)?,
                Tensor::from_vec(dw, (vocab, c), &dev)?,
            );
            *self
                .grads
                .lock()
                .map_err(|_| candle_core::Error::Msg("lm-head-loss: poisoned".into()))? = Some(grads);
        }
        let mean = (total / n.max(1) as f64) as f32;
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    fn bwd(
        &self,
        _h: &Tensor,
        _w: &Tensor,
        _t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Some((dh, dw)) = self
            .grads
            .lock()
            .map_err(|_| candle_core::Error::Msg("lm-head-loss: poisoned".into()))?
            .take()
        else {
            candle_core::bail!("lm-head-loss: backward without a forward pass that took the gradients")
        };
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        if g == 1.0 {
            // The loss itself is what `backward` was called on (training's case): no pass to scale.
            return Ok((Some(dh), Some(dw), None));
        }
        Ok((Some((dh * g)?), Some((dw * g)?), None))
    }
}
