//! RMSNorm over the last dimension and its gradient, one pass each way over each row (the
//! Llama, Qwen and Gemma families' norm). candle-nn's fused `rms_norm` has no backward pass, and
//! its composite (`rms_norm_slow`) is six broadcast ops forward and about twelve back, each a
//! whole tensor in memory.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::layer_norm::lane_sum;
use crate::f32_slice;
use crate::parallel;

/// `x / sqrt(mean(x²) + eps) * gamma` over the last dimension.
pub(crate) struct RmsNorm {
    pub(crate) eps: f32,
}

/// 1 / sqrt(mean(x²) + eps) of a row.
#[inline(always)]
fn rstd(row: &[f32], eps: f32) -> f32 {
    1.0 / (lane_sum([row], |[x]| x * x) / row.len() as f32 + eps).sqrt()
}

fn check(op: &str, x: &[f32], gamma: &[f32], l1: &Layout, l2: &Layout) -> Result<usize> {
    let c = gamma.len();
    if c == 0 || !x.len().is_multiple_of(c) {
        candle_core::bail!("{op}: x {:?}, gamma {:?}", l1.dims(), l2.dims())
    }
    Ok(c)
}

/// `(x, gamma, other, C)`: see [`with_gamma_and`].
type Operands<'a> = (&'a [f32], &'a [f32], &'a [f32], usize);

/// `x`, `gamma` and a second operand of `x`'s size (`what` in errors) as f32 values, with `C`.
fn with_gamma_and<'a>(
    op: &str,
    (x, lx): (&'a CpuStorage, &Layout),
    (gamma, lg): (&'a CpuStorage, &Layout),
    (other, lo, what): (&'a CpuStorage, &Layout, &str),
) -> Result<Operands<'a>> {
    let (x, gamma, other) = (
        f32_slice(x, lx, op)?,
        f32_slice(gamma, lg, op)?,
        f32_slice(other, lo, op)?,
    );
    let c = check(op, x, gamma, lx, lg)?;
    if other.len() != x.len() {
        candle_core::bail!("{op}: x {:?}, {what} {:?}", lx.dims(), lo.dims())
    }
    Ok((x, gamma, other, c))
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, gamma) = (f32_slice(s1, l1, "rms-norm")?, f32_slice(s2, l2, "rms-norm")?);
        let c = check("rms-norm", x, gamma, l1, l2)?;
        let y = parallel::collect(
            x.len(),
            parallel::rows_per_chunk(c) * c,
            #[inline(always)]
            |start, out| {
                for (xr, yr) in x[start..].chunks_exact(c).zip(out.chunks_exact_mut(c)) {
                    let r = rstd(xr, self.eps);
                    for ((y, &x), &g) in yr.iter_mut().zip(xr).zip(gamma) {
                        y.write(x * r * g);
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
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let c = gamma.elem_count();
        let rows = x.elem_count() / c.max(1);
        let packed = x
            .contiguous()?
            .apply_op3_no_bwd(gamma, &grad.contiguous()?, &RmsNormGrad { eps: self.eps })?;
        let dx = packed.narrow(0, 0, rows)?.reshape(x.shape())?;
        let dgamma = packed.narrow(0, rows, 1)?.reshape(gamma.shape())?;
        Ok((Some(dx), Some(dgamma)))
    }
}

/// Inference's residual add and the RMSNorm after it in one pass over each row: `s = x + h`, then
/// `s / sqrt(mean(s²) + eps) * gamma` as [`RmsNorm`] computes it (the same bits as the two ops),
/// packed as the rows of a `(2 rows, C)` matrix: the sums, then the normalised rows. (A decode
/// step's two ops a norm had each been a candle tensor and a pass.)
pub(crate) struct AddRmsNorm {
    pub(crate) eps: f32,
}

impl candle_core::CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "fused-add-rms-norm"
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
        let (x, gamma, h, c) = with_gamma_and("add-rms-norm", (s1, l1), (s3, l3), (s2, l2, "h"))?;
        let rows = x.len() / c;
        let mut out = vec![0f32; 2 * rows * c];
        let (sums, normed) = out.split_at_mut(rows * c);
        let mut normed: Vec<&mut [f32]> = normed.chunks_exact_mut(c).collect();
        parallel::rows_with(
            sums,
            c,
            &mut normed,
            #[inline(always)]
            |row, sr, yr| {
                let (xr, hr) = (&x[row * c..(row + 1) * c], &h[row * c..(row + 1) * c]);
                for ((s, &x), &h) in sr.iter_mut().zip(xr).zip(hr) {
                    *s = x + h;
                }
                let r = rstd(sr, self.eps);
                for ((y, &s), &g) in yr.iter_mut().zip(&*sr).zip(gamma) {
                    *y = s * r * g;
                }
            },
        );
        Ok((CpuStorage::F32(out), Shape::from((2 * rows, c))))
    }
}

/// Both RMSNorm gradients in one pass, packed as the rows of a `(rows + 1, C)` matrix: dx, then
/// d gamma. With x̂ = x r the normalised row and ĝ = g ⊙ gamma:
/// dx = r (ĝ − x̂ mean(ĝ ⊙ x̂)), d gamma = Σ g ⊙ x̂.
pub(crate) struct RmsNormGrad {
    pub(crate) eps: f32,
}

impl candle_core::CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "fused-rms-norm-grad"
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
        let (x, gamma, g, c) = with_gamma_and("rms-norm-grad", (s1, l1), (s2, l2), (s3, l3, "grad"))?;
        let rows = x.len() / c;
        let mut out = vec![0f32; (rows + 1) * c];
        let (dx, dgamma) = out.split_at_mut(rows * c);
        let mut stats = vec![0f32; rows];
        parallel::rows_with(
            dx,
            c,
            &mut stats,
            #[inline(always)]
            |row, dxr, stat| {
                let (xr, gr) = (&x[row * c..(row + 1) * c], &g[row * c..(row + 1) * c]);
                let r = rstd(xr, self.eps);
                *stat = r;
                for ((gh, &g), &w) in dxr.iter_mut().zip(gr).zip(gamma) {
                    *gh = g * w;
                }
                let m = lane_sum([dxr, xr], |[gh, x]| gh * x * r) / c as f32;
                for (dx, &x) in dxr.iter_mut().zip(xr) {
                    *dx = r * (*dx - x * r * m);
                }
            },
        );
        let cols = (parallel::GRAIN / rows.max(1)).max(16);
        parallel::chunks_mut(
            dgamma,
            cols,
            #[inline(always)]
            |j0, dgamma| {
                let j1 = j0 + dgamma.len();
                for ((xr, gr), &r) in x.chunks_exact(c).zip(g.chunks_exact(c)).zip(&stats) {
                    for ((dg, &xv), &gv) in dgamma.iter_mut().zip(&xr[j0..j1]).zip(&gr[j0..j1]) {
                        *dg += gv * xv * r;
                    }
                }
            },
        );
        Ok((CpuStorage::F32(out), Shape::from((rows + 1, c))))
    }
}
