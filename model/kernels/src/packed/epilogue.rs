//! What a product's tasks apply to the outputs they have just written: a recoded block format's
//! offsets, the bias, then GELU (the fused `x @ W^T + b` and the MLP's first layer), and those
//! products as candle ops.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape};

use super::PackedMatrix;
use crate::simd::{Kernel, Simd, Vec16};

/// What each task applies to the outputs it has written: the offsets, the bias, then GELU.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epilogue<'a> {
    pub offsets: Option<Offsets<'a>>,
    pub bias: Option<&'a [f32]>,
    pub gelu: bool,
}

/// A block format's offsets per block of 32 inputs ([`PackedMatrix::matmul_offsets`]):
/// `y[i, c] += Σ_b sums[i, b] · table[b, c]`, `sums` `(m, blocks)` the sums of `x` over each
/// block, `table` in the tasks' order ([`PackedMatrix::group_offsets`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Offsets<'a> {
    pub sums: &'a [f32],
    pub table: &'a [f32],
    pub blocks: usize,
}

/// [`PackedMatrix::matmul_bias`] as a candle op of `x` and the bias, and
/// [`PackedMatrix::matmul_offsets_bias`] as one of `x`, the offsets' table and the bias.
pub(super) struct WithEpilogue<'a> {
    pub(super) w: &'a PackedMatrix,
    pub(super) gelu: bool,
}

impl WithEpilogue<'_> {
    /// The bias `b` and GELU where asked.
    fn epilogue<'b>(&self, b: &'b CpuStorage, lb: &Layout) -> Result<Epilogue<'b>> {
        Ok(Epilogue {
            bias: Some(crate::f32_slice(b, lb, "packed-matmul-bias")?),
            gelu: self.gelu,
            offsets: None,
        })
    }
}

impl CustomOp2 for WithEpilogue<'_> {
    fn name(&self) -> &'static str {
        "packed-matmul-bias"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        self.w.forward_cpu(x, lx, self.epilogue(b, lb)?)
    }
}

impl CustomOp3 for WithEpilogue<'_> {
    fn name(&self) -> &'static str {
        "packed-matmul-offsets-bias"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        with_offsets(self.w, x, lx, t, lt, self.epilogue(b, lb)?)
    }
}

/// [`PackedMatrix::matmul_offsets`] as a candle op of `x` and the offsets' table.
pub(super) struct WithOffsets<'a>(pub(super) &'a PackedMatrix);

impl CustomOp2 for WithOffsets<'_> {
    fn name(&self) -> &'static str {
        "packed-matmul-offsets"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, t: &CpuStorage, lt: &Layout) -> Result<(CpuStorage, Shape)> {
        with_offsets(self.0, x, lx, t, lt, Epilogue::default())
    }
}

/// `x @ W^T` with the offsets of table `t` (in the tasks' order) added, then `ep`'s bias and GELU.
fn with_offsets(
    w: &PackedMatrix,
    x: &CpuStorage,
    lx: &Layout,
    t: &CpuStorage,
    lt: &Layout,
    ep: Epilogue,
) -> Result<(CpuStorage, Shape)> {
    w.check_grouped(lt.dims())?;
    let blocks = w.k / super::BLOCK;
    let table = crate::f32_slice(t, lt, "packed-matmul-offsets")?;
    let xs = crate::f32_slice(x, lx, "packed-matmul-offsets")?;
    // Each block's sum in order (as `x.reshape((m, k / 32, 32)).sum(2)`).
    let sums: Vec<f32> = xs.chunks_exact(super::BLOCK).map(|b| b.iter().sum()).collect();
    let ep = Epilogue {
        offsets: Some(Offsets {
            sums: &sums,
            table,
            blocks,
        }),
        ..ep
    };
    w.forward_cpu(x, lx, ep)
}

/// The epilogue (offsets, bias, then GELU) on columns `col0..col0 + cols` of `y`'s rows
/// `r0..r0 + m` (`y` points at row `r0` of `(.., n)`), which a task has just written, on
/// `simd`'s vectors (the GELU's rational tanh vectorises; at the baseline's 4 lanes a long
/// prefill's MLP spent ~6% of its time here).
///
/// # Safety
/// `y` holds `m * n` f32 and no other thread touches these columns meanwhile; `simd` available.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn epilogue(
    ep: Epilogue,
    simd: Simd,
    y: *mut f32,
    r0: usize,
    m: usize,
    n: usize,
    col0: usize,
    cols: usize,
) {
    /// The epilogue as a kernel of plain Rust that the instruction set's compilation vectorises.
    struct EpilogueKernel<'a> {
        ep: Epilogue<'a>,
        y: *mut f32,
        shape: (usize, usize, usize, usize, usize),
    }
    impl Kernel for EpilogueKernel<'_> {
        type Output = ();
        #[inline(always)]
        fn run<V: Vec16>(self) {
            let (r0, m, n, col0, cols) = self.shape;
            // SAFETY: the caller's contract (the columns are its own).
            unsafe { epilogue_any(self.ep, self.y, r0, m, n, col0, cols) }
        }
    }
    simd.run(EpilogueKernel {
        ep,
        y,
        shape: (r0, m, n, col0, cols),
    })
}

/// [`epilogue`] on any lanes.
///
/// # Safety
/// As [`epilogue`]'s.
#[inline(always)]
unsafe fn epilogue_any(ep: Epilogue, y: *mut f32, r0: usize, m: usize, n: usize, col0: usize, cols: usize) {
    if let Some(o) = ep.offsets {
        debug_assert!(col0.is_multiple_of(super::OFFSET_GROUP) && cols <= super::OFFSET_GROUP);
        for i in 0..m {
            // SAFETY: the caller's columns of row `i`, in bounds.
            let out = unsafe { std::slice::from_raw_parts_mut(y.add(i * n + col0), cols) };
            let sums = &o.sums[(r0 + i) * o.blocks..(r0 + i + 1) * o.blocks];
            // A task's columns are at most `GROUP * LANES`: the blocks' terms summed first, then
            // added (as `y + sums.matmul(table)`).
            let mut acc = [0f32; super::GROUP * super::LANES];
            // The task's group of columns: its offsets, block after block, in one run.
            let group = &o.table[col0 / super::OFFSET_GROUP * o.blocks * super::OFFSET_GROUP..];
            for (b, &s) in sums.iter().enumerate() {
                let row = &group[b * super::OFFSET_GROUP..b * super::OFFSET_GROUP + cols];
                for (a, &t) in acc.iter_mut().zip(row) {
                    *a += s * t;
                }
            }
            for (v, a) in out.iter_mut().zip(acc) {
                *v += a;
            }
        }
    }
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
