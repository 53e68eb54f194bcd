//! q8_0 and q4_0 products on integers, as llama.cpp takes them: the activations quantized to
//! q8_0 (per row and block of 32 positions, `d = max|x| / 127` and codes `q = round(x · (1/d))`,
//! half away from zero), each block's product `Σ q·w` summed exactly in 32-bit integers, then
//! `y += Σ q·w · (d_x · d_w)` in f32, block after block along `k` (`Σ q·w · s` as one fused
//! multiply-add, `s = d_x · d_w` rounded first). An integer dot product takes 64 byte products per
//! AVX512-VNNI instruction (`vpdpbusd`) against 16 f32 ones per fused multiply-add, and the weights
//! are never widened: at 16-64 rows (batched decode, prefill) the f32-activation kernel was slower
//! with q8_0 weights than with f32 ones, and at one row on AVX2 it was bound by dequantizing q4_0
//! to f32 (`BENCHMARKS.md`).
//!
//! Every instruction set gives the same bits: the integer sums are exact (at most 32 · 255 · 127 in
//! magnitude) and exact in f32 (under 2^24), and the f32 steps are the same operations in the same
//! order. Rows are quantized independently, so a row decodes the same alone or in a batch.
//!
//! Layout (set by `PackedMatrix::from_qtensor`): in a q8_0 block of a panel, the 16 columns'
//! codes for positions `4g..4g + 4` are one 64-byte line, column after column, each column's four
//! positions adjacent (byte `64g + 4c + r` is column `c` at position `4g + r`): the order in which
//! `vpdpbusd` sums four byte products into each 32-bit lane. The 16 f16 scales follow. A q4_0
//! block has four such lines: byte `64g + 4c + r` holds GGML's pair of codes, positions
//! `t = 4g + r` (low nibble) and `t + 16` (high), so that its low nibbles are q8_0's lines 0..4
//! and its high ones lines 4..8, each a mask (and a shift) away.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones. q8_0's weights are read as `w + 128` (their
//! top bit flipped in the register) and q4_0's as their codes `w + 8` (0..16); `128 · Σq` or
//! `8 · Σq`, from the activations' codes, is taken off where each block's sum starts.

use std::mem::MaybeUninit;

use super::epilogue::Epilogue;
use super::{PackedMatrix, Simd, BLOCK, GROUP, LANES, PREFETCH};
use crate::simd::{Kernel, Vec16};

/// Bytes of a block in a panel: 16 columns x 32 codes (q4_0: two codes a byte), then 16 f16
/// scales.
const fn block_bytes(q4: bool) -> usize {
    LANES * BLOCK / if q4 { 2 } else { 1 } + 2 * LANES
}

/// What weight codes are offset by, to read them as unsigned bytes: q8_0's `w + 128` in the VNNI
/// kernel (its AVX2 kernel takes signed codes), q4_0's stored `w + 8`.
const fn code_bias(q4: bool) -> i32 {
    if q4 {
        8
    } else {
        128
    }
}

/// Byte offset, within its block, of the code of column `lane` at position `t` (`0..32`); in a
/// q4_0 block, of the pair of positions `t` and `t + 16` (`t` in `0..16`).
pub(super) fn code_offset(t: usize, lane: usize) -> usize {
    t / 4 * 64 + lane * 4 + t % 4
}

/// Activations `(m, k)` quantized to q8_0 blocks (`k` a multiple of 32).
#[derive(Default)]
pub(super) struct Q8Rows {
    codes: Vec<i8>,
    /// `d` per row and block.
    scales: Vec<f32>,
    /// `Σq` per row and block: `-bias · Σq` is where an unsigned-weight sum starts.
    sums: Vec<i32>,
}

thread_local! {
    /// The calling thread's last [`Q8Rows`] (up to [`KEPT_CODES`]), whose buffers the next product refills: three
    /// allocations, their zeroing and frees had been 12% of a SmolLM2 decode step's serial work.
    static SCRATCH: std::cell::Cell<Q8Rows> = std::cell::Cell::new(Q8Rows::default());
}

impl Q8Rows {
    /// `x`'s rows of `k` in q8_0 blocks, on `simd`'s instructions (the same values on any).
    #[cfg(test)]
    pub(super) fn new(x: &[f32], k: usize, simd: Simd) -> Self {
        let mut q = Self::default();
        q.quantize(x, k, simd);
        q
    }

    /// Refills `self` with `x`'s rows of `k` ([`Q8Rows::new`]): every code, scale and sum is
    /// written.
    fn quantize(&mut self, x: &[f32], k: usize, simd: Simd) {
        let blocks = x.len() / BLOCK;
        debug_assert!(k.is_multiple_of(BLOCK) && x.len().is_multiple_of(k.max(1)));
        self.codes.resize(x.len(), 0);
        self.scales.resize(blocks, 0.0);
        self.sums.resize(blocks, 0);
        simd.run(Quantize { x, q: self });
    }
}

/// [`Q8Rows::new`] as plain Rust for [`Simd::run`] to vectorise (a pass that took as long as the
/// product itself at 4 rows when it ran unvectorised).
struct Quantize<'a> {
    x: &'a [f32],
    q: &'a mut Q8Rows,
}

impl Kernel for Quantize<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        let q = self.q;
        let (blocks, _) = self.x.as_chunks::<BLOCK>();
        let (codes, _) = q.codes.as_chunks_mut::<BLOCK>();
        for (((block, codes), scale), total) in blocks.iter().zip(codes).zip(&mut q.scales).zip(&mut q.sums) {
            (*scale, *total) = quantize_block(block, codes);
        }
    }
}

/// One block of 32 activations as q8_0: its codes written, `(d, Σq)` returned; `(NaN, 0)` with
/// zero codes where a value is not finite (the product is then not a number, as in f32:
/// `0 · NaN` is NaN).
///
/// `max |x|` is taken on the values' bits: non-negative floats order as their bits do, and a
/// value is not finite exactly where its magnitude's bits reach infinity's. An integer maximum
/// vectorises where `f32::max`'s NaN rules kept the fold scalar (2 µs for SmolLM2's 576 values,
/// 6% of a decode step on one thread while the other waited). The same `d` as `fold(f32::max)`.
#[inline(always)]
fn quantize_block(block: &[f32; BLOCK], codes: &mut [i8; BLOCK]) -> (f32, i32) {
    const INFINITY_BITS: u32 = 0x7f80_0000;
    let top = block.iter().fold(0u32, |a, v| a.max(v.to_bits() & !(1 << 31)));
    if top >= INFINITY_BITS {
        codes.fill(0);
        return (f32::NAN, 0);
    }
    let d = f32::from_bits(top) / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (c, &v) in codes.iter_mut().zip(block) {
        let code = integer((v * inv).round().clamp(-127.0, 127.0));
        *c = code as i8;
        sum += code;
    }
    (d, sum)
}

/// `r as i32` for `r` a whole number within ±127, or NaN (`0 · ∞` where `d` is so small that
/// `1/d` is infinite): 0, as `as` gives. Read from the bits of `r + 1.5 · 2^23`, whose low bits
/// hold `r` exactly: Rust's saturating `as` ran lane by lane (a compare and two moves each).
#[inline(always)]
fn integer(r: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23
    let r = if r.is_nan() { 0.0 } else { r };
    (r + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

/// Whether this CPU has AVX512-VNNI beside [`Simd::Avx512`] (detected once).
fn vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return *VNNI.get_or_init(|| Simd::Avx512.is_available() && std::is_x86_feature_detected!("avx512vnni"));
    #[cfg(not(target_arch = "x86_64"))]
    return *VNNI.get_or_init(|| false);
}

/// One task: columns `col0..col0 + 32` (two panels) of every row.
struct Task<'a> {
    q: &'a Q8Rows,
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    panels: *const u8,
    panel_bytes: usize,
    col0: usize,
    accumulate: bool,
    /// q4_0 weights (else q8_0).
    q4: bool,
}

/// Blocks along `k` per chunk when several row tiles share a task's panels: the two panels' chunk
/// (2 x 8 x 544 B, 8.5 KiB) stays in L1 while every tile passes over it.
#[cfg(target_arch = "x86_64")]
const CHUNK: usize = 8;

/// A task's row tiles as the x86 kernels run them: tiles of (nearly) equal height, at most
/// `most` rows; with several tiles, `k` in chunks of [`CHUNK`] blocks that every tile passes
/// over in turn, each tile's outputs kept in `y` between chunks (the same operations in the same
/// order: the same bits). The first tile prefetches the panels ahead, the others find them in
/// cache. Calls `tile(i0, rows, (b0, b1, accumulate), prefetch)`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn for_each_tile(t: &Task, most: usize, mut tile: impl FnMut(usize, usize, (usize, usize, bool), usize)) {
    let tiles = t.m.div_ceil(most);
    let (height, taller) = (t.m / tiles, t.m % tiles);
    let blocks = t.k / BLOCK;
    let chunk = if tiles > 1 { CHUNK } else { blocks };
    for b0 in (0..blocks).step_by(chunk) {
        let span = (b0, (b0 + chunk).min(blocks), t.accumulate || b0 > 0);
        let mut i0 = 0;
        for n in 0..tiles {
            let rows = height + usize::from(n < taller);
            tile(i0, rows, span, if n == 0 { PREFETCH } else { 0 });
            i0 += rows;
        }
    }
}

/// `y = x @ W^T` (`y += ` with `accumulate`) for q8_0 `W`, then the epilogue, over candle's thread
/// pool, a task per two panels; every element of `y` is written. `k > 0`, a multiple of 32.
pub(super) fn run(
    w: &PackedMatrix,
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    m: usize,
    simd: Simd,
    ep: Epilogue,
    accumulate: bool,
) {
    debug_assert!(x.len() == m * w.k && y.len() == m * w.n && w.k.is_multiple_of(BLOCK));
    let mut q = SCRATCH.take();
    q.quantize(x, w.k, simd);
    let panel_bytes = super::panel_bytes(w.format, w.k);
    let groups = w.n.div_ceil(LANES * GROUP);
    let (y_at, w_at) = (y.as_mut_ptr() as usize, w.bytes().as_ptr() as usize);
    let vnni = simd == Simd::Avx512 && vnni();
    let q4 = w.format == super::WeightFormat::Q4_0;
    candle_core::utils::barrier_pool().execute_chunked(groups, |range| {
        for g in range {
            let t = Task {
                q: &q,
                y: y_at as *mut f32,
                m,
                n: w.n,
                k: w.k,
                panels: (w_at + g * GROUP * panel_bytes) as *const u8,
                panel_bytes,
                col0: g * GROUP * LANES,
                accumulate,
                q4,
            };
            ep.prefetch(t.col0);
            // Tasks write disjoint columns of `y`; the panels of group `g` exist (the matrix is
            // padded to whole groups).
            #[cfg(target_arch = "x86_64")]
            if vnni {
                // SAFETY: AVX-512 and VNNI available (checked once above); the task's operands
                // lie within `q`, the panels and `y`, its columns its own.
                unsafe {
                    match q4 {
                        true => avx512_vnni::task::<true>(&t),
                        false => avx512_vnni::task::<false>(&t),
                    }
                }
            } else if simd != Simd::Portable {
                // SAFETY: AVX2, FMA and F16C come with either x86 instruction set; the task as
                // above.
                unsafe {
                    match q4 {
                        true => avx2::task::<true>(&t),
                        false => avx2::task::<false>(&t),
                    }
                }
            } else {
                simd.run(Portable(&t));
            }
            #[cfg(not(target_arch = "x86_64"))]
            simd.run(Portable(&t));
            // SAFETY: this task's columns, written above.
            unsafe { super::epilogue::epilogue(ep, simd, t.y, 0, m, w.n, t.col0, (w.n - t.col0).min(GROUP * LANES)) };
        }
    });
    if q.codes.capacity() <= KEPT_CODES {
        SCRATCH.set(q);
    }
}

/// The most codes a thread keeps between products (a long prompt's are freed).
const KEPT_CODES: usize = 1 << 20;

/// A task in plain Rust (vectorised for the instruction set [`Simd::run`] compiles it for): the
/// definition, and the kernel where there is no VNNI.
struct Portable<'a, 'b>(&'a Task<'b>);

impl Kernel for Portable<'_, '_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        let t = self.0;
        let cols = (t.n - t.col0).min(GROUP * LANES);
        let blocks = t.k / BLOCK;
        for i in 0..t.m {
            let codes = &t.q.codes[i * t.k..(i + 1) * t.k];
            for j in 0..GROUP {
                if j * LANES >= cols {
                    break;
                }
                // SAFETY: panel `j` of this task holds `blocks` blocks (the `Task` that `run` built).
                let panel =
                    unsafe { std::slice::from_raw_parts(t.panels.add(j * t.panel_bytes), blocks * block_bytes(t.q4)) };
                // SAFETY: row `i`'s columns of this task, its own.
                let y = unsafe { t.y.add(i * t.n + t.col0 + j * LANES) };
                let lanes = (cols - j * LANES).min(LANES);
                let mut acc = [0f32; LANES];
                if t.accumulate {
                    // SAFETY: as above; initialised when accumulating (`run`'s contract).
                    unsafe { std::ptr::copy_nonoverlapping(y, acc.as_mut_ptr(), lanes) };
                }
                for (b, block) in panel.chunks_exact(block_bytes(t.q4)).enumerate() {
                    let x = &codes[b * BLOCK..(b + 1) * BLOCK];
                    // Column `c`'s weight at position `4g + r`.
                    let w = |g: usize, c: usize, r: usize| -> i32 {
                        if t.q4 {
                            let pair = block[64 * (g % 4) + 4 * c + r];
                            i32::from(if g < 4 { pair & 15 } else { pair >> 4 }) - 8
                        } else {
                            i32::from(block[64 * g + 4 * c + r] as i8)
                        }
                    };
                    let mut dots = [0i32; LANES];
                    for g in 0..BLOCK / 4 {
                        for (c, dot) in dots.iter_mut().enumerate() {
                            for r in 0..4 {
                                *dot += i32::from(x[4 * g + r]) * w(g, c, r);
                            }
                        }
                    }
                    let dx = t.q.scales[i * blocks + b];
                    let scales = &block[block_bytes(t.q4) - 2 * LANES..];
                    for c in 0..LANES {
                        let dw = half::f16::from_le_bytes([scales[2 * c], scales[2 * c + 1]]).to_f32();
                        acc[c] = (dots[c] as f32).mul_add(dx * dw, acc[c]);
                    }
                }
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), y, lanes) };
            }
        }
    }
}

/// The integer products on AVX2, for CPUs without VNNI (AMD Zen 3, Intel before Ice Lake): where
/// `vpdpbusd` sums four byte products into a 32-bit lane, `vpmaddubsw` sums two into 16 bits and
/// `vpmaddwd` two of those into 32. `vpmaddubsw` multiplies unsigned bytes by signed ones and
/// saturates its 16-bit sums, so for q8_0 it takes `|w|` (at most 128, unsigned) times the
/// activations' codes with `w`'s sign (`vpsignb`; codes lie in -127..=127, so the sign never
/// overflows): each 16-bit sum is at most 2 · 128 · 127 = 32512, exact. q4_0's codes are unsigned
/// already. The same integer sums, so the same bits as every other path. The portable loop ran at
/// ~15 GFLOP/s a core's pair here, under a tenth of the f32 kernel's rate.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{block_bytes, code_bias, Task, BLOCK, GROUP, LANES};

    /// Rows per register tile of several rows, one half panel (8 columns) at a time: `R` f32
    /// accumulators and as many integer sums, the weights and their magnitudes (q4_0: low and
    /// high codes), a broadcast and the ones: 14 of the 16 registers at 4. A tile of two rows
    /// over both halves (`R x 2` accumulators) had spilled them to the stack (perf annotate), and
    /// Q8_0 prefill ran at 0.75-1.09x llama.cpp's on an EPYC Zen 3.
    const ROWS: usize = 4;

    /// Every row of one task ([`super::for_each_tile`]), one panel after the other; one row over
    /// both halves of a panel at once (the activations' broadcasts shared), several rows a half
    /// at a time (each weight load shared by more rows); `Q4`: q4_0 weights.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; the task's operands valid, its columns its own.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn task<const Q4: bool>(t: &Task) {
        let cols = (t.n - t.col0).min(GROUP * LANES);
        super::for_each_tile(t, ROWS, |i0, rows, span, prefetch| {
            for j in 0..GROUP {
                let lanes = cols.saturating_sub(j * LANES).min(LANES);
                if lanes == 0 {
                    break;
                }
                if rows == 1 {
                    // SAFETY: the caller's contract; row `i0` and panel `j` exist.
                    unsafe { rows_tile::<1, 2, Q4>(t, i0, (j, 0, lanes), span, prefetch) };
                    continue;
                }
                for half in 0..2 {
                    let lanes = lanes.saturating_sub(half * HALF).min(HALF);
                    if lanes == 0 {
                        break;
                    }
                    let prefetch = if half == 0 { prefetch } else { 0 };
                    // SAFETY: the caller's contract; rows `i0..i0 + rows` and panel `j` exist.
                    unsafe {
                        match rows {
                            4 => rows_tile::<4, 1, Q4>(t, i0, (j, half, lanes), span, prefetch),
                            3 => rows_tile::<3, 1, Q4>(t, i0, (j, half, lanes), span, prefetch),
                            _ => rows_tile::<2, 1, Q4>(t, i0, (j, half, lanes), span, prefetch),
                        }
                    }
                }
            }
        });
    }

    /// Columns in half a panel: one AVX2 vector of f32.
    const HALF: usize = LANES / 2;

    /// Rows `i0..i0 + R` times halves `h0..h0 + H` of panel `j` of the task (their first `lanes`
    /// columns) over blocks `b0..b1` of `k`, from the outputs in `y` if `accumulate`, from zero
    /// otherwise.
    ///
    /// # Safety
    /// As [`task`]'s, with rows `i0..i0 + R` among the task's and `b0 <= b1 <=` its blocks.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc[i][h] reads as the formula
    unsafe fn rows_tile<const R: usize, const H: usize, const Q4: bool>(
        t: &Task,
        i0: usize,
        (j, h0, lanes): (usize, usize, usize),
        (b0, b1, accumulate): (usize, usize, bool),
        prefetch: usize,
    ) {
        let blocks = t.k / BLOCK;
        let size = block_bytes(Q4);
        // SAFETY: the caller's contract (`task`'s): every pointer below is within the rows of the
        // quantized activations, the task's panel `j`, or its columns of `y`.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let y = |i: usize| t.y.add((i0 + i) * t.n + t.col0 + j * LANES + h0 * HALF);
            let mut acc = [[_mm256_setzero_ps(); H]; R];
            if accumulate {
                for i in 0..R {
                    let mut start = [0f32; LANES];
                    std::ptr::copy_nonoverlapping(y(i), start.as_mut_ptr(), lanes);
                    acc[i] = std::array::from_fn(|h| _mm256_loadu_ps(start.as_ptr().add(HALF * h)));
                }
            }
            let codes = t.q.codes.as_ptr().add(i0 * t.k);
            let (scales, sums) = (t.q.scales.as_ptr().add(i0 * blocks), t.q.sums.as_ptr().add(i0 * blocks));
            // The activations' four codes at positions `p..p + 4` of block `b`, in every lane.
            let x4 = |i: usize, b: usize, p: usize| {
                _mm256_set1_epi32((codes.add(i * t.k + b * BLOCK + p) as *const i32).read_unaligned())
            };
            let panel = t.panels.add(j * t.panel_bytes);
            // Half `h`'s 32 bytes of line `g` of block `block`.
            let line = |block: *const u8, g: usize, h: usize| {
                _mm256_loadu_si256(block.add(64 * g + 32 * (h0 + h)) as *const _)
            };
            for b in b0..b1 {
                let block = panel.add(b * size);
                if prefetch > 0 {
                    for line in 0..size.div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(prefetch + 64 * line) as *const i8);
                    }
                }
                let mut dots = [[_mm256_setzero_si256(); H]; R];
                if Q4 {
                    // Codes 0..16 times the activations' codes: each 16-bit sum of two pairs of
                    // products at most 4 · 15 · 127 = 7620, and of a block's four such at most
                    // 30480, exact in 16 bits: widened to 32 once a block in a tile of several
                    // rows (one row widens each step, as before: its decode rate, in this VM's
                    // noise, could not show which is faster). `-8 · Σq` is added below.
                    let low = _mm256_set1_epi8(15);
                    let mut sums16 = [[_mm256_setzero_si256(); H]; R];
                    for g in 0..BLOCK / 8 {
                        // Positions 4g.. (low codes) and 16 + 4g.. (high).
                        let pairs: [__m256i; H] = std::array::from_fn(|h| line(block, g, h));
                        let lo = pairs.map(|p| _mm256_and_si256(p, low));
                        let hi = pairs.map(|p| _mm256_and_si256(_mm256_srli_epi16::<4>(p), low));
                        for i in 0..R {
                            let (xl, xh) = (x4(i, b, 4 * g), x4(i, b, 16 + 4 * g));
                            for h in 0..H {
                                let four =
                                    _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl), _mm256_maddubs_epi16(hi[h], xh));
                                if R == 1 {
                                    dots[i][h] = _mm256_add_epi32(dots[i][h], _mm256_madd_epi16(four, ones));
                                } else {
                                    sums16[i][h] = _mm256_add_epi16(sums16[i][h], four);
                                }
                            }
                        }
                    }
                    for i in 0..R {
                        let start = _mm256_set1_epi32(-code_bias(true) * *sums.add(i * blocks + b));
                        for h in 0..H {
                            let widened = match R {
                                1 => dots[i][h],
                                _ => _mm256_madd_epi16(sums16[i][h], ones),
                            };
                            dots[i][h] = _mm256_add_epi32(widened, start);
                        }
                    }
                } else {
                    for g in 0..BLOCK / 4 {
                        // Four positions of each of the half's 8 columns.
                        let w: [__m256i; H] = std::array::from_fn(|h| line(block, g, h));
                        let magnitude = w.map(|w| _mm256_abs_epi8(w));
                        for i in 0..R {
                            let x = x4(i, b, 4 * g);
                            for h in 0..H {
                                let pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(x, w[h]));
                                dots[i][h] = _mm256_add_epi32(dots[i][h], _mm256_madd_epi16(pairs, ones));
                            }
                        }
                    }
                }
                let dw: [__m256; H] = std::array::from_fn(|h| {
                    _mm256_cvtph_ps(_mm_loadu_si128(block.add(size - 2 * LANES + 16 * (h0 + h)) as *const _))
                });
                for i in 0..R {
                    let dx = _mm256_set1_ps(*scales.add(i * blocks + b));
                    for h in 0..H {
                        acc[i][h] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[i][h]), _mm256_mul_ps(dx, dw[h]), acc[i][h]);
                    }
                }
            }
            for i in 0..R {
                let mut out = [0f32; LANES];
                for h in 0..H {
                    _mm256_storeu_ps(out.as_mut_ptr().add(HALF * h), acc[i][h]);
                }
                std::ptr::copy_nonoverlapping(out.as_ptr(), y(i), lanes);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512_vnni {
    use std::arch::x86_64::*;

    use super::{block_bytes, code_bias, Task, BLOCK, GROUP, LANES};

    /// Rows per register tile: `R` f32 accumulators and as many integer sums, the weights
    /// (q4_0: low and high codes) and the broadcasts.
    const ROWS: usize = 6;

    /// Every row of one task ([`super::for_each_tile`]); `Q4`: q4_0 weights.
    ///
    /// # Safety
    /// AVX-512F/BW, VNNI, F16C available; the task's operands valid, its columns its own.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn task<const Q4: bool>(t: &Task) {
        super::for_each_tile(t, ROWS, |i0, rows, span, prefetch| {
            // SAFETY: the caller's contract; rows `i0..i0 + rows` exist.
            unsafe {
                match rows {
                    6 => panels::<6, Q4>(t, i0, span, prefetch),
                    5 => panels::<5, Q4>(t, i0, span, prefetch),
                    4 => panels::<4, Q4>(t, i0, span, prefetch),
                    3 => panels::<3, Q4>(t, i0, span, prefetch),
                    2 => panels::<2, Q4>(t, i0, span, prefetch),
                    _ => panels::<1, Q4>(t, i0, span, prefetch),
                }
            }
        });
    }

    /// Rows `i0..i0 + R` times the task's panels, one after the other. On an EPYC Zen 4 one row
    /// had read both panels at once (two streams, the activations' broadcasts shared) at 17-24
    /// GB/s (Q4_0) and 21-28 GB/s (Q8_0) from memory, and reads them one at a time at 19-38 and
    /// 23-38, the machine's read bandwidth (30.4, `bench/bandwidth.rs`) on the larger matrices;
    /// decode at batch 1, 4 and 6 gained, prefill stayed within the noise (`BENCHMARKS.md`).
    ///
    /// # Safety
    /// As [`rows_tile`]'s.
    #[inline(always)]
    unsafe fn panels<const R: usize, const Q4: bool>(t: &Task, i0: usize, span: (usize, usize, bool), prefetch: usize) {
        for j in 0..GROUP {
            let lanes = (t.n - t.col0).saturating_sub(j * LANES).min(LANES);
            if lanes > 0 {
                // SAFETY: the caller's contract; panel `j` of the task exists.
                unsafe { rows_tile::<R, Q4>(t, i0, (j, lanes), span, prefetch) }
            }
        }
    }

    /// Rows `i0..i0 + R` times panel `j` of the task (its first `lanes` columns) over blocks
    /// `b0..b1` of `k`, from the outputs in `y` if `accumulate`, from zero otherwise.
    ///
    /// # Safety
    /// As [`task`]'s, with rows `i0..i0 + R` among the task's, panel `j` among its panels and
    /// `b0 <= b1 <=` its blocks.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc[i] reads as the formula
    unsafe fn rows_tile<const R: usize, const Q4: bool>(
        t: &Task,
        i0: usize,
        (j, lanes): (usize, usize),
        (b0, b1, accumulate): (usize, usize, bool),
        prefetch: usize,
    ) {
        let blocks = t.k / BLOCK;
        let size = block_bytes(Q4);
        // SAFETY: the caller's contract (`task`'s): every pointer below is within the rows of the
        // quantized activations, the task's panel `j`, or its columns of `y`.
        unsafe {
            let (flip, low) = (_mm512_set1_epi8(-128), _mm512_set1_epi8(15));
            let mut acc = [_mm512_setzero_ps(); R];
            let y = |i: usize| t.y.add((i0 + i) * t.n + t.col0 + j * LANES);
            if accumulate {
                for i in 0..R {
                    acc[i] = load_cols(y(i), lanes);
                }
            }
            let codes = t.q.codes.as_ptr().add(i0 * t.k);
            let (scales, sums) = (t.q.scales.as_ptr().add(i0 * blocks), t.q.sums.as_ptr().add(i0 * blocks));
            // The activations' four codes at positions `p..p + 4` of block `b`, in every lane.
            let x4 = |i: usize, b: usize, p: usize| {
                _mm512_set1_epi32((codes.add(i * t.k + b * BLOCK + p) as *const i32).read_unaligned())
            };
            let panel = t.panels.add(j * t.panel_bytes);
            for b in b0..b1 {
                let block = panel.add(b * size);
                if prefetch > 0 {
                    for line in 0..size.div_ceil(64) {
                        _mm_prefetch::<_MM_HINT_T0>(block.wrapping_add(prefetch + 64 * line) as *const i8);
                    }
                }
                let mut dots: [__m512i; R] =
                    std::array::from_fn(|i| _mm512_set1_epi32(-code_bias(Q4) * *sums.add(i * blocks + b)));
                if Q4 {
                    for g in 0..BLOCK / 8 {
                        // Positions 4g.. (low codes) and 16 + 4g.. (high).
                        let pairs = _mm512_loadu_si512(block.add(64 * g) as *const _);
                        let lo = _mm512_and_si512(pairs, low);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(pairs), low);
                        for i in 0..R {
                            let (xl, xh) = (x4(i, b, 4 * g), x4(i, b, 16 + 4 * g));
                            dots[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dots[i], lo, xl), hi, xh);
                        }
                    }
                } else {
                    for g in 0..BLOCK / 4 {
                        let w = _mm512_xor_si512(_mm512_loadu_si512(block.add(64 * g) as *const _), flip);
                        for i in 0..R {
                            dots[i] = _mm512_dpbusd_epi32(dots[i], w, x4(i, b, 4 * g));
                        }
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(block.add(size - 2 * LANES) as *const _));
                for i in 0..R {
                    let dx = _mm512_set1_ps(*scales.add(i * blocks + b));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[i]), _mm512_mul_ps(dx, dw), acc[i]);
                }
            }
            for i in 0..R {
                if lanes == LANES {
                    _mm512_storeu_ps(y(i), acc[i]);
                } else {
                    _mm512_mask_storeu_ps(y(i), (1u32 << lanes) as u16 - 1, acc[i]);
                }
            }
        }
    }

    /// The first `cols` (up to 16) values at `p`, zeros after them.
    ///
    /// # Safety
    /// AVX-512F available, and `p` holds `cols.min(16)` readable values.
    #[inline(always)]
    unsafe fn load_cols(p: *const f32, cols: usize) -> __m512 {
        // SAFETY: `p` holds `cols.min(16)` values (the caller's contract).
        unsafe { _mm512_maskz_loadu_ps(((1u32 << cols.min(LANES)) - 1) as u16, p) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `quantize_block` on every instruction set against the definition written out plainly
    /// (`d = max|x| / 127` by `f32::max`, codes `round(x / d)` half away from zero): ties, zeros,
    /// signed zeros, subnormals, the largest floats, NaN and infinities, random blocks.
    #[test]
    fn quantized_blocks_are_the_plain_definitions_bits() {
        fn plain(block: &[f32]) -> (Vec<i8>, f32, i32) {
            if !block.iter().all(|v| v.is_finite()) {
                return (vec![0; BLOCK], f32::NAN, 0);
            }
            let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            let codes: Vec<i8> = block
                .iter()
                .map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8)
                .collect();
            let sum = codes.iter().map(|&c| c as i32).sum();
            (codes, d, sum)
        }
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut blocks: Vec<Vec<f32>> = vec![
            vec![0.0; BLOCK],
            (0..BLOCK).map(|i| if i % 2 == 0 { -0.0 } else { 0.0 }).collect(),
            // x · (1/d) at exact halves: 127 · (j + 0.5) / 127.
            (0..BLOCK)
                .map(|i| (i as f32 - 16.0) + 0.5)
                .chain([127.0])
                .skip(1)
                .collect(),
            (0..BLOCK).map(|i| f32::from_bits(1 + i as u32)).collect(),
            // d subnormal, 1/d infinite: zeros give 0 · ∞ = NaN, and code 0.
            (0..BLOCK)
                .map(|i| if i % 3 == 0 { 0.0 } else { 1e-38 * i as f32 / 32.0 })
                .collect(),
            (0..BLOCK)
                .map(|i| if i == 3 { -f32::MAX } else { f32::MAX / (i + 1) as f32 })
                .collect(),
        ];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            blocks.push((0..BLOCK).map(|i| if i == 9 { bad } else { i as f32 }).collect());
        }
        for _ in 0..2000 {
            let scale = f32::from_bits(((next() % 60) as u32 + 97) << 23); // 2^-30 .. 2^30
            blocks.push(
                (0..BLOCK)
                    .map(|_| (next() as i64 as f32 / i64::MAX as f32) * scale)
                    .collect(),
            );
        }
        let x: Vec<f32> = blocks.concat();
        for &simd in Simd::available() {
            let q = Q8Rows::new(&x, BLOCK, simd);
            for (b, block) in blocks.iter().enumerate() {
                let (codes, d, sum) = plain(block);
                assert_eq!(
                    &q.codes[b * BLOCK..(b + 1) * BLOCK],
                    &codes[..],
                    "{simd:?}, block {b}: {block:?}"
                );
                assert_eq!(
                    (q.scales[b].to_bits(), q.sums[b]),
                    (d.to_bits(), sum),
                    "{simd:?}, block {b}"
                );
            }
        }
    }
}
