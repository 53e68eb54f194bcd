//! The instruction-set layer, in one place: which vector instructions this CPU runs ([`Simd`]),
//! sixteen f32 lanes on each of them ([`Vec16`]: `portable`, `avx2`, `avx512`), running a kernel
//! compiled for one of them ([`Simd::run`]), and Intel's AMX tiles (`amx`: detection and the
//! kernel's permission).
//!
//! Every kernel takes the [`Simd`] it runs on, so that tests run each path the host has against
//! the portable one. A kernel is written once, generic over [`Vec16`] (or as plain Rust that the
//! compiler vectorises): [`Simd::run`] monomorphises it inside a function compiled for the chosen
//! instructions (the `pulp` crate's pattern; `std::simd` is nightly-only). The x86 intrinsics of
//! one instruction set live in its file here; kernels that need more than [`Vec16`] offers (the
//! attention's horizontal sums, the AMX tile instructions) dispatch on [`Simd`] themselves.

pub(crate) mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

use std::sync::OnceLock;

/// Rows per register tile of the packed kernel on `V`: [`Vec16::PANEL_ROWS`] where it tiles one
/// panel at a time, else [`Vec16::ROWS`].
#[inline(always)]
pub(crate) fn tile_height<V: Vec16>() -> usize {
    if V::PANEL_ROWS > 0 {
        V::PANEL_ROWS
    } else {
        V::ROWS
    }
}

/// f32 lanes of a [`Vec16`].
pub(crate) const LANES: usize = 16;

/// The instruction sets the kernels are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// AVX-512 (F and BW) with AVX2, FMA and F16C.
    Avx512,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// Plain Rust (`f32::mul_add`): any CPU, and the reference of the others.
    Portable,
}

impl Simd {
    /// The widest this CPU runs (detected once).
    pub fn detect() -> Self {
        Self::available()[0]
    }

    /// Every one this CPU runs, widest first (detected once).
    pub fn available() -> &'static [Self] {
        static AVAILABLE: OnceLock<Vec<Simd>> = OnceLock::new();
        AVAILABLE.get_or_init(|| {
            let mut out = Vec::new();
            #[cfg(target_arch = "x86_64")]
            {
                let avx2 = std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c");
                if avx2 && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
                    out.push(Simd::Avx512);
                }
                if avx2 {
                    out.push(Simd::Avx2);
                }
            }
            out.push(Simd::Portable);
            out
        })
    }

    /// Whether this CPU runs `self`.
    pub fn is_available(self) -> bool {
        Self::available().contains(&self)
    }

    /// Rows of `a` in one register tile of the packed kernel on these lanes (12 on AVX-512, 6
    /// on AVX2, 2 on the portable lanes): how much of each cache line a tile uses where it reads
    /// `a`'s columns.
    pub fn tile_rows(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => tile_height::<std::arch::x86_64::__m512>(),
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => tile_height::<avx2::Y2>(),
            _ => tile_height::<[f32; LANES]>(),
        }
    }

    /// `kernel` on this instruction set's lanes, compiled for it.
    ///
    /// # Panics
    /// If this CPU does not run `self` (a `Simd` not taken from [`Simd::available`]): running
    /// instructions the CPU lacks would be undefined behaviour.
    #[inline(always)]
    pub(crate) fn run<K: Kernel>(self, kernel: K) -> K::Output {
        assert!(self.is_available(), "{self:?} is not available on this CPU");
        match self {
            // SAFETY: available (asserted above).
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => unsafe { avx512::run(kernel) },
            // SAFETY: available (asserted above).
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => unsafe { avx2::run(kernel) },
            _ => kernel.run::<[f32; LANES]>(),
        }
    }
}

/// The cache a prefetch asks lines into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CacheLevel {
    L1,
    L2,
}

/// The `bytes` from `start` asked into `level`, a line (64 bytes) at a time, where the CPU has
/// such a hint (nothing elsewhere): for short streams that the hardware's prefetchers learn too
/// late. A prefetch reads nothing architecturally and faults on no address, so any range will do.
#[inline(always)]
pub(crate) fn prefetch_lines(start: *const u8, bytes: usize, level: CacheLevel) {
    #[cfg(target_arch = "x86_64")]
    for at in (0..bytes).step_by(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let line = start.wrapping_add(at) as *const i8;
        // SAFETY: SSE is part of x86-64; a prefetch reads nothing and does not fault.
        unsafe {
            match level {
                CacheLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(line),
                CacheLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(line),
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, bytes, level);
}

/// MXCSR's DAZ (subnormal inputs read as zero) and FTZ (subnormal results flushed to zero) set
/// on this thread while it lives, and the previous value back when it drops: `vdpbf16ps`'s
/// arithmetic for f32 instructions (the bf16 products on f32 fused multiply-adds), without a
/// compare and blend after every multiply-add. (Rust's `_mm_setcsr` is deprecated; the two
/// instructions are written with `asm!`.)
#[cfg(target_arch = "x86_64")]
pub(crate) struct FlushSubnormals(u32);

#[cfg(target_arch = "x86_64")]
impl FlushSubnormals {
    const DAZ: u32 = 1 << 6;
    const FTZ: u32 = 1 << 15;

    pub(crate) fn new() -> Self {
        let mut old = 0u32;
        // SAFETY: `stmxcsr` writes the 4 bytes at the pointer; every x86-64 CPU has SSE.
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut old, options(nostack, preserves_flags)) };
        let new = old | Self::DAZ | Self::FTZ;
        // SAFETY: `ldmxcsr` reads the 4 bytes at the pointer, a valid MXCSR value (the old one
        // with two mode bits set, which every CPU with SSE2 has).
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &new, options(nostack, preserves_flags, readonly)) };
        Self(old)
    }
}

#[cfg(target_arch = "x86_64")]
impl Drop for FlushSubnormals {
    fn drop(&mut self) {
        // SAFETY: as in `new`: the value read there.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &self.0, options(nostack, preserves_flags, readonly)) };
    }
}

/// `f` compiled for the widest instruction set this CPU runs, so that the plain loops in it
/// vectorise for AVX-512 or AVX2 (with FMA) rather than for the build's baseline (x86-64's SSE2):
/// the element-wise passes of training and the optimizer go through this. Vectorising a loop of
/// independent values does not change its results (the compiler does not reorder sums of floats
/// nor fuse a multiply and an add on its own), so every instruction set gives the same bits.
/// `f` must be `#[inline(always)]` (and so must the closures it calls), or it is compiled apart,
/// for the baseline.
#[inline(always)]
pub fn vectorised<R>(f: impl FnOnce() -> R) -> R {
    vectorised_on(Simd::detect(), f)
}

/// [`vectorised`] for the instruction set `simd` (tests compare them).
///
/// # Panics
/// If this CPU does not run `simd`.
#[inline(always)]
pub fn vectorised_on<R>(simd: Simd, f: impl FnOnce() -> R) -> R {
    /// `f` as a [`Kernel`] that ignores its lanes.
    struct Plain<F>(F);
    impl<R, F: FnOnce() -> R> Kernel for Plain<F> {
        type Output = R;
        #[inline(always)]
        fn run<V: Vec16>(self) -> R {
            (self.0)()
        }
    }
    simd.run(Plain(f))
}

/// Writes the transpose of the 8 x 8 block of f32 at `src` (rows `src_stride` values apart) to
/// `dst` (rows `dst_stride` apart), on `simd`: the blocks of [`transpose`]. Compilers do not turn
/// the element-by-element copy into register shuffles; it moved ~4.7 GB/s (EPYC, Zen 3), a
/// quarter of a small weight gradient's product.
///
/// # Safety
/// `src` readable and `dst` writable at 8 rows of 8 values each; the blocks do not overlap.
#[inline]
pub(crate) unsafe fn transpose8(simd: Simd, src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
    match simd {
        // SAFETY: both imply AVX (detected), and the caller's contract is `transpose8`'s.
        #[cfg(target_arch = "x86_64")]
        Simd::Avx512 | Simd::Avx2 => unsafe { avx2::transpose8(src, src_stride, dst, dst_stride) },
        _ => {
            for r in 0..8 {
                for c in 0..8 {
                    // SAFETY: within the two blocks (the caller's contract).
                    unsafe { *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c) };
                }
            }
        }
    }
}

/// Writes the transpose of the `rows x cols` matrix at `src` (rows `src_stride` values apart)
/// to `dst` (`cols x rows`, rows `dst_stride` apart), on `simd`: 8 x 8 blocks by [`transpose8`],
/// the edges value by value.
///
/// # Safety
/// `src` readable at `rows` rows of `cols` values, `dst` writable at `cols` rows of `rows`; they
/// do not overlap.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn transpose(
    simd: Simd,
    src: *const f32,
    src_stride: usize,
    dst: *mut f32,
    dst_stride: usize,
    rows: usize,
    cols: usize,
) {
    let (whole_rows, whole_cols) = (rows / 8 * 8, cols / 8 * 8);
    // SAFETY: every block and edge value lies within the two matrices (the caller's contract).
    unsafe {
        for r0 in (0..whole_rows).step_by(8) {
            for c0 in (0..whole_cols).step_by(8) {
                let at = src.add(r0 * src_stride + c0);
                transpose8(simd, at, src_stride, dst.add(c0 * dst_stride + r0), dst_stride);
            }
        }
        for r in 0..rows {
            let done = if r < whole_rows { whole_cols } else { 0 };
            for c in done..cols {
                *dst.add(c * dst_stride + r) = *src.add(r * src_stride + c);
            }
        }
    }
}

/// A computation written once for any [`Vec16`], run by [`Simd::run`] on one instruction set.
/// Its `run` should be `#[inline(always)]` (and so should what it calls), so that it compiles
/// inside the instruction set's function; a kernel of plain Rust can ignore `V` and still be
/// vectorised for the instruction set.
pub(crate) trait Kernel {
    type Output;
    fn run<V: Vec16>(self) -> Self::Output;
}

/// Sixteen f32 lanes: an AVX-512 register, two AVX2 registers, or an array.
///
/// # Safety
/// An implementation's methods may use only the instructions of the [`Simd`] whose `run` uses
/// it (the caller checks that instruction set once, in [`Simd::run`]), and each touches exactly
/// the memory its contract names: the 16 lanes (64 bytes of f32, 32 of f16 or bf16, 16 of
/// nibble pairs) at the pointer given, unaligned. Callers of the `unsafe` methods guarantee that
/// this memory is valid.
pub(crate) unsafe trait Vec16: Copy {
    /// Activation rows per register tile of the packed kernel.
    const ROWS: usize;
    /// Rows per tile of one panel (16 columns) instead of two, where that fits the register
    /// file better; 0: two-panel tiles of [`Vec16::ROWS`] rows.
    const PANEL_ROWS: usize = 0;
    /// # Safety
    /// As the trait.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As the trait.
    unsafe fn set1(v: f32) -> Self;
    /// `*p` in every lane.
    /// # Safety
    /// `p` valid for one f32.
    unsafe fn splat(p: *const f32) -> Self;
    /// `a * b + c`, rounded once.
    /// # Safety
    /// As the trait.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// # Safety
    /// `p` valid for 64 bytes.
    unsafe fn load_f32(p: *const u8) -> Self;
    /// # Safety
    /// `p` valid for 32 bytes.
    unsafe fn load_f16(p: *const u8) -> Self;
    /// # Safety
    /// `p` valid for 32 bytes.
    unsafe fn load_bf16(p: *const u8) -> Self;
    /// # Safety
    /// `p` valid for writing 16 f32.
    unsafe fn store(self, p: *mut f32);
    /// A hint to bring the cache line at `p` in (no effect where there is none).
    /// # Safety
    /// None beyond the trait's: a prefetch does not fault on any address.
    unsafe fn prefetch(_p: *const u8) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instruction set's 8 x 8 transpose moves each value of a block read from wider rows
    /// into its transposed place in wider rows, and nothing else.
    #[test]
    fn transpose8_moves_each_value_to_its_transposed_place() {
        let (src_stride, dst_stride) = (11, 13);
        let src: Vec<f32> = (0..8 * src_stride).map(|i| i as f32).collect();
        for &simd in Simd::available() {
            let mut dst = vec![-1f32; 8 * dst_stride];
            // SAFETY: 8 rows of `src_stride` and of `dst_stride` values, 8 used of each.
            unsafe { transpose8(simd, src.as_ptr(), src_stride, dst.as_mut_ptr(), dst_stride) };
            for r in 0..8 {
                for c in 0..dst_stride {
                    let want = if c < 8 { src[c * src_stride + r] } else { -1.0 };
                    assert_eq!(dst[r * dst_stride + c], want, "{simd:?} row {r} column {c}");
                }
            }
        }
    }
}
