//! The register-tiled products of the CPU's window attention (`q kᵀ`, `P v` and their
//! gradients' products), on [`Vec16`] lanes, skipping the terms the causal mask makes zero.

use super::Dims;
use crate::simd::{Vec16, LANES};

/// A row-major matrix operand of [`gemm`]: its first element and its row stride.
#[derive(Clone, Copy)]
pub(super) struct Mat<P> {
    ptr: P,
    ld: usize,
}

/// Slices as [`gemm`]'s operands, with a row stride.
pub(super) trait AsMat {
    fn at(&self, ld: usize) -> Mat<*const f32>;
    fn at_mut(&mut self, ld: usize) -> Mat<*mut f32>;
}

impl AsMat for [f32] {
    fn at(&self, ld: usize) -> Mat<*const f32> {
        Mat { ptr: self.as_ptr(), ld }
    }
    fn at_mut(&mut self, ld: usize) -> Mat<*mut f32> {
        Mat {
            ptr: self.as_mut_ptr(),
            ld,
        }
    }
}

impl<P: Copy> Mat<P> {
    /// The matrix at `ptr` with rows `ld` values apart.
    pub(super) fn new(ptr: P, ld: usize) -> Self {
        Self { ptr, ld }
    }
}

impl Mat<*const f32> {
    /// The same matrix from row `i` on.
    ///
    /// # Safety
    /// Row `i` lies within the memory the matrix names.
    pub(super) unsafe fn rows_from(self, i: usize) -> Self {
        // SAFETY: the caller's contract.
        Self::new(unsafe { self.ptr.add(i * self.ld) }, self.ld)
    }
}

/// A block's unscaled scores `q kᵀ`, rows `i0..i0 + m` against keys `..n`, into `p`: `q` the
/// block's first query row (`hs` columns), `kᵀ` `(hs, tp)`, `p` `(m, tp)`.
///
/// # Safety
/// `q` holds the block's `m` rows of `hs`, `kᵀ` `hs` rows of `n <= tp` keys (zero past `t`), `p`
/// `m` rows of `n`; `p` overlaps neither.
#[inline(always)]
pub(super) unsafe fn scores<V: Vec16>(
    d: Dims,
    i0: usize,
    m: usize,
    n: usize,
    q: Mat<*const f32>,
    kt: Mat<*const f32>,
    p: Mat<*mut f32>,
) {
    // SAFETY: the caller's contract.
    unsafe { gemm::<V>(m, n, d.hs, q, kt, p, false, Causal::KeyColumns(i0)) }
}

/// `c = a @ b` (or `c += a @ b` when `accumulate`) for `a` `(m, k)`, `b` `(k, n)` with `n` a
/// multiple of 16, and `c` `(m, n)`: register tiles of `R` rows by 32 columns (16 at the edge),
/// each output one chain of multiply-adds over `k` in order. A small kernel of its own rather
/// than the packed one ([`crate::PackedMatrix`]): these operands are already in cache and laid
/// out for it, and at these sizes (k of 32 to 256) packing them would cost as much as the
/// products.
///
/// `causal` says which terms the causal mask makes zero, so that they are skipped: half of a
/// block's products at the diagonal. Skipping a zero term leaves every sum's bits as they were.
///
/// # Safety
/// The memory named is valid (`c`'s for writing) and `c` overlaps neither operand.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn gemm<V: Vec16>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<*const f32>,
    b: Mat<*const f32>,
    c: Mat<*mut f32>,
    acc: bool,
    causal: Causal,
) {
    debug_assert!(n.is_multiple_of(LANES));
    // AVX-512's 32 registers hold 6 x 2 accumulators beside the operands. Two AVX2 registers
    // make one `Vec16`, and 16 of them hold 6 x 1 (12 accumulators, as the packed kernel's
    // tiles there): with 2 x 2 (8), two FMA pipes of latency 4 had no slack, and each step
    // loaded 4 vectors for 8 FMAs against 2 for 12.
    if V::ROWS >= 8 {
        // SAFETY: the caller's contract.
        unsafe { gemm_rows::<V, 6, 2>(m, n, k, a, b, c, acc, causal) }
    } else if V::PANEL_ROWS >= 6 {
        // SAFETY: the caller's contract.
        unsafe { gemm_rows::<V, 6, 1>(m, n, k, a, b, c, acc, causal) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { gemm_rows::<V, 2, 2>(m, n, k, a, b, c, acc, causal) }
    }
}

/// Which terms of one of the attention's products the causal mask makes zero, for the block of
/// queries that starts at position `i0` (the payload): query `i0 + r` sees keys `..=i0 + r`.
#[derive(Debug, Clone, Copy)]
pub(super) enum Causal {
    /// `c`'s rows are queries and its columns keys (scores, their gradient): a row tile's
    /// columns past its last query's keys are left unwritten (the caller zeroes them).
    KeyColumns(usize),
    /// `a`'s rows are queries and the sums run over keys (`P v`, `dZ k`): a row tile's sums stop
    /// after its last query's keys (the weights past them are zero).
    KeySums(usize),
    /// `c`'s columns are keys and the sums run over the block's queries (`dyᵀ S`, `qᵀ dZ`): a
    /// column tile's sums start at the first query that sees its first key.
    QuerySums(usize),
}

/// [`gemm`] with tiles of `R` rows (at most 6; the bottom edge's fewer) by `16 W` columns (`W`
/// 1 or 2; 16 at the right edge).
///
/// # Safety
/// As [`gemm`].
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn gemm_rows<V: Vec16, const R: usize, const W: usize>(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<*const f32>,
    b: Mat<*const f32>,
    c: Mat<*mut f32>,
    acc: bool,
    causal: Causal,
) {
    let (a_all, c_all) = (a, c);
    let mut i = 0;
    while i < m {
        let rows = R.min(m - i);
        // Keys the tile's last query sees.
        let seen = |i0: usize| i0 + i + rows;
        let (n, k_end) = match causal {
            Causal::KeyColumns(i0) => (n.min(seen(i0).next_multiple_of(LANES)), k),
            Causal::KeySums(i0) => (n, k.min(seen(i0))),
            Causal::QuerySums(_) => (n, k),
        };
        // SAFETY: rows `i..i + rows` of `a` and `c`: within the caller's operands.
        let (a, c) = unsafe { (a.ptr.add(i * a.ld), c.ptr.add(i * c.ld)) };
        let mut j = 0;
        while j < n {
            let width = if W == 2 && j + 2 * LANES <= n { 2 } else { 1 };
            let k_start = match causal {
                Causal::QuerySums(i0) => j.saturating_sub(i0).min(k_end),
                _ => 0,
            };
            // SAFETY: columns `j..j + 16 * width` of `b` and of these rows of `c`: within the
            // caller's operands.
            unsafe {
                let (a, b, c) = (
                    Mat { ptr: a, ..a_all },
                    Mat { ptr: b.ptr.add(j), ..b },
                    Mat { ptr: c.add(j), ..c_all },
                );
                let k = k_start..k_end;
                if width == 2 {
                    tile_of::<V, 2>(rows, k, a, b, c, acc)
                } else {
                    tile_of::<V, 1>(rows, k, a, b, c, acc)
                }
            }
            j += width * LANES;
        }
        i += rows;
    }
}

/// [`tile`] for `rows` (1 to 6) rows: the bottom edge's rows in one tile too, rather than as
/// single rows, whose tiles have only two chains of multiply-adds each to hide the latency.
///
/// # Safety
/// As [`gemm`], for the tile's rows and columns.
#[inline(always)]
pub(super) unsafe fn tile_of<V: Vec16, const W: usize>(
    rows: usize,
    k: std::ops::Range<usize>,
    a: Mat<*const f32>,
    b: Mat<*const f32>,
    c: Mat<*mut f32>,
    accumulate: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match rows {
            6 => tile::<V, 6, W>(k, a, b, c, accumulate),
            5 => tile::<V, 5, W>(k, a, b, c, accumulate),
            4 => tile::<V, 4, W>(k, a, b, c, accumulate),
            3 => tile::<V, 3, W>(k, a, b, c, accumulate),
            2 => tile::<V, 2, W>(k, a, b, c, accumulate),
            _ => tile::<V, 1, W>(k, a, b, c, accumulate),
        }
    }
}

/// One `R x 16 W` tile of [`gemm`]: `R * W` accumulators in registers over the positions `k`.
///
/// # Safety
/// As [`gemm`], for the tile's rows and columns.
#[inline(always)]
pub(super) unsafe fn tile<V: Vec16, const R: usize, const W: usize>(
    k: std::ops::Range<usize>,
    a: Mat<*const f32>,
    b: Mat<*const f32>,
    c: Mat<*mut f32>,
    accumulate: bool,
) {
    // SAFETY: the caller's contract: the tile's operands are valid.
    unsafe {
        let mut acc = [[V::zero(); W]; R];
        for p in k {
            let mut bv = [V::zero(); W];
            for (w, bv) in bv.iter_mut().enumerate() {
                *bv = V::load_f32(b.ptr.add(p * b.ld + w * LANES) as *const u8);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let av = V::splat(a.ptr.add(r * a.ld + p));
                for (acc, &bv) in acc.iter_mut().zip(&bv) {
                    *acc = V::fma(av, bv, *acc);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (w, &acc) in acc.iter().enumerate() {
                let out = c.ptr.add(r * c.ld + w * LANES);
                let v = if accumulate {
                    // 1 · c + acc, rounded once: the sum.
                    V::fma(V::set1(1.0), V::load_f32(out as *const u8), acc)
                } else {
                    acc
                };
                v.store(out);
            }
        }
    }
}
