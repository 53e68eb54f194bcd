//! The operands of the bf16 products packed as pairs of bf16: the left one as rows
//! ([`Bf16Rows`]), the right one as panels of 16 columns ([`Bf16Panels`]).

use std::mem::MaybeUninit;

use super::*;

/// The left operand `a` `(m, k)` as rows of bf16 pairs.
pub struct Bf16Rows {
    m: usize,
    k: usize,
    pairs: Vec<u32>,
}

impl Bf16Rows {
    /// `a` rounded to bf16, in one pass from any layout (a transposed view is read in blocks of
    /// 16 x 16 pairs, so both sides stay in cache).
    pub fn new(a: Operand) -> Self {
        let (m, k) = (a.rows, a.cols);
        let kp = k.div_ceil(2);
        let mut pairs: Vec<u32> = Vec::with_capacity(m * kp);
        let out = &mut pairs.spare_capacity_mut()[..m * kp];
        // Blocks of whole 16-row groups over the pool, each packed as an operand of its own.
        let row = kp.max(1);
        let rows = crate::parallel::rows_per_chunk(row).next_multiple_of(LANES);
        crate::parallel::chunks_mut(
            out,
            rows * row,
            #[inline(always)]
            |start, out| {
                let a = Operand {
                    offset: a.offset + start / row * a.stride.0,
                    rows: out.len() / row,
                    ..a
                };
                pack_rows_here(a, out);
            },
        );
        // SAFETY: `PackRows` writes every one of the `m * kp` values.
        unsafe { pairs.set_len(m * kp) };
        Self { m, k, pairs }
    }
}

/// Pair `p` of row `r` of the operand, zero past its `k` (an odd `k`'s padding).
#[inline(always)]
fn pair_at(a: &Operand, r: usize, p: usize) -> u32 {
    let at = |c: usize| if c < a.cols { a.at(r, c) } else { 0.0 };
    pair(at(2 * p), at(2 * p + 1))
}

/// How packing rounds 16 pairs at a time: [`Scalar`] in plain Rust that vectorises, or
/// `vcvtne2ps2bf16` where the CPU has it (the same bits: [`to_bf16`]).
pub(super) trait Round {
    /// Pairs `(src[2j], src[2j + 1])` of the first 32 values of `src`.
    fn adjacent(src: &[f32]) -> [u32; LANES];
    /// Pairs `(lo[j], hi[j])` of the first 16 values of each.
    fn interleaved(lo: &[f32], hi: &[f32]) -> [u32; LANES];
}

pub(super) struct Scalar;

impl Round for Scalar {
    #[inline(always)]
    fn adjacent(src: &[f32]) -> [u32; LANES] {
        let src = &src[..2 * LANES];
        std::array::from_fn(|j| pair(src[2 * j], src[2 * j + 1]))
    }

    #[inline(always)]
    fn interleaved(lo: &[f32], hi: &[f32]) -> [u32; LANES] {
        let (lo, hi) = (&lo[..LANES], &hi[..LANES]);
        std::array::from_fn(|j| pair(lo[j], hi[j]))
    }
}

/// `a` `(m, k)` into `out` as rows of pairs, on this CPU's fastest rounding.
fn pack_rows_here(a: Operand, out: &mut [MaybeUninit<u32>]) {
    #[cfg(target_arch = "x86_64")]
    if Bf16Dot::detect() == Bf16Dot::Avx512Bf16 {
        // SAFETY: the CPU has AVX512-BF16 (and AVX512F/BW with it).
        unsafe { x86::pack_rows(a, out) };
        return;
    }
    Simd::detect().run(PackRows { a, out });
}

/// [`pack_rows`] compiled for the instruction set at hand (the plain conversions vectorise).
struct PackRows<'a, 'b> {
    a: Operand<'a>,
    out: &'b mut [MaybeUninit<u32>],
}

impl Kernel for PackRows<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        pack_rows::<Scalar>(self.a, self.out);
    }
}

/// [`Bf16Rows::new`]'s packing of `a` into `out`, rounding with `R`.
#[inline(always)]
pub(super) fn pack_rows<R: Round>(a: Operand, out: &mut [MaybeUninit<u32>]) {
    let (m, k) = (a.rows, a.cols);
    let kp = k.div_ceil(2);
    if a.stride.1 == 1 {
        // Rows of adjacent values: each pair from two neighbours, 16 pairs at a time.
        let whole = k / (2 * LANES);
        for (r, row) in out.chunks_exact_mut(kp.max(1)).enumerate().take(m) {
            let src = &a.data[a.offset + r * a.stride.0..][..k];
            for q in 0..whole {
                let pairs = R::adjacent(&src[2 * LANES * q..]);
                for (o, &v) in row[LANES * q..][..LANES].iter_mut().zip(&pairs) {
                    o.write(v);
                }
            }
            for (p, o) in row.iter_mut().enumerate().skip(whole * LANES) {
                o.write(pair(src[2 * p], src.get(2 * p + 1).copied().unwrap_or(0.0)));
            }
        }
        return;
    }
    let whole = if a.stride.0 == 1 {
        (m / LANES, k / 2 / LANES)
    } else {
        (0, 0)
    };
    // Rows of `a` are columns of the source: 16 rows by 16 pairs at a time, read along the
    // source's rows and written along ours.
    for rb in 0..whole.0 {
        let r0 = rb * LANES;
        for pb in 0..whole.1 {
            let p0 = pb * LANES;
            let block: [[u32; LANES]; LANES] = std::array::from_fn(|j| {
                // [pair][row]
                let c = 2 * (p0 + j);
                R::interleaved(
                    &a.data[a.offset + r0 + c * a.stride.1..],
                    &a.data[a.offset + r0 + (c + 1) * a.stride.1..],
                )
            });
            for i in 0..LANES {
                for (j, o) in out[(r0 + i) * kp + p0..][..LANES].iter_mut().enumerate() {
                    o.write(block[j][i]);
                }
            }
        }
        for r in r0..r0 + LANES {
            for p in whole.1 * LANES..kp {
                out[r * kp + p].write(pair_at(&a, r, p));
            }
        }
    }
    // What the blocks left: the last rows, any other layout.
    for r in whole.0 * LANES..m {
        for p in 0..kp {
            out[r * kp + p].write(pair_at(&a, r, p));
        }
    }
}

/// The right operand `B` `(n, k)` of `a @ B^T`, in panels of bf16 pairs (see the module's notes).
pub struct Bf16Panels {
    n: usize,
    k: usize,
    kp: usize,
    /// `n` rounded up to whole tasks, 16 rows a panel; each panel `kp * 16` pairs.
    pairs: Vec<u32>,
}

impl Bf16Panels {
    /// `B` rounded to bf16, in one pass from any layout.
    pub fn new(b: Operand) -> Self {
        let (n, k) = (b.rows, b.cols);
        let kp = k.div_ceil(2);
        let panels = n.div_ceil(LANES * GROUP) * GROUP;
        let len = panels * kp * LANES;
        let mut pairs: Vec<u32> = Vec::with_capacity(len);
        let out = &mut pairs.spare_capacity_mut()[..len];
        // Panels over the pool, each run of them packed as an operand of its own.
        let panel = (kp * LANES).max(1);
        let per_chunk = (crate::parallel::GRAIN / panel).max(1);
        crate::parallel::chunks_mut(
            out,
            per_chunk * panel,
            #[inline(always)]
            |start, out| {
                let r0 = start / panel * LANES;
                let b = Operand {
                    offset: b.offset + r0 * b.stride.0,
                    rows: n.saturating_sub(r0),
                    ..b
                };
                pack_panels_here(b, out);
            },
        );
        // SAFETY: `PackPanels` writes every value of every panel (padding rows as zeros).
        unsafe { pairs.set_len(len) };
        Self { n, k, kp, pairs }
    }

    /// `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// `a @ B^T` `(m, n)` in f32; `a` must have `B`'s `k`.
    pub fn matmul(&self, a: &Bf16Rows, dot: Bf16Dot) -> candle_core::Result<Vec<f32>> {
        let len = a.m * self.n;
        let mut y: Vec<f32> = Vec::with_capacity(len);
        self.run(a, dot, &mut y.spare_capacity_mut()[..len], false)?;
        // SAFETY: `run` wrote every one of the `m * n` outputs.
        unsafe { y.set_len(len) };
        Ok(y)
    }

    /// `y = a @ B^T` into `y` `(m, n)`, which may start uninitialised (every value is written).
    pub fn matmul_into(&self, a: &Bf16Rows, dot: Bf16Dot, y: &mut [MaybeUninit<f32>]) -> candle_core::Result<()> {
        self.run(a, dot, y, false)
    }

    /// `y += a @ B^T` for `y` `(m, n)`: each output's chain continues from its value.
    pub fn matmul_add(&self, a: &Bf16Rows, dot: Bf16Dot, y: &mut [f32]) -> candle_core::Result<()> {
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; every value is initialised and stays so.
        let y = unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) };
        self.run(a, dot, y, true)
    }

    /// The products into `y` `(m, n)`, written, or added to its values with `accumulate`.
    fn run(&self, a: &Bf16Rows, dot: Bf16Dot, y: &mut [MaybeUninit<f32>], accumulate: bool) -> candle_core::Result<()> {
        let (m, n, kp) = (a.m, self.n, self.kp);
        if a.k != self.k || y.len() != m * n {
            candle_core::bail!(
                "bf16 product: a is ({m}, {}), B ({n}, {}), the output {} values",
                a.k,
                self.k,
                y.len()
            )
        }
        assert!(
            dot == Bf16Dot::Emulated || Bf16Dot::available().contains(&dot),
            "{dot:?} is not available"
        );
        if y.is_empty() {
            return Ok(());
        }
        // On AVX2 each pair of `a` is widened once to its two f32, the high one (added first)
        // before the low one, so that the tiles broadcast them straight from memory.
        let wide;
        let (a_at, lda) = if dot == Bf16Dot::Avx2Fma {
            wide = widen_pairs(&a.pairs);
            (wide.as_ptr() as usize, 2 * kp)
        } else {
            (a.pairs.as_ptr() as usize, kp)
        };
        let blocks = ProductBlocks::new(m, n.div_ceil(LANES * GROUP), kp * LANES * GROUP * 4, lda * 4);
        let (w_at, y_at) = (self.pairs.as_ptr() as usize, y.as_mut_ptr() as usize);
        candle_core::utils::barrier_pool().execute_chunked(blocks.items(), |range| {
            for item in range {
                let (task, r0, rows) = blocks.item(item);
                let col0 = task * LANES * GROUP;
                let t = Task {
                    a: (a_at + r0 * lda * 4) as *const u32,
                    lda,
                    m: rows,
                    kp,
                    w: (w_at + col0 * kp * 4) as *const u32,
                    y: (y_at + (r0 * n + col0) * 4) as *mut f32,
                    ldy: n,
                    cols: (n - col0).min(LANES * GROUP),
                    accumulate,
                };
                // SAFETY: items write disjoint blocks of `y` (rows `r0..r0 + rows` of a task's
                // columns), which holds `m * n` values (initialised where `accumulate` reads
                // them); `a` holds `m * kp` pairs and the task's two panels `2 * kp * 16` (the
                // panels are padded to whole tasks); `dot` is available (asserted above).
                unsafe { t.run(dot) };
            }
        });
        Ok(())
    }
}

/// Each pair `(lo, hi)` of bf16 as the bits of two f32, `hi` first.
fn widen_pairs(pairs: &[u32]) -> Vec<u32> {
    let mut wide = vec![0u32; 2 * pairs.len()];
    crate::parallel::chunks_mut(
        &mut wide,
        crate::parallel::GRAIN,
        #[inline(always)]
        |start, out| {
            for (o, &p) in out.chunks_exact_mut(2).zip(&pairs[start / 2..]) {
                o[0] = p & 0xffff_0000;
                o[1] = p << 16;
            }
        },
    );
    wide
}

/// `b` `(n, k)` into `out` as panels, on this CPU's fastest rounding.
fn pack_panels_here(b: Operand, out: &mut [MaybeUninit<u32>]) {
    #[cfg(target_arch = "x86_64")]
    if Bf16Dot::detect() == Bf16Dot::Avx512Bf16 {
        // SAFETY: the CPU has AVX512-BF16 (and AVX512F/BW with it).
        unsafe { x86::pack_panels(b, out) };
        return;
    }
    Simd::detect().run(PackPanels { b, out });
}

/// [`pack_panels`] compiled for the instruction set at hand.
struct PackPanels<'a, 'b> {
    b: Operand<'a>,
    out: &'b mut [MaybeUninit<u32>],
}

impl Kernel for PackPanels<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        pack_panels::<Scalar>(self.b, self.out);
    }
}

/// [`Bf16Panels::new`]'s packing of `b` into `out`, rounding with `R`.
#[inline(always)]
pub(super) fn pack_panels<R: Round>(b: Operand, out: &mut [MaybeUninit<u32>]) {
    let (n, k) = (b.rows, b.cols);
    let kp = k.div_ceil(2);
    for (panel, out) in out.chunks_exact_mut((kp * LANES).max(1)).enumerate() {
        let r0 = panel * LANES;
        let full = r0 + LANES <= n;
        let done = if full && b.stride.0 == 1 {
            // A transposed source: the panel's 16 rows are adjacent at every position.
            for p in 0..k / 2 {
                let pairs = R::interleaved(
                    &b.data[b.offset + r0 + 2 * p * b.stride.1..],
                    &b.data[b.offset + r0 + (2 * p + 1) * b.stride.1..],
                );
                for (o, &v) in out[p * LANES..][..LANES].iter_mut().zip(&pairs) {
                    o.write(v);
                }
            }
            k / 2
        } else if full && b.stride.1 == 1 {
            // Rows of adjacent values: 16 rows by 16 pairs at a time, read along the rows and
            // written across them.
            let whole = k / 2 / LANES * LANES;
            for p0 in (0..whole).step_by(LANES) {
                let block: [[u32; LANES]; LANES] = std::array::from_fn(|i| {
                    // [row][pair]
                    R::adjacent(&b.data[b.offset + (r0 + i) * b.stride.0 + 2 * p0..])
                });
                for j in 0..LANES {
                    for (i, o) in out[(p0 + j) * LANES..][..LANES].iter_mut().enumerate() {
                        o.write(block[i][j]);
                    }
                }
            }
            whole
        } else {
            0
        };
        // What the paths above left: the last pairs, a partial panel, any other layout.
        for p in done..kp {
            for lane in 0..LANES {
                let r = r0 + lane;
                out[p * LANES + lane].write(if r < n { pair_at(&b, r, p) } else { 0 });
            }
        }
    }
}
