//! GELU, tanh approximation (GPT-2's `gelu_new`), and its gradient: one pass each way. candle's
//! calls libm's scalar `tanhf` per element, and its backward builds ten temporaries; here the tanh
//! is a rational approximation that the compiler vectorises.

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_A: f32 = 0.044_715;

/// tanh(x) as a 13/6 rational function on [-7.9053, 7.9053] (|error| < 1e-6; beyond that range
/// tanh is ±1 in f32). The coefficients are the published minimax fit used by Eigen's float tanh.
#[inline(always)]
pub(crate) fn fast_tanh(x: f32) -> f32 {
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

/// GPT-2's GELU (tanh form) of one value: the fused op's and the packed kernel's epilogue's.
#[inline(always)]
pub(crate) fn gelu_new(x: f32) -> f32 {
    0.5 * x * (1.0 + fast_tanh(SQRT_2_OVER_PI * (x + GELU_A * x * x * x)))
}

/// (gelu_new(x), its derivative at x): what the gradients multiply.
#[inline(always)]
pub(crate) fn gelu_new_and_slope(x: f32) -> (f32, f32) {
    let t = fast_tanh(SQRT_2_OVER_PI * (x + GELU_A * x * x * x));
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_A * x * x);
    (0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
}

/// GELU, tanh approximation (GPT-2's `gelu_new`).
pub(crate) struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "fused-gelu"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        super::map(storage, layout, "gelu", gelu_new)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            arg.contiguous()?.apply_op2_no_bwd(&grad_res.contiguous()?, &GeluGrad)?,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::gelu(s, l)
    }
}

/// grad · d gelu(x)/dx, in one pass.
pub(crate) struct GeluGrad;

impl CustomOp2 for GeluGrad {
    fn name(&self) -> &'static str {
        "fused-gelu-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        super::map_grad((s1, l1), (s2, l2), "gelu-grad", |x| gelu_new_and_slope(x).1)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        cuda::gelu_grad(s1, l1, s2, l2)
    }
}

/// The CUDA launchers of this op's kernels (`gelu.cu`, beside this file).
#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use crate::cuda::{elementwise, f32_view, output, wrap};

    const MODULE: crate::cuda::Module = crate::ptx_module!("gelu");

    pub fn gelu(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let x = f32_view(s, l, "gelu")?;
        let n = x.len();
        let y = output(dev, n)?; // gelu_fwd writes each of the n elements
        crate::launch!(dev, MODULE, "gelu_fwd", elementwise(n); &x, &y, &n);
        Ok(wrap(y, dev, l.shape().clone()))
    }

    pub fn gelu_grad(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s1.device();
        let (x, g) = (f32_view(s1, l1, "gelu-grad")?, f32_view(s2, l2, "gelu-grad")?);
        let n = x.len();
        if g.len() != n {
            candle_core::bail!("gelu-grad: {} gradients for {n} inputs", g.len());
        }
        let dx = output(dev, n)?; // gelu_bwd writes each of the n elements
        crate::launch!(dev, MODULE, "gelu_bwd", elementwise(n); &x, &g, &dx, &n);
        Ok(wrap(dx, dev, l1.shape().clone()))
    }
}
