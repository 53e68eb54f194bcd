//! Squared ReLU, `max(x, 0)²` (the ungated MLP of Arcee's models and of modded-nanogpt), and its
//! gradient `2 max(x, 0) · dy`: one pass each way. With candle's ops it was two passes forward
//! and, back, the gradients of `sqr` and of `relu` (a mask, a product) in four.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

/// `max(x, 0)²`.
pub(crate) struct Relu2;

impl CustomOp1 for Relu2 {
    fn name(&self) -> &'static str {
        "fused-relu2"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        super::map(storage, layout, "relu2", |x| x.max(0.0) * x.max(0.0))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            arg.contiguous()?
                .apply_op2_no_bwd(&grad_res.contiguous()?, &Relu2Grad)?,
        ))
    }
}

/// `dy · 2 max(x, 0)`, in one pass.
pub(crate) struct Relu2Grad;

impl CustomOp2 for Relu2Grad {
    fn name(&self) -> &'static str {
        "fused-relu2-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        super::map_grad((s1, l1), (s2, l2), "relu2-grad", |x| 2.0 * x.max(0.0))
    }
}
