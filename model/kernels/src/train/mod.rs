//! Kernels of training and evaluation over whole `(B, T)` windows: the products with operands
//! in any layout ([`product`], bf16 under autocast in [`bf16`]), the fused linear layers
//! ([`linear`]), causal window attention ([`window_attention`]), the cross-entropy and the LM
//! head fused with it ([`head_loss`]).

pub mod bf16;
pub mod cross_entropy;
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
pub use head_loss::lm_head_loss;
pub use linear::{affine, affine_gelu, frozen_affine, linear_product, scaled_linear_product};
pub use product::{product, Autocast, Operand};
use window_attention::WindowAttention;

/// Mean cross-entropy of `logits` `(N, V)` against `targets` `(N)` (u32), with label smoothing
/// `eps` (0 for plain NLL; the formula is in `ops/cross_entropy.rs`), differentiable with respect
/// to the logits; fused on the CPU in f32, else composed of candle-nn's ops.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, eps: f32) -> Result<Tensor> {
    if logits.device().is_cpu() && logits.dtype() == DType::F32 && targets.dtype() == DType::U32 {
        tape::op2(&logits.contiguous()?, &targets.contiguous()?, CrossEntropy { eps })
    } else if eps == 0.0 {
        candle_nn::loss::cross_entropy(logits, targets)
    } else {
        let log_p = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?;
        let nll = candle_nn::loss::nll(&log_p, targets)?;
        let uniform = log_p.mean(candle_core::D::Minus1)?.mean_all()?.neg()?;
        (nll * (1.0 - eps as f64))? + (uniform * eps as f64)?
    }
}

/// Causal self-attention of `qkv` `(B * T, 3C)`, windows of `t` rows (queries, keys and
/// values, head after head, as GPT-2's `c_attn` writes them) with `n_head` heads:
/// `softmax(q kᵀ · scale + mask) v` per head, returned as `(B * T, C)`; differentiable. Dropout
/// `p` of the attention weights draws the masks that [`dropout`] keyed by `key` would draw for
/// the `(B, nh, T, T)` weights from window `first_row` (0: none). CPU, f32 (see [`fused`]);
/// tiled, never holding the `(B, nh, T, T)` weights (the `window_attention` module). On
/// `simd`'s lanes ([`Simd::detect`] for this CPU's widest).
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
) -> Result<Tensor> {
    let head_dim = qkv.dims().last().map_or(0, |w| w / 3 / n_head.max(1));
    if !window_attention_runs_on(qkv, head_dim) {
        candle_core::bail!("window-attention: qkv must be f32 on the CPU, or on a CUDA GPU with heads of at most 128 (a multiple of 4)")
    }
    let dropout = (p > 0.0).then_some(Dropout {
        key,
        first: (first_row * n_head * t * t) as u64,
        p,
    });
    tape::op1(
        &qkv.contiguous()?,
        WindowAttention {
            t,
            n_head,
            scale,
            dropout,
            simd,
        },
    )
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
