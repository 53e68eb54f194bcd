//! bf16 products for mixed-precision training on the CPU: `a @ B^T` with both operands rounded
//! to bf16 (to nearest, ties to even) and the products summed in f32, pair by pair: what
//! `torch.autocast(dtype=torch.bfloat16)` asks of a matrix product. On CPUs with AVX512-BF16
//! (AMD Zen 4 and later; Intel Cooper Lake, Sapphire Rapids and later) one `vdpbf16ps` takes 32
//! such products, twice the rate of f32 fused multiply-adds on AMD Zen 4 (224 against 116 GFLOP/s
//! a core on this project's EPYC) but half of it on Intel Emerald Rapids (70-83 against 120-157).
//! Elsewhere, and where it is slower, the same arithmetic runs as the instruction defines it, so a
//! run gives the same bits on every CPU: as f32 fused multiply-adds of the pairs widened to f32
//! under the instruction's DAZ and FTZ, on the f32 packed kernel with AVX-512
//! ([`Bf16Dot::Avx512Fma`]) or on AVX2 tiles ([`Bf16Dot::Avx2Fma`]), else in plain Rust
//! ([`Bf16Dot::Emulated`]); [`Bf16Dot::detect`] times the two AVX-512 kinds once. The tests check
//! each against the plain Rust, bit for bit: the instruction on normal values, the others below
//! f32's normal range too.
//!
//! The instruction, per output lane (Intel's definition: "FP32 FMA with DAZ in, FTZ out and RNE
//! rounding"): `acc = fma(a[2p+1], b[2p+1], acc)`, then `acc = fma(a[2p], b[2p], acc)`, each
//! rounded once (to nearest even); inputs that are subnormal read as zero, and a subnormal result
//! is flushed to zero. Each product of two bf16 values is exact in f32 (8-bit significands) unless
//! it falls below f32's normal range, so the fused and the unfused sums differ only there.
//!
//! Layout: `a` `(m, k)` as rows of bf16 pairs (a `u32`: position `2p` in the low half, `2p + 1` in
//! the high; an odd `k` padded with a zero); `B` `(n, k)` in panels of 16 rows, each pair position
//! holding its 16 rows' pairs side by side (64 bytes, one register), `n` padded with zero rows to
//! whole tasks of two panels. The kernel: a tile of up to 12 rows of `a` times two panels (24
//! accumulators), at each position one broadcast per row and one register per panel. Every output
//! is one chain along `k` in one order, whatever the tile, the rows or the threads: repeatable,
//! and the same for a row alone or in a batch. For the kernels on f32 multiply-adds, `a`'s rows
//! hold each pair as two f32, the high one first; [`Bf16Dot::Avx512Fma`]'s panels hold at each
//! pair position its 16 high values, then its 16 low ones: the f32 packed kernel's bf16 panels,
//! with the positions in the instruction's order.

use crate::parallel::ProductBlocks;
use crate::simd::{Kernel, Simd, Vec16};
use crate::train::operand::Operand;

mod pack;
use pack::{pack_panels, pack_rows, Round};
pub use pack::{Bf16Panels, Bf16Rows};

/// Output columns per panel.
const LANES: usize = 16;
/// Panels per task and per tile.
const GROUP: usize = 2;
/// Rows of `a` per register tile on AVX-512 (24 accumulators of 32).
const ROWS: usize = 12;
/// Rows of `a` per register tile on AVX2, each against one panel (8 accumulators of 16).
const ROWS_AVX2: usize = 4;

/// How the bf16 pair products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Dot {
    /// `vdpbf16ps` on AVX-512 registers.
    Avx512Bf16,
    /// The f32 packed kernel ([`crate::packed`]) on AVX-512, under MXCSR's DAZ and FTZ: `a`'s
    /// pairs widened to f32 once, `B` packed as bf16 panels that the kernel widens a chunk at a
    /// time for all its row tiles, each pair's high value at the position before its low one.
    /// The instruction's bits at the rate of f32 products, where `vdpbf16ps` runs at half of
    /// it (Intel Emerald Rapids: 70-83 against 120-157 GFLOP/s a core).
    Avx512Fma,
    /// `vfmadd` on AVX2 registers, each pair widened to two f32, with MXCSR's DAZ and FTZ set for
    /// the kernel: the instruction's bits at the rate of f32 products (AVX2 and FMA).
    Avx2Fma,
    /// Plain Rust, as the instruction defines it: any CPU, the same bits.
    Emulated,
}

impl Bf16Dot {
    /// The fastest this CPU runs, measured once: where it has both AVX-512 kinds, whichever
    /// takes a product of training's size sooner (`vdpbf16ps` doubles f32's rate on AMD Zen 4
    /// and halves it on Intel Emerald Rapids); else the first [`Self::available`]. Every kind
    /// gives the same bits, so the pick changes only the time. `GPT_BF16_DOT` ([`Self::from_env`])
    /// overrides it.
    pub fn detect() -> Self {
        static FASTEST: std::sync::OnceLock<Bf16Dot> = std::sync::OnceLock::new();
        *FASTEST.get_or_init(|| {
            if let Ok(Some(named)) = Self::from_env() {
                return named;
            }
            let avx512 = [Bf16Dot::Avx512Bf16, Bf16Dot::Avx512Fma];
            if avx512.iter().all(|d| Self::available().contains(d)) {
                fastest(&avx512)
            } else {
                Self::available()[0]
            }
        })
    }

    /// The kind the environment's `GPT_BF16_DOT` names (`Avx512Bf16`, `Avx512Fma`, `Avx2Fma` or
    /// `Emulated`), if it is set; an error that lists this CPU's kinds if it names none of them.
    pub fn from_env() -> Result<Option<Self>, String> {
        let Ok(name) = std::env::var("GPT_BF16_DOT") else {
            return Ok(None);
        };
        match Self::available().iter().find(|d| format!("{d:?}") == name) {
            Some(&dot) => Ok(Some(dot)),
            None => Err(format!(
                "GPT_BF16_DOT={name}: this CPU runs the bf16 products as one of {:?}",
                Self::available()
            )),
        }
    }

    /// Every one this CPU runs, widest first.
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
            #[cfg(target_arch = "x86_64")]
            if Simd::Avx512.is_available() {
                out.push(Bf16Dot::Avx512Fma);
            }
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                out.push(Bf16Dot::Avx2Fma);
            }
            out.push(Bf16Dot::Emulated);
            out
        })
    }

    /// Rows of `a` in one register tile.
    fn tile_rows(self) -> usize {
        match self {
            Bf16Dot::Avx2Fma => ROWS_AVX2,
            _ => ROWS,
        }
    }

    /// Whether `B` is packed as positions of 16 bf16 (each pair's high value, then its low one:
    /// the f32 kernel's layout), rather than as 16 pairs.
    fn splits_pairs(self) -> bool {
        self == Bf16Dot::Avx512Fma
    }

    /// Whether `a` is packed as rows of f32 (each pair's two values widened, the high one
    /// first), which the kernels on f32 multiply-adds broadcast from memory.
    fn widens_rows(self) -> bool {
        matches!(self, Bf16Dot::Avx512Fma | Bf16Dot::Avx2Fma)
    }
}

/// Whichever of `dots` takes a product of training's size (256 x 512 by 512 x 512, both
/// operands packed) soonest, each timed at its best of three, alternating.
fn fastest(dots: &[Bf16Dot]) -> Bf16Dot {
    let (m, k, n) = (256, 512, 512);
    let values = |len: usize| {
        (0..len)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 512.0)
            .collect::<Vec<_>>()
    };
    let (a, b) = (values(m * k), values(n * k));
    let mut best = vec![std::time::Duration::MAX; dots.len()];
    for _ in 0..3 {
        for (best, &dot) in best.iter_mut().zip(dots) {
            let start = std::time::Instant::now();
            let y = product(Operand::rows(&a, m, k), Operand::rows(&b, n, k), dot);
            *best = (*best).min(start.elapsed());
            std::hint::black_box(y.ok());
        }
    }
    let at = (0..dots.len()).min_by_key(|&i| best[i]).unwrap_or(0);
    dots[at]
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
    let hi = flush(widen((a >> 16) as u16).mul_add(widen((b >> 16) as u16), flush(acc)));
    flush(widen(a as u16).mul_add(widen(b as u16), hi))
}

/// `a @ B^T` for operands read in place, rounded to bf16: `(a.rows, b.rows)` in f32.
pub fn product(a: Operand, b: Operand, dot: Bf16Dot) -> candle_core::Result<Vec<f32>> {
    Bf16Panels::new(b, dot).matmul(&Bf16Rows::new(a, dot))
}

/// All rows of `a` times two panels (output columns `col0..col0 + cols`).
struct Task {
    a: *const u32,
    /// Words from one row of `a` to the next: `kp` pairs, or `2 * kp` widened to f32 (AVX2).
    lda: usize,
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
        let tiles = self.m.div_ceil(dot.tile_rows());
        let (height, taller) = (self.m / tiles, self.m % tiles);
        #[cfg(target_arch = "x86_64")]
        let _flush = (dot == Bf16Dot::Avx2Fma).then(crate::simd::FlushSubnormals::new);
        let mut r0 = 0;
        for tile in 0..tiles {
            let rows = height + usize::from(tile < taller);
            // SAFETY: rows `r0..r0 + rows` of `a` and `y`, within the caller's contract.
            unsafe {
                let a = self.a.add(r0 * self.lda);
                let y = self.y.add(r0 * self.ldy);
                match dot {
                    #[cfg(target_arch = "x86_64")]
                    Bf16Dot::Avx512Bf16 => x86::tile_rows(a, rows, self, y),
                    #[cfg(target_arch = "x86_64")]
                    Bf16Dot::Avx2Fma => x86::tile_rows_avx2(a, rows, self, y),
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
mod x86;

#[cfg(test)]
mod tests {
    use super::pack::Scalar;
    use super::*;
    use std::mem::MaybeUninit;

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
    /// every source layout and both packed ones (pairs; widened rows and split panels), with
    /// values that round every way: ties, NaNs, infinities, subnormals, values that round up to
    /// infinity.
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
                let plain = pack(&|out| pack_rows::<Scalar, false>(a, out), m * kp);
                // SAFETY: the CPU has AVX512-BF16 (checked above).
                let fast = pack(&|out| unsafe { x86::pack_rows::<false>(a, out) }, m * kp);
                assert_eq!(plain, fast, "rows ({m}, {k}) stride {:?}", a.stride);
                let plain = pack(&|out| pack_rows::<Scalar, true>(a, out), 2 * m * kp);
                // SAFETY: as above.
                let fast = pack(&|out| unsafe { x86::pack_rows::<true>(a, out) }, 2 * m * kp);
                assert_eq!(plain, fast, "widened rows ({m}, {k}) stride {:?}", a.stride);
                let len = m.div_ceil(LANES * GROUP) * GROUP * kp * LANES;
                let plain = pack(&|out| pack_panels::<Scalar, false>(a, out), len);
                // SAFETY: as above.
                let fast = pack(&|out| unsafe { x86::pack_panels::<false>(a, out) }, len);
                assert_eq!(plain, fast, "panels ({m}, {k}) stride {:?}", a.stride);
                let plain = pack(&|out| pack_panels::<Scalar, true>(a, out), len);
                // SAFETY: as above.
                let fast = pack(&|out| unsafe { x86::pack_panels::<true>(a, out) }, len);
                assert_eq!(plain, fast, "split panels ({m}, {k}) stride {:?}", a.stride);
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

    /// Values whose products and sums fall below f32's normal range, where the instruction's
    /// DAZ and FTZ decide the bits: the AVX2 kernel gives the emulation's bits, for a product and
    /// for one that continues from subnormal outputs. The case is not vacuous: the same chains
    /// without the flushes give other bits. (`vdpbf16ps` itself is left out: whether the
    /// hardware follows Intel's definition this far below the normal range has not been
    /// checked on a CPU that has it, and the tests above compare it on normal values only.)
    #[test]
    fn products_below_the_normal_range_flush_as_the_instruction_does() {
        let (m, k, n) = (5, 37, 40);
        let scale = |v: Vec<f32>, s: i32| v.into_iter().map(|x| x * 2f32.powi(s)).collect::<Vec<_>>();
        let (a, b) = (scale(random(m * k, 7), -60), scale(random(n * k, 8), -66));
        let start: Vec<f32> = (0..m * n)
            .map(|i| f32::from_bits(i as u32 * 0x0001_3579 % 0x0080_0000) * if i % 3 == 0 { -1.0 } else { 1.0 })
            .collect();
        let run = |dot| {
            let ra = Bf16Rows::new(Operand::rows(&a, m, k), dot);
            let pb = Bf16Panels::new(Operand::rows(&b, n, k), dot);
            let mut y = start.clone();
            pb.matmul_add(&ra, &mut y).unwrap();
            (pb.matmul(&ra).unwrap(), y)
        };
        let want = run(Bf16Dot::Emulated);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for &dot in Bf16Dot::available().iter().filter(|&&d| d != Bf16Dot::Avx512Bf16) {
            let got = run(dot);
            assert_eq!(bits(&got.0), bits(&want.0), "{dot:?}: product");
            assert_eq!(bits(&got.1), bits(&want.1), "{dot:?}: continued from subnormals");
        }
        // The same chains with subnormals kept.
        let kept: Vec<f32> = (0..m * n)
            .map(|o| {
                let (i, j) = (o / n, o % n);
                let r = |x: f32| f32::from_bits((to_bf16(x) as u32) << 16);
                let mut acc = 0f32;
                for p in (0..k).step_by(2) {
                    for c in [p + 1, p].into_iter().filter(|&c| c < k) {
                        acc = r(a[i * k + c]).mul_add(r(b[j * k + c]), acc);
                    }
                }
                acc
            })
            .collect();
        assert!(
            kept.iter().any(|x| x.is_subnormal()),
            "no subnormal sums: the case tests nothing"
        );
        assert_ne!(bits(&kept), bits(&want.0));
        assert!(want.0.iter().chain(&want.1).all(|x| !x.is_subnormal()));
        // The pool's threads are back in IEEE mode: f32 products keep their subnormals.
        let f32s = crate::train::product::product(Operand::rows(&a, m, k), Operand::rows(&b, n, k), Default::default());
        assert!(
            f32s.unwrap().iter().any(|x| x.is_subnormal()),
            "MXCSR left with FTZ set"
        );
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols)
            .flat_map(|c| (0..rows).map(move |r| x[r * cols + c]))
            .collect()
    }
}
