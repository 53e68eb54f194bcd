//! Grouped-query attention's key and value heads repeated for their groups of query heads, on
//! the rows of a fused projection, so that the window attention (which takes GPT-2's three equal
//! parts) runs the Llama, Qwen and Gemma families' heads; its gradient sums each group back.

use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

use crate::f32_slice;
use crate::parallel;

/// `(N, (nh + 2 nkv) hs)` (queries, keys, values, head after head) -> `(N, 3 nh hs)`, query head
/// `h` beside key and value head `h / (nh / nkv)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RepeatKv {
    pub(crate) n_head: usize,
    pub(crate) n_kv_head: usize,
}

impl RepeatKv {
    /// (head width, rows) of a `(N, (nh + 2 nkv) hs)` layout.
    fn dims(&self, op: &str, l: &Layout, width_in_heads: usize) -> Result<(usize, usize)> {
        let &[rows, width] = l.dims() else {
            candle_core::bail!("{op}: {:?} is not (rows, columns)", l.dims())
        };
        if width == 0
            || self.n_kv_head == 0
            || !self.n_head.is_multiple_of(self.n_kv_head)
            || !width.is_multiple_of(width_in_heads)
        {
            candle_core::bail!(
                "{op}: {width} columns are not {width_in_heads} heads ({} query heads in groups over {} key/value heads)",
                self.n_head,
                self.n_kv_head
            )
        }
        Ok((width / width_in_heads, rows))
    }
}

impl RepeatKv {
    /// The input head that output head `j` of `(N, 3 nh hs)` copies: query head `j`, then key
    /// head `(j - nh) / group`, then value head `(j - 2 nh) / group`.
    #[inline(always)]
    fn source(&self, j: usize) -> usize {
        let (nh, nkv) = (self.n_head, self.n_kv_head);
        let group = nh / nkv;
        match j {
            j if j < nh => j,
            j if j < 2 * nh => nh + (j - nh) / group,
            j => nh + nkv + (j - 2 * nh) / group,
        }
    }
}

impl CustomOp1 for RepeatKv {
    fn name(&self) -> &'static str {
        "repeat-kv-heads"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, "repeat-kv-heads")?;
        let (nh, nkv) = (self.n_head, self.n_kv_head);
        let (hs, rows) = self.dims("repeat-kv-heads", layout, nh + 2 * nkv)?;
        let (w_in, w_out) = ((nh + 2 * nkv) * hs, 3 * nh * hs);
        let y = parallel::collect(
            rows * w_out,
            parallel::rows_per_chunk(w_out) * w_out,
            #[inline(always)]
            |start, out| {
                for (r, yr) in out.chunks_exact_mut(w_out).enumerate() {
                    let xr = &x[(start / w_out + r) * w_in..][..w_in];
                    for (yh, j) in yr.chunks_exact_mut(hs).zip(0..) {
                        let from = self.source(j);
                        for (y, &v) in yh.iter_mut().zip(&xr[from * hs..][..hs]) {
                            y.write(v);
                        }
                    }
                }
            },
        );
        Ok((CpuStorage::F32(y), Shape::from((rows, w_out))))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&GroupSum(*self))?))
    }
}

/// The gradient of [`RepeatKv`]: `(N, 3 nh hs)` -> `(N, (nh + 2 nkv) hs)`, each key and value
/// head's the sum of its group's, added in head order.
pub(crate) struct GroupSum(RepeatKv);

impl CustomOp1 for GroupSum {
    fn name(&self) -> &'static str {
        "repeat-kv-heads-grad"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = f32_slice(storage, layout, "repeat-kv-heads-grad")?;
        let (nh, nkv) = (self.0.n_head, self.0.n_kv_head);
        let (hs, rows) = self.0.dims("repeat-kv-heads-grad", layout, 3 * nh)?;
        let (w_in, w_out) = (3 * nh * hs, (nh + 2 * nkv) * hs);
        let mut dx = vec![0f32; rows * w_out];
        parallel::chunks_mut(
            &mut dx,
            parallel::rows_per_chunk(w_out) * w_out,
            #[inline(always)]
            |start, out| {
                for (r, dr) in out.chunks_exact_mut(w_out).enumerate() {
                    let gr = &g[(start / w_out + r) * w_in..][..w_in];
                    dr[..nh * hs].copy_from_slice(&gr[..nh * hs]);
                    for j in nh..3 * nh {
                        let to = self.0.source(j);
                        for (d, &v) in dr[to * hs..][..hs].iter_mut().zip(&gr[j * hs..][..hs]) {
                            *d += v;
                        }
                    }
                }
            },
        );
        Ok((CpuStorage::F32(dx), Shape::from((rows, w_out))))
    }
}
