//! f32 products on Intel's AMX tiles, for [`crate::MatmulPrecision::High`]: each f32 operand
//! split into two bf16 (`hi = bf16(v)`, `lo = bf16(v - hi)`, 16 of f32's 24 mantissa bits) and
//! `x @ W^T` taken as `hi·lo + hi·hi + lo·hi` with bf16 tile products (`tdpbf16ps`) accumulated in
//! f32: PyTorch's `set_float32_matmul_precision("high")` on such CPUs (oneDNN's "bf16x3").
//! Relative error about 1e-5 of `Σ|x||w|` instead of f32's ~1e-7; the arithmetic rate of a
//! Sapphire Rapids core is several times its AVX-512 FMA rate, so prefill runs at the memory's
//! rate instead of the FMA units'. bf16 weights are their own `hi` (`lo` is zero), so their
//! products are `hi·w + lo·w`: two tile products, the activations split as above, and half the
//! weight bytes to stream.
//!
//! Why by hand: neither candle nor the `gemm` crate uses AMX, and Rust's AMX intrinsics are
//! nightly-only; the few instructions are written with `asm!`.
//!
//! Layout: the weights in panels of 16 output columns as in the f32 kernel, each panel in blocks
//! of 32 positions along `k`: the block's `hi` tile then (f32 weights) its `lo` tile, each 16 rows
//! (pairs of positions) of 16 columns x 2 bf16 (the "VNNI" order `tdpbf16ps` reads). Activations are split
//! per call into the same tile order (per 16 rows, per block: `hi` tile, `lo` tile), rows padded
//! to 16 and `k` to 32 with zeros.
//! A task (two panels, as in the f32 kernel) holds four 16 x 16 f32 accumulators (tmm0-3) for 32
//! rows x 32 columns, two activation tiles (tmm4-5) and two weight tiles (tmm6-7). Every output
//! is the same chain of tile products along `k` whatever the row count, so results do not
//! depend on the batch.

use std::mem::MaybeUninit;

use super::epilogue::Epilogue;
use super::WeightFormat;
use super::{PackedMatrix, Simd, GROUP, LANES};
use crate::simd::{Kernel, Vec16};

/// Positions along `k` per tile product: one 64-byte tile row of bf16.
const KB: usize = 32;
/// Rows of a tile.
const TILE_ROWS: usize = 16;
/// Bytes of one tile (16 rows of 64 bytes).
const TILE_BYTES: usize = 1024;

/// `v` as `hi + lo`, both bf16 rounded to nearest even (bits; NaN and infinity not kept).
#[inline(always)]
fn split(v: f32) -> (u16, u16) {
    let round = |v: f32| {
        let u = v.to_bits();
        (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
    };
    let hi = round(v);
    (hi, round(v - f32::from_bits((hi as u32) << 16)))
}

/// [`split`] over a row, vectorised (a scalar loop here cost more than the tile products at
/// 40 rows).
#[inline(always)]
fn split_row(x: &[f32], hi: &mut [u16], lo: &mut [u16]) {
    for ((&v, h), l) in x.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
        (*h, *l) = split(v);
    }
}

/// [`split_row`] as a kernel, vectorised for the instruction set that runs it.
struct SplitRow<'a> {
    x: &'a [f32],
    hi: &'a mut [u16],
    lo: &'a mut [u16],
}

impl Kernel for SplitRow<'_> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        split_row(self.x, self.hi, self.lo)
    }
}

/// Weight tiles per block and panel: 2 (`hi`, `lo`) for f32 weights, 1 for bf16 ones.
fn weight_tiles(format: WeightFormat) -> usize {
    if format == WeightFormat::Bf16 {
        1
    } else {
        2
    }
}

/// The weights of an f32 or bf16 [`PackedMatrix`], split and laid out for the tiles (module
/// notes).
pub(crate) struct AmxWeights {
    /// `k` rounded up to 32.
    kp: usize,
    /// Per panel, `kp / 32` blocks of [`weight_tiles`] tiles.
    tiles: Vec<super::Line>,
}

impl AmxWeights {
    /// The tiles of `w`, f32 or bf16 (the caller checks).
    pub(crate) fn new(w: &PackedMatrix) -> Self {
        let (n, k) = (w.n, w.k);
        let halves = weight_tiles(w.format);
        let kp = k.div_ceil(KB) * KB;
        let panels = n.div_ceil(LANES * GROUP) * GROUP;
        let mut tiles = vec![super::Line([0; 64]); panels * kp / KB * halves * TILE_BYTES / 64];
        // SAFETY: `Line` is plain bytes; u16 needs 2-byte alignment (lines are 64-aligned).
        let words = unsafe { std::slice::from_raw_parts_mut(tiles.as_mut_ptr() as *mut u16, tiles.len() * 32) };
        for r in 0..n {
            let (panel, lane) = (r / LANES, r % LANES);
            for c in 0..k {
                // A bf16 weight splits into itself and zero.
                let (hi, lo) = split(w.value(r, c));
                let (block, t, e) = (c / KB, c % KB / 2, c % 2);
                let at = (panel * (kp / KB) + block) * halves * (TILE_BYTES / 2) + (t * LANES + lane) * 2 + e;
                words[at] = hi;
                if halves == 2 {
                    words[at + TILE_BYTES / 2] = lo;
                }
            }
        }
        Self { kp, tiles }
    }
}

/// `y = x @ W^T` (then the epilogue) for `x` `(m, k)`, on the tiles; [`crate::simd::amx::available`] must hold.
/// Every element of `y` is written, so it may start uninitialised.
/// With [`Tiles::Emulated`] the tile products are computed in plain Rust instead
/// ([`emulated`]), on any CPU.
pub(super) fn run(
    w: &PackedMatrix,
    t: &AmxWeights,
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    m: usize,
    ep: Epilogue,
    tiles: Tiles,
) {
    let (n, k, kp) = (w.n, w.k, t.kp);
    let mp = m.div_ceil(TILE_ROWS) * TILE_ROWS;
    // The activations' halves, zero-padded, tile by tile: per 16 rows, per block of 32
    // positions, the `hi` tile then the `lo` tile (1 KiB each, read front to back).
    let blocks = kp / KB;
    let mut halves = vec![0u16; mp * kp * 2];
    for (i, row) in x.chunks_exact(k).enumerate() {
        for (b, part) in row.chunks(KB).enumerate() {
            let at = ((i / TILE_ROWS * blocks + b) * 2 * TILE_ROWS + i % TILE_ROWS) * KB;
            let (hi, lo) = halves[at..].split_at_mut(TILE_ROWS * KB);
            Simd::detect().run(SplitRow {
                x: part,
                hi: &mut hi[..part.len()],
                lo: &mut lo[..part.len()],
            });
        }
    }
    let groups = n.div_ceil(LANES * GROUP);
    let (a_at, y_at) = (halves.as_ptr() as usize, y.as_mut_ptr() as usize);
    let w_at = t.tiles.as_ptr() as usize;
    let per_block = weight_tiles(w.format);
    let panel_bytes = kp / KB * per_block * TILE_BYTES;
    candle_core::utils::barrier_pool().execute_chunked(groups, |range| {
        if tiles == Tiles::Hardware {
            // SAFETY: `available()` (the caller's contract) granted this process the tile state;
            // the configuration is this thread's own, set before and released after its tiles.
            unsafe { hardware::configure(m.min(TILE_ROWS)) };
        }
        let mut acc = Acc([[0.0; LANES]; 4 * TILE_ROWS]);
        let (first, end) = (range.start, range.end);
        // Memory streams while the tiles work: each pass over a task's panels (two row tiles a
        // pass) prefetches its share of the next task's panels, spread evenly over its blocks,
        // so that memory is as busy in the passes from cache as in the first. The range's first
        // task also prefetches its own panels ahead, in its first pass.
        let passes = mp.div_ceil(2 * TILE_ROWS);
        let task_bytes = GROUP * panel_bytes;
        let step = (task_bytes / 64).div_ceil(passes * blocks) * 64;
        for g in range {
            let col0 = g * GROUP * LANES;
            let cols = (n - col0).min(GROUP * LANES);
            let panels = (w_at + g * GROUP * panel_bytes) as *const u8;
            let next = if g + 1 < end {
                panels.wrapping_add(task_bytes)
            } else {
                std::ptr::null()
            };
            for (pass, r0) in (0..mp).step_by(2 * TILE_ROWS).enumerate() {
                let two = mp - r0 >= 2 * TILE_ROWS;
                let a = Operands {
                    a: (a_at + r0 / TILE_ROWS * blocks * 2 * TILE_BYTES) as *const u8,
                    b: panels,
                    panel_bytes,
                    blocks,
                    own: g == first && pass == 0,
                    next: Stream {
                        at: next,
                        from: pass * blocks * step,
                        step,
                    },
                };
                let acc_at = acc.0.as_mut_ptr() as *mut f32;
                // SAFETY: the operands lie within `halves` (row tiles from r0, one or two, all
                // below mp) and the task's two panels; `acc` holds four tiles; the tiles are
                // configured (hardware) or not needed (emulated).
                unsafe {
                    match (tiles, per_block) {
                        (Tiles::Hardware, 2) => hardware::block(&a, two, acc_at),
                        (Tiles::Hardware, _) => hardware::block_bf16(&a, two, acc_at),
                        (Tiles::Emulated, _) => emulated::block(&a, two, per_block, acc_at),
                    }
                };
                let rows = (m - r0).min(2 * TILE_ROWS);
                for i in 0..rows {
                    let (tile_row, i_t) = (i / TILE_ROWS, i % TILE_ROWS);
                    for panel in 0..cols.div_ceil(LANES) {
                        let tile = tile_row * 2 + panel;
                        let from = &acc.0[tile * TILE_ROWS + i_t];
                        let len = (cols - panel * LANES).min(LANES);
                        // SAFETY: row r0 + i < m and columns col0 + panel * 16 + j < n: inside
                        // `y`, and only this task writes these columns.
                        unsafe {
                            let to = (y_at as *mut f32).add((r0 + i) * n + col0 + panel * LANES);
                            if len == LANES {
                                // A whole row of the tile: a fixed-size copy (a `memmove` call
                                // per 64 bytes otherwise).
                                (to as *mut [f32; LANES]).write_unaligned(*from);
                            } else {
                                std::ptr::copy_nonoverlapping(from.as_ptr(), to, len);
                            }
                        }
                    }
                }
            }
            // SAFETY: this task's columns of `y`, written above; AMX's CPUs all have AVX-512.
            unsafe { super::epilogue::epilogue(ep, Simd::detect(), y_at as *mut f32, 0, m, n, col0, cols) };
        }
        if tiles == Tiles::Hardware {
            // SAFETY: as `configure`.
            unsafe { hardware::release() };
        }
    });
}

/// Who takes the tile products: the CPU's AMX unit, or plain Rust that follows the instruction's
/// definition ([`emulated`]: any CPU, for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tiles {
    Hardware,
    Emulated,
}

/// Four accumulator tiles of 16 rows of 16 f32, 64-byte aligned for `tilestored`.
#[repr(C, align(64))]
struct Acc([[f32; LANES]; 4 * TILE_ROWS]);

/// One block's operands: the activation tiles from row `r0` on, the task's two panels.
struct Operands {
    a: *const u8,
    b: *const u8,
    panel_bytes: usize,
    blocks: usize,
    /// Whether to prefetch the own panels some blocks ahead.
    own: bool,
    next: Stream,
}

/// The part of the next task's panels that a pass prefetches: block `kb` of the pass the bytes
/// `from + kb * step..` (at most `step`, within the task's panels) from `at` (none when null).
struct Stream {
    at: *const u8,
    from: usize,
    step: usize,
}

#[cfg(target_arch = "x86_64")]
mod hardware {
    use std::arch::asm;

    use super::{Operands, GROUP, TILE_BYTES};

    /// Blocks ahead that [`block`] prefetches the weights.
    const AHEAD: usize = 4;

    /// A block's lines to prefetch, up to three runs of consecutive lines, issued in
    /// [`SLICES`] slices between the tile instructions: a burst of them ahead of the block
    /// fills the core's line-fill buffers and then leaves memory idle while the tiles work.
    /// The `T1` hint (to L2): the tile loads read L2 at ~14 cycles a tile, and interleaved `T1`
    /// prefetches beat a burst of `T0` ones in a model of a two-row-tile pass.
    struct Lines {
        runs: [(*const u8, usize); 3],
        total: usize,
    }

    const SLICES: usize = 8;

    impl Lines {
        fn new(runs: [(*const u8, usize); 3]) -> Self {
            let total = runs.iter().map(|r| r.1).sum();
            Self { runs, total }
        }

        /// Prefetch slice `i` of [`SLICES`].
        #[inline(always)]
        fn slice(&self, i: usize) {
            let (mut from, to) = (i * self.total / SLICES, (i + 1) * self.total / SLICES);
            let mut skipped = 0;
            for &(at, lines) in &self.runs {
                while from < to && from < skipped + lines {
                    let p = at.wrapping_add((from - skipped) * 64);
                    // SAFETY: a prefetch is a hint; it does not fault on any address.
                    unsafe { asm!("prefetcht1 [{p}]", p = in(reg) p, options(nostack, readonly)) };
                    from += 1;
                }
                skipped += lines;
            }
        }
    }

    /// Block `kb`'s operands: the `hi` and `lo` activation tiles of rows 0-15, the block's
    /// weight tiles in the two panels, and its prefetches.
    struct BlockAt {
        ah: *const u8,
        al: *const u8,
        b0: *const u8,
        b1: *const u8,
        pf: Lines,
    }

    impl Operands {
        /// Block `kb` with `wt` weight tiles per block and panel (`super::weight_tiles`).
        ///
        /// # Safety
        /// `kb < self.blocks`.
        #[inline(always)]
        unsafe fn block_at(&self, kb: usize, wt: usize) -> BlockAt {
            // SAFETY: within this function's contract (its `# Safety`): the tiles configured, the operands' rows and blocks readable, `acc` four tiles.
            unsafe {
                let ah = self.a.add(kb * 2 * TILE_BYTES);
                let b0 = self.b.add(kb * wt * TILE_BYTES);
                // The hardware prefetcher does not follow tile loads far enough ahead (past the
                // end of the weights a prefetch is a harmless hint).
                let own = if self.own { wt * TILE_BYTES / 64 } else { 0 };
                let pf = self.prefetches(kb, b0.wrapping_add(AHEAD * wt * TILE_BYTES), own);
                BlockAt {
                    ah,
                    al: ah.add(TILE_BYTES),
                    b0,
                    b1: b0.add(self.panel_bytes),
                    pf,
                }
            }
        }

        /// Block `kb`'s prefetches: `own` lines from `ahead` in each of the task's two panels,
        /// and the block's share of the next task's panels.
        #[inline(always)]
        fn prefetches(&self, kb: usize, ahead: *const u8, own: usize) -> Lines {
            let next = &self.next;
            let from = next.from + kb * next.step;
            let stream = if next.at.is_null() {
                0
            } else {
                (from + next.step).min(GROUP * self.panel_bytes).saturating_sub(from) / 64
            };
            Lines::new([
                (ahead, own),
                (ahead.wrapping_add(self.panel_bytes), own),
                (next.at.wrapping_add(from), stream),
            ])
        }
    }

    #[repr(C, align(64))]
    struct Config([u8; 64]);

    /// Palette 1, tiles 0-7 of 64 bytes a row: the weight tiles (6, 7) of 16 rows, the others of
    /// `rows` (1-16: fewer than 16 when that is all the rows there are, a decode batch, so the
    /// products skip the padding).
    ///
    /// # Safety
    /// AMX available and permitted ([`crate::simd::amx::available`]).
    pub(super) unsafe fn configure(rows: usize) {
        let mut c = Config([0; 64]);
        c.0[0] = 1;
        for t in 0..8 {
            c.0[16 + 2 * t] = 64;
            c.0[48 + t] = if t >= 6 { 16 } else { rows as u8 };
        }
        // SAFETY: the caller's contract; `c` is a valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) c.0.as_ptr(), options(nostack, readonly)) };
    }

    /// # Safety
    /// As [`configure`].
    pub(super) unsafe fn release() {
        // SAFETY: within this function's contract (its `# Safety`): the tiles configured, the operands' rows and blocks readable, `acc` four tiles.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    macro_rules! load {
        ($tmm:literal, $p:expr, $stride:expr) => {
            asm!(concat!("tileloadd ", $tmm, ", [{p} + {s} * 1]"), p = in(reg) $p, s = in(reg) $stride,
                options(nostack, readonly))
        };
    }
    macro_rules! dp {
        ($c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tdpbf16ps ", $c, ", ", $a, ", ", $b),
                options(nostack, nomem)
            )
        };
    }
    macro_rules! store {
        ($tmm:literal, $p:expr) => {
            asm!(concat!("tilestored [{p} + {s} * 1], ", $tmm), p = in(reg) $p, s = in(reg) 64usize,
                options(nostack))
        };
    }

    /// Zeroes the accumulators and loads block 0's first operands: the `hi` activation tiles of
    /// rows 0-15 (tmm4) and 16-31 (tmm5, `two`), and the weight tiles at `w` bytes into each of
    /// the two panels (tmm6, tmm7).
    ///
    /// # Safety
    /// As [`block`].
    #[inline(always)]
    unsafe fn start(a: &Operands, two: bool, w: usize) {
        // SAFETY: within this function's contract (its `# Safety`): the tiles configured, the operands' rows and blocks readable, `acc` four tiles.
        unsafe {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                options(nostack, nomem)
            );
            load!("tmm4", a.a, 64usize);
            load!("tmm6", a.b.add(w), 64usize);
            load!("tmm7", a.b.add(a.panel_bytes + w), 64usize);
            if two {
                load!("tmm5", a.a.add(a.blocks * 2 * TILE_BYTES), 64usize);
            }
        }
    }

    /// Stores the accumulators (rows 16-31's with `two`) into `acc`.
    ///
    /// # Safety
    /// `acc` holds four 16 x 16 f32.
    #[inline(always)]
    unsafe fn finish(two: bool, acc: *mut f32) {
        // SAFETY: within this function's contract (its `# Safety`): the tiles configured, the operands' rows and blocks readable, `acc` four tiles.
        unsafe {
            store!("tmm0", acc);
            store!("tmm1", acc.add(256));
            if two {
                store!("tmm2", acc.add(512));
                store!("tmm3", acc.add(768));
            }
        }
    }

    /// Rows r0..r0 + 32 (`two`) or r0..r0 + 16 of the task's 32 columns into `acc` (tiles in
    /// order rows 0-15 x panel 0, x panel 1, rows 16-31 x panel 0, x panel 1). Per block of 32
    /// positions, in this order: `hi·lo`, `hi·hi`, `lo·hi`.
    ///
    /// # Safety
    /// Tiles configured ([`configure`]); the operands' rows and blocks readable; `acc` holds
    /// four 16 x 16 f32.
    pub(super) unsafe fn block(a: &Operands, two: bool, acc: *mut f32) {
        // Per block: the `hi` and `lo` tiles of rows 0-15, then (`lb` on) of rows 16-31.
        let (s, lb) = (64usize, a.blocks * 2 * TILE_BYTES);
        // SAFETY: within this function's contract (its `# Safety`): the tiles configured, the operands' rows and blocks readable, `acc` four tiles.
        unsafe {
            // Software-pipelined: a tile is loaded as soon as the products reading its old
            // contents are issued, a few products before its first use, since a product right
            // after the load of its operand waits out the load (from L2, where the panels and
            // activations of a many-row product sit). Block 0's first operands here (its `lo`
            // weight tiles), each block's last products then load the next block's.
            start(a, two, TILE_BYTES);
            for kb in 0..a.blocks {
                let BlockAt { ah, al, b0, b1, pf } = a.block_at(kb, 2);
                // In: tmm4 `hi` of rows 0-15, tmm5 `hi` of rows 16-31 (`two`), tmm6 and tmm7
                // `lo` of panels 0 and 1. Per accumulator: `hi·lo`, `hi·hi`, `lo·hi`.
                dp!("tmm0", "tmm4", "tmm6");
                pf.slice(0);
                if two {
                    dp!("tmm2", "tmm5", "tmm6");
                }
                load!("tmm6", b0, 64usize);
                dp!("tmm1", "tmm4", "tmm7");
                pf.slice(1);
                if two {
                    dp!("tmm3", "tmm5", "tmm7");
                }
                load!("tmm7", b1, 64usize);
                pf.slice(2);
                dp!("tmm0", "tmm4", "tmm6");
                if two {
                    dp!("tmm2", "tmm5", "tmm6");
                }
                pf.slice(3);
                dp!("tmm1", "tmm4", "tmm7");
                load!("tmm4", al, s);
                pf.slice(4);
                if two {
                    dp!("tmm3", "tmm5", "tmm7");
                    load!("tmm5", al.add(lb), s);
                }
                pf.slice(5);
                dp!("tmm0", "tmm4", "tmm6");
                if two {
                    dp!("tmm2", "tmm5", "tmm6");
                }
                let more = kb + 1 < a.blocks;
                if more {
                    load!("tmm6", b0.add(2 * TILE_BYTES + TILE_BYTES), 64usize);
                }
                pf.slice(6);
                dp!("tmm1", "tmm4", "tmm7");
                if more {
                    load!("tmm4", ah.add(2 * TILE_BYTES), s);
                }
                pf.slice(7);
                if two {
                    dp!("tmm3", "tmm5", "tmm7");
                }
                if more {
                    load!("tmm7", b1.add(2 * TILE_BYTES + TILE_BYTES), 64usize);
                    if two {
                        load!("tmm5", ah.add(lb + 2 * TILE_BYTES), s);
                    }
                }
            }
            finish(two, acc);
        }
    }

    /// [`block`] for bf16 weights (one tile per block and panel): per block, `hi·w` then `lo·w`.
    ///
    /// # Safety
    /// As [`block`].
    pub(super) unsafe fn block_bf16(a: &Operands, two: bool, acc: *mut f32) {
        let (s, lb) = (64usize, a.blocks * 2 * TILE_BYTES);
        // SAFETY: within this function's contract (its `# Safety`): the tiles configured, the operands' rows and blocks readable, `acc` four tiles.
        unsafe {
            // Pipelined as `block`: each tile is reloaded once the products reading it are issued.
            start(a, two, 0);
            for kb in 0..a.blocks {
                let BlockAt { ah, al, b0, b1, pf } = a.block_at(kb, 1);
                let more = kb + 1 < a.blocks;
                // In: tmm4 `hi` of rows 0-15, tmm5 `hi` of rows 16-31 (`two`), tmm6 and tmm7
                // the weights of panels 0 and 1.
                dp!("tmm0", "tmm4", "tmm6");
                pf.slice(0);
                dp!("tmm1", "tmm4", "tmm7");
                load!("tmm4", al, s);
                pf.slice(1);
                if two {
                    dp!("tmm2", "tmm5", "tmm6");
                    pf.slice(2);
                    dp!("tmm3", "tmm5", "tmm7");
                    load!("tmm5", al.add(lb), s);
                }
                pf.slice(3);
                dp!("tmm0", "tmm4", "tmm6");
                pf.slice(4);
                dp!("tmm1", "tmm4", "tmm7");
                if more {
                    load!("tmm4", ah.add(2 * TILE_BYTES), s);
                }
                pf.slice(5);
                if two {
                    dp!("tmm2", "tmm5", "tmm6");
                }
                if more {
                    load!("tmm6", b0.add(TILE_BYTES), 64usize);
                }
                pf.slice(6);
                if two {
                    dp!("tmm3", "tmm5", "tmm7");
                    if more {
                        load!("tmm5", ah.add(lb + 2 * TILE_BYTES), s);
                    }
                }
                if more {
                    load!("tmm7", b1.add(TILE_BYTES), 64usize);
                }
                pf.slice(7);
            }
            finish(two, acc);
        }
    }
}

mod emulated;

/// Off x86-64 nothing runs AMX (`simd::amx::available` is false), so these are never called;
/// they exist for the code above to compile, with `hardware`'s contracts (none to uphold).
#[cfg(not(target_arch = "x86_64"))]
mod hardware {
    use super::Operands;
    pub(super) unsafe fn configure(_: usize) {
        unreachable!("AMX is x86-64 only")
    }
    pub(super) unsafe fn release() {}
    pub(super) unsafe fn block(_: &Operands, _: bool, _: *mut f32) {}
    pub(super) unsafe fn block_bf16(_: &Operands, _: bool, _: *mut f32) {}
}
