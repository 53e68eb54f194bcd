//! `x @ W^T` on the CPU for a weight stored `(out, in)` (the inference layout) in f32, f16 or
//! bf16, with f32 activations and f32 accumulation.
//!
//! Why not candle's matmul: decoding reads every weight once per step, so its speed limit is
//! memory bandwidth. candle's gemm (a blocked GEMM that packs its operands) reads weights at
//! ~12.5 GB/s on one-row products on this 2-core machine, where the machine can read ~22 GB/s
//! (`cargo bench -p gpt --bench gemv`), and its f16 path needs f16 activations. Here each task
//! streams a few whole weight rows once, converting half-precision weights in registers, against
//! every activation row: a register-blocked dot-product kernel (AVX-512 or AVX2, with FMA and
//! F16C, chosen at run time; plain Rust elsewhere) split over candle's own persistent thread pool.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape};
use half::{bf16, f16};

/// `(m, k) @ W^T` with `W` `(n, k)`: the op's second operand is `W` itself, contiguous.
pub(super) struct MatmulWt;

impl CustomOp2 for MatmulWt {
    fn name(&self) -> &'static str {
        "matmul-wt"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = super::f32_slice(s1, l1, "matmul-wt")?;
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("matmul-wt: x is (.., {k}) but the weight is ({n}, {k2})")
        }
        let Some((start, end)) = l2.contiguous_offsets() else {
            candle_core::bail!("matmul-wt: the weight must be contiguous")
        };
        let mut y = vec![0f32; m * n];
        if k == 0 {
            return Ok((CpuStorage::F32(y), Shape::from((m, n)))); // empty sums
        }
        match s2 {
            CpuStorage::F32(w) => run(x, &w[start..end], &mut y, m, n, k),
            CpuStorage::F16(w) => run(x, &w[start..end], &mut y, m, n, k),
            CpuStorage::BF16(w) => run(x, &w[start..end], &mut y, m, n, k),
            _ => candle_core::bail!("matmul-wt: the weight must be f32, f16 or bf16"),
        }
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// The weight types the kernel reads, widened to f32 in registers.
pub(super) trait WeightElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// Eight consecutive weights at `p` as f32.
    ///
    /// # Safety
    /// `p..p + 8` must be readable, and the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen consecutive weights at `p` as f32.
    ///
    /// # Safety
    /// `p..p + 16` must be readable, and the CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl WeightElem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl WeightElem for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
}

impl WeightElem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    // bf16 is the top half of an f32: widen to 32 bits and shift into place.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        unsafe {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        unsafe {
            let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h))
        }
    }
}

/// Weight rows per task: a task reads its rows once for all activation rows.
const ROWS_PER_TASK: usize = 8;

/// `y (m, n) = x (m, k) @ w^T`, `w` `(n, k)`, over candle's thread pool.
pub(super) fn run<W: WeightElem>(x: &[f32], w: &[W], y: &mut [f32], m: usize, n: usize, k: usize) {
    debug_assert!(x.len() == m * k && w.len() == n * k && y.len() == m * n);
    let y_ptr = y.as_mut_ptr() as usize;
    let tasks = n.div_ceil(ROWS_PER_TASK);
    let simd = Simd::detect();
    candle_core::utils::barrier_pool().execute_chunked(tasks, |range| {
        for task in range {
            let r0 = task * ROWS_PER_TASK;
            let rows = ROWS_PER_TASK.min(n - r0);
            // SAFETY: tasks own disjoint output columns r0..r0 + rows of every row of `y`, which
            // outlives the pool's call; the slices are in bounds by the checks of `run`'s callers.
            unsafe {
                let y = y_ptr as *mut f32;
                let w = &w[r0 * k..(r0 + rows) * k];
                #[cfg(target_arch = "x86_64")]
                match simd {
                    Simd::Avx512 if k.is_multiple_of(16) => {
                        x86::columns512(x, w, y, m, n, k, r0);
                        continue;
                    }
                    Simd::Avx512 | Simd::Avx2 if k.is_multiple_of(8) => {
                        x86::columns256(x, w, y, m, n, k, r0);
                        continue;
                    }
                    _ => {}
                }
                let _ = simd;
                scalar_columns(x, w, y, n, k, r0);
            }
        }
    });
}

/// The widest vector kernel this CPU runs (detected once per call; `is_x86_feature_detected`
/// caches).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Simd {
    Avx512,
    Avx2,
    None,
}

impl Simd {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c");
            if avx2 && std::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if avx2 {
                return Self::Avx2;
            }
        }
        Self::None
    }
}

/// Output columns `col0..col0 + w.len() / k` of every row, one dot product at a time.
///
/// # Safety
/// `y` must be valid for `m * n` writes and no other thread may write those columns.
unsafe fn scalar_columns<W: WeightElem>(x: &[f32], w: &[W], y: *mut f32, n: usize, k: usize, col0: usize) {
    for (j, wr) in w.chunks_exact(k).enumerate() {
        for (i, xr) in x.chunks_exact(k).enumerate() {
            let dot: f32 = xr.iter().zip(wr).map(|(&a, &b)| a * b.to_f32()).sum();
            unsafe { *y.add(i * n + col0 + j) = dot };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::WeightElem;

    /// A vector register of f32 lanes, for the kernel written once over both widths.
    pub(super) trait Lanes: Copy {
        const N: usize;
        unsafe fn zero() -> Self;
        unsafe fn load_x(p: *const f32) -> Self;
        unsafe fn load_w<W: WeightElem>(p: *const W) -> Self;
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
        unsafe fn sum(self) -> f32;
    }

    impl Lanes for __m256 {
        const N: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm256_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> Self {
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_w<W: WeightElem>(p: *const W) -> Self {
            unsafe { W::load8(p) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            unsafe { _mm256_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            unsafe {
                let s = _mm_add_ps(_mm256_castps256_ps128(self), _mm256_extractf128_ps::<1>(self));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
            }
        }
    }

    impl Lanes for __m512 {
        const N: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { _mm512_setzero_ps() }
        }
        #[inline(always)]
        unsafe fn load_x(p: *const f32) -> Self {
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load_w<W: WeightElem>(p: *const W) -> Self {
            unsafe { W::load16(p) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            unsafe { _mm512_fmadd_ps(a, b, c) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            unsafe { _mm512_reduce_add_ps(self) }
        }
    }

    /// [`super::scalar_columns`] with 256-bit vectors.
    ///
    /// # Safety
    /// As [`super::scalar_columns`]; the CPU must have AVX2, FMA and F16C; `k % 8 == 0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn columns256<W: WeightElem>(
        x: &[f32],
        w: &[W],
        y: *mut f32,
        m: usize,
        n: usize,
        k: usize,
        col0: usize,
    ) {
        unsafe { columns::<W, __m256>(x, w, y, m, n, k, col0) }
    }

    /// [`super::scalar_columns`] with 512-bit vectors.
    ///
    /// # Safety
    /// As [`super::scalar_columns`]; the CPU must have AVX-512F, AVX2, FMA and F16C;
    /// `k % 16 == 0`.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub(super) unsafe fn columns512<W: WeightElem>(
        x: &[f32],
        w: &[W],
        y: *mut f32,
        m: usize,
        n: usize,
        k: usize,
        col0: usize,
    ) {
        unsafe { columns::<W, __m512>(x, w, y, m, n, k, col0) }
    }

    /// The register-blocked kernel: 8 weight rows against one activation row (decode), or 4
    /// against two (each weight load used twice); 8 independent accumulators either way, enough
    /// to hide the FMA latency. Every output is one accumulator over `k` in the same order
    /// whatever the block, so a row's result does not depend on the other rows of the batch
    /// (batch-invariant: a sequence decodes the same alone or batched, with or without a
    /// cached prefix).
    #[inline(always)]
    unsafe fn columns<W: WeightElem, L: Lanes>(
        x: &[f32],
        w: &[W],
        y: *mut f32,
        m: usize,
        n: usize,
        k: usize,
        col0: usize,
    ) {
        let rows = w.len() / k;
        let (x, w) = (x.as_ptr(), w.as_ptr());
        let mut i = 0;
        if m == 1 {
            let mut j = 0;
            while j + 8 <= rows {
                unsafe { block::<W, L, 8, 1>(x, w.add(j * k), y.add(col0 + j), n, k) };
                j += 8;
            }
            while j < rows {
                unsafe { block::<W, L, 1, 1>(x, w.add(j * k), y.add(col0 + j), n, k) };
                j += 1;
            }
            return;
        }
        // With 32 vector registers (AVX-512), 4 x 4 blocks: 16 accumulators, each weight load used
        // four times.
        while L::N == 16 && i + 4 <= m {
            let (xi, yi) = unsafe { (x.add(i * k), y.add(i * n + col0)) };
            let mut j = 0;
            while j + 4 <= rows {
                unsafe { block::<W, L, 4, 4>(xi, w.add(j * k), yi.add(j), n, k) };
                j += 4;
            }
            while j < rows {
                unsafe { block::<W, L, 1, 4>(xi, w.add(j * k), yi.add(j), n, k) };
                j += 1;
            }
            i += 4;
        }
        while i + 2 <= m {
            let (xi, yi) = unsafe { (x.add(i * k), y.add(i * n + col0)) };
            let mut j = 0;
            while j + 4 <= rows {
                unsafe { block::<W, L, 4, 2>(xi, w.add(j * k), yi.add(j), n, k) };
                j += 4;
            }
            while j < rows {
                unsafe { block::<W, L, 1, 2>(xi, w.add(j * k), yi.add(j), n, k) };
                j += 1;
            }
            i += 2;
        }
        if i < m {
            let (xi, yi) = unsafe { (x.add(i * k), y.add(i * n + col0)) };
            for j in 0..rows {
                unsafe { block::<W, L, 1, 1>(xi, w.add(j * k), yi.add(j), n, k) };
            }
        }
    }

    /// `y[i * n + j] = x[i] . w[j]` for `R` weight rows and `M` activation rows.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // acc[i][j] reads as the formula
    unsafe fn block<W: WeightElem, L: Lanes, const R: usize, const M: usize>(
        x: *const f32,
        w: *const W,
        y: *mut f32,
        n: usize,
        k: usize,
    ) {
        unsafe {
            let mut acc = [[L::zero(); R]; M];
            let mut c = 0;
            while c < k {
                let mut xv = [L::zero(); M];
                for (i, v) in xv.iter_mut().enumerate() {
                    *v = L::load_x(x.add(i * k + c));
                }
                for j in 0..R {
                    let wv = L::load_w(w.add(j * k + c));
                    for i in 0..M {
                        acc[i][j] = L::fma(wv, xv[i], acc[i][j]);
                    }
                }
                c += L::N;
            }
            for i in 0..M {
                for j in 0..R {
                    *y.add(i * n + j) = acc[i][j].sum();
                }
            }
        }
    }
}
