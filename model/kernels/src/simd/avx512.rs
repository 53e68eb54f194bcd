//! AVX-512 lanes: one `__m512` register is sixteen f32.

use std::arch::x86_64::*;

use super::{Kernel, Vec16};

/// Runs `k` on AVX-512 lanes, compiled for AVX-512F (and AVX2, FMA, F16C, which every such
/// CPU has).
///
/// # Safety
/// The CPU has those features (`Simd::Avx512` is available).
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub(super) unsafe fn run<K: Kernel>(k: K) -> K::Output {
    k.run::<__m512>()
}

/// 12 rows x 2 panels: 24 accumulators of the 32 registers. (8 x 3 does as well on
/// prefill but worse on batched decode, where fewer panels per row pass overlap the
/// weights' arrival with more arithmetic.)
// SAFETY: every method reads or writes exactly the 16 lanes its contract names (unaligned loads
// and stores of at most 64 bytes); they run where `Simd::Avx512` does, whose availability
// (AVX-512F, AVX2, FMA, F16C) `Simd` checks before any kernel is entered.
unsafe impl Vec16 for __m512 {
    const ROWS: usize = 12;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn set1(v: f32) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_set1_ps(*p) }
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn load_f32(p: *const u8) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const u8) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    /// bf16 is the top half of an f32: widen to 32 bits and shift into place.
    #[inline(always)]
    unsafe fn load_bf16(p: *const u8) -> Self {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm512_storeu_ps(p, self) }
    }
    #[inline(always)]
    unsafe fn prefetch(p: *const u8) {
        // SAFETY: the trait's contract: this instruction set is available (`Simd::run` checked it) and the memory at the pointer holds the lanes read or written.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
    }
}
