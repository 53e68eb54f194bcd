//! Fused CPU kernels, with backward passes, for the element-heavy steps of training: one file per
//! op (`gelu`, `softmax`, `add`, `layer_norm`, `cross_entropy`, `dropout`), and here the dispatch
//! that picks them or candle's own ops.
//!
//! On the CPU, candle's GELU calls libm's scalar `tanhf` per element and its backward builds ten
//! temporaries (two of them `powf`); the causal softmax is a mask tensor, an add and five ops
//! each way; the gradients of broadcast adds (biases, the position table) and of the composite
//! LayerNorm are reductions over leading dimensions, which candle walks element by element. In
//! profiles of nanoGPT's CPU recipe these took most of each step. Here each is one pass forward
//! and one backward; the tanh is a rational approximation that the compiler vectorises. They run
//! for f32 tensors on the CPU, and with the `cuda` feature on the GPU too (kernels in `ops.cu`,
//! launched from `cuda_ops.rs`: on the GPU the gain is fewer launches and passes over memory);
//! callers fall back to candle's ops elsewhere.

#![deny(clippy::undocumented_unsafe_blocks)]

mod add;
mod attention;
pub mod bf16_dot;
mod cross_entropy;
mod dropout;
mod gelu;
mod head_loss;
mod layer_norm;
mod linear;
mod packed;
mod parallel;
mod product;
mod rows;
pub mod simd;
mod softmax;
pub mod tape;
#[cfg(test)]
mod tests;
mod window_attention;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

use add::AddTiled;
use cross_entropy::CrossEntropy;
use dropout::Dropout;
use gelu::Gelu;
use layer_norm::LayerNorm;
use softmax::CausalSoftmax;
use window_attention::WindowAttention;

pub(crate) use attention::WriteRows;
pub use attention::{cached_attention, cached_attention_on, CachedKv};
pub use bf16_dot::Bf16Dot;
pub(crate) use gelu::gelu_new;
pub use head_loss::lm_head_loss;
pub use linear::{affine, affine_gelu, linear_product};
pub use packed::{MatmulPrecision, PackedMatrix, WeightFormat};
pub use product::{product, Autocast, Operand};
pub use rows::{argmax, argmax_on, log_sum_exp, log_sum_exp_on};
pub use simd::Simd;

/// The f32 data of a contiguous CPU tensor, for custom ops' `cpu_fwd`.
pub fn f32_slice<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    let data = storage.as_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

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

/// Whether a fused op (here, or the trainer's AdamW update) runs for `x`: f32 on the CPU unless
/// the environment sets `GPT_CPU_FUSED=0`, or on a CUDA GPU unless it sets `GPT_CUDA_FUSED=0`
/// (candle's own ops then, to compare).
pub fn fused(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && ((x.device().is_cpu() && cpu_fused()) || (x.device().is_cuda() && cuda_fused()))
}

/// `GPT_CPU_FUSED` is not `0`.
pub fn cpu_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_on(&ON, "GPT_CPU_FUSED")
}

/// Whether the on/off switch `var` (the `GPT_CPU_*` and `GPT_CUDA_*` variables) is on: anything
/// but `0`, or unset. Read once into `cell`, a static of the caller's, as it is asked per op.
pub fn switch_on(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// Dropout of `x` with probability `p`, the mask drawn from the counter-based generator keyed by
/// `key` for the rows of a batch starting at row `first_row` (see the `dropout` module);
/// differentiable. Fused on the CPU and CUDA in f32, else a mask tensor made on the host.
pub fn dropout(x: &Tensor, p: f32, key: u64, first_row: usize) -> Result<Tensor> {
    let per_row = if x.rank() == 0 {
        1
    } else {
        x.elem_count() / x.dim(0)?.max(1)
    };
    let op = Dropout {
        key,
        first: (first_row * per_row) as u64,
        p,
    };
    if fused(x) {
        tape::op1(&x.contiguous()?, op)
    } else {
        x.broadcast_mul(&op.mask(x)?)
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
            && cuda_fused()
            && switch_on(&ON, "GPT_CUDA_ATTENTION")
            && head_dim <= crate::cuda_ops::WINDOW_ATTENTION_MAX_HEAD
            && head_dim.is_multiple_of(4)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = head_dim;
        false
    }
}

/// `x + dropout(h)` (the residual add of a dropped-out branch) as one node, `h`'s masks those of
/// [`dropout`] with the same arguments; without dropout (`p` 0), `x + h`. Differentiable; fused
/// on the CPU in f32.
pub fn add_dropout(x: &Tensor, h: &Tensor, p: f32, key: u64, first_row: usize) -> Result<Tensor> {
    if p <= 0.0 {
        return tape::add(x, h);
    }
    if !(fused(h) && h.device().is_cpu()) {
        return x + dropout(h, p, key, first_row)?;
    }
    let per_row = h.elem_count() / h.dim(0)?.max(1);
    let op = dropout::AddDropout(Dropout {
        key,
        first: (first_row * per_row) as u64,
        p,
    });
    tape::op2(&x.contiguous()?, &h.contiguous()?, op)
}

/// `GPT_CUDA_FUSED` is not `0`.
pub fn cuda_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_on(&ON, "GPT_CUDA_FUSED")
}

/// GELU (tanh approximation), differentiable; fused on the CPU in f32.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        tape::op1(&x.contiguous()?, Gelu)
    } else {
        x.gelu()
    }
}

/// `x + b` with `b` broadcast over the leading dimensions of `x` (its shape is their trailing
/// dimensions), differentiable; fused on the CPU in f32.
pub fn add_tiled(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fused(x) && b.dtype() == DType::F32 {
        tape::op2(&x.contiguous()?, &b.contiguous()?, AddTiled)
    } else {
        x.broadcast_add(b)
    }
}

/// LayerNorm over the last dimension with weight `gamma` and bias `beta`, differentiable; fused
/// on the CPU in f32, else candle-nn's composite.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    if fused(x) && gamma.dtype() == DType::F32 {
        tape::op3(&x.contiguous()?, gamma, beta, LayerNorm { eps })
    } else {
        candle_nn::ops::layer_norm_slow(x, gamma, beta, eps)
    }
}

/// Causal softmax of attention scores `(.., T_q, T_k)` (see [`CausalSoftmax`]), differentiable;
/// fused on the CPU in f32, else an additive mask and candle's softmax.
pub fn causal_softmax(att: &Tensor, differentiable: bool) -> Result<Tensor> {
    if fused(att) {
        return tape::op1(&att.contiguous()?, CausalSoftmax);
    }
    let (t_q, t_k) = (att.dim(candle_core::D::Minus2)?, att.dim(candle_core::D::Minus1)?);
    // One new query (a decode step) sees every key: no mask to build and copy to the device.
    let att = if t_q == 1 {
        att.clone()
    } else {
        att.broadcast_add(&causal_mask(t_q, t_k - t_q, att.dtype(), att.device())?)?
    };
    if differentiable {
        candle_nn::ops::softmax(&att, candle_core::D::Minus1)
    } else {
        candle_nn::ops::softmax_last_dim(&att)
    }
}

/// Additive causal mask `(t_q, t_q + offset)` for queries at positions `offset..offset + t_q`: 0
/// where key j <= the query's position, -inf above (candle-transformers' helper, unbatched).
pub fn causal_mask(t_q: usize, offset: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    candle_transformers::utils::build_additive_causal_mask(t_q, offset, None, device, dtype)?
        .squeeze(0)?
        .squeeze(0)
}
