//! The products of training's linear layers on the packed CPU kernel ([`PackedMatrix`]), with
//! their backward: `y = x @ W^T`, then `dx = dy @ W` and `dW = dy^T @ x`, each as `a @ B^T` with
//! `B` packed for that product (weights change at every step, so they are packed at every
//! product: one pass over `B` against `rows` passes of arithmetic). candle's CPU matmul is the
//! `gemm` crate's AVX2 path on stable Rust; the packed kernel runs AVX-512 where the CPU has it.
//! Every output is one chain of multiply-adds in a fixed order, so a run is repeatable.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::packed::PackedMatrix;
use super::simd::Simd;

/// `a @ B^T` for `a` `(m, k)` and `B` `(n, k)`, f32 tensors on the CPU (any layout); not
/// differentiable.
fn product(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    a.contiguous()?.apply_op2_no_bwd(b, &Product)
}

/// `x @ W^T` for `x` `(m, k)` and `W` `(n, k)` (any layout, a transposed view included), f32
/// on the CPU, differentiable in both.
pub fn linear_product(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(w, Product)
}

/// See [`linear_product`].
struct Product;

impl CustomOp2 for Product {
    fn name(&self) -> &'static str {
        "packed-linear"
    }

    fn cpu_fwd(&self, a: &CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = super::f32_slice(a, la, "packed-linear")?;
        let (m, k) = la.shape().dims2()?;
        let (n, kb) = lb.shape().dims2()?;
        if k != kb {
            candle_core::bail!("packed-linear: x is ({m}, {k}) but the weight is ({n}, {kb})")
        }
        let stride = lb.stride();
        let packed =
            PackedMatrix::from_strided_f32(b.as_slice::<f32>()?, lb.start_offset(), (n, k), (stride[0], stride[1]));
        Ok((
            CpuStorage::F32(packed.matmul_with(x, m, Simd::detect())),
            Shape::from((m, n)),
        ))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = product(dy, &w.t()?)?; // (m, n) @ (n, k): dy @ (W^T)^T
                                        // dW (n, k) = dy^T @ x: the activations of the product must be a contiguous copy of
                                        // one transposed operand, so transpose the smaller: dy^T (n, m) for dW, or x^T (k, m) for
                                        // dW^T (k, n), returned as its transposed view.
        let (n, k) = w.dims2()?;
        let dw = if n <= k {
            product(&dy.t()?, &x.t()?)? // (n, m) @ (m, k): dy^T @ (x^T)^T
        } else {
            product(&x.t()?, &dy.t()?)?.t()? // ((k, m) @ (m, n))^T: (x^T @ (dy^T)^T)^T
        };
        Ok((Some(dx), Some(dw)))
    }
}
