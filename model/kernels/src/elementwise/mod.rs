//! Element-wise and row-wise ops with their backward rules, used by training and inference
//! alike: one file per op (`gelu`, `relu2`, `softmax`, `add`, `layer_norm`, `dropout`), and here the
//! dispatch that picks them or candle's own ops.
//!
//! On the CPU, candle's GELU calls libm's scalar `tanhf` per element and its backward builds ten
//! temporaries (two of them `powf`); the causal softmax is a mask tensor, an add and five ops
//! each way; the gradients of broadcast adds (biases, the position table) and of the composite
//! LayerNorm are reductions over leading dimensions, which candle walks element by element. In
//! profiles of nanoGPT's CPU recipe these took most of each step. Here each is one pass forward
//! and one backward; the tanh is a rational approximation that the compiler vectorises.

pub mod add;
pub mod dropout;
pub mod gated;
pub mod gelu;
pub mod layer_norm;
pub mod relu2;
pub mod rms_norm;
pub mod rope;
pub mod softmax;

use candle_core::{CpuStorage, DType, Layout, Result, Shape, Tensor};

use crate::{f32_slice, fused, parallel, tape};
use add::AddTiled;
use dropout::Dropout;
use gated::{GateActivation, Gated};
use gelu::Gelu;
use layer_norm::LayerNorm;
use relu2::Relu2;
use rms_norm::RmsNorm;
use rope::Rope;
use softmax::CausalSoftmax;

/// `f` of every value of an f32 tensor, in one pass on the pool: an element-wise op's forward.
#[inline(always)]
fn map(storage: &CpuStorage, layout: &Layout, op: &str, f: impl Fn(f32) -> f32 + Sync) -> Result<(CpuStorage, Shape)> {
    let x = f32_slice(storage, layout, op)?;
    let y = parallel::collect(
        x.len(),
        parallel::GRAIN,
        #[inline(always)]
        |start, out| {
            for (y, &x) in out.iter_mut().zip(&x[start..]) {
                y.write(f(x));
            }
        },
    );
    Ok((CpuStorage::F32(y), layout.shape().clone()))
}

/// `g · slope(x)` for an element-wise op's input `x` (`s1`) and its output's gradient `g` (`s2`),
/// in one pass on the pool: the op's backward.
#[inline(always)]
fn map_grad(
    (s1, l1): (&CpuStorage, &Layout),
    (s2, l2): (&CpuStorage, &Layout),
    op: &str,
    slope: impl Fn(f32) -> f32 + Sync,
) -> Result<(CpuStorage, Shape)> {
    let (x, g) = (f32_slice(s1, l1, op)?, f32_slice(s2, l2, op)?);
    if x.len() != g.len() {
        candle_core::bail!("{op}: {:?} and {:?}", l1.dims(), l2.dims())
    }
    let dx = parallel::collect(
        x.len(),
        parallel::GRAIN,
        #[inline(always)]
        |start, out| {
            for ((d, &x), &g) in out.iter_mut().zip(&x[start..]).zip(&g[start..]) {
                d.write(g * slope(x));
            }
        },
    );
    Ok((CpuStorage::F32(dx), l1.shape().clone()))
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

/// `x + dropout(h)` (the residual add of a dropped-out branch) as one node, `h`'s masks those of
/// [`dropout`] with the same arguments; without dropout (`p` 0), `x + h`. Differentiable; fused
/// on the CPU in f32.
pub fn add_dropout(x: &Tensor, h: &Tensor, p: f32, key: u64, first_row: usize) -> Result<Tensor> {
    if p <= 0.0 {
        return tape::add(x, h);
    }
    if !(fused(h) && h.device().is_cpu()) {
        return tape::add(x, &dropout(h, p, key, first_row)?);
    }
    let per_row = h.elem_count() / h.dim(0)?.max(1);
    let op = dropout::AddDropout(Dropout {
        key,
        first: (first_row * per_row) as u64,
        p,
    });
    tape::op2(&x.contiguous()?, &h.contiguous()?, op)
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

/// RMSNorm over the last dimension with weight `gamma`, differentiable; fused on the CPU in f32,
/// else candle-nn's composite.
pub fn rms_norm(x: &Tensor, gamma: &Tensor, eps: f32) -> Result<Tensor> {
    if fused(x) && x.device().is_cpu() && gamma.dtype() == DType::F32 {
        tape::op2(&x.contiguous()?, &gamma.contiguous()?, RmsNorm { eps })
    } else {
        candle_nn::ops::rms_norm_slow(x, gamma, eps)
    }
}

/// Inference's `(x + h, rms_norm(x + h))` in one pass over each row, the same bits as the two
/// ops ([`rms_norm`]); `None` (nothing computed) off the CPU or outside f32, where the caller
/// takes the two ops. Not differentiable.
pub fn add_rms_norm(x: &Tensor, h: &Tensor, gamma: &Tensor, eps: f32) -> Result<Option<(Tensor, Tensor)>> {
    if !(fused(x) && x.device().is_cpu() && h.dtype() == DType::F32 && gamma.dtype() == DType::F32) {
        return Ok(None);
    }
    let c = gamma.elem_count();
    let rows = x.elem_count() / c.max(1);
    let out =
        x.contiguous()?
            .apply_op3_no_bwd(&h.contiguous()?, &gamma.contiguous()?, &rms_norm::AddRmsNorm { eps })?;
    let half = |at: usize| out.narrow(0, at, rows)?.reshape(x.shape());
    Ok(Some((half(0)?, half(rows)?)))
}

/// Rotary position embedding of `x` `(1, N, H, D)` (rows of heads), row `n` by the angles of
/// `cos[n]` and `sin[n]` `(N, D / 2)`, the two halves of each head as the pairs (`transformers`'
/// `rotate_half`); differentiable. Fused on the CPU in f32, else candle-nn's `rope_slow`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if fused(x) && x.device().is_cpu() && cos.dtype() == DType::F32 && sin.dtype() == DType::F32 {
        tape::op3(&x.contiguous()?, &cos.contiguous()?, &sin.contiguous()?, Rope)
    } else {
        candle_nn::rotary_emb::rope_slow(&x.transpose(1, 2)?, cos, sin)?.transpose(1, 2)
    }
}

/// `act(h[.., :I]) ⊙ h[.., I:]` for a gated MLP's `(.., 2 I)` projection, differentiable; fused on
/// the CPU in f32, else candle's ops.
pub fn gated(h: &Tensor, act: GateActivation) -> Result<Tensor> {
    if fused(h) && h.device().is_cpu() {
        return tape::op1(&h.contiguous()?, Gated(act));
    }
    let width = h.dim(candle_core::D::Minus1)? / 2;
    let (gate, up) = (
        h.narrow(candle_core::D::Minus1, 0, width)?,
        h.narrow(candle_core::D::Minus1, width, width)?,
    );
    let gate = match act {
        GateActivation::Silu => candle_nn::ops::silu(&gate)?,
        GateActivation::GeluTanh => gate.gelu()?,
    };
    gate * up
}

/// `max(x, 0)²` (squared ReLU), differentiable; fused on the CPU in f32, else candle's ops.
pub fn relu2(x: &Tensor) -> Result<Tensor> {
    if fused(x) && x.device().is_cpu() {
        return tape::op1(&x.contiguous()?, Relu2);
    }
    x.relu()?.sqr()
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
