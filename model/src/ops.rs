//! Fused CPU kernels, with backward passes, for the element-heavy steps of training.
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

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// tanh(x) as a 13/6 rational function on [-7.9053, 7.9053] (|error| < 1e-6; beyond that range
/// tanh is ±1 in f32). The coefficients are the published minimax fit used by Eigen's float tanh.
#[inline(always)]
fn fast_tanh(x: f32) -> f32 {
    let x = x.clamp(-7.905_311, 7.905_311);
    let x2 = x * x;
    let p = x2 * -2.760_768_5e-16 + 2.000_188e-13;
    let p = x2 * p + -8.604_672e-11;
    let p = x2 * p + 5.122_297e-8;
    let p = x2 * p + 1.485_722_4e-5;
    let p = x2 * p + 6.372_619e-4;
    let p = x2 * p + 4.893_524_6e-3;
    let q = x2 * 1.198_258_4e-6 + 1.185_347e-4;
    let q = x2 * q + 2.268_434_6e-3;
    let q = x2 * q + 4.893_525e-3;
    x * p / q
}

/// The f32 data of a contiguous CPU tensor, for custom ops' `cpu_fwd`.
pub fn f32_slice<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    let data = storage.as_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

/// GELU, tanh approximation (GPT-2's `gelu_new`).
struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, "gelu")?;
        let y: Vec<f32> = x
            .iter()
            .map(|&x| 0.5 * x * (1.0 + fast_tanh(SQRT_2_OVER_PI * (x + GELU_A * x * x * x))))
            .collect();
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            arg.contiguous()?.apply_op2_no_bwd(&grad_res.contiguous()?, &GeluGrad)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::gelu(s, l)
    }
}

/// grad · d gelu(x)/dx, in one pass.
struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "fused-gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, g) = (f32_slice(s1, l1, "gelu-grad")?, f32_slice(s2, l2, "gelu-grad")?);
        let dx: Vec<f32> = x
            .iter()
            .zip(g)
            .map(|(&x, &g)| {
                let t = fast_tanh(SQRT_2_OVER_PI * (x + GELU_A * x * x * x));
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_A * x * x);
                g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
            })
            .collect();
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::gelu_grad(s1, l1, s2, l2)
    }
}

/// Softmax over the last dimension of attention scores `(.., T_q, T_k)`, with the causal mask
/// built in: query i (at position T_k - T_q + i) sees keys 0..=T_k - T_q + i; the rest get 0.
struct CausalSoftmax;

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "fused-causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, "causal-softmax")?;
        let dims = layout.dims();
        let (t_q, t_k) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let offset = t_k.saturating_sub(t_q);
        let mut y = vec![0f32; x.len()];
        for (row, (xr, yr)) in x.chunks_exact(t_k).zip(y.chunks_exact_mut(t_k)).enumerate() {
            let n = (offset + row % t_q + 1).min(t_k);
            let max = xr[..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (yv, &xv) in yr[..n].iter_mut().zip(&xr[..n]) {
                *yv = (xv - max).exp();
                sum += *yv;
            }
            let inv = 1.0 / sum;
            yr[..n].iter_mut().for_each(|v| *v *= inv);
        }
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            res.contiguous()?
                .apply_op2_no_bwd(&grad_res.contiguous()?, &SoftmaxGrad)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::causal_softmax(s, l)
    }
}

/// dx = y ⊙ (g − Σ g ⊙ y) per row, given the softmax output y and its gradient g.
struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (y, g) = (f32_slice(s1, l1, "softmax-grad")?, f32_slice(s2, l2, "softmax-grad")?);
        let t_k = *l1.dims().last().unwrap_or(&1);
        let mut dx = vec![0f32; y.len()];
        for ((yr, gr), dr) in y
            .chunks_exact(t_k)
            .zip(g.chunks_exact(t_k))
            .zip(dx.chunks_exact_mut(t_k))
        {
            let dot: f32 = yr.iter().zip(gr).map(|(a, b)| a * b).sum();
            for ((d, &yv), &gv) in dr.iter_mut().zip(yr).zip(gr) {
                *d = yv * (gv - dot);
            }
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::softmax_grad(s1, l1, s2, l2)
    }
}

/// `x + b`, with `b` repeated over `x`: `b`'s shape is the trailing dimensions of `x` (a bias
/// over rows, a position table over a batch). The gradient of `b` sums contiguous blocks.
struct AddTiled;

impl CustomOp2 for AddTiled {
    fn name(&self) -> &'static str {
        "fused-add-tiled"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, b) = (f32_slice(s1, l1, "add-tiled")?, f32_slice(s2, l2, "add-tiled")?);
        let mut y = vec![0f32; x.len()];
        for (yb, xb) in y.chunks_exact_mut(b.len()).zip(x.chunks_exact(b.len())) {
            for ((yv, &xv), &bv) in yb.iter_mut().zip(xb).zip(b) {
                *yv = xv + bv;
            }
        }
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let db = grad.contiguous()?.apply_op1_no_bwd(&TileSum {
            shape: b.shape().clone(),
        })?;
        Ok((Some(grad.clone()), Some(db)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::add_tiled(s1, l1, s2, l2)
    }
}

/// Sums the consecutive blocks of `shape`'s size: the gradient of the tiled operand.
struct TileSum {
    shape: Shape,
}

impl CustomOp1 for TileSum {
    fn name(&self) -> &'static str {
        "fused-tile-sum"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = f32_slice(storage, layout, "tile-sum")?;
        let mut sum = vec![0f32; self.shape.elem_count()];
        for block in g.chunks_exact(sum.len()) {
            sum.iter_mut().zip(block).for_each(|(s, &v)| *s += v);
        }
        Ok((CpuStorage::F32(sum), self.shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::tile_sum(s, l, &self.shape)
    }
}

/// LayerNorm over the last dimension, `(x - mean) / sqrt(var + eps) * gamma + beta`.
struct LayerNorm {
    eps: f32,
}

/// Row statistics: (mean, 1 / sqrt(var + eps)).
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "fused-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "layer-norm")?;
        let (gamma, beta) = (f32_slice(s2, l2, "layer-norm")?, f32_slice(s3, l3, "layer-norm")?);
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks_exact(gamma.len()).zip(y.chunks_exact_mut(gamma.len())) {
            let (mean, rstd) = moments(xr, self.eps);
            for (((yv, &xv), &g), &b) in yr.iter_mut().zip(xr).zip(gamma).zip(beta) {
                *yv = (xv - mean) * rstd * g + b;
            }
        }
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gamma: &Tensor,
        _beta: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = gamma.elem_count();
        let rows = x.elem_count() / c;
        let packed = x
            .contiguous()?
            .apply_op3_no_bwd(gamma, &grad.contiguous()?, &LayerNormGrad { eps: self.eps })?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dgamma = packed.narrow(0, rows, 1)?.reshape(gamma.shape())?;
        let dbeta = packed.narrow(0, rows + 1, 1)?.reshape(gamma.shape())?;
        Ok((Some(dx), Some(dgamma), Some(dbeta)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::layer_norm((s1, l1), (s2, l2), (s3, l3), self.eps)
    }
}

/// The three LayerNorm gradients in one pass, packed as rows of a `(rows + 2, C)` matrix: dx,
/// then d gamma, then d beta. With x̂ the normalised row and ĝ = g ⊙ gamma:
/// dx = rstd (ĝ − mean(ĝ) − x̂ mean(ĝ ⊙ x̂)), d gamma = Σ g ⊙ x̂, d beta = Σ g.
struct LayerNormGrad {
    eps: f32,
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "fused-layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(s1, l1, "layer-norm-grad")?;
        let (gamma, g) = (
            f32_slice(s2, l2, "layer-norm-grad")?,
            f32_slice(s3, l3, "layer-norm-grad")?,
        );
        let c = gamma.len();
        let rows = x.len() / c;
        let mut out = vec![0f32; (rows + 2) * c];
        let (dx, params) = out.split_at_mut(rows * c);
        let (dgamma, dbeta) = params.split_at_mut(c);
        let mut xhat = vec![0f32; c];
        let mut ghat = vec![0f32; c];
        for ((xr, gr), dxr) in x.chunks_exact(c).zip(g.chunks_exact(c)).zip(dx.chunks_exact_mut(c)) {
            let (mean, rstd) = moments(xr, self.eps);
            let (mut sum_ghat, mut sum_ghat_xhat) = (0f32, 0f32);
            for j in 0..c {
                xhat[j] = (xr[j] - mean) * rstd;
                ghat[j] = gr[j] * gamma[j];
                sum_ghat += ghat[j];
                sum_ghat_xhat += ghat[j] * xhat[j];
                dgamma[j] += gr[j] * xhat[j];
                dbeta[j] += gr[j];
            }
            let (m1, m2) = (sum_ghat / c as f32, sum_ghat_xhat / c as f32);
            for j in 0..c {
                dxr[j] = rstd * (ghat[j] - m1 - xhat[j] * m2);
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((rows + 2, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        crate::cuda_ops::layer_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps)
    }
}

/// Mean cross-entropy of rows of logits `(N, V)` against target ids `(N)`: per row
/// `logsumexp(x) - x[target]`, from two passes over the row and no `(N, V)` temporaries (candle's
/// `cross_entropy` is log-softmax, gather and mean: seven full-size passes each way at GPT-2's
/// 50257-word vocabulary).
struct CrossEntropy;

/// Row `r`'s max and log of the sum of exp(x - max).
fn row_logsumexp(row: &[f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
    (max, sum.ln())
}

fn targets_of<'a>(storage: &'a CpuStorage, layout: &Layout, vocab: usize) -> Result<&'a [u32]> {
    let data = storage.as_slice::<u32>()?;
    let ids = match layout.contiguous_offsets() {
        Some((start, end)) => &data[start..end],
        None => candle_core::bail!("cross-entropy: the targets must be contiguous"),
    };
    if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
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
            .map(|(row, &t)| {
                let (max, lse) = row_logsumexp(row);
                (max + lse - row[t as usize]) as f64
            })
            .sum();
        let mean = (total / targets.len().max(1) as f64) as f32;
        Ok((CpuStorage::F32(vec![mean]), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let rows = logits.dim(0)?.max(1);
        let scale = grad.to_dtype(DType::F32)?.to_scalar::<f32>()? / rows as f32;
        let dx = logits
            .contiguous()?
            .apply_op2_no_bwd(&targets.contiguous()?, &CrossEntropyGrad { scale })?;
        Ok((Some(dx), None))
    }
}

/// d loss / d logits = scale * (softmax(x) - onehot(target)), per row.
struct CrossEntropyGrad {
    scale: f32,
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
            let (max, lse) = row_logsumexp(row);
            let shift = max + lse;
            for (d, &v) in drow.iter_mut().zip(row) {
                *d = self.scale * (v - shift).exp();
            }
            drow[t as usize] -= self.scale;
        }
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Mean cross-entropy of `logits` `(N, V)` against `targets` `(N)` (u32), differentiable with
/// respect to the logits; fused on the CPU in f32, else candle-nn's `cross_entropy`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    if logits.device().is_cpu() && logits.dtype() == DType::F32 && targets.dtype() == DType::U32 {
        logits.contiguous()?.apply_op2(&targets.contiguous()?, CrossEntropy)
    } else {
        candle_nn::loss::cross_entropy(logits, targets)
    }
}

/// Whether a fused op (here, or the trainer's AdamW update) runs for `x`: f32 on the CPU, or on a
/// CUDA GPU unless the environment sets `GPT_CUDA_FUSED=0` (candle's own ops then, to compare).
pub fn fused(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && (x.device().is_cpu() || (x.device().is_cuda() && cuda_fused()))
}

static AUTOCAST_BF16: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Mixed precision, as `torch.autocast(dtype=torch.bfloat16)`: while on, the matrix products of
/// [`crate::Gpt::forward_t`] (projections, attention scores and values, LM head) cast their f32
/// operands to bf16, multiply (tensor cores on a GPU), and return f32; parameters, gradients,
/// LayerNorm, softmax, GELU and the loss stay f32. Process-wide; `gpt-train --dtype bf16` sets it.
/// (No f16: without loss scaling its gradients underflow.)
pub fn set_autocast_bf16(on: bool) {
    AUTOCAST_BF16.store(on, std::sync::atomic::Ordering::Relaxed);
}

pub fn autocast_bf16() -> bool {
    AUTOCAST_BF16.load(std::sync::atomic::Ordering::Relaxed)
}

/// `a @ b`, in bf16 for f32 operands while [`set_autocast_bf16`] is on, differentiable.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if autocast_bf16() && a.dtype() == DType::F32 {
        a.to_dtype(DType::BF16)?
            .matmul(&b.to_dtype(DType::BF16)?)?
            .to_dtype(DType::F32)
    } else {
        a.matmul(b)
    }
}

/// `GPT_CUDA_FUSED` is not `0`.
pub fn cuda_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GPT_CUDA_FUSED").map_or(true, |v| v != "0"))
}

/// GELU (tanh approximation), differentiable; fused on the CPU in f32.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if fused(x) {
        x.contiguous()?.apply_op1(Gelu)
    } else {
        x.gelu()
    }
}

/// `x + b` with `b` broadcast over the leading dimensions of `x` (its shape is their trailing
/// dimensions), differentiable; fused on the CPU in f32.
pub fn add_tiled(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    if fused(x) && b.dtype() == DType::F32 {
        x.contiguous()?.apply_op2(&b.contiguous()?, AddTiled)
    } else {
        x.broadcast_add(b)
    }
}

/// LayerNorm over the last dimension with weight `gamma` and bias `beta`, differentiable; fused
/// on the CPU in f32, else candle-nn's composite.
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> Result<Tensor> {
    if fused(x) && gamma.dtype() == DType::F32 {
        x.contiguous()?.apply_op3(gamma, beta, LayerNorm { eps })
    } else {
        candle_nn::ops::layer_norm_slow(x, gamma, beta, eps)
    }
}

/// Causal softmax of attention scores `(.., T_q, T_k)` (see [`CausalSoftmax`]), differentiable;
/// fused on the CPU in f32, else an additive mask and candle's softmax.
pub fn causal_softmax(att: &Tensor, differentiable: bool) -> Result<Tensor> {
    if fused(att) {
        return att.contiguous()?.apply_op1(CausalSoftmax);
    }
    let (t_q, t_k) = (att.dim(candle_core::D::Minus2)?, att.dim(candle_core::D::Minus1)?);
    // One new query (a decode step) sees every key: no mask to build and copy to the device.
    let att = if t_q == 1 {
        att.clone()
    } else {
        att.broadcast_add(&crate::attention::causal_mask(
            t_q,
            t_k - t_q,
            att.dtype(),
            att.device(),
        )?)?
    };
    if differentiable {
        candle_nn::ops::softmax(&att, candle_core::D::Minus1)
    } else {
        candle_nn::ops::softmax_last_dim(&att)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var, D};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn fast_tanh_is_accurate() {
        let worst = (-20_000..=20_000)
            .map(|i| i as f32 / 1000.0)
            .map(|x| (fast_tanh(x) as f64 - (x as f64).tanh()).abs())
            .fold(0.0, f64::max);
        assert!(worst < 2e-6, "{worst}");
    }

    #[test]
    fn gelu_matches_candle_forward_and_backward() {
        let x = Var::from_tensor(&(Tensor::randn(0f32, 2.0, (7, 33), &Device::Cpu).unwrap())).unwrap();
        let g = Tensor::randn(0f32, 1.0, (7, 33), &Device::Cpu).unwrap();
        let (ours, theirs) = (gelu(&x).unwrap(), x.gelu().unwrap());
        assert!(max_diff(&ours, &theirs) < 1e-5);
        let ga = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (theirs * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let d = max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap());
        assert!(d < 1e-4, "{d}");
    }

    /// Forward values and the gradients of every input against candle's composite ops.
    #[test]
    fn add_tiled_and_layer_norm_match_candle() {
        let dev = &Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 2.0, (3, 5, 8), dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, (5, 8), dev).unwrap()).unwrap();
        let gamma = Var::from_tensor(&Tensor::randn(1f32, 0.5, 8, dev).unwrap()).unwrap();
        let beta = Var::from_tensor(&Tensor::randn(0f32, 0.5, 8, dev).unwrap()).unwrap();
        let g = Tensor::randn(0f32, 1.0, (3, 5, 8), dev).unwrap();
        let run = |fused: bool| {
            let h = if fused { add_tiled(&x, &b) } else { x.broadcast_add(&b) }.unwrap();
            let y = if fused {
                layer_norm(&h, &gamma, &beta, 1e-5)
            } else {
                candle_nn::ops::layer_norm_slow(&h, &gamma, &beta, 1e-5)
            }
            .unwrap();
            let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let get = |v: &Var| grads.get(v).unwrap().clone();
            (y, [get(&x), get(&b), get(&gamma), get(&beta)])
        };
        let ((ya, ga), (yb, gb)) = (run(true), run(false));
        assert!(max_diff(&ya, &yb) < 1e-5);
        for (i, (a, b)) in ga.iter().zip(&gb).enumerate() {
            assert_eq!(a.shape(), b.shape());
            assert!(max_diff(a, b) < 1e-4, "gradient {i}: {}", max_diff(a, b));
        }
    }

    #[test]
    fn cross_entropy_matches_candle_forward_and_backward() {
        let dev = &Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 3.0, (37, 301), dev).unwrap()).unwrap();
        let targets = Tensor::new((0..37u32).map(|i| (i * 97) % 301).collect::<Vec<_>>(), dev).unwrap();
        let ours = cross_entropy(&x, &targets).unwrap();
        let theirs = candle_nn::loss::cross_entropy(&x, &targets).unwrap();
        let (a, b) = (ours.to_scalar::<f32>().unwrap(), theirs.to_scalar::<f32>().unwrap());
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        // Scaled by 3 after the loss, so that the incoming gradient is not 1.
        let ga = (ours * 3.0).unwrap().backward().unwrap();
        let gb = (theirs * 3.0).unwrap().backward().unwrap();
        let d = max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap());
        assert!(d < 1e-6, "{d}");
        let bad = Tensor::new(&[0u32, 301], dev).unwrap();
        let err = cross_entropy(&x.narrow(0, 0, 2).unwrap(), &bad)
            .unwrap_err()
            .to_string();
        assert!(err.contains("301") && err.contains("vocabulary"), "{err}");
    }

    #[test]
    fn causal_softmax_matches_mask_and_softmax_forward_and_backward() {
        for (t_q, t_k) in [(5, 5), (3, 8), (1, 4)] {
            let x = Var::from_tensor(&Tensor::randn(0f32, 3.0, (2, 3, t_q, t_k), &Device::Cpu).unwrap()).unwrap();
            let g = Tensor::randn(0f32, 1.0, (2, 3, t_q, t_k), &Device::Cpu).unwrap();
            let mask = crate::attention::causal_mask(t_q, t_k - t_q, DType::F32, &Device::Cpu).unwrap();
            let reference = candle_nn::ops::softmax(&x.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
            let ours = causal_softmax(&x, true).unwrap();
            assert!(max_diff(&ours, &reference) < 1e-6, "{t_q}x{t_k}");
            let ga = (ours * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (reference * &g).unwrap().sum_all().unwrap().backward().unwrap();
            assert!(max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap()) < 1e-5, "{t_q}x{t_k}");
        }
    }
}
