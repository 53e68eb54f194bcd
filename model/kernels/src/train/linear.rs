//! The products of training's linear layers on the CPU, with their backward: `y = x @ W^T`, then
//! `dx = dy @ W` and `dW = dy^T @ x`, each as `a @ B^T` with both operands read where they are
//! ([`crate::train::product`]: f32 on the packed kernel, or bf16 under autocast); and [`affine`], GPT-2's
//! `Conv1D` `x @ W + b` with `W` in the checkpoint's `(in, out)` layout, the bias and its gradient
//! in the same op. (Weights change at every step, so they are packed at every product: one pass
//! over `B` against `rows` passes of arithmetic.) candle's CPU matmul is the `gemm` crate's AVX2
//! path on stable Rust; the packed kernel runs AVX-512 where the CPU has it. Every output is one
//! chain of multiply-adds in a fixed order, so a run is repeatable.

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Device, Layout, Result, Shape, Tensor};

use crate::elementwise::gelu::{gelu_new, GeluGrad};
use crate::parallel;
use crate::train::product::{product, product_into, Autocast, Operand};

/// `a @ B^T` for `a` `(m, k)` and `B` `(n, k)`, f32 tensors on the CPU (any layout); not
/// differentiable.
fn product_of(a: &Tensor, b: &Tensor, autocast: Autocast) -> Result<Tensor> {
    a.apply_op2_no_bwd(b, &Product { autocast, scale: 1.0 })
}

/// `x @ W^T` for `x` `(m, k)` and `W` `(n, k)` (any layout, a transposed view included), f32
/// on the CPU, at `autocast`'s precision; differentiable in both.
pub fn linear_product(x: &Tensor, w: &Tensor, autocast: Autocast) -> Result<Tensor> {
    crate::tape::op2(x, w, Product { autocast, scale: 1.0 })
}

/// `scale · x @ W^T`, as [`linear_product`] (a LoRA update's second product, `scale` its
/// `alpha / r`).
pub fn scaled_linear_product(x: &Tensor, w: &Tensor, scale: f32, autocast: Autocast) -> Result<Tensor> {
    crate::tape::op2(x, w, Product { autocast, scale })
}

/// See [`linear_product`].
struct Product {
    autocast: Autocast,
    scale: f32,
}

impl CustomOp2 for Product {
    fn name(&self) -> &'static str {
        "packed-linear"
    }

    fn cpu_fwd(&self, a: &CpuStorage, la: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (Operand::of(a, la)?, Operand::of(b, lb)?);
        if x.cols != w.cols {
            candle_core::bail!(
                "packed-linear: x is ({}, {}) but the weight is ({}, {})",
                x.rows,
                x.cols,
                w.rows,
                w.cols
            )
        }
        let mut y = product(x, w, self.autocast)?;
        if self.scale != 1.0 {
            y.iter_mut().for_each(|v| *v *= self.scale);
        }
        Ok((CpuStorage::F32(y), Shape::from((x.rows, w.rows))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let scaled;
        let dy = if self.scale == 1.0 {
            dy
        } else {
            scaled = (dy * f64::from(self.scale))?;
            &scaled
        };
        // dx (m, k) = dy @ W: (m, n) @ ((W^T) (k, n))^T.
        let dx = product_of(dy, &w.t()?, self.autocast)?;
        // dW (n, k) = dy^T @ x. In f32 the product's left operand, a transposed view here, is
        // read in place when small, else made contiguous (a transposed copy): the smaller, dy^T
        // (n, m) for dW, or x^T (k, m) for dW^T (k, n), returned as its transposed view.
        let (n, k) = w.dims2()?;
        let dw = if n <= k {
            product_of(&dy.t()?, &x.t()?, self.autocast)? // (n, m) @ (m, k): dy^T @ (x^T)^T
        } else {
            product_of(&x.t()?, &dy.t()?, self.autocast)?.t()? // ((k, m) @ (m, n))^T
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// `x @ W + b` for `x` `(m, k)`, `W` `(k, n)` (GPT-2's `(in, out)` layout, any strides) and `b`
/// `(n)`, f32 on the CPU, at `autocast`'s precision, differentiable in all three: a training
/// `Conv1D` as one node of the graph. candle's backward pass gives every node's output gradient a
/// zeroed buffer and an add; as a product, a broadcast add and a transposed view of the variable,
/// a layer was three such nodes, and the weight's gradient reached the variable through a strided
/// add. Here `dW` comes out in the variable's own layout.
pub fn affine(x: &Tensor, w: &Tensor, b: &Tensor, autocast: Autocast) -> Result<Tensor> {
    affine_op(x, w, b, autocast, false, true)
}

/// [`affine`] with `W` and `b` frozen: the backward pass gives `x` its gradient and computes none
/// for them (a LoRA run's base layers: `dW` would be a third of the layer's arithmetic, and
/// thrown away).
pub fn frozen_affine(x: &Tensor, w: &Tensor, b: &Tensor, autocast: Autocast) -> Result<Tensor> {
    affine_op(x, w, b, autocast, false, false)
}

/// `gelu(x @ W + b)` (GPT-2's tanh form), as [`affine`] with the activation in the same node:
/// the MLP's widest tensor, `(m, 4C)`, then has one gradient edge rather than two (candle gives
/// each edge a zeroed buffer and an add), and the GELU is computed while the bias is added.
pub fn affine_gelu(x: &Tensor, w: &Tensor, b: &Tensor, autocast: Autocast) -> Result<Tensor> {
    affine_op(x, w, b, autocast, true, true)
}

fn affine_op(x: &Tensor, w: &Tensor, b: &Tensor, autocast: Autocast, gelu: bool, weight_grad: bool) -> Result<Tensor> {
    if !x.device().is_cpu() {
        // On a GPU the product is cuBLAS's (f32, or TF32 where candle allows it) and the bias
        // add a kernel of its own; the GELU is its own op there (the op keeps no
        // pre-activation on the device).
        if autocast != Autocast::Off {
            candle_core::bail!("packed-affine: mixed precision runs on the CPU only")
        }
        let op = Affine {
            autocast,
            gelu: None,
            weight_grad,
        };
        let y = crate::tape::op3(&x.contiguous()?, w, &b.contiguous()?, op)?;
        return if gelu { crate::gelu(&y) } else { Ok(y) };
    }
    let op = Affine {
        autocast,
        gelu: gelu.then(OnceLock::new),
        weight_grad,
    };
    crate::tape::op3(&x.contiguous()?, w, &b.contiguous()?, op)
}

/// See [`affine`] and [`affine_gelu`].
struct Affine {
    autocast: Autocast,
    /// With the GELU: the pre-activation `x @ W + b`, kept by the forward pass for the backward
    /// (a custom op has one output). It is the tensor that an unfused GELU node would keep.
    gelu: Option<OnceLock<Tensor>>,
    /// Whether the backward pass computes `dW` and `db` (not for frozen weights).
    weight_grad: bool,
}

impl CustomOp3 for Affine {
    fn name(&self) -> &'static str {
        "packed-affine"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (Operand::of(sx, lx)?, Operand::of(sw, lw)?);
        let b = crate::f32_slice(sb, lb, "packed-affine")?;
        let (m, n) = (x.rows, w.cols);
        if x.cols != w.rows || b.len() != n {
            candle_core::bail!(
                "packed-affine: x is ({m}, {}), the weight ({}, {n}), the bias {:?}",
                x.cols,
                w.rows,
                lb.dims()
            )
        }
        let mut y = product(x, w.t(), self.autocast)?; // (m, k) @ (n, k)^T
        let grain = parallel::rows_per_chunk(n) * n.max(1);
        let Some(pre) = &self.gelu else {
            parallel::chunks_mut(
                &mut y,
                grain,
                #[inline(always)]
                |_, rows| {
                    for row in rows.chunks_exact_mut(n.max(1)) {
                        row.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
                    }
                },
            );
            return Ok((CpuStorage::F32(y), Shape::from((m, n))));
        };
        let mut g = Vec::with_capacity(y.len());
        parallel::chunks_mut2(
            &mut y,
            &mut g.spare_capacity_mut()[..m * n],
            grain,
            #[inline(always)]
            |_, rows, out| {
                for (row, out) in rows.chunks_exact_mut(n.max(1)).zip(out.chunks_exact_mut(n.max(1))) {
                    for ((v, g), &b) in row.iter_mut().zip(out).zip(b) {
                        *v += b;
                        g.write(gelu_new(*v));
                    }
                }
            },
        );
        // SAFETY: the pass above wrote all `m * n` values (whole rows of `n`; `y` has `m` rows).
        unsafe { g.set_len(m * n) };
        let y = Tensor::from_vec(y, (m, n), &Device::Cpu)?;
        if pre.set(y).is_err() {
            candle_core::bail!("packed-affine-gelu: the op ran forward twice")
        }
        Ok((CpuStorage::F32(g), Shape::from((m, n))))
    }

    /// `x @ W + b` on a CUDA GPU: cuBLAS's product (candle's), then the bias added over the rows.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        if self.gelu.is_some() || self.autocast != Autocast::Off {
            candle_core::bail!("packed-affine on CUDA: f32 products without the GELU only")
        }
        let ((m, k), (kw, n)) = (lx.shape().dims2()?, lw.shape().dims2()?);
        if k != kw || lb.shape().elem_count() != n {
            candle_core::bail!(
                "packed-affine: x is ({m}, {k}), the weight ({kw}, {n}), the bias {:?}",
                lb.dims()
            )
        }
        let y = sx.matmul(sw, (1, m, n, k), lx, lw)?;
        crate::elementwise::add::cuda::add_tiled(&y, &Layout::contiguous((m, n)), sb, lb)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut dy = dy.contiguous()?;
        if !dy.device().is_cpu() {
            // candle's products (cuBLAS) on views that track nothing: dx = dy @ W^T,
            // dW = x^T @ dy in the variable's (in, out) layout, db the column sums of dy.
            let (x, w, dy) = (x.detach(), w.detach(), dy.detach());
            let dx = dy.matmul(&w.t()?)?;
            if !self.weight_grad {
                return Ok((Some(dx), None, None));
            }
            let dw = x.t()?.matmul(&dy)?;
            let db = dy.apply_op1_no_bwd(&crate::elementwise::add::TileSum {
                shape: Shape::from(dy.dim(1)?),
            })?;
            return Ok((Some(dx), Some(dw), Some(db)));
        }
        if let Some(pre) = &self.gelu {
            let pre = pre
                .get()
                .ok_or_else(|| candle_core::Error::Msg("packed-affine-gelu: backward before forward".into()))?;
            dy = pre.apply_op2_no_bwd(&dy, &GeluGrad)?; // through the GELU: d(x @ W + b)
        }
        let dx = product_of(&dy, w, self.autocast)?; // (m, n) @ (k, n)^T
        if !self.weight_grad {
            return Ok((Some(dx), None, None));
        }
        let (dw, db) = dy
            .apply_op2_no_bwd(
                x,
                &AffineGrads {
                    autocast: self.autocast,
                },
            )?
            .chunk_pair()?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The weight's and the bias's gradients of [`Affine`] from `dy` `(m, n)` and `x` `(m, k)`:
/// `dW = x^T @ dy` `(k, n)` and `db` the column sums of `dy`, returned as one `(k + 1, n)`
/// tensor (a custom op has one output) that [`ChunkPair`] splits.
struct AffineGrads {
    autocast: Autocast,
}

impl CustomOp2 for AffineGrads {
    fn name(&self) -> &'static str {
        "packed-affine-grads"
    }

    fn cpu_fwd(&self, sd: &CpuStorage, ld: &Layout, sx: &CpuStorage, lx: &Layout) -> Result<(CpuStorage, Shape)> {
        let (dy, x) = (Operand::of(sd, ld)?, Operand::of(sx, lx)?);
        let (k, n) = (x.cols, dy.cols);
        // (k, m) @ (n, m)^T: x^T as the product's rows, dy^T packed from dy's columns; written
        // into the output with room for the bias's row after it.
        let mut out = Vec::with_capacity((k + 1) * n);
        product_into(x.t(), dy.t(), self.autocast, &mut out.spare_capacity_mut()[..k * n])?;
        // SAFETY: `product_into` wrote every one of the `k * n` values.
        unsafe { out.set_len(k * n) };
        out.extend_from_slice(&parallel::column_sums(
            crate::f32_slice(sd, ld, "packed-affine-grads")?,
            n,
        ));
        Ok((CpuStorage::F32(out), Shape::from((k + 1, n))))
    }
}

/// Splits [`AffineGrads`]' `(k + 1, n)` output into `(k, n)` and `(n)` views.
trait ChunkPair {
    fn chunk_pair(&self) -> Result<(Tensor, Tensor)>;
}

impl ChunkPair for Tensor {
    fn chunk_pair(&self) -> Result<(Tensor, Tensor)> {
        let k = self.dim(0)? - 1;
        Ok((self.narrow(0, 0, k)?, self.get(k)?))
    }
}
