//! The AVX512-BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`) versions of the bf16 packing and tiles.

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
                31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                17, 1, 16, 0,
            );
            std::mem::transmute(_mm512_permutexvar_epi16(order, both))
        }
    }

    #[inline(always)]
    fn split(pairs: [u32; LANES]) -> [u32; LANES] {
        // SAFETY: 16 words; the callers' functions enable AVX512BW.
        unsafe {
            // Word 2j + 1 of the pairs is pair j's high value, 2j its low one.
            let order = _mm512_set_epi16(
                30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11,
                9, 7, 5, 3, 1,
            );
            std::mem::transmute(_mm512_permutexvar_epi16(
                order,
                std::mem::transmute::<[u32; LANES], __m512i>(pairs),
            ))
        }
    }

    #[inline(always)]
    fn split_interleaved(lo: &[f32], hi: &[f32]) -> [u32; LANES] {
        let (lo, hi) = (&lo[..LANES], &hi[..LANES]);
        // SAFETY: 16 values each; the callers' functions enable AVX512-BF16.
        unsafe {
            // The high values' 16 bf16 first, then the low ones'.
            std::mem::transmute(_mm512_cvtne2ps_pbh(
                _mm512_loadu_ps(lo.as_ptr()),
                _mm512_loadu_ps(hi.as_ptr()),
            ))
        }
    }
}

/// [`super::pack_rows`] on `vcvtne2ps2bf16`.
///
/// # Safety
/// AVX512-BF16 available.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn pack_rows<const WIDE: bool>(a: Operand, out: &mut [MaybeUninit<u32>]) {
    super::pack_rows::<Cvt, WIDE>(a, out)
}

/// [`super::pack_panels`] on `vcvtne2ps2bf16`.
///
/// # Safety
/// AVX512-BF16 available.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn pack_panels<const SPLIT: bool>(b: Operand, out: &mut [MaybeUninit<u32>]) {
    super::pack_panels::<Cvt, SPLIT>(b, out)
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

/// `R` rows of packed pairs from `a` times the task's panels, into `y`.
///
/// # Safety
/// AVX-512F and AVX512-BF16 available; `a` holds `R` packed rows of the task's `k`, and `y`
/// the task's columns of those rows, written by no other thread.
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

/// [`Bf16Dot::Avx2Fma`](super::Bf16Dot)'s tile of `rows` (1 to 4) rows, `a` widened (the
/// task's `lda` f32 a row, each pair's high value first).
///
/// # Safety
/// As [`Task::run`]; AVX2 and FMA available; a [`crate::simd::FlushSubnormals`] alive on this thread (else
/// the bits differ where values fall below f32's normal range).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn tile_rows_avx2(a: *const u32, rows: usize, t: &Task, y: *mut f32) {
    // SAFETY: the caller's contract, for the rows given.
    unsafe {
        for panel in 0..GROUP {
            let cols = t.cols.saturating_sub(panel * LANES).min(LANES);
            if cols == 0 {
                break;
            }
            let (w, y) = (t.w.add(panel * t.kp * LANES), y.add(panel * LANES));
            match rows {
                4 => tile_avx2::<4>(a as *const f32, w, t, y, cols),
                3 => tile_avx2::<3>(a as *const f32, w, t, y, cols),
                2 => tile_avx2::<2>(a as *const f32, w, t, y, cols),
                _ => tile_avx2::<1>(a as *const f32, w, t, y, cols),
            }
        }
    }
}

/// `R` widened rows from `a` times one panel `w`, into the first `cols` columns at `y`, on AVX2:
/// at each pair position the panel's high halves (the odd positions, which the instruction adds
/// first) widened to f32 (`x & 0xffff0000`), then its low halves (`x << 16`), and one fused
/// multiply-add per product.
///
/// # Safety
/// As [`tile_rows_avx2`]; `w` one of the task's panels, `y` its columns.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::needless_range_loop)] // acc[i][j] reads as the formula
unsafe fn tile_avx2<const R: usize>(a: *const f32, w: *const u32, t: &Task, y: *mut f32, cols: usize) {
    let kp = t.kp;
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: the caller's contract: `R` rows of `2 * kp` values at `a`, a panel of `kp * 16`
    // pairs at `w`, `R` rows of `cols` columns at `y`.
    unsafe {
        if t.accumulate {
            for i in 0..R {
                let start = start_cols(y.add(i * t.ldy), cols, true);
                acc[i] = [_mm256_loadu_ps(start.as_ptr()), _mm256_loadu_ps(start.as_ptr().add(8))];
            }
        }
        let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        for p in 0..kp {
            let at = w.add(p * LANES) as *const __m256i;
            let (w0, w1) = (_mm256_loadu_si256(at), _mm256_loadu_si256(at.add(1)));
            let hi = [_mm256_and_si256(w0, high), _mm256_and_si256(w1, high)].map(|v| _mm256_castsi256_ps(v));
            for i in 0..R {
                let x = _mm256_broadcast_ss(&*a.add(i * t.lda + 2 * p));
                acc[i] = [
                    _mm256_fmadd_ps(x, hi[0], acc[i][0]),
                    _mm256_fmadd_ps(x, hi[1], acc[i][1]),
                ];
            }
            let lo = [_mm256_slli_epi32::<16>(w0), _mm256_slli_epi32::<16>(w1)].map(|v| _mm256_castsi256_ps(v));
            for i in 0..R {
                let x = _mm256_broadcast_ss(&*a.add(i * t.lda + 2 * p + 1));
                acc[i] = [
                    _mm256_fmadd_ps(x, lo[0], acc[i][0]),
                    _mm256_fmadd_ps(x, lo[1], acc[i][1]),
                ];
            }
        }
        for i in 0..R {
            let mut out = [0f32; LANES * GROUP];
            _mm256_storeu_ps(out.as_mut_ptr(), acc[i][0]);
            _mm256_storeu_ps(out.as_mut_ptr().add(8), acc[i][1]);
            store_cols(&out, y.add(i * t.ldy), cols);
        }
    }
}
