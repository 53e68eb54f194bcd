//! AVX2 lanes: two `__m256` registers make sixteen f32.

use std::arch::x86_64::*;

use super::{Kernel, Vec16};

/// Runs `k` on AVX2 lanes, compiled for AVX2, FMA and F16C.
///
/// # Safety
/// The CPU has those features (`Simd::Avx2` is available).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<K: Kernel>(k: K) -> K::Output {
    k.run::<Y2>()
}

/// Two AVX2 registers (16 registers in all: tiles of 2 rows by two panels, or of 6 rows by one:
/// 12 accumulators, the panel's two registers and a broadcast).
#[derive(Clone, Copy)]
pub(crate) struct Y2(__m256, __m256);

// SAFETY: as for AVX-512, two 8-lane halves; they run where `Simd::Avx2` does (AVX2, FMA, F16C).
unsafe impl Vec16 for Y2 {
    const ROWS: usize = 2;
    const PANEL_ROWS: usize = 6;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { Y2(_mm256_setzero_ps(), _mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn set1(v: f32) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { Y2(_mm256_set1_ps(v), _mm256_set1_ps(v)) }
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe {
            let v = _mm256_broadcast_ss(&*p);
            Y2(v, v)
        }
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { Y2(_mm256_fmadd_ps(a.0, b.0, c.0), _mm256_fmadd_ps(a.1, b.1, c.1)) }
    }
    #[inline(always)]
    unsafe fn load_f32(p: *const u8) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe {
            let p = p as *const f32;
            Y2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe {
            let p = p as *const __m128i;
            Y2(
                _mm256_cvtph_ps(_mm_loadu_si128(p)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(1))),
            )
        }
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe {
            let p = p as *const __m128i;
            let a = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)));
            let b = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(1))));
            Y2(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b))
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe {
            _mm256_storeu_ps(p, self.0);
            _mm256_storeu_ps(p.add(8), self.1);
        }
    }
}

/// [`super::transpose8`] with AVX's in-lane unpacks and shuffles and a swap of 128-bit halves.
///
/// # Safety
/// AVX is available; as [`super::transpose8`].
#[target_feature(enable = "avx")]
pub(super) unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    // SAFETY: the caller's contract: 8 rows of 8 readable at `src`, writable at `dst`.
    unsafe {
        let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * src_stride)));
        // Pairs of rows interleaved: (r0 r1) in t[0] (columns 0, 1 | 4, 5) and t[1] (2, 3 | 6, 7).
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(a, b)
            } else {
                _mm256_unpackhi_ps(a, b)
            }
        });
        // Four rows of one column per 128-bit half: s[2q + h] holds column 2q + h (low half)
        // and 2q + h + 4 (high half) of rows 0-3 (s[0..4]) or rows 4-7 (s[4..8]).
        let s: [__m256; 8] = std::array::from_fn(|i| {
            let (rows, q, h) = (i / 4 * 4, i % 4 / 2, i % 2);
            let (a, b) = (t[rows + q], t[rows + 2 + q]);
            if h == 0 {
                _mm256_shuffle_ps::<0x44>(a, b)
            } else {
                _mm256_shuffle_ps::<0xEE>(a, b)
            }
        });
        for c in 0..4 {
            _mm256_storeu_ps(dst.add(c * dst_stride), _mm256_permute2f128_ps::<0x20>(s[c], s[4 + c]));
            _mm256_storeu_ps(
                dst.add((c + 4) * dst_stride),
                _mm256_permute2f128_ps::<0x31>(s[c], s[4 + c]),
            );
        }
    }
}
