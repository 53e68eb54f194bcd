//! Kernels of training and evaluation over whole `(B, T)` windows: the products with operands
//! in any layout ([`product`], bf16 under autocast in [`bf16`]), the fused linear layers
//! ([`linear`]), causal window attention ([`window_attention`]), the cross-entropy and the LM
//! head fused with it ([`head_loss`]).

pub mod bf16;
pub mod cross_entropy;
mod grouped;
pub mod head_loss;
pub mod linear;
pub mod operand;
pub mod product;
mod window_attention;

use candle_core::{DType, Result, Tensor};

use crate::elementwise::dropout::Dropout;
use crate::{tape, Simd};
pub use bf16::Bf16Dot;
use cross_entropy::CrossEntropy;
pub use cross_entropy::IGNORE;
pub use head_loss::lm_head_loss;
pub use linear::{affine, affine_gelu, frozen_affine, linear_product, scaled_linear_product};
pub use product::{product, Autocast, Operand};
use window_attention::WindowAttention;

/// Mean cross-entropy of `logits` `(N, V)` against `targets` `(N)` (u32), with label smoothing
/// `eps` (0 for plain NLL; the formula is in `ops/cross_entropy.rs`), differentiable with respect
/// to the logits; the mean over the targets that are not [`IGNORE`]. Fused on the CPU in f32,
/// else composed of candle-nn's ops.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, eps: f32) -> Result<Tensor> {
    if logits.device().is_cpu() && logits.dtype() == DType::F32 && targets.dtype() == DType::U32 {
        tape::op2(&logits.contiguous()?, &targets.contiguous()?, CrossEntropy { eps })
    } else {
        // Always the masked form: asking whether any target is IGNORE would read the targets
        // back to the host, a GPU sync per micro-batch; the mask costs a few `(N,)` ops.
        masked_cross_entropy(logits, targets, eps)
    }
}

/// [`cross_entropy`] of candle's ops where some targets are [`IGNORE`]d: each row's loss times
/// whether it counts, summed, over the count (at least 1).
fn masked_cross_entropy(logits: &Tensor, targets: &Tensor, eps: f32) -> Result<Tensor> {
    let keep = targets.ne(IGNORE)?; // (N,) u8
    let safe = keep.where_cond(targets, &targets.zeros_like()?)?;
    let log_p = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?; // (N, V)
    let nll = log_p.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?.neg()?; // (N,)
    let rows = if eps == 0.0 {
        nll
    } else {
        let uniform = log_p.mean(candle_core::D::Minus1)?.neg()?;
        ((nll * (1.0 - eps as f64))? + (uniform * eps as f64)?)?
    };
    let keep = keep.to_dtype(rows.dtype())?;
    let count = keep.sum_all()?.maximum(1.0)?;
    (rows * &keep)?.sum_all()?.div(&count)
}

/// Causal self-attention of `qkv` `(B * T, 3C)`, windows of `t` rows (queries, keys and
/// values, head after head, as GPT-2's `c_attn` writes them) with `n_head` heads:
/// `softmax(q kᵀ · scale + mask) v` per head, returned as `(B * T, C)`; differentiable. Dropout
/// `p` of the attention weights draws the masks that [`dropout`] keyed by `key` would draw for
/// the `(B, nh, T, T)` weights from window `first_row` (0: none). CPU, f32 (see [`fused`]);
/// tiled, never holding the `(B, nh, T, T)` weights (the `window_attention` module). On
/// `simd`'s lanes ([`Simd::detect`] for this CPU's widest).
///
/// `segments` packs several sequences into a window: [`segment_starts`] of the rows' positions.
/// Each row then sees its own sequence's keys only. On the CPU only.
///
/// # Panics
/// If this CPU does not run `simd` (see [`Simd::available`]).
#[allow(clippy::too_many_arguments)]
pub fn window_attention(
    simd: Simd,
    qkv: &Tensor,
    t: usize,
    n_head: usize,
    scale: f32,
    p: f32,
    key: u64,
    first_row: usize,
    segments: Option<std::sync::Arc<[u32]>>,
) -> Result<Tensor> {
    let head_dim = qkv.dims().last().map_or(0, |w| w / 3 / n_head.max(1));
    if !window_attention_runs_on(qkv, head_dim) {
        candle_core::bail!("window-attention: qkv must be f32 on the CPU, or on a CUDA GPU with heads of at most 128 (a multiple of 4)")
    }
    if let Some(starts) = &segments {
        let rows = qkv.dim(0)?;
        if !qkv.device().is_cpu() {
            candle_core::bail!("window-attention: packed windows (segments) run on the CPU only")
        }
        if starts.len() != rows || t == 0 {
            candle_core::bail!("window-attention: {} segment starts for {rows} rows", starts.len())
        }
        if let Some(r) = (0..rows).find(|&r| starts[r] as usize > r % t) {
            candle_core::bail!(
                "window-attention: row {r} starts its sequence at {}, after itself",
                starts[r]
            )
        }
    }
    let dropout = (p > 0.0).then_some(Dropout {
        key,
        first: (first_row * n_head * t * t) as u64,
        p,
    });
    let qkv = qkv.contiguous()?;
    // The probabilities are kept for a backward pass where one will run (a tape records, or
    // candle tracks `qkv`) and the CPU's caches hold them (see `KEEP_PROBS_MAX`).
    let keep = qkv.device().is_cpu()
        && (tape::recording() || qkv.track_op())
        && window_attention::keeps_probs(qkv.dim(0)?, t, n_head);
    tape::op1(
        &qkv,
        WindowAttention {
            t,
            n_head,
            scale,
            dropout,
            simd,
            starts: segments,
            probs: keep.then(Default::default),
        },
    )
}

/// Grouped-query attention's rows `(N, (nh + 2 nkv) hs)` (queries, keys, values, head after
/// head) with each key and value head repeated for its group of `nh / nkv` query heads:
/// `(N, 3 nh hs)`, what [`window_attention`] takes; differentiable (the gradient sums each
/// group). With as many key/value heads as query heads, `qkv` itself. One pass each way on the
/// CPU in f32, else candle's ops.
pub fn repeat_kv_heads(qkv: &Tensor, n_head: usize, n_kv_head: usize) -> Result<Tensor> {
    if n_kv_head == n_head {
        return Ok(qkv.clone());
    }
    let op = grouped::RepeatKv { n_head, n_kv_head };
    if qkv.device().is_cpu() && crate::fused(qkv) {
        return tape::op1(&qkv.contiguous()?, op);
    }
    let (rows, width) = qkv.dims2()?;
    if n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) || !width.is_multiple_of(n_head + 2 * n_kv_head) {
        candle_core::bail!("repeat-kv-heads: {width} columns for {n_head} query heads over {n_kv_head} key/value heads")
    }
    let hs = width / (n_head + 2 * n_kv_head);
    let repeat = |start: usize| -> Result<Tensor> {
        qkv.narrow(1, start * hs, n_kv_head * hs)?
            .reshape((rows, n_kv_head, 1, hs))?
            .broadcast_as((rows, n_kv_head, n_head / n_kv_head, hs))?
            .reshape((rows, n_head * hs))
    };
    Tensor::cat(
        &[
            &qkv.narrow(1, 0, n_head * hs)?,
            &repeat(n_head)?,
            &repeat(n_head + n_kv_head)?,
        ],
        1,
    )
}

/// Where each row's sequence starts in its window, from the rows' positions `(B * T)` (each 0
/// where a sequence starts, else one more than the row before: packed windows, positions
/// restarting per sequence, as Hugging Face's `position_ids` for packing): what
/// [`window_attention`] and [`segment_mask`] take. An error names the first position that
/// breaks the rule.
pub fn segment_starts(positions: &[u32], t: usize) -> Result<std::sync::Arc<[u32]>> {
    if t == 0 || !positions.len().is_multiple_of(t) {
        candle_core::bail!("{} positions are not whole windows of {t}", positions.len())
    }
    let mut starts = Vec::with_capacity(positions.len());
    for (r, &p) in positions.iter().enumerate() {
        let i = r % t;
        let follows = i > 0 && p > 0 && positions[r - 1].checked_add(1) == Some(p);
        if p != 0 && !follows {
            candle_core::bail!(
                "position {p} at window {}, row {i}: a sequence's positions start at 0 and go up by one",
                r / t
            )
        }
        starts.push((i - p as usize) as u32);
    }
    Ok(starts.into())
}

/// The additive mask `(B, 1, T, T)` of packed windows for candle's composite attention: 0 where
/// a row's query may see the key (its own sequence, not after it), -inf elsewhere.
pub fn segment_mask(starts: &[u32], t: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let b = starts.len() / t.max(1);
    let mut mask = vec![f32::NEG_INFINITY; b * t * t];
    for (r, &s) in starts.iter().enumerate() {
        let i = r % t;
        mask[r * t + s as usize..=r * t + i].fill(0.0);
    }
    Tensor::from_vec(mask, (b, 1, t, t), device)?.to_dtype(dtype)
}

/// Whether [`window_attention`] runs on `x`'s device and dtype with heads of `head_dim`: f32 on
/// the CPU, or with the `cuda` feature f32 on a CUDA GPU with heads of at most 128 (a multiple
/// of 4), unless `GPT_CUDA_FUSED=0` or `GPT_CUDA_ATTENTION=0` is set.
pub fn window_attention_runs_on(x: &Tensor, head_dim: usize) -> bool {
    if x.dtype() != DType::F32 {
        return false;
    }
    if x.device().is_cpu() {
        return true;
    }
    #[cfg(feature = "cuda")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        x.device().is_cuda()
            && crate::cuda_fused()
            && crate::switch_on(&ON, "GPT_CUDA_ATTENTION")
            && head_dim <= window_attention::cuda::WINDOW_ATTENTION_MAX_HEAD
            && head_dim.is_multiple_of(4)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = head_dim;
        false
    }
}

#[cfg(test)]
mod ignored_targets {
    use candle_core::{Device, Tensor, Var};

    use super::*;

    /// Logits `(6, 11)` and their gradients' weight.
    fn logits() -> Result<Var> {
        let values: Vec<f32> = (0..66).map(|i| ((i * 37 % 23) as f32 - 11.0) / 4.0).collect();
        Var::from_tensor(&Tensor::from_vec(values, (6, 11), &Device::Cpu)?)
    }

    /// The loss and its gradient by `f`.
    fn with_grad(f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<(f32, Vec<Vec<f32>>)> {
        let x = logits()?;
        let loss = f(x.as_tensor())?;
        let grads = loss.backward()?;
        let g = grads
            .get(x.as_tensor())
            .map_or(Ok(vec![vec![0.0; 11]; 6]), |g| g.to_vec2::<f32>())?;
        Ok((loss.to_scalar::<f32>()?, g))
    }

    #[test]
    fn ignored_rows_add_no_loss_and_get_no_gradient() -> Result<()> {
        let targets = Tensor::new(&[3u32, IGNORE, 7, IGNORE, 0, 10], &Device::Cpu)?;
        let kept = Tensor::new(&[0u32, 2, 4, 5], &Device::Cpu)?;
        for eps in [0.0, 0.1] {
            // The mean over the kept rows alone, fused and of candle's ops alike.
            let (loss, grad) = with_grad(|x| cross_entropy(x, &targets, eps))?;
            let (plain, plain_grad) =
                with_grad(|x| cross_entropy(&x.index_select(&kept, 0)?, &targets.index_select(&kept, 0)?, eps))?;
            assert!((loss - plain).abs() < 1e-6, "{loss} vs {plain}");
            let (masked, masked_grad) = with_grad(|x| masked_cross_entropy(x, &targets, eps))?;
            assert!((loss - masked).abs() < 1e-5, "fused {loss} vs candle's ops {masked}");
            for (r, row) in grad.iter().enumerate() {
                let ignored = r == 1 || r == 3;
                assert_eq!(row.iter().all(|&g| g == 0.0), ignored, "row {r}");
                for (a, b) in row.iter().zip(&masked_grad[r]) {
                    assert!((a - b).abs() < 1e-6, "row {r}: {a} vs {b}");
                }
            }
            // The gradient of the kept rows' mean (over 4 rows either way), through the selection.
            for (r, (row, plain)) in grad.iter().zip(&plain_grad).enumerate() {
                for (a, b) in row.iter().zip(plain) {
                    assert!((a - b).abs() < 1e-6, "row {r}: {a} vs {b}");
                }
            }
        }
        // Every row ignored: loss 0 and no gradient, not NaN.
        let none = Tensor::new(&[IGNORE; 6], &Device::Cpu)?;
        for f in [
            cross_entropy as fn(&Tensor, &Tensor, f32) -> Result<Tensor>,
            masked_cross_entropy,
        ] {
            let (loss, grad) = with_grad(|x| f(x, &none, 0.0))?;
            assert_eq!(loss, 0.0);
            assert!(grad.iter().flatten().all(|&g| g == 0.0));
        }
        // A target outside the vocabulary that is not IGNORE is still an error.
        let bad = Tensor::new(&[3u32, 11, 0, 0, 0, 0], &Device::Cpu)?;
        assert!(cross_entropy(logits()?.as_tensor(), &bad, 0.0).is_err());
        Ok(())
    }

    #[test]
    fn the_fused_head_ignores_them_too() -> Result<()> {
        let hidden: Vec<f32> = (0..24).map(|i| ((i * 13 % 7) as f32 - 3.0) / 3.0).collect();
        let hidden = Var::from_tensor(&Tensor::from_vec(hidden, (6, 4), &Device::Cpu)?)?;
        let w: Vec<f32> = (0..44).map(|i| ((i * 5 % 9) as f32 - 4.0) / 5.0).collect();
        let w = Var::from_tensor(&Tensor::from_vec(w, (11, 4), &Device::Cpu)?)?;
        let targets = Tensor::new(&[3u32, IGNORE, 7, IGNORE, 0, 10], &Device::Cpu)?;
        let fused = lm_head_loss(hidden.as_tensor(), w.as_tensor(), &targets, 0.0, true, Autocast::Off)?;
        let (loss, tape) = crate::tape::record(|| {
            lm_head_loss(hidden.as_tensor(), w.as_tensor(), &targets, 0.0, true, Autocast::Off)
        })?;
        let grads = tape.backward(&loss, 1.0, &[hidden.as_tensor(), w.as_tensor()])?;
        let logits = hidden.as_tensor().matmul(&w.as_tensor().t()?)?;
        let reference = cross_entropy(&logits, &targets, 0.0)?;
        let (a, b) = (fused.to_scalar::<f32>()?, reference.to_scalar::<f32>()?);
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        let dh = grads[0]
            .as_ref()
            .map(|g| g.to_vec2::<f32>())
            .transpose()?
            .unwrap_or_default();
        assert!(
            dh[1].iter().chain(&dh[3]).all(|&g| g == 0.0),
            "ignored rows' hidden states get no gradient"
        );
        assert!(dh[0].iter().any(|&g| g != 0.0));
        let all = Tensor::new(&[IGNORE; 6], &Device::Cpu)?;
        let none = lm_head_loss(hidden.as_tensor(), w.as_tensor(), &all, 0.0, false, Autocast::Off)?;
        assert_eq!(none.to_scalar::<f32>()?, 0.0);
        Ok(())
    }
}
