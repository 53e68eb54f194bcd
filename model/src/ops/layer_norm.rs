//! LayerNorm over the last dimension and its gradient, one pass each way over each row.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::f32_slice;

/// LayerNorm over the last dimension, `(x - mean) / sqrt(var + eps) * gamma + beta`.
pub(super) struct LayerNorm {
    pub(super) eps: f32,
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
pub(super) struct LayerNormGrad {
    pub(super) eps: f32,
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
