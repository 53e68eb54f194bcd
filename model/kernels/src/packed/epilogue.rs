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
/// block, `table` in the tasks' order ([`PackedMatrix::group_offsets`]), or each block's minimum
/// from which the offsets are formed ([`PackedMatrix::group_mins`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Offsets<'a> {
    pub sums: &'a [f32],
    pub table: Table<'a>,
    pub blocks: usize,
}

impl Epilogue<'_> {
    /// Asks for the offsets of the task at `col0` to be brought into cache, where the CPU has such
    /// a hint, before its product runs: the epilogue then finds them there. A task's table is
    /// 18-48 lines that the hardware's prefetcher barely learns; after the product, the loads of
    /// the table had stalled on memory (most of a Q4_1 decode's epilogue samples, perf).
    #[inline]
    pub(super) fn prefetch(&self, col0: usize) {
        let Some(o) = self.offsets else { return };
        let first = col0 / super::OFFSET_GROUP * o.blocks * super::OFFSET_GROUP;
        let len = o.blocks * super::OFFSET_GROUP;
        // The run's start and length in bytes (checked in bounds once, here).
        let (start, bytes) = match o.table {
            Table::Values(t) => (t[first..first + len].as_ptr() as *const u8, 4 * len),
            Table::Mins { mins, .. } => (mins[first..first + len].as_ptr() as *const u8, 2 * len),
        };
        crate::simd::prefetch_lines(start, bytes, crate::simd::CacheLevel::L1);
    }
}

/// The offsets themselves, or each block's `m` ([`PackedMatrix::group_mins`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Table<'a> {
    Values(&'a [f32]),
    /// The offset `m + shift · d`, `d` the block's scale in `w`'s panels.
    Mins {
        mins: &'a [half::f16],
        shift: f32,
        w: &'a PackedMatrix,
    },
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
    let table = match t {
        CpuStorage::F16(mins) => match lt.contiguous_offsets() {
            Some((start, end)) => Table::Mins {
                mins: &mins[start..end],
                shift: w.min_shift()?,
                w,
            },
            None => candle_core::bail!("packed-matmul-offsets: the table must be contiguous"),
        },
        _ => Table::Values(crate::f32_slice(t, lt, "packed-matmul-offsets")?),
    };
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
            unsafe { epilogue_any::<V>(self.ep, self.y, r0, m, n, col0, cols) }
        }
    }
    simd.run(EpilogueKernel {
        ep,
        y,
        shape: (r0, m, n, col0, cols),
    })
}

/// Block `b`'s offsets of the task at `col0` (its group's minima from `first`) from a table of
/// minima: `m + shift · d` (`shift · d` is exact: the one rounding of the f32 offset), `d` the
/// panels' 16 scales of the block (the matrix is padded to whole groups of panels). A function
/// rather than a closure, so that it compiles within the instruction set's function.
#[inline(always)]
fn min_offsets<V: Vec16>(
    mins: &[half::f16],
    shift: f32,
    w: &PackedMatrix,
    col0: usize,
    first: usize,
    b: usize,
) -> [f32; super::OFFSET_GROUP] {
    let (bytes, codes) = (w.bytes(), super::code_bytes(w.format));
    let (mut t, mut d) = ([0f32; super::OFFSET_GROUP], [0f32; super::OFFSET_GROUP]);
    for p in 0..super::GROUP {
        let lanes = p * super::LANES;
        let scales = &bytes[w.block_start(col0 + lanes, b) + codes..][..2 * super::LANES];
        let mins = &mins[first + b * super::OFFSET_GROUP + lanes..][..super::LANES];
        // SAFETY: 32 bytes each, in bounds (the slices above).
        unsafe {
            V::load_f16(scales.as_ptr()).store(d[lanes..].as_mut_ptr());
            V::load_f16(mins.as_ptr() as *const u8).store(t[lanes..].as_mut_ptr());
        }
    }
    for (t, d) in t.iter_mut().zip(d) {
        *t += shift * d;
    }
    t
}

thread_local! {
    /// A task's offsets computed from a table of minima, for its rows to read ([`epilogue_any`]).
    static EXPANDED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`epilogue`] on any lanes.
///
/// # Safety
/// As [`epilogue`]'s.
#[inline(always)]
unsafe fn epilogue_any<V: Vec16>(ep: Epilogue, y: *mut f32, r0: usize, m: usize, n: usize, col0: usize, cols: usize) {
    const G: usize = super::OFFSET_GROUP;
    if let Some(o) = ep.offsets {
        debug_assert!(col0.is_multiple_of(G) && cols <= G);
        // The task's group of columns: its offsets, block after block, in one run.
        let first = col0 / G * o.blocks * G;
        // The offsets each row reads: a row alone computes a table of minima's as it goes;
        // several rows (a batch, a prompt) read them computed once into this thread's buffer
        // (each row recomputing them had been ~6% of an 8-sequence decode's samples, perf).
        let takes_buffer = m > 1 && matches!(o.table, Table::Mins { .. });
        let mut expanded = match takes_buffer {
            true => EXPANDED.with_borrow_mut(std::mem::take),
            false => Vec::new(),
        };
        let (table, direct) = match o.table {
            Table::Values(table) => (&table[first..first + o.blocks * G], None),
            Table::Mins { mins, shift, w } if m == 1 => (&[][..], Some((mins, shift, w))),
            Table::Mins { mins, shift, w } => {
                // (Loops, not closures: a closure would compile outside the instruction set.)
                expanded.clear();
                for b in 0..o.blocks {
                    expanded.extend_from_slice(&min_offsets::<V>(mins, shift, w, col0, first, b));
                }
                (&expanded[..], None)
            }
        };
        for i in 0..m {
            // SAFETY: the caller's columns of row `i`, in bounds.
            let out = unsafe { std::slice::from_raw_parts_mut(y.add(i * n + col0), cols) };
            let sums = &o.sums[(r0 + i) * o.blocks..(r0 + i + 1) * o.blocks];
            // A task's columns are at most `G`: the blocks' terms summed first, then added (as
            // `y + sums.matmul(table)`).
            let mut acc = [0f32; G];
            match direct {
                Some((mins, shift, w)) => {
                    for (b, &s) in sums.iter().enumerate() {
                        for (a, t) in acc.iter_mut().zip(min_offsets::<V>(mins, shift, w, col0, first, b)) {
                            *a += s * t;
                        }
                    }
                }
                None => {
                    // Whole groups of `G` (the table is padded with zeros past `n`), so that the
                    // sums stay in registers: over the task's `cols` they had gone through the
                    // stack, each block's adds waiting on the last one's stores (perf annotate).
                    let (blocks, _) = table.as_chunks::<G>();
                    for (row, &s) in blocks.iter().zip(sums) {
                        for (a, &t) in acc.iter_mut().zip(row) {
                            *a += s * t;
                        }
                    }
                }
            }
            for (v, a) in out.iter_mut().zip(acc) {
                *v += a;
            }
        }
        if takes_buffer {
            EXPANDED.with_borrow_mut(|buffer| *buffer = expanded);
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
