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
