//! The gated MLP's activation, `act(gate) ⊙ up` over the two halves of one `(.., 2 I)`
//! projection (SwiGLU with SiLU, GeGLU with GELU-tanh: the Llama, Qwen and Gemma families), and
//! its gradient, one pass each way. With candle's ops it was two strided narrows, the activation
//! and a product forward, and back the zero-padded gradients of both narrows added.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use super::gelu::{gelu_new, gelu_new_and_slope};
use crate::f32_slice;
use crate::parallel;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// `x σ(x)` (SwiGLU).
    Silu,
    /// GELU, tanh approximation (GeGLU as Gemma's `gelu_pytorch_tanh`).
    GeluTanh,
}

impl GateActivation {
    /// (act(x), act'(x)). The sigmoid's `e^x` is [`crate::rows::exp`], which vectorises (libm's
    /// `expf`, a call per value, was 3% of a SmolLM2-shaped training step).
    #[inline(always)]
    fn with_slope(self, x: f32) -> (f32, f32) {
        match self {
            Self::Silu => {
                let s = 1.0 / (1.0 + crate::rows::exp(-x));
                (x * s, s * (1.0 + x * (1.0 - s)))
            }
            Self::GeluTanh => gelu_new_and_slope(x),
        }
    }

    #[inline(always)]
    fn value(self, x: f32) -> f32 {
        match self {
            Self::Silu => x / (1.0 + crate::rows::exp(-x)),
            Self::GeluTanh => gelu_new(x),
        }
    }
}

/// `(.., 2 I)` -> `(.., I)`: `act(h[.., :I]) ⊙ h[.., I:]`.
pub(crate) struct Gated(pub(crate) GateActivation);

fn halves(op: &str, l: &Layout) -> Result<(usize, usize)> {
    let dims = l.dims();
    let width = dims.last().copied().unwrap_or(0);
    if width == 0 || width % 2 != 0 {
        candle_core::bail!("{op}: the last dimension of {dims:?} is not two halves")
    }
    Ok((width / 2, l.shape().elem_count() / width))
}

impl CustomOp1 for Gated {
    fn name(&self) -> &'static str {
        "fused-gated-activation"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = f32_slice(storage, layout, "gated-activation")?;
        let (i, rows) = halves("gated-activation", layout)?;
        let act = self.0;
        let y = parallel::collect(
            rows * i,
            parallel::rows_per_chunk(2 * i) * i,
            #[inline(always)]
            |start, out| {
                let r0 = start / i;
                for (r, yr) in out.chunks_exact_mut(i).enumerate() {
                    let (gate, up) = h[(r0 + r) * 2 * i..(r0 + r + 1) * 2 * i].split_at(i);
                    for ((y, &g), &u) in yr.iter_mut().zip(gate).zip(up) {
                        y.write(act.value(g) * u);
                    }
                }
            },
        );
        let mut dims = layout.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = i;
        }
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(
            arg.contiguous()?
                .apply_op2_no_bwd(&grad_res.contiguous()?, &GatedGrad(self.0))?,
        ))
    }
}

/// The gradient of [`Gated`] with respect to its `(.., 2 I)` input: `dy ⊙ up ⊙ act'(gate)`, then
/// `dy ⊙ act(gate)`.
pub(crate) struct GatedGrad(pub(crate) GateActivation);

impl CustomOp2 for GatedGrad {
    fn name(&self) -> &'static str {
        "fused-gated-activation-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (h, dy) = (
            f32_slice(s1, l1, "gated-activation-grad")?,
            f32_slice(s2, l2, "gated-activation-grad")?,
        );
        let (i, rows) = halves("gated-activation-grad", l1)?;
        if dy.len() != rows * i {
            candle_core::bail!("gated-activation-grad: input {:?}, grad {:?}", l1.dims(), l2.dims())
        }
        let act = self.0;
        let dh = parallel::collect(
            h.len(),
            parallel::rows_per_chunk(2 * i) * 2 * i,
            #[inline(always)]
            |start, out| {
                let r0 = start / (2 * i);
                for (r, dr) in out.chunks_exact_mut(2 * i).enumerate() {
                    let row = r0 + r;
                    let (gate, up) = h[row * 2 * i..(row + 1) * 2 * i].split_at(i);
                    let dyr = &dy[row * i..(row + 1) * i];
                    let (dgate, dup) = dr.split_at_mut(i);
                    for j in 0..i {
                        let (a, slope) = act.with_slope(gate[j]);
                        dgate[j].write(dyr[j] * up[j] * slope);
                        dup[j].write(dyr[j] * a);
                    }
                }
            },
        );
        Ok((CpuStorage::F32(dh), l1.shape().clone()))
    }
}
