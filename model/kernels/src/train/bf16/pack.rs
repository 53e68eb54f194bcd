//! The operands of the bf16 products packed as pairs of bf16: the left one as rows
//! ([`Bf16Rows`]), the right one as panels of 16 columns ([`Bf16Panels`]).

use std::mem::MaybeUninit;

use super::*;

/// The left operand `a` `(m, k)` as rows of bf16 pairs, or for the kernels on f32 multiply-adds
/// ([`Bf16Dot::widens_rows`]) as rows of f32, each pair's two values rounded to bf16 and widened
/// back, the high one first.
pub struct Bf16Rows {
    m: usize,
    k: usize,
    /// `m` rows of `kp` pairs, or of `2 * kp` f32 (as bits) when `wide`.
    words: Vec<u32>,
    wide: bool,
}

impl Bf16Rows {
    /// `a` rounded to bf16 for the products on `dot`, in one pass from any layout (a transposed
    /// view is read in blocks of 16 x 16 pairs, so both sides stay in cache).
    pub fn new(a: Operand, dot: Bf16Dot) -> Self {
        let (m, k, wide) = (a.rows, a.cols, dot.widens_rows());
        let row = k.div_ceil(2) * if wide { 2 } else { 1 };
        let len = m * row;
        let mut words: Vec<u32> = Vec::with_capacity(len);
        let out = &mut words.spare_capacity_mut()[..len];
        // Blocks of whole 16-row groups over the pool, each packed as an operand of its own.
        let row = row.max(1);
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
                pack_rows_here(a, out, wide);
            },
        );
        // SAFETY: `PackRows` writes every one of the `len` words.
        unsafe { words.set_len(len) };
        Self { m, k, words, wide }
    }
}

/// Writes pair `v` as the `i`th of `out`'s pairs, or `WIDE`, as its two values widened to f32,
/// the high one first.
#[inline(always)]
fn put<const WIDE: bool>(out: &mut [MaybeUninit<u32>], i: usize, v: u32) {
    if WIDE {
        out[2 * i].write(v & 0xffff_0000);
        out[2 * i + 1].write(v << 16);
    } else {
        out[i].write(v);
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
    /// 16 pairs of one position, [`Bf16Dot::splits_pairs`]' way: their 16 high values, then their
    /// 16 low ones (as bf16, little-endian: the low half of a word first).
    #[inline(always)]
    fn split(pairs: [u32; LANES]) -> [u32; LANES] {
        let half = |t: usize| {
            if t < LANES {
                pairs[t] >> 16
            } else {
                pairs[t - LANES] & 0xffff
            }
        };
        std::array::from_fn(|j| half(2 * j) | half(2 * j + 1) << 16)
    }
    /// `split(interleaved(lo, hi))`.
    #[inline(always)]
    fn split_interleaved(lo: &[f32], hi: &[f32]) -> [u32; LANES] {
        Self::split(Self::interleaved(lo, hi))
    }
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

/// Whether this CPU rounds on `vcvtne2ps2bf16` (AVX512-BF16). Not [`Bf16Dot::detect`]: its
/// timing packs operands, which would wait on itself.
#[cfg(target_arch = "x86_64")]
fn has_cvt() -> bool {
    Bf16Dot::available().contains(&Bf16Dot::Avx512Bf16)
}

/// `a` `(m, k)` into `out` as rows of pairs, on this CPU's fastest rounding.
fn pack_rows_here(a: Operand, out: &mut [MaybeUninit<u32>], wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if has_cvt() {
        // SAFETY: the CPU has AVX512-BF16 (and AVX512F/BW with it).
        unsafe {
            match wide {
                true => x86::pack_rows::<true>(a, out),
                false => x86::pack_rows::<false>(a, out),
            }
        };
        return;
    }
    Simd::detect().run(PackRows { a, out, wide });
}

/// [`pack_rows`] compiled for the instruction set at hand (the plain conversions vectorise).
struct PackRows<'a, 'b> {
    a: Operand<'a>,
    out: &'b mut [MaybeUninit<u32>],
    wide: bool,
}

impl Kernel for PackRows<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        match self.wide {
            true => pack_rows::<Scalar, true>(self.a, self.out),
            false => pack_rows::<Scalar, false>(self.a, self.out),
        }
    }
}

/// [`Bf16Rows::new`]'s packing of `a` into `out`, rounding with `R`: pairs, or `WIDE`, their
/// values widened to f32 ([`put`]).
#[inline(always)]
pub(super) fn pack_rows<R: Round, const WIDE: bool>(a: Operand, out: &mut [MaybeUninit<u32>]) {
    let (m, k) = (a.rows, a.cols);
    let kp = k.div_ceil(2);
    if a.stride.1 == 1 {
        // Rows of adjacent values: each pair from two neighbours, 16 pairs at a time.
        let whole = k / (2 * LANES);
        let row_words = kp * if WIDE { 2 } else { 1 };
        for (r, row) in out.chunks_exact_mut(row_words.max(1)).enumerate().take(m) {
            let src = &a.data[a.offset + r * a.stride.0..][..k];
            for q in 0..whole {
                let pairs = R::adjacent(&src[2 * LANES * q..]);
                for (j, &v) in pairs.iter().enumerate() {
                    put::<WIDE>(row, LANES * q + j, v);
                }
            }
            for p in whole * LANES..kp {
                put::<WIDE>(row, p, pair(src[2 * p], src.get(2 * p + 1).copied().unwrap_or(0.0)));
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
                for (j, pairs) in block.iter().enumerate() {
                    put::<WIDE>(out, (r0 + i) * kp + p0 + j, pairs[i]);
                }
            }
        }
        for r in r0..r0 + LANES {
            for p in whole.1 * LANES..kp {
                put::<WIDE>(out, r * kp + p, pair_at(&a, r, p));
            }
        }
    }
    // What the blocks left: the last rows, any other layout.
    for r in whole.0 * LANES..m {
        for p in 0..kp {
            put::<WIDE>(out, r * kp + p, pair_at(&a, r, p));
        }
    }
}

/// The right operand `B` `(n, k)` of `a @ B^T`, in panels of bf16 pairs (see the module's notes).
pub struct Bf16Panels {
    n: usize,
    k: usize,
    kp: usize,
    /// `n` rounded up to whole tasks, 16 rows a panel; each panel `kp * 16` pairs, or with
    /// [`Bf16Dot::splits_pairs`] `2 * kp` positions of 16 bf16 (each pair's high value, then its
    /// low one).
    pairs: Vec<u32>,
    /// The kernel that takes the products (the layout is its own).
    dot: Bf16Dot,
}

impl Bf16Panels {
    /// `B` rounded to bf16, in one pass from any layout, for the products on `dot`.
    pub fn new(b: Operand, dot: Bf16Dot) -> Self {
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
                pack_panels_here(b, out, dot.splits_pairs());
            },
        );
        // SAFETY: `PackPanels` writes every value of every panel (padding rows as zeros).
        unsafe { pairs.set_len(len) };
        Self { n, k, kp, pairs, dot }
    }

    /// `(n, k)`.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The kernel these panels are packed for (the left operand must be too: [`Bf16Rows::new`]).
    pub fn dot(&self) -> Bf16Dot {
        self.dot
    }

    /// `a @ B^T` `(m, n)` in f32; `a` must have `B`'s `k`.
    pub fn matmul(&self, a: &Bf16Rows) -> candle_core::Result<Vec<f32>> {
        let len = a.m * self.n;
        let mut y: Vec<f32> = Vec::with_capacity(len);
        self.run(a, &mut y.spare_capacity_mut()[..len], false)?;
        // SAFETY: `run` wrote every one of the `m * n` outputs.
        unsafe { y.set_len(len) };
        Ok(y)
    }

    /// `y = a @ B^T` into `y` `(m, n)`, which may start uninitialised (every value is written).
    pub fn matmul_into(&self, a: &Bf16Rows, y: &mut [MaybeUninit<f32>]) -> candle_core::Result<()> {
        self.run(a, y, false)
    }

    /// `y += a @ B^T` for `y` `(m, n)`: each output's chain continues from its value.
    pub fn matmul_add(&self, a: &Bf16Rows, y: &mut [f32]) -> candle_core::Result<()> {
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; every value is initialised and stays so.
        let y = unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) };
        self.run(a, y, true)
    }

    /// The products into `y` `(m, n)`, written, or added to its values with `accumulate`.
    fn run(&self, a: &Bf16Rows, y: &mut [MaybeUninit<f32>], accumulate: bool) -> candle_core::Result<()> {
        let (m, n, kp, dot) = (a.m, self.n, self.kp, self.dot);
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
        if a.wide != dot.widens_rows() {
            candle_core::bail!("bf16 product: a packed for another kernel than {dot:?}")
        }
        // On f32 multiply-adds each pair of `a` is widened to its two f32, the high one (added
        // first) before the low one, so that the tiles broadcast them straight from memory.
        #[cfg(target_arch = "x86_64")]
        if dot == Bf16Dot::Avx512Fma {
            // SAFETY: `u32` and `f32` have one size and alignment; every bit pattern is an f32.
            let values = unsafe { std::slice::from_raw_parts(a.words.as_ptr() as *const f32, a.words.len()) };
            let x = crate::packed::InPlace {
                values,
                ldx: 2 * kp,
                transposed: false,
            };
            // SAFETY: `u32` holds two `u16`; the split panels are `2 * kp` positions of 16.
            let panels = unsafe { std::slice::from_raw_parts(self.pairs.as_ptr() as *const u16, 2 * self.pairs.len()) };
            return crate::packed::matmul_bf16_panels_flushed(panels, (n, 2 * kp), x, m, Simd::Avx512, y, accumulate);
        }
        let (a_at, lda) = (a.words.as_ptr() as usize, if a.wide { 2 * kp } else { kp });
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

/// `b` `(n, k)` into `out` as panels, on this CPU's fastest rounding.
fn pack_panels_here(b: Operand, out: &mut [MaybeUninit<u32>], split: bool) {
    #[cfg(target_arch = "x86_64")]
    if has_cvt() {
        // SAFETY: the CPU has AVX512-BF16 (and AVX512F/BW with it).
        unsafe {
            match split {
                true => x86::pack_panels::<true>(b, out),
                false => x86::pack_panels::<false>(b, out),
            }
        };
        return;
    }
    Simd::detect().run(PackPanels { b, out, split });
}

/// [`pack_panels`] compiled for the instruction set at hand.
struct PackPanels<'a, 'b> {
    b: Operand<'a>,
    out: &'b mut [MaybeUninit<u32>],
    split: bool,
}

impl Kernel for PackPanels<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        match self.split {
            true => pack_panels::<Scalar, true>(self.b, self.out),
            false => pack_panels::<Scalar, false>(self.b, self.out),
        }
    }
}

/// [`Bf16Panels::new`]'s packing of `b` into `out`, rounding with `R`: each position's 16 pairs
/// side by side, or `SPLIT`, their high values, then their low ones ([`Round::split`]).
#[inline(always)]
pub(super) fn pack_panels<R: Round, const SPLIT: bool>(b: Operand, out: &mut [MaybeUninit<u32>]) {
    let (n, k) = (b.rows, b.cols);
    let kp = k.div_ceil(2);
    for (panel, out) in out.chunks_exact_mut((kp * LANES).max(1)).enumerate() {
        let r0 = panel * LANES;
        let full = r0 + LANES <= n;
        let done = if full && b.stride.0 == 1 {
            // A transposed source: the panel's 16 rows are adjacent at every position.
            for p in 0..k / 2 {
                let (lo, hi) = (
                    &b.data[b.offset + r0 + 2 * p * b.stride.1..],
                    &b.data[b.offset + r0 + (2 * p + 1) * b.stride.1..],
                );
                let words = if SPLIT {
                    R::split_interleaved(lo, hi)
                } else {
                    R::interleaved(lo, hi)
                };
                for (o, &v) in out[p * LANES..][..LANES].iter_mut().zip(&words) {
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
                    let pairs: [u32; LANES] = std::array::from_fn(|i| block[i][j]);
                    let words = if SPLIT { R::split(pairs) } else { pairs };
                    for (o, &v) in out[(p0 + j) * LANES..][..LANES].iter_mut().zip(&words) {
                        o.write(v);
                    }
                }
            }
            whole
        } else {
            0
        };
        // What the paths above left: the last pairs, a partial panel, any other layout.
        for p in done..kp {
            let pairs: [u32; LANES] = std::array::from_fn(|lane| {
                let r = r0 + lane;
                if r < n {
                    pair_at(&b, r, p)
                } else {
                    0
                }
            });
            let words = if SPLIT { R::split(pairs) } else { pairs };
            for (o, &v) in out[p * LANES..][..LANES].iter_mut().zip(&words) {
                o.write(v);
            }
        }
    }
}
