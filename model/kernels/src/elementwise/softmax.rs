//! The causal softmax of attention scores with its gradient: the mask is built into the pass
//! (candle's is a mask tensor, an add and five ops each way).

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use crate::f32_slice;

/// Softmax over the last dimension of attention scores `(.., T_q, T_k)`, with the causal mask
/// built in: query i (at position T_k - T_q + i) sees keys 0..=T_k - T_q + i; the rest get 0.
pub(crate) struct CausalSoftmax;

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
        cuda::causal_softmax(s, l)
    }
}

/// dx = y ⊙ (g − Σ g ⊙ y) per row, given the softmax output y and its gradient g.
pub(crate) struct SoftmaxGrad;

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
        cuda::softmax_grad(s1, l1, s2, l2)
    }
}

/// The CUDA launchers of this op's kernels (`softmax.cu`, beside this file).
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda::{f32_view, output, per_row, wrap};

    const MODULE: crate::cuda::Module = crate::ptx_module!("softmax");

    pub fn causal_softmax(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let x = f32_view(s, l, "causal-softmax")?;
        let &[.., t_q, t_k] = l.dims() else {
            candle_core::bail!("causal-softmax: scores of {:?} are not (.., T_q, T_k)", l.dims())
        };
        let (t_q, t_k) = (t_q as i32, t_k as i32);
        let rows = x.len() / t_k.max(1) as usize;
        let y = output(dev, x.len())?; // one warp writes each row whole
        crate::launch!(dev, MODULE, "causal_softmax_fwd", per_row(rows); &x, &y, &rows, &t_q, &t_k);
        Ok(wrap(y, dev, l.shape().clone()))
    }

    pub fn softmax_grad(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s1.device();
        let (y, g) = (f32_view(s1, l1, "softmax-grad")?, f32_view(s2, l2, "softmax-grad")?);
        if g.len() != y.len() {
            candle_core::bail!("softmax-grad: {} gradients for {} outputs", g.len(), y.len());
        }
        let t_k = *l1.dims().last().unwrap_or(&1) as i32;
        let rows = y.len() / t_k.max(1) as usize;
        let dx = output(dev, y.len())?; // one warp writes each row whole
        crate::launch!(dev, MODULE, "softmax_bwd", per_row(rows); &y, &g, &dx, &rows, &t_k);
        Ok(wrap(dx, dev, l1.shape().clone()))
    }
}
