//! LayerNorm over the last dimension and its gradient, one pass each way over each row.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::f32_slice;
use crate::parallel;

/// LayerNorm over the last dimension, `(x - mean) / sqrt(var + eps) * gamma + beta`.
pub(crate) struct LayerNorm {
    pub(crate) eps: f32,
}

/// Partial sums of a row: lane `l` sums the values at `l`, `l + 16`, ...
const SUM_LANES: usize = 16;

/// `Σ f(cols[0][j], cols[1][j], ..)` over the columns' length (all equal), as [`SUM_LANES`]
/// interleaved partial sums added pairwise at the end. A sum value after value is bound by the
/// add's latency (a 128-wide row's two sums were most of LayerNorm's time); this one
/// vectorises, and its order is the code's, so every instruction set gives the same bits. The
/// values come in fixed-size chunks, with no bounds check per value (one took the vectors
/// apart).
#[inline(always)]
pub(super) fn lane_sum<const K: usize>(cols: [&[f32]; K], f: impl Fn([f32; K]) -> f32) -> f32 {
    let n = cols.first().map_or(0, |c| c.len());
    let mut acc = [0f32; SUM_LANES];
    let whole = n / SUM_LANES * SUM_LANES;
    for j0 in (0..whole).step_by(SUM_LANES) {
        let chunk = cols.map(|c| &c[j0..j0 + SUM_LANES]);
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(std::array::from_fn(|k| chunk[k][l]));
        }
    }
    for (a, j) in acc.iter_mut().zip(whole..n) {
        *a += f(std::array::from_fn(|k| cols[k][j]));
    }
    let mut width = SUM_LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// Row statistics: (mean, 1 / sqrt(var + eps)).
#[inline(always)]
fn moments(row: &[f32], eps: f32) -> (f32, f32) {
    let n = row.len() as f32;
    let mean = lane_sum([row], |[x]| x) / n;
    let var = lane_sum([row], |[x]| (x - mean) * (x - mean)) / n;
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
        let c = gamma.len();
        if c == 0 || x.len() % c != 0 || beta.len() != c {
            candle_core::bail!(
                "layer-norm: x {:?}, gamma {:?}, beta {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let y = parallel::collect(
            x.len(),
            parallel::rows_per_chunk(c) * c,
            #[inline(always)]
            |start, out| {
                for (xr, yr) in x[start..].chunks_exact(c).zip(out.chunks_exact_mut(c)) {
                    let (mean, rstd) = moments(xr, self.eps);
                    for (((yv, &xv), &g), &b) in yr.iter_mut().zip(xr).zip(gamma).zip(beta) {
                        yv.write((xv - mean) * rstd * g + b);
                    }
                }
            },
        );
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
        cuda::layer_norm((s1, l1), (s2, l2), (s3, l3), self.eps)
    }
}

/// The three LayerNorm gradients in one pass, packed as rows of a `(rows + 2, C)` matrix: dx,
/// then d gamma, then d beta. With x̂ the normalised row and ĝ = g ⊙ gamma:
/// dx = rstd (ĝ − mean(ĝ) − x̂ mean(ĝ ⊙ x̂)), d gamma = Σ g ⊙ x̂, d beta = Σ g.
pub(crate) struct LayerNormGrad {
    pub(crate) eps: f32,
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
        if c == 0 || x.len() % c != 0 || g.len() != x.len() {
            candle_core::bail!(
                "layer-norm-grad: x {:?}, gamma {:?}, grad {:?}",
                l1.dims(),
                l2.dims(),
                l3.dims()
            )
        }
        let rows = x.len() / c;
        let mut out = vec![0f32; (rows + 2) * c];
        let (dx, params) = out.split_at_mut(rows * c);
        let (dgamma, dbeta) = params.split_at_mut(c);
        // dx and each row's statistics by rows; then d gamma, d beta by columns (each summed row
        // after row, whatever the split).
        let mut stats = vec![(0f32, 0f32); rows];
        parallel::rows_with(
            dx,
            c,
            &mut stats,
            #[inline(always)]
            |row, dxr, stat| {
                let (xr, gr) = (&x[row * c..(row + 1) * c], &g[row * c..(row + 1) * c]);
                let (mean, rstd) = moments(xr, self.eps);
                *stat = (mean, rstd);
                // ĝ first, in dx's row; then each sum over at most two rows, and dx from ĝ. (Sums
                // over three rows, and a loop indexing four, ran value by value: the backward
                // pass took 4x the forward's time.)
                for ((gh, &g), &w) in dxr.iter_mut().zip(gr).zip(gamma) {
                    *gh = g * w;
                }
                let sum_ghat = lane_sum([dxr], |[gh]| gh);
                let sum_ghat_xhat = lane_sum([dxr, xr], |[gh, x]| gh * ((x - mean) * rstd));
                let (m1, m2) = (sum_ghat / c as f32, sum_ghat_xhat / c as f32);
                for (dx, &x) in dxr.iter_mut().zip(xr) {
                    *dx = rstd * (*dx - m1 - ((x - mean) * rstd) * m2);
                }
            },
        );
        let cols = (parallel::GRAIN / rows.max(1)).max(16);
        parallel::chunks_mut2(
            dgamma,
            dbeta,
            cols,
            #[inline(always)]
            |j0, dgamma, dbeta| {
                let j1 = j0 + dgamma.len();
                for ((xr, gr), &(mean, rstd)) in x.chunks_exact(c).zip(g.chunks_exact(c)).zip(&stats) {
                    for (((dg, db), &xv), &gv) in dgamma
                        .iter_mut()
                        .zip(dbeta.iter_mut())
                        .zip(&xr[j0..j1])
                        .zip(&gr[j0..j1])
                    {
                        *dg += gv * ((xv - mean) * rstd);
                        *db += gv;
                    }
                }
            },
        );
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
        cuda::layer_norm_grad((s1, l1), (s2, l2), (s3, l3), self.eps)
    }
}

/// The CUDA launchers of this op's kernels (`layer_norm.cu`, beside this file).
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda::{f32_view, output, per_row, wrap};

    const MODULE: crate::cuda::Module = crate::ptx_module!("layer_norm");

    pub fn layer_norm(
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
        eps: f32,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s1.device();
        let x = f32_view(s1, l1, "layer-norm")?;
        let (gamma, beta) = (f32_view(s2, l2, "layer-norm")?, f32_view(s3, l3, "layer-norm")?);
        if gamma.is_empty() || beta.len() != gamma.len() || x.len() % gamma.len() != 0 {
            candle_core::bail!(
                "layer-norm: {} inputs for {} weights and {} biases",
                x.len(),
                gamma.len(),
                beta.len()
            );
        }
        let c = gamma.len() as i32;
        let rows = x.len() / gamma.len();
        let y = output(dev, x.len())?; // one warp writes each row whole
        crate::launch!(dev, MODULE, "layer_norm_fwd", per_row(rows); &x, &gamma, &beta, &y, &rows, &c, &eps);
        Ok(wrap(y, dev, l1.shape().clone()))
    }

    /// dx, d gamma and d beta packed as the rows of a `(rows + 2, C)` matrix, as the CPU op.
    pub fn layer_norm_grad(
        (s1, l1): (&CudaStorage, &Layout),
        (s2, l2): (&CudaStorage, &Layout),
        (s3, l3): (&CudaStorage, &Layout),
        eps: f32,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s1.device();
        let x = f32_view(s1, l1, "layer-norm-grad")?;
        let (gamma, g) = (
            f32_view(s2, l2, "layer-norm-grad")?,
            f32_view(s3, l3, "layer-norm-grad")?,
        );
        let c = gamma.len();
        if c == 0 || g.len() != x.len() || x.len() % c != 0 {
            candle_core::bail!(
                "layer-norm-grad: {} inputs, {} gradients, {c} weights",
                x.len(),
                g.len()
            );
        }
        let rows = x.len() / c;
        // layer_norm_bwd writes dx into the first rows * c values of out and g * x̂ into gx; the
        // column sums below write the last two rows.
        let mut out = output(dev, (rows + 2) * c)?;
        let gx = output(dev, rows * c)?;
        let c_i32 = c as i32;
        crate::launch!(dev, MODULE, "layer_norm_bwd", per_row(rows); &x, &gamma, &g, &mut out, &gx, &rows, &c_i32, &eps);
        crate::elementwise::add::cuda::column_sum(dev, &gx.slice(..), rows, c, &mut out, rows * c)?;
        crate::elementwise::add::cuda::column_sum(dev, &g, rows, c, &mut out, (rows + 1) * c)?;
        Ok(wrap(out, dev, Shape::from((rows + 2, c))))
    }
}
