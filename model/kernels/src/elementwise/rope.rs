//! Rotary position embedding (Su et al., 2021), `transformers`' `rotate_half` form (the two
//! halves of each head as the pairs), on rows of heads, and its gradient: the rotation by the
//! opposite angle. candle-nn's fused `rope_thd` has no backward pass, and `rope_slow` is five
//! broadcast ops each way over a transposed copy.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::f32_slice;
use crate::parallel;

/// `x` `(N, H, D)` (any leading shape of `N * H * D` values, rows of heads), each row `n`'s heads
/// rotated by the angles whose cosines and sines are `cos[n]`, `sin[n]` (`(N, D / 2)`).
pub(crate) struct Rope;

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
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
        let x = f32_slice(s1, l1, "rope")?;
        let (cos, sin) = (f32_slice(s2, l2, "rope")?, f32_slice(s3, l3, "rope")?);
        let (n, half) = l2.shape().dims2()?;
        if x.is_empty() && n == 0 {
            return Ok((CpuStorage::F32(Vec::new()), l1.shape().clone()));
        }
        let row = x.len().checked_div(n).unwrap_or(0);
        if half == 0 || row == 0 || sin.len() != cos.len() || x.len() != n * row || !row.is_multiple_of(2 * half) {
            candle_core::bail!("rope: x {:?}, cos {:?}, sin {:?}", l1.dims(), l2.dims(), l3.dims())
        }
        let y = parallel::collect(
            x.len(),
            parallel::rows_per_chunk(row) * row,
            #[inline(always)]
            |start, out| {
                for (i, (xr, yr)) in x[start..].chunks_exact(row).zip(out.chunks_exact_mut(row)).enumerate() {
                    let at = (start / row + i) * half;
                    let (c, s) = (&cos[at..at + half], &sin[at..at + half]);
                    for (xh, yh) in xr.chunks_exact(2 * half).zip(yr.chunks_exact_mut(2 * half)) {
                        let (x1, x2) = xh.split_at(half);
                        let (y1, y2) = yh.split_at_mut(half);
                        for j in 0..half {
                            y1[j].write(x1[j] * c[j] - x2[j] * s[j]);
                            y2[j].write(x2[j] * c[j] + x1[j] * s[j]);
                        }
                    }
                }
            },
        );
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The rotation is orthogonal: its gradient is the rotation back.
        let dx = grad.contiguous()?.apply_op3_no_bwd(cos, &sin.neg()?, &Rope)?;
        Ok((Some(dx), None, None))
    }
}
