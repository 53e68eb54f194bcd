//! bf16 products for mixed-precision training on the CPU: `a @ B^T` with both operands rounded
//! to bf16 (to nearest, ties to even) and the products summed in f32, pair by pair: what
//! `torch.autocast(dtype=torch.bfloat16)` asks of a matrix product. On CPUs with AVX512-BF16
//! (AMD Zen 4 and later; Intel Cooper Lake, Sapphire Rapids and later) one `vdpbf16ps` takes 32
//! such products, twice the rate of f32 fused multiply-adds (224 against 116 GFLOP/s a core on
//! this project's EPYC). Elsewhere the same arithmetic runs in plain Rust ([`Bf16Dot::Emulated`])
//! as the instruction defines it, so a run gives the same bits on every CPU (the tests check the
//! emulation against the hardware, bit for bit).
//!
//! The instruction, per output lane: `acc += a[2p+1]·b[2p+1]`, rounded, then `acc += a[2p]·b[2p]`,
//! rounded (to nearest even); bf16 inputs that are subnormal read as zero, and a subnormal result
//! is flushed to zero. Each product of two bf16 values is exact in f32 (8-bit significands).
//!
//! Layout: `a` `(m, k)` as rows of bf16 pairs (a `u32`: position `2p` in the low half, `2p + 1` in
//! the high; an odd `k` padded with a zero); `B` `(n, k)` in panels of 16 rows, each pair position
//! holding its 16 rows' pairs side by side (64 bytes, one register), `n` padded with zero rows to
//! whole tasks of two panels. The kernel: a tile of up to 12 rows of `a` times two panels (24
//! accumulators), at each position one broadcast per row and one register per panel. Every output
//! is one chain along `k` in one order, whatever the tile, the rows or the threads: repeatable,
//! and the same for a row alone or in a batch.

use std::mem::MaybeUninit;

use crate::parallel::ProductBlocks;
use crate::simd::{Kernel, Simd, Vec16};
use crate::train::product::Operand;

/// Output columns per panel.
const LANES: usize = 16;
/// Panels per task and per tile.
const GROUP: usize = 2;
/// Rows of `a` per register tile.
const ROWS: usize = 12;

/// How the bf16 pair products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Dot {
    /// `vdpbf16ps` on AVX-512 registers.
    Avx512Bf16,
    /// Plain Rust, as the instruction defines it: any CPU, the same bits.
    Emulated,
}

impl Bf16Dot {
    /// The fastest this CPU runs (detected once).
    pub fn detect() -> Self {
        Self::available()[0]
    }

    /// Every one this CPU runs, fastest first.
    pub fn available() -> &'static [Self] {
        static AVAILABLE: std::sync::OnceLock<Vec<Bf16Dot>> = std::sync::OnceLock::new();
        AVAILABLE.get_or_init(|| {
            let mut out = Vec::new();
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512bf16")
            {
                out.push(Bf16Dot::Avx512Bf16);
            }
            out.push(Bf16Dot::Emulated);
            out
        })
    }
}

/// `x` rounded to bf16 (to nearest, ties to even), as bits, as `vcvtne2ps2bf16` rounds: a NaN
/// stays a (quiet) NaN, and a subnormal `x` reads as zero (measured on Zen 4: `0x007fffff`
/// gives `0x0000`, where rounding alone gives the smallest normal bf16). Written without
/// branches so that packing loops vectorise.
#[inline(always)]
pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let b = if b & 0x7f80_0000 == 0 { b & 0x8000_0000 } else { b };
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    (if nan { (b >> 16) | 0x40 } else { rounded }) as u16
}

/// A bf16 value as the instruction reads it: subnormals as zero.
#[inline(always)]
fn widen(bits: u16) -> f32 {
    let v = f32::from_bits((bits as u32) << 16);
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

#[inline(always)]
fn flush(v: f32) -> f32 {
    if v.is_subnormal() {
        0.0f32.copysign(v)
    } else {
        v
    }
}

#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    to_bf16(lo) as u32 | (to_bf16(hi) as u32) << 16
}

/// `acc` after one pair of products, as `vdpbf16ps` computes one lane.
#[inline(always)]
fn dot_pair(acc: f32, a: u32, b: u32) -> f32 {
    let hi = flush(acc + widen((a >> 16) as u16) * widen((b >> 16) as u16));
    flush(hi + widen(a as u16) * widen(b as u16))
}

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
trait Round {
    /// Pairs `(src[2j], src[2j + 1])` of the first 32 values of `src`.
    fn adjacent(src: &[f32]) -> [u32; LANES];
    /// Pairs `(lo[j], hi[j])` of the first 16 values of each.
    fn interleaved(lo: &[f32], hi: &[f32]) -> [u32; LANES];
}

struct Scalar;

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
fn pack_rows<R: Round>(a: Operand, out: &mut [MaybeUninit<u32>]) {
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
        let blocks = ProductBlocks::new(m, n.div_ceil(LANES * GROUP), kp * LANES * GROUP * 4, kp * 4);
        let (a_at, w_at, y_at) = (
            a.pairs.as_ptr() as usize,
            self.pairs.as_ptr() as usize,
            y.as_mut_ptr() as usize,
        );
        candle_core::utils::barrier_pool().execute_chunked(blocks.items(), |range| {
            for item in range {
                let (task, r0, rows) = blocks.item(item);
                let col0 = task * LANES * GROUP;
                let t = Task {
                    a: (a_at + r0 * kp * 4) as *const u32,
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
fn pack_panels<R: Round>(b: Operand, out: &mut [MaybeUninit<u32>]) {
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

/// `a @ B^T` for operands read in place, rounded to bf16: `(a.rows, b.rows)` in f32.
pub fn product(a: Operand, b: Operand, dot: Bf16Dot) -> candle_core::Result<Vec<f32>> {
    Bf16Panels::new(b).matmul(&Bf16Rows::new(a), dot)
}

/// All rows of `a` times two panels (output columns `col0..col0 + cols`).
struct Task {
    a: *const u32,
    m: usize,
    kp: usize,
    /// The first of the task's two panels; the second follows at `kp * 16` pairs.
    w: *const u32,
    /// Row 0, column `col0` of the output.
    y: *mut f32,
    ldy: usize,
    cols: usize,
    /// Start each chain from the output's value instead of zero.
    accumulate: bool,
}

impl Task {
    /// # Safety
    /// As [`Bf16Panels::matmul`] builds it: the task's operands valid, its columns its own; `dot`
    /// available.
    unsafe fn run(&self, dot: Bf16Dot) {
        // Tiles of (nearly) equal height: 16 rows as 8 + 8, not 12 + 4.
        let tiles = self.m.div_ceil(ROWS);
        let (height, taller) = (self.m / tiles, self.m % tiles);
        let mut r0 = 0;
        for tile in 0..tiles {
            let rows = height + usize::from(tile < taller);
            // SAFETY: rows `r0..r0 + rows` of `a` and `y`, within the caller's contract.
            unsafe {
                let a = self.a.add(r0 * self.kp);
                let y = self.y.add(r0 * self.ldy);
                match dot {
                    #[cfg(target_arch = "x86_64")]
                    Bf16Dot::Avx512Bf16 => x86::tile_rows(a, rows, self, y),
                    _ => tile_emulated(a, rows, self, y),
                }
            }
            r0 += rows;
        }
    }
}

/// The first `cols` values at `y` (zeros after them), or zeros without `accumulate`.
///
/// # Safety
/// `y` valid for reading `cols` (at most 32) values when `accumulate`.
#[inline(always)]
unsafe fn start_cols(y: *const f32, cols: usize, accumulate: bool) -> [f32; LANES * GROUP] {
    let mut acc = [0f32; LANES * GROUP];
    if accumulate {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(y, acc.as_mut_ptr(), cols) };
    }
    acc
}

/// Writes the first `cols` of `acc` to `y`.
///
/// # Safety
/// `y` valid for `cols` (at most 32) values.
#[inline(always)]
unsafe fn store_cols(acc: &[f32; LANES * GROUP], y: *mut f32, cols: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), y, cols) };
}

/// [`Bf16Dot::Emulated`]'s tile: `rows` rows from `a`, both panels, every position.
///
/// # Safety
/// As [`Task::run`].
unsafe fn tile_emulated(a: *const u32, rows: usize, t: &Task, y: *mut f32) {
    let kp = t.kp;
    // SAFETY: the task's panels hold `2 * kp * 16` pairs.
    let w = unsafe { std::slice::from_raw_parts(t.w, GROUP * kp * LANES) };
    for i in 0..rows {
        // SAFETY: row `i` of the tile holds `kp` pairs.
        let row = unsafe { std::slice::from_raw_parts(a.add(i * kp), kp) };
        // SAFETY: row `i` of the task's columns.
        let mut acc = unsafe { start_cols(y.add(i * t.ldy), t.cols, t.accumulate) };
        for (j, acc) in acc.chunks_exact_mut(LANES).enumerate() {
            let panel = &w[j * kp * LANES..(j + 1) * kp * LANES];
            for (&x, lanes) in row.iter().zip(panel.chunks_exact(LANES)) {
                for (s, &v) in acc.iter_mut().zip(lanes) {
                    *s = dot_pair(*s, x, v);
                }
            }
        }
        // SAFETY: row `i` of the task's columns.
        unsafe { store_cols(&acc, y.add(i * t.ldy), t.cols) };
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{start_cols, store_cols, Operand, Round, Task, GROUP, LANES};
    use std::mem::MaybeUninit;

    /// Rounding on `vcvtne2ps2bf16`, 32 values an instruction.
    struct Cvt;

    impl Round for Cvt {
        #[inline(always)]
        fn adjacent(src: &[f32]) -> [u32; LANES] {
            let src = &src[..2 * LANES];
            // SAFETY: 32 values; the callers' functions enable AVX512-BF16.
            unsafe {
                let (lo, hi) = (_mm512_loadu_ps(src.as_ptr()), _mm512_loadu_ps(src.as_ptr().add(LANES)));
                // bf16 values 0..16 from `lo`, 16..32 from `hi`: in memory order, pairs of
                // neighbours.
                std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo))
            }
        }

        #[inline(always)]
        fn interleaved(lo: &[f32], hi: &[f32]) -> [u32; LANES] {
            let (lo, hi) = (&lo[..LANES], &hi[..LANES]);
            // SAFETY: 16 values each; the callers' functions enable AVX512-BF16 and AVX512BW.
            unsafe {
                let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(hi.as_ptr()),
                    _mm512_loadu_ps(lo.as_ptr()),
                ));
                // Words 0..16 are `lo`'s, 16..32 `hi`'s: pair j is words j and 16 + j.
                let order = _mm512_set_epi16(
                    31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                    18, 2, 17, 1, 16, 0,
                );
                std::mem::transmute(_mm512_permutexvar_epi16(order, both))
            }
        }
    }

    /// [`super::pack_rows`] on `vcvtne2ps2bf16`.
    ///
    /// # Safety
    /// AVX512-BF16 available.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(crate) unsafe fn pack_rows(a: Operand, out: &mut [MaybeUninit<u32>]) {
        super::pack_rows::<Cvt>(a, out)
    }

    /// [`super::pack_panels`] on `vcvtne2ps2bf16`.
    ///
    /// # Safety
    /// AVX512-BF16 available.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(crate) unsafe fn pack_panels(b: Operand, out: &mut [MaybeUninit<u32>]) {
        super::pack_panels::<Cvt>(b, out)
    }

    /// [`Bf16Dot::Avx512Bf16`](super::Bf16Dot)'s tile of `rows` (1 to 12) rows.
    ///
    /// # Safety
    /// As [`Task::run`]; AVX512-BF16 available.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(crate) unsafe fn tile_rows(a: *const u32, rows: usize, t: &Task, y: *mut f32) {
        // SAFETY: the caller's contract, for the rows given.
        unsafe {
            match rows {
                12 => tile::<12>(a, t, y),
                11 => tile::<11>(a, t, y),
                10 => tile::<10>(a, t, y),
                9 => tile::<9>(a, t, y),
                8 => tile::<8>(a, t, y),
                7 => tile::<7>(a, t, y),
                6 => tile::<6>(a, t, y),
                5 => tile::<5>(a, t, y),
                4 => tile::<4>(a, t, y),
                3 => tile::<3>(a, t, y),
                2 => tile::<2>(a, t, y),
                _ => tile::<1>(a, t, y),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    #[allow(clippy::needless_range_loop)] // acc[i][j] reads as the formula
    unsafe fn tile<const R: usize>(a: *const u32, t: &Task, y: *mut f32) {
        let kp = t.kp;
        let mut acc = [[_mm512_setzero_ps(); GROUP]; R];
        // SAFETY: the caller's contract: `R` rows of `kp` pairs at `a`, two panels of `kp * 16`
        // pairs at `t.w`, `R` rows of the task's columns at `y`.
        unsafe {
            if t.accumulate {
                for i in 0..R {
                    let row = y.add(i * t.ldy);
                    acc[i] = if t.cols == LANES * GROUP {
                        // Straight from `y` (through a copy, a call per row: 7% of a GPT-2 step
                        // in bf16, the LM head's weight gradient summed over chunks of rows).
                        [_mm512_loadu_ps(row), _mm512_loadu_ps(row.add(LANES))]
                    } else {
                        let start = start_cols(row, t.cols, true);
                        [
                            _mm512_loadu_ps(start.as_ptr()),
                            _mm512_loadu_ps(start.as_ptr().add(LANES)),
                        ]
                    };
                }
            }
            for p in 0..kp {
                let w0: __m512bh = std::mem::transmute(_mm512_loadu_si512(t.w.add(p * LANES) as *const _));
                let w1: __m512bh = std::mem::transmute(_mm512_loadu_si512(t.w.add((kp + p) * LANES) as *const _));
                for i in 0..R {
                    let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(i * kp + p) as i32));
                    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, w0);
                    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, w1);
                }
            }
            for i in 0..R {
                let out = y.add(i * t.ldy);
                if t.cols == LANES * GROUP {
                    _mm512_storeu_ps(out, acc[i][0]);
                    _mm512_storeu_ps(out.add(LANES), acc[i][1]);
                } else {
                    let mut tmp = [0f32; LANES * GROUP];
                    _mm512_storeu_ps(tmp.as_mut_ptr(), acc[i][0]);
                    _mm512_storeu_ps(tmp.as_mut_ptr().add(LANES), acc[i][1]);
                    store_cols(&tmp, out, t.cols);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn rounding_is_to_nearest_even_and_keeps_nan() {
        for x in [
            1.0f32,
            -2.5,
            std::f32::consts::PI,
            1e-30,
            65504.0,
            f32::INFINITY,
            f32::MIN_POSITIVE,
        ] {
            assert_eq!(to_bf16(x), half::bf16::from_f32(x).to_bits(), "{x}");
        }
        // Ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 and goes to the even one (1).
        assert_eq!(to_bf16(1.0 + 1.0 / 256.0), to_bf16(1.0));
        assert_eq!(to_bf16(1.0 + 3.0 / 256.0), to_bf16(1.0 + 4.0 / 256.0));
        assert!(f32::from_bits((to_bf16(f32::NAN) as u32) << 16).is_nan());
        // Subnormals read as zero, keeping their sign, as the instruction reads them.
        assert_eq!(to_bf16(f32::from_bits(0x007f_ffff)), 0);
        assert_eq!(to_bf16(f32::from_bits(0x807f_8000)), 0x8000);
    }

    /// Packing on `vcvtne2ps2bf16` gives the bits of the plain rounding, for both operands in
    /// every layout, with values that round every way: ties, NaNs, infinities, subnormals,
    /// values that round up to infinity.
    #[test]
    fn packing_on_the_instruction_gives_the_plain_roundings_bits() {
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::from_bits(0x007f_ffff),
            f32::from_bits(0x8000_0001),
            f32::MIN_POSITIVE,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -0.0,
        ];
        if !Bf16Dot::available().contains(&Bf16Dot::Avx512Bf16) {
            return;
        }
        for &(m, k) in &[(16, 32), (35, 70), (40, 129), (17, 1), (64, 96)] {
            let mut x = random(m * k, 3);
            for (i, v) in x.iter_mut().enumerate().filter(|(i, _)| i % 7 == 0) {
                *v = specials[i / 7 % specials.len()];
            }
            let xt = transpose(&x, m, k);
            for a in [Operand::rows(&x, m, k), Operand::columns(&xt, m, k)] {
                let kp = k.div_ceil(2);
                let pack = |f: &dyn Fn(&mut [MaybeUninit<u32>]), len: usize| {
                    let mut out = vec![MaybeUninit::new(0xdead_beef_u32); len];
                    f(&mut out);
                    // SAFETY: initialised above.
                    out.iter().map(|v| unsafe { v.assume_init() }).collect::<Vec<u32>>()
                };
                let plain = pack(&|out| pack_rows::<Scalar>(a, out), m * kp);
                // SAFETY: the CPU has AVX512-BF16 (checked above).
                let fast = pack(&|out| unsafe { x86::pack_rows(a, out) }, m * kp);
                assert_eq!(plain, fast, "rows ({m}, {k}) stride {:?}", a.stride);
                let len = m.div_ceil(LANES * GROUP) * GROUP * kp * LANES;
                let plain = pack(&|out| pack_panels::<Scalar>(a, out), len);
                // SAFETY: as above.
                let fast = pack(&|out| unsafe { x86::pack_panels(a, out) }, len);
                assert_eq!(plain, fast, "panels ({m}, {k}) stride {:?}", a.stride);
            }
        }
    }

    /// Every layout and shape, every kernel this CPU runs: the emulation's bits (which are the
    /// instruction's), and within bf16's bound of the exact product of the unrounded operands.
    /// The last shape spans several blocks of rows and of columns ([`ProductBlocks`]: one task
    /// a column block, 24 rows a row block, the last one 4).
    #[test]
    fn products_match_the_definition_on_every_kernel_and_layout() {
        let blocked = (100, 4096, 70);
        let kp = blocked.1 / 2;
        let b = ProductBlocks::new(blocked.0, 3, kp * LANES * GROUP * 4, kp * 4);
        assert_eq!(b.shape(), (1, 24, 5));
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 7, 5),
            (13, 64, 33),
            (30, 129, 70),
            (25, 256, 32),
            blocked,
        ] {
            let a = random(m * k, 1);
            let b = random(n * k, 2);
            let (at, bt) = (transpose(&a, m, k), transpose(&b, n, k));
            let want = product(Operand::rows(&a, m, k), Operand::rows(&b, n, k), Bf16Dot::Emulated).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let (exact, size) = (0..k).fold((0f64, 0f64), |(s, z), c| {
                        let (x, w) = (a[i * k + c] as f64, b[j * k + c] as f64);
                        (s + x * w, z + (x * w).abs())
                    });
                    let got = want[i * n + j] as f64;
                    assert!(
                        (got - exact).abs() <= size / 128.0 + 1e-6,
                        "({m},{k},{n})[{i},{j}]: {got} vs {exact}"
                    );
                }
            }
            for &dot in Bf16Dot::available() {
                for (ao, bo) in [
                    (Operand::rows(&a, m, k), Operand::rows(&b, n, k)),
                    (Operand::columns(&at, m, k), Operand::columns(&bt, n, k)),
                    (Operand::rows(&a, m, k), Operand::columns(&bt, n, k)),
                ] {
                    let got = product(ao, bo, dot).unwrap();
                    assert!(
                        got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{dot:?} ({m},{k},{n}) differs from the definition"
                    );
                }
                // A row's outputs do not depend on the rows beside it.
                let alone = product(Operand::rows(&a[..k], 1, k), Operand::rows(&b, n, k), dot).unwrap();
                assert_eq!(alone, want[..n].to_vec(), "{dot:?}: batch invariance");
            }
        }
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols)
            .flat_map(|c| (0..rows).map(move |r| x[r * cols + c]))
            .collect()
    }
}
