//! Dropout with masks from a counter-based generator ([`crate::rng`]): element i of a call keyed
//! by `key` is kept when `uniform(key, first + i) >= p`, and scaled by 1 / (1 - p). A mask is a
//! function of (key, index) alone, so it is the same on every device, after a resume, and for
//! any split of a batch into shards (`first` counts from the batch's first element); the
//! backward pass applies the same mask to the gradient, recomputing it instead of storing it.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use crate::f32_slice;
use crate::parallel;
use crate::rng;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Dropout {
    pub(crate) key: u64,
    /// Index of this tensor's first element in the whole batch's.
    pub(crate) first: u64,
    pub(crate) p: f32,
}

impl Dropout {
    pub(crate) fn keeps(&self, i: u64) -> bool {
        rng::uniform(self.key, self.first + i) >= self.p
    }

    pub(crate) fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// The mask as a tensor of 0 and 1/(1-p), for devices and dtypes without the fused kernel.
    pub(crate) fn mask(&self, x: &Tensor) -> Result<Tensor> {
        let scale = self.scale();
        let values: Vec<f32> = (0..x.elem_count() as u64)
            .map(|i| if self.keeps(i) { scale } else { 0.0 })
            .collect();
        Tensor::from_vec(values, x.shape(), &candle_core::Device::Cpu)?
            .to_dtype(x.dtype())?
            .to_device(x.device())
    }
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "counter-dropout"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = f32_slice(storage, layout, "dropout")?;
        let scale = self.scale();
        let y = parallel::collect(
            x.len(),
            parallel::GRAIN,
            #[inline(always)]
            |start, out| {
                for (i, (y, &v)) in (start..).zip(out.iter_mut().zip(&x[start..])) {
                    y.write(if self.keeps(i as u64) { v * scale } else { 0.0 });
                }
            },
        );
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::dropout(s, l, self.key, self.first, self.p)
    }

    /// Linear with a fixed mask: the gradient goes through the same mask.
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad_res.contiguous()?.apply_op1(*self)?))
    }
}

/// `x + dropout(h)`: one node of the backward graph instead of two (each costs a zeroed
/// gradient buffer and an add in candle's backward pass).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AddDropout(pub(super) Dropout);

impl CustomOp2 for AddDropout {
    fn name(&self) -> &'static str {
        "counter-add-dropout"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, h) = (f32_slice(s1, l1, "add-dropout")?, f32_slice(s2, l2, "add-dropout")?);
        if x.len() != h.len() {
            candle_core::bail!("add-dropout: {:?} + {:?}", l1.dims(), l2.dims())
        }
        let scale = self.0.scale();
        let y = parallel::collect(
            x.len(),
            parallel::GRAIN,
            #[inline(always)]
            |start, out| {
                for (i, ((y, &x), &h)) in (start..).zip(out.iter_mut().zip(&x[start..]).zip(&h[start..])) {
                    y.write(if self.0.keeps(i as u64) { x + h * scale } else { x });
                }
            },
        );
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _h: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(dy.clone()), Some(dy.contiguous()?.apply_op1(self.0)?)))
    }
}

/// The CUDA launchers of this op's kernels (`dropout.cu`, beside this file).
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda::{elementwise, f32_view, output, wrap};

    const MODULE: crate::cuda::Module = crate::ptx_module!("dropout");

    /// Dropout of a contiguous f32 tensor: the mask from (key, first + i).
    pub fn dropout(s: &CudaStorage, l: &Layout, key: u64, first: u64, p: f32) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let x = f32_view(s, l, "dropout")?;
        let n = x.len();
        let y = output(dev, n)?; // dropout_fwd writes each of the n elements
        let scale = 1.0 / (1.0 - p);
        crate::launch!(dev, MODULE, "dropout_fwd", elementwise(n); &x, &y, &n, &key, &first, &p, &scale);
        Ok(wrap(y, dev, l.shape().clone()))
    }
}
