//! The products of training's linear layers on the packed CPU kernel ([`PackedMatrix`]), with
//! their backward: `y = x @ W^T`, then `dx = dy @ W` and `dW = dy^T @ x`, each as `a @ B^T` with
//! `B` packed for that product (and [`affine`]: GPT-2's `Conv1D`, `x @ W + b` with `W` in the
//! checkpoint's `(in, out)` layout, the bias and its gradient in the same op) (weights change at every step, so they are packed at every
//! product: one pass over `B` against `rows` passes of arithmetic). candle's CPU matmul is the
//! `gemm` crate's AVX2 path on stable Rust; the packed kernel runs AVX-512 where the CPU has it.
//! Every output is one chain of multiply-adds in a fixed order, so a run is repeatable.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

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

/// `x @ W + b` for `x` `(m, k)`, `W` `(k, n)` (GPT-2's `(in, out)` layout, any strides) and `b`
/// `(n)`, f32 on the CPU, differentiable in all three: a training `Conv1D` as one node of the
/// graph. candle's backward pass gives every node's output gradient a zeroed buffer and an add;
/// as a product, a broadcast add and a transposed view of the variable, a layer was three such
/// nodes, and the weight's gradient reached the variable through a strided add. Here `dW` comes
/// out in the variable's own layout.
pub fn affine(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op3(w, &b.contiguous()?, Affine)
}

/// See [`affine`].
struct Affine;

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
        let x = super::f32_slice(sx, lx, "packed-affine")?;
        let b = super::f32_slice(sb, lb, "packed-affine")?;
        let (m, k) = lx.shape().dims2()?;
        let (kw, n) = lw.shape().dims2()?;
        if k != kw || b.len() != n {
            candle_core::bail!(
                "packed-affine: x is ({m}, {k}), the weight ({kw}, {n}), the bias {:?}",
                lb.dims()
            )
        }
        // The product's B is W^T, (n, k): W's strides swapped.
        let stride = lw.stride();
        let packed =
            PackedMatrix::from_strided_f32(sw.as_slice::<f32>()?, lw.start_offset(), (n, k), (stride[1], stride[0]));
        let mut y = packed.matmul_with(x, m, Simd::detect());
        for row in y.chunks_exact_mut(n.max(1)) {
            row.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
        }
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        let dx = product(&dy, w)?; // (m, n) @ (k, n)^T
        let (dw, db) = dy.apply_op2_no_bwd(x, &AffineGrads)?.chunk_pair()?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

/// The weight's and the bias's gradients of [`Affine`] from `dy` `(m, n)` and `x` `(m, k)`:
/// `dW = x^T @ dy` `(k, n)` and `db` the column sums of `dy`, returned as one `(k + 1, n)`
/// tensor (a custom op has one output) that [`ChunkPair`] splits.
struct AffineGrads;

impl CustomOp2 for AffineGrads {
    fn name(&self) -> &'static str {
        "packed-affine-grads"
    }

    fn cpu_fwd(&self, sd: &CpuStorage, ld: &Layout, sx: &CpuStorage, lx: &Layout) -> Result<(CpuStorage, Shape)> {
        let dy = super::f32_slice(sd, ld, "packed-affine-grads")?;
        let x = super::f32_slice(sx, lx, "packed-affine-grads")?;
        let (m, n) = ld.shape().dims2()?;
        let (_, k) = lx.shape().dims2()?;
        // x^T as the product's rows; dy^T (n, m) packed straight from dy's columns.
        let xt = transpose(x, m, k);
        let packed = PackedMatrix::from_strided_f32(dy, 0, (n, m), (1, n));
        let mut out = packed.matmul_with(&xt, k, Simd::detect());
        let mut db = vec![0f32; n];
        for row in dy.chunks_exact(n.max(1)) {
            db.iter_mut().zip(row).for_each(|(s, &v)| *s += v);
        }
        out.extend_from_slice(&db);
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

/// `x` `(rows, cols)` row-major, transposed: `(cols, rows)` row-major, in 32 x 32 blocks so that
/// both sides stay in cache (candle's strided copy walks one side across cache lines, element by
/// element).
pub(super) fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    const B: usize = 32;
    let mut out = vec![0f32; rows * cols];
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    out[c * rows + r] = x[r * cols + c];
                }
            }
        }
    }
    out
}
