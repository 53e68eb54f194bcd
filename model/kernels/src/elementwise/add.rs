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
        cuda::add_tiled(s1, l1, s2, l2)
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
        cuda::tile_sum(s, l, &self.shape)
    }
}

/// The CUDA launchers of this op's kernels (`add.cu`, beside this file).
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda::{elementwise, f32_view, output, wrap};

    const MODULE: crate::cuda::Module = crate::ptx_module!("add");

    use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
    use candle_core::CudaDevice;

    pub fn add_tiled(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s1.device();
        let (x, bias) = (f32_view(s1, l1, "add-tiled")?, f32_view(s2, l2, "add-tiled")?);
        let (n, nb) = (x.len(), bias.len());
        if nb == 0 || n % nb != 0 {
            candle_core::bail!("add-tiled: {nb} values do not tile {n}");
        }
        let y = output(dev, n)?; // add_tiled writes each of the n elements
        crate::launch!(dev, MODULE, "add_tiled", elementwise(n); &x, &bias, &y, &n, &nb);
        Ok(wrap(y, dev, l1.shape().clone()))
    }

    /// Column sums of `a`, a `(rows, cols)` matrix, into `out[offset..offset + cols]`: partial
    /// sums over chunks of rows, then their sum, in a fixed order (the same result every run).
    pub(crate) fn column_sum(
        dev: &CudaDevice,
        a: &CudaView<'_, f32>,
        rows: usize,
        cols: usize,
        out: &mut CudaSlice<f32>,
        offset: usize,
    ) -> Result<()> {
        if a.len() < rows * cols || out.len() < offset + cols {
            candle_core::bail!(
                "column-sum: ({rows}, {cols}) from {} values into {} at {offset}",
                a.len(),
                out.len()
            );
        }
        let col_blocks = (cols as u32).div_ceil(128);
        // Enough chunks to fill the GPU, each long enough to amortise its launch. Chunk c covers
        // rows [c * chunk, min(rows, (c + 1) * chunk)) and writes its own row of `partial`.
        let chunks = rows.div_ceil(64).clamp(1, 256);
        let chunk = rows.div_ceil(chunks);
        let partial = output(dev, chunks * cols)?; // each chunk writes its row of cols sums
        let cfg = LaunchConfig {
            grid_dim: (col_blocks, chunks as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        crate::launch!(dev, MODULE, "column_sum", cfg; a, &partial, &0usize, &rows, &cols, &chunk);
        // Then the partial rows as one chunk, into out[offset..offset + cols].
        let cfg = LaunchConfig {
            grid_dim: (col_blocks, 1, 1),
            ..cfg
        };
        crate::launch!(dev, MODULE, "column_sum", cfg; &partial, &mut *out, &offset, &chunks, &cols, &chunks);
        Ok(())
    }

    /// Sums the consecutive blocks of `shape`'s size (the gradient of a tiled operand).
    pub fn tile_sum(s: &CudaStorage, l: &Layout, shape: &Shape) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let g = f32_view(s, l, "tile-sum")?;
        let cols = shape.elem_count();
        if cols == 0 || g.len() % cols != 0 {
            candle_core::bail!("tile-sum: blocks of {cols} do not tile {}", g.len());
        }
        let mut out = output(dev, cols)?; // column_sum writes the cols sums
        column_sum(dev, &g, g.len() / cols, cols, &mut out, 0)?;
        Ok(wrap(out, dev, shape.clone()))
    }
}
