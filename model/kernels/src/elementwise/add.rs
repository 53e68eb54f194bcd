//! Broadcast adds (biases over rows, the position table over a batch) and their gradient, a sum
//! over contiguous blocks (candle walks such reductions element by element).

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use crate::f32_slice;
use crate::parallel;

/// `x + b`, with `b` repeated over `x`: `b`'s shape is the trailing dimensions of `x` (a bias
/// over rows, a position table over a batch). The gradient of `b` sums contiguous blocks.
pub(crate) struct AddTiled;

impl CustomOp2 for AddTiled {
    fn name(&self) -> &'static str {
        "fused-add-tiled"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, b) = (f32_slice(s1, l1, "add-tiled")?, f32_slice(s2, l2, "add-tiled")?);
        if b.is_empty() || x.len() % b.len() != 0 {
            candle_core::bail!("add-tiled: {:?} + {:?}", l1.dims(), l2.dims())
        }
        // Chunks of whole tiles, so that each starts at the tile's start.
        let grain = parallel::rows_per_chunk(b.len()) * b.len();
        let y = parallel::collect(
            x.len(),
            grain,
            #[inline(always)]
            |start, out| {
                for (yb, xb) in out.chunks_exact_mut(b.len()).zip(x[start..].chunks_exact(b.len())) {
                    for ((yv, &xv), &bv) in yb.iter_mut().zip(xb).zip(b) {
                        yv.write(xv + bv);
                    }
                }
            },
        );
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
        crate::cuda::add_tiled(s1, l1, s2, l2)
    }
}

/// Sums the consecutive blocks of `shape`'s size: the gradient of the tiled operand.
pub(crate) struct TileSum {
    pub(crate) shape: Shape,
}

impl CustomOp1 for TileSum {
    fn name(&self) -> &'static str {
        "fused-tile-sum"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = f32_slice(storage, layout, "tile-sum")?;
        let sum = parallel::column_sums(g, self.shape.elem_count());
        Ok((CpuStorage::F32(sum), self.shape.clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        crate::cuda::tile_sum(s, l, &self.shape)
    }
}
