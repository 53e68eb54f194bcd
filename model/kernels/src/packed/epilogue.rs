//! What a product's tasks apply to the outputs they have just written: the bias, then GELU
//! (the fused `x @ W^T + b` and the MLP's first layer), and that product as a candle op.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape};

use super::PackedMatrix;
use crate::simd::{Kernel, Simd, Vec16};

/// What each task applies to the outputs it has written: the bias, then GELU.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub gelu: bool,
}

/// [`PackedMatrix::matmul_bias`] as a candle op of `x` and the bias.
pub(super) struct WithEpilogue<'a> {
    pub(super) w: &'a PackedMatrix,
    pub(super) gelu: bool,
}

impl CustomOp2 for WithEpilogue<'_> {
    fn name(&self) -> &'static str {
        "packed-matmul-bias"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let ep = Epilogue {
            bias: Some(crate::f32_slice(b, lb, "packed-matmul-bias")?),
            gelu: self.gelu,
        };
        self.w.forward_cpu(x, lx, ep)
    }
}

/// The epilogue (bias, then GELU) on columns `col0..col0 + cols` of `y` `(m, n)`, which a task
/// has just written, on `simd`'s vectors (the GELU's rational tanh vectorises; at the baseline's
/// 4 lanes a long prefill's MLP spent ~6% of its time here).
///
/// # Safety
/// `y` holds `m * n` f32 and no other thread touches these columns meanwhile; `simd` available.
pub(super) unsafe fn epilogue(ep: Epilogue, simd: Simd, y: *mut f32, m: usize, n: usize, col0: usize, cols: usize) {
    /// The epilogue as a kernel of plain Rust that the instruction set's compilation vectorises.
    struct EpilogueKernel<'a> {
        ep: Epilogue<'a>,
        y: *mut f32,
        shape: (usize, usize, usize, usize),
    }
    impl Kernel for EpilogueKernel<'_> {
        type Output = ();
        #[inline(always)]
        fn run<V: Vec16>(self) {
            let (m, n, col0, cols) = self.shape;
            // SAFETY: the caller's contract (the columns are its own).
            unsafe { epilogue_any(self.ep, self.y, m, n, col0, cols) }
        }
    }
    simd.run(EpilogueKernel {
        ep,
        y,
        shape: (m, n, col0, cols),
    })
}

/// [`epilogue`] on any lanes.
///
/// # Safety
/// As [`epilogue`]'s.
#[inline(always)]
unsafe fn epilogue_any(ep: Epilogue, y: *mut f32, m: usize, n: usize, col0: usize, cols: usize) {
    let Some(bias) = ep.bias else { return };
    for i in 0..m {
        // SAFETY: the caller's columns of row `i`, in bounds.
        let out = unsafe { std::slice::from_raw_parts_mut(y.add(i * n + col0), cols) };
        for (v, &b) in out.iter_mut().zip(&bias[col0..]) {
            *v += b;
            if ep.gelu {
                *v = crate::elementwise::gelu::gelu_new(*v);
            }
        }
    }
}
