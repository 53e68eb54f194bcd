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

use crate::parallel;
use crate::train::cross_entropy::{counted, row_loss, row_loss_and_grad, targets_of};
use crate::train::product::{Autocast, Operand, Rhs};

/// Rows per chunk: the chunk's logits (`ROWS x V` f32, 103 MB at GPT-2's vocabulary) in place of
/// the whole batch's. Each chunk adds its part of the head's gradient `(V, C)` (154 MB at GPT-2's
/// size) over `ROWS` positions: with 128 rows that pass over memory weighed on a GPT-2-small step
/// (4 x 256 tokens on 2 cores: 512 rows 8-12% faster than 128, f32 and bf16, the same peak RSS).
const ROWS: usize = 512;

/// Mean cross-entropy (label smoothing `eps`, as [`crate::train::cross_entropy`]) of the logits
/// `hidden @ W^T` against `targets`, for `hidden` `(N, C)` and the head `W` `(V, C)` (any layout),
/// f32 on the CPU, u32 targets, the products at `autocast`'s precision. Differentiable in
/// `hidden` and `W` when `with_grad` (the gradients are taken in this pass; without it, the loss
/// alone, as evaluation needs).
pub fn lm_head_loss(
    hidden: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    eps: f32,
    with_grad: bool,
    autocast: Autocast,
) -> Result<Tensor> {
    let op = HeadLoss {
        eps,
        with_grad,
        // A head no gradient can reach (a LoRA run's frozen embedding): no `d W` (a third of the
        // head's arithmetic, and `V x C` floats).
        weight_grad: with_grad && w.track_op(),
        autocast,
        grads: Mutex::new(None),
    };
    let (hidden, targets) = (hidden.contiguous()?, targets.contiguous()?);
    if with_grad {
        crate::tape::op3(&hidden, w, &targets, op)
    } else {
        hidden.apply_op3_no_bwd(w, &targets, &op)
    }
}

struct HeadLoss {
    eps: f32,
    with_grad: bool,
    /// Whether `d W` is taken too (when `with_grad`).
    weight_grad: bool,
    autocast: Autocast,
    /// `d loss / d hidden` `(N, C)` and `d loss / d W` `(V, C)`, taken in the forward pass, for
    /// `bwd` (which scales them in place by the upstream gradient: no copy).
    grads: Mutex<Option<Grads>>,
}

struct Grads {
    dh: (Vec<f32>, (usize, usize)),
    dw: Option<(Vec<f32>, (usize, usize))>,
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
        let h = crate::f32_slice(sh, lh, "lm-head-loss")?;
        let (n, c) = lh.shape().dims2()?;
        let (vocab, cw) = lw.shape().dims2()?;
        let targets = targets_of(st, lt, vocab)?;
        if cw != c || targets.len() != n {
            candle_core::bail!(
                "lm-head-loss: hidden ({n}, {c}), head ({vocab}, {cw}), {} targets",
                targets.len()
            )
        }
        let w = Operand::of(sw, lw)?;
        // `W` `(V, C)` for the logits, and `W^T` `(C, V)` for `d hidden = d logits @ W`.
        let w_rows = Rhs::new(w, self.autocast);
        let w_cols = self.with_grad.then(|| Rhs::new(w.t(), self.autocast));
        let scale = 1.0 / counted(targets) as f32;
        let mut total = 0f64;
        let mut dh = Vec::with_capacity(if self.with_grad { n * c } else { 0 });
        let mut dw: Option<Vec<f32>> = None;
        for (chunk, h_chunk) in h.chunks(ROWS * c.max(1)).enumerate() {
            let rows = h_chunk.len() / c.max(1);
            let h_chunk = Operand::rows(h_chunk, rows, c);
            let mut logits = w_rows.matmul(h_chunk)?; // (R, V)
            let chunk_targets = &targets[chunk * ROWS..chunk * ROWS + rows];
            // Rows over the pool, their losses summed in order.
            let mut losses = vec![0f64; rows];
            parallel::rows_with(
                &mut logits,
                vocab,
                &mut losses,
                #[inline(always)]
                |i, row, loss| {
                    let target = chunk_targets[i] as usize;
                    *loss = match w_cols {
                        Some(_) => row_loss_and_grad(row, target, self.eps, scale),
                        None => row_loss(row, target, self.eps),
                    };
                },
            );
            total += losses.iter().sum::<f64>();
            let Some(w_cols) = &w_cols else { continue };
            let dlogits = Operand::rows(&logits, rows, vocab);
            // d hidden (R, C) = d logits (R, V) @ W (V, C).
            dh.extend(w_cols.matmul(dlogits)?);
            // d W (V, C) += d logits^T (V, R) @ hidden (R, C), summed over the chunks in one
            // buffer, contiguous (V, C) as the variable is (candle's sum with the embedding's
            // gradient would read a transposed view element by element, across cache lines).
            if !self.weight_grad {
                continue;
            }
            let h_t = Rhs::new(h_chunk.t(), self.autocast);
            match &mut dw {
                None => dw = Some(h_t.matmul(dlogits.t())?),
                Some(dw) => h_t.matmul_add(dlogits.t(), dw)?,
            }
        }
        if self.with_grad {
            let grads = Grads {
                dh: (dh, (n, c)),
                dw: self
                    .weight_grad
                    .then(|| (dw.unwrap_or_else(|| vec![0f32; vocab * c]), (vocab, c))),
            };
            *self
                .grads
                .lock()
                .map_err(|_| candle_core::Error::Msg("lm-head-loss: poisoned".into()))? = Some(grads);
        }
        let mean = (total / counted(targets) as f64) as f32;
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
        let Some(Grads { dh, dw }) = self
            .grads
            .lock()
            .map_err(|_| candle_core::Error::Msg("lm-head-loss: poisoned".into()))?
            .take()
        else {
            candle_core::bail!("lm-head-loss: backward without a forward pass that took the gradients")
        };
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let tensor = |(mut values, shape): (Vec<f32>, (usize, usize))| {
            if g != 1.0 {
                values.iter_mut().for_each(|v| *v *= g);
            }
            Tensor::from_vec(values, shape, &candle_core::Device::Cpu)
        };
        Ok((Some(tensor(dh)?), dw.map(tensor).transpose()?, None))
    }
}
