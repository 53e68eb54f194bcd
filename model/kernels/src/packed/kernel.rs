//! The kernel behind [`super::PackedMatrix::matmul`]: register tiles of activation rows times
//! panels, for each weight format and instruction set.

use std::mem::MaybeUninit;

use super::epilogue::{epilogue, Epilogue};
use super::WeightFormat;
use super::{PackedMatrix, Simd, GROUP, LANES, PREFETCH};
use crate::parallel::ProductBlocks;
use crate::simd::{tile_height, Kernel, Vec16};

/// How one dense format's panel yields weight vectors: each position along `k` is one line of
/// `BLOCK_BYTES`, its 16 weights (so that the same products, widened to f32 by [`widen`], run in
/// the same order). Quantized formats take the integer kernel (`int8.rs`).
pub(super) trait Format {
    /// Panels already in f32, read where they are.
    const IN_PLACE: bool = false;
    /// Bytes of one position's 16 weights.
    const BLOCK_BYTES: usize;
    /// The 16 weights at `p`, in f32.
    ///
    /// # Safety
    /// `p` points at one position's weights in this format's panel (`BLOCK_BYTES` readable
    /// bytes), and `V`'s instructions run on this CPU.
    unsafe fn load<V: Vec16>(p: *const u8) -> V;
}

pub(super) struct F32;
pub(super) struct F16;
pub(super) struct Bf16;

macro_rules! dense_format {
    ($name:ident, $bytes:expr, $load:ident) => {
        impl Format for $name {
            const IN_PLACE: bool = $bytes == 4;
            const BLOCK_BYTES: usize = LANES * $bytes;
            #[inline(always)]
            unsafe fn load<V: Vec16>(p: *const u8) -> V {
                // SAFETY: `p` holds one position's `LANES` weights (the trait's contract).
                unsafe { V::$load(p) }
            }
        }
    };
}
dense_format!(F32, 4, load_f32);
dense_format!(F16, 2, load_f16);
dense_format!(Bf16, 2, load_bf16);

/// One task's operands: output columns `col0..col0 + 32` (two panels from `panels`) of
/// every row.
pub(super) struct Task {
    pub x: *const f32,
    /// `x`'s layout: row `i`, position `c` at `x[i * ldx + c]`, or with `XT` (a column-major
    /// `x`, such as a transposed view) at `x[c * ldx + i]`.
    pub ldx: usize,
    pub y: *mut f32,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub panels: *const u8,
    pub panel_bytes: usize,
    /// Bytes from one position of a panel to the next: `F::BLOCK_BYTES` for packed panels; for
    /// f32 read in place from a row-major matrix ([`run_f32_rows_in_place`]), its row's bytes.
    pub block_bytes: usize,
    pub col0: usize,
    /// Add the products to the outputs already in `y` instead of writing them.
    pub accumulate: bool,
}

/// `y = x @ W^T` (or with `accumulate`, `y += x @ W^T`: then `y` must be initialised), then the
/// epilogue, over candle's thread pool, a task per two panels. Every element of `y` is written
/// (the first pass over `k` stores, later ones add), so it may start uninitialised; `k > 0`.
pub(super) fn run(
    w: &PackedMatrix,
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    m: usize,
    simd: Simd,
    ep: Epilogue,
    accumulate: bool,
) {
    debug_assert!(x.len() == m * w.k);
    let run = match w.format {
        WeightFormat::F32 => run_format::<F32, false>,
        WeightFormat::F16 => run_format::<F16, false>,
        WeightFormat::Bf16 => run_format::<Bf16, false>,
        // Integer products on activations quantized to q8_0 (`int8.rs`).
        WeightFormat::Q8_0 | WeightFormat::Q4_0 => return super::int8::run(w, x, y, m, simd, ep, accumulate),
    };
    run(w.panels(), x, w.k, y, m, simd, ep, accumulate, Flush::Ieee)
}

/// [`run`] for f32 panels with `x` `(m, k)` read where it is: row `i`, position `c` at
/// `x[i * ldx + c]`, or, `transposed`, at `x[c * ldx + i]` (a transposed view: training's
/// `dW = dY^T X` reads `dY^T` so, where a row-major copy cost 8% of a small model's step). The
/// same chains of multiply-adds as [`run`] on a dense copy: the same bits.
pub(super) fn run_f32_in_place(
    w: &PackedMatrix,
    x: super::InPlace,
    y: &mut [MaybeUninit<f32>],
    m: usize,
    simd: Simd,
    accumulate: bool,
) {
    debug_assert!(w.format == WeightFormat::F32);
    debug_assert!(if x.transposed {
        m <= x.ldx && x.values.len() >= (w.k - 1) * x.ldx + m
    } else {
        w.k <= x.ldx && x.values.len() >= (m - 1) * x.ldx + w.k
    });
    run_f32(w.panels(), x, y, m, simd, accumulate)
}

/// f32 panels times `x` read where it is, either layout.
fn run_f32(panels: Panels, x: super::InPlace, y: &mut [MaybeUninit<f32>], m: usize, simd: Simd, accumulate: bool) {
    let run = if x.transposed {
        run_format::<F32, true>
    } else {
        run_format::<F32, false>
    };
    run(
        panels,
        x.values,
        x.ldx,
        y,
        m,
        simd,
        Epilogue::default(),
        accumulate,
        Flush::Ieee,
    )
}

/// `y = x @ B` (or with `accumulate`, `y += x @ B`) for `B` `(k, n)` a row-major f32 matrix
/// read where it is, rows `ldb` apart, as the panels of its transpose: panel `p` is columns
/// `16p..16p + 16`, its positions a row apart (training's `x @ W` of a `(in, out)` weight and
/// `dY^T`'s columns in `dW = x^T dY` need no packing pass then). `x` as in
/// [`run_f32_in_place`]; the same chains of multiply-adds as on the packed panels: the same
/// bits. `n` is a whole number of tasks' columns (32): no padding panels.
///
/// # Safety
/// `b` holds `(k - 1) * ldb + n` values, `n` is a multiple of 32 and `k > 0`; `x` as in
/// [`run_f32_in_place`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run_f32_rows_in_place(
    b: &[f32],
    ldb: usize,
    (k, n): (usize, usize),
    x: super::InPlace,
    y: &mut [MaybeUninit<f32>],
    m: usize,
    simd: Simd,
    accumulate: bool,
) {
    debug_assert!(n.is_multiple_of(GROUP * LANES) && k > 0 && b.len() >= (k - 1) * ldb + n);
    let panels = Panels {
        base: b.as_ptr() as *const u8,
        n,
        k,
        panel_bytes: LANES * 4,
        block_bytes: ldb * 4,
        span: k * LANES * 4,
    };
    run_f32(panels, x, y, m, simd, accumulate)
}

/// How the tasks treat values below f32's normal range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Flush {
    /// As IEEE 754 defines (the f32 products).
    Ieee,
    /// Read as zero and flushed to zero (MXCSR's DAZ and FTZ, x86 only): `vdpbf16ps`'s
    /// arithmetic, for the bf16 products on this kernel ([`run_bf16_split_in_place`]).
    Subnormals,
}

/// `y = x @ W^T` (or with `accumulate`, `y += x @ W^T`) for `W` `(n, k)` given as bf16 panels
/// of this module's layout (`n` rounded up to whole tasks, each panel `k` positions of 16 bf16,
/// 16-bit aligned), `x` row-major f32 read where it is, under MXCSR's DAZ and FTZ: the bf16
/// products of training ([`crate::train::bf16`]) on this kernel, which widens each chunk of the
/// panels once for all the row tiles.
///
/// # Safety
/// `panels` holds `n.div_ceil(32) * 2` panels of `k * 16` values; `k > 0`; `x` holds `m` rows
/// of `k` values `x.ldx` apart (not transposed); `y` holds `m * n` values; x86-64.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn run_bf16_split_in_place(
    panels: &[u16],
    (n, k): (usize, usize),
    x: super::InPlace,
    y: &mut [MaybeUninit<f32>],
    m: usize,
    simd: Simd,
    accumulate: bool,
) {
    debug_assert!(k > 0 && !x.transposed && panels.len() >= n.div_ceil(GROUP * LANES) * GROUP * k * LANES);
    let panel_bytes = k * LANES * 2;
    let panels = Panels {
        base: panels.as_ptr() as *const u8,
        n,
        k,
        panel_bytes,
        block_bytes: LANES * 2,
        span: panel_bytes,
    };
    run_format::<Bf16, false>(
        panels,
        x.values,
        x.ldx,
        y,
        m,
        simd,
        Epilogue::default(),
        accumulate,
        Flush::Subnormals,
    )
}

/// The right operand as the kernel reads it: `n` rows (the outputs) of `k` positions in panels
/// of 16 rows, panel `p` at `base + p * panel_bytes`, its positions `block_bytes` apart.
pub(super) struct Panels {
    pub base: *const u8,
    pub n: usize,
    pub k: usize,
    pub panel_bytes: usize,
    pub block_bytes: usize,
    /// Bytes of one panel over all `k` positions (what a task reads of it).
    pub span: usize,
}

impl PackedMatrix {
    /// The packed panels as [`run_format`] reads them.
    fn panels(&self) -> Panels {
        let panel_bytes = super::panel_bytes(self.format, self.k);
        Panels {
            base: self.bytes().as_ptr(),
            n: self.n,
            k: self.k,
            panel_bytes,
            span: panel_bytes,
            block_bytes: match self.format.ggml() {
                Some(_) => super::code_bytes(self.format) + 2 * LANES,
                None => LANES * super::format_bytes(self.format),
            },
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn run_format<F: Format, const XT: bool>(
    w: Panels,
    x: &[f32],
    ldx: usize,
    y: &mut [MaybeUninit<f32>],
    m: usize,
    simd: Simd,
    ep: Epilogue,
    accumulate: bool,
    flush: Flush,
) {
    debug_assert!(y.len() == m * w.n);
    let panel_bytes = w.panel_bytes;
    let groups = w.n.div_ceil(LANES * GROUP);
    let blocks = ProductBlocks::new(m, groups, GROUP * w.span, w.k * 4);
    let (x_at, y_at, w_at) = (x.as_ptr() as usize, y.as_mut_ptr() as usize, w.base as usize);
    candle_core::utils::barrier_pool().execute_chunked(blocks.items(), |range| {
        #[cfg(target_arch = "x86_64")]
        let _flush = (flush == Flush::Subnormals).then(crate::simd::FlushSubnormals::new);
        #[cfg(not(target_arch = "x86_64"))]
        debug_assert!(flush == Flush::Ieee, "MXCSR's flushes are x86's");
        for item in range {
            let (g, r0, rows) = blocks.item(item);
            let t = Task {
                x: (x_at + 4 * if XT { r0 } else { r0 * ldx }) as *const f32,
                ldx,
                y: (y_at + 4 * r0 * w.n) as *mut f32,
                m: rows,
                n: w.n,
                k: w.k,
                panels: (w_at + g * GROUP * panel_bytes) as *const u8,
                panel_bytes,
                block_bytes: w.block_bytes,
                col0: g * GROUP * LANES,
                accumulate,
            };
            // Items write disjoint blocks of `y` (rows `r0..r0 + rows` of group `g`'s columns),
            // which outlives the pool's call; the panels of group `g` exist (the matrix is padded
            // to whole groups).
            simd.run(TaskKernel::<F, XT> {
                t: &t,
                format: std::marker::PhantomData,
            });
            // SAFETY: this item's block of `y`, written above.
            unsafe { epilogue(ep, simd, t.y, r0, rows, w.n, t.col0, (w.n - t.col0).min(GROUP * LANES)) };
        }
    });
}

/// One task of [`run_format`] on the lanes [`Simd::run`] picks.
struct TaskKernel<'a, F, const XT: bool> {
    t: &'a Task,
    format: std::marker::PhantomData<F>,
}

impl<F: Format, const XT: bool> Kernel for TaskKernel<'_, F, XT> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        // SAFETY: `run_format` builds tasks within `x`, `y` and the panels, each task's columns
        // its own.
        unsafe { task::<F, V, XT>(self.t) }
    }
}

/// Positions along `k` per chunk when several row tiles share a task's panels: the two panels'
/// f32 weights for a chunk (2 x 128 x 64 B = 16 KiB) stay in L1 while every tile passes over them.
const CHUNK: usize = 128;

/// One register tile's operands: rows of `x` from position `k0` on, `kc` positions of two
/// panels, the tile's outputs.
struct Tile {
    x: *const f32,
    ldx: usize,
    w: *const u8,
    panel_stride: usize,
    /// Bytes from one block to the next (f32 panels: see [`Task::block_bytes`]).
    block_bytes: usize,
    kc: usize,
    y: *mut f32,
    ldy: usize,
    cols: usize,
    /// Start from the outputs already in `y` (a later chunk) instead of zero.
    accumulate: bool,
    /// Bytes ahead of each block to prefetch its panels' lines (0: none; the single-tile path).
    prefetch: usize,
    /// Cache lines to prefetch while the tile runs instead (the chunked path): `ahead_lines`
    /// consecutive lines from each of `ahead[j]` (one per panel), a few per step.
    ahead: [*const u8; GROUP],
    ahead_lines: usize,
}

/// Every row of one task.
///
/// One tile of rows (decode, small batches) reads the panels once, in their own format, over
/// the whole of `k`, prefetching `PREFETCH` bytes ahead. With more rows, `k` is cut into chunks:
/// per chunk the panels are widened or dequantized once into f32 (f32 panels are read in place)
/// and every tile passes over them, keeping its outputs in `y` between chunks, while the tiles
/// share the prefetching of the next chunk. Each output is the same chain of fused
/// multiply-adds over the same weight values either way, so the bits do not depend on the row
/// count (batch invariance), only the cost does: the dequantization is shared by all tiles, and
/// reading the next chunk from memory overlaps the arithmetic on this one (batch 16 decodes
/// 3-10% faster than with whole-`k` tiles).
///
/// # Safety
/// As [`Task`] describes; `V`'s instructions available.
#[inline(always)]
pub(super) unsafe fn task<F: Format, V: Vec16, const XT: bool>(t: &Task) {
    let cols = (t.n - t.col0).min(GROUP * LANES);
    // SAFETY: `j < GROUP`: the task's panels are `GROUP` panels of `panel_bytes` each (`Task`).
    let panel = |j: usize| unsafe { t.panels.add(j * t.panel_bytes) };
    // Bytes of `F`'s panel holding positions `0..k`.
    let span = |k: usize| k * F::BLOCK_BYTES;
    let tile_at = |i0: usize, k0: usize| Tile {
        // SAFETY: `i0 < m` and `k0 < k` index the task's own rows of `x` (`Task`).
        x: unsafe { t.x.add(if XT { k0 * t.ldx + i0 } else { i0 * t.ldx + k0 }) },
        ldx: t.ldx,
        w: t.panels,
        panel_stride: t.panel_bytes,
        block_bytes: t.block_bytes,
        kc: t.k,
        // SAFETY: `i0 < m`: row `i0` of `y` `(m, n)`, from the task's first column (`Task`).
        y: unsafe { t.y.add(i0 * t.n + t.col0) },
        ldy: t.n,
        cols,
        accumulate: t.accumulate,
        prefetch: PREFETCH,
        ahead: [t.panels; GROUP],
        ahead_lines: 0,
    };
    // f32 read in place from a row-major matrix: its positions a row apart, so the prefetches,
    // which run ahead within a packed panel, are left to the hardware's stride prefetcher, and
    // every tile reads the whole of `k` (the chunks' offsets count packed positions).
    let strided = F::IN_PLACE && t.block_bytes != F::BLOCK_BYTES;
    let most = tile_height::<V>();
    if t.m <= most {
        let mut at = tile_at(0, 0);
        if strided {
            at.prefetch = 0;
        }
        // SAFETY: the task's `m <= V::ROWS` rows from row 0, and its two panels over the whole
        // of `k`, as `Task` describes them; `V` runs here (this function's contract).
        unsafe { tile_rows::<F, V, XT>(&at, t.m) };
        return;
    }
    // Tiles of (nearly) equal height: 16 rows as 8 + 8, not 12 + 4.
    let tiles = t.m.div_ceil(most);
    let (height, taller) = (t.m / tiles, t.m % tiles);
    if F::IN_PLACE && (tiles > 2 || strided) {
        // Prefill: f32 panels are read in place over the whole of `k`, the first tile
        // streaming them from memory, the others finding them in cache (measured ~10% faster
        // than chunks here, where reloading the outputs per chunk costs more than it saves).
        let mut i0 = 0;
        for tile in 0..tiles {
            let rows = height + usize::from(tile < taller);
            let mut at = tile_at(i0, 0);
            at.prefetch = if tile == 0 && !strided { PREFETCH } else { 0 };
            // SAFETY: rows `i0..i0 + rows` of the task (`rows <= V::ROWS`, and the tiles' rows add
            // up to `m`), its f32 panels read in place over the whole of `k`.
            unsafe { tile_rows::<F, V, XT>(&at, rows) };
            i0 += rows;
        }
        return;
    }
    #[repr(align(64))]
    struct Scratch(#[allow(dead_code)] [f32; GROUP * CHUNK * LANES]);
    // Left uninitialised: `widen` writes each chunk's positions before the tiles read them.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    let scratch = scratch.as_mut_ptr() as *mut f32;
    if !F::IN_PLACE {
        // The first chunk, before any tile runs.
        for j in 0..GROUP {
            for line in 0..span(CHUNK.min(t.k)).div_ceil(64) {
                // SAFETY: a prefetch reads nothing and never faults; the address is in the panel or
                // (`wrapping_add`) just past it.
                unsafe { V::prefetch(panel(j).wrapping_add(64 * line)) };
            }
        }
    }
    for k0 in (0..t.k).step_by(CHUNK) {
        let kc = CHUNK.min(t.k - k0);
        let (w, panel_stride) = if F::IN_PLACE {
            // SAFETY: `k0 < k`: the chunk's first block in the task's f32 panels.
            (unsafe { t.panels.add(span(k0)) }, t.panel_bytes)
        } else {
            // SAFETY: `scratch` holds `GROUP * CHUNK` vectors and `kc <= CHUNK`; positions
            // `k0..k0 + kc` of both panels exist (`Task`).
            unsafe { widen::<F, V>(t, k0, kc, scratch) };
            (scratch as *const u8, CHUNK * LANES * 4)
        };
        // The next chunk's lines, shared among the tiles; during the last chunk, the first
        // chunk of the next task's panels, which follow this task's in memory (the pool runs
        // consecutive tasks on one thread; past the matrix's end a prefetch is only a wasted
        // read, never a fault): 1-5% at 16 and 64 rows, every format.
        let (ahead, next) = if k0 + kc < t.k {
            (span(k0 + kc), span((k0 + kc + CHUNK).min(t.k)) - span(k0 + kc))
        } else {
            (GROUP * t.panel_bytes, span(CHUNK.min(t.k)))
        };
        let lines = next.div_ceil(64);
        let mut i0 = 0;
        for tile in 0..tiles {
            let rows = height + usize::from(tile < taller);
            let (first, last) = (lines * tile / tiles, lines * (tile + 1) / tiles);
            let mut at = tile_at(i0, k0);
            (at.w, at.panel_stride, at.kc, at.accumulate) = (w, panel_stride, kc, t.accumulate || k0 > 0);
            at.ahead = std::array::from_fn(|j| panel(j).wrapping_add(ahead + 64 * first));
            (at.prefetch, at.ahead_lines) = (0, last - first);
            // (Direct calls, not a function pointer: they inherit the caller's target features.)
            // SAFETY: the tile's rows `i0..i0 + rows` of `x` and `y` as above; `w` is the chunk of
            // the f32 panels or the widened scratch, `kc` positions of each, `panel_stride` apart.
            unsafe {
                if F::IN_PLACE {
                    tile_rows::<F, V, XT>(&at, rows)
                } else {
                    tile_rows::<Widened<F>, V, XT>(&at, rows)
                }
            }
            i0 += rows;
        }
    }
}

/// Format `F`'s weights widened to f32 by [`widen`]: the layout of [`F32`] panels, in the
/// scratch.
struct Widened<F>(std::marker::PhantomData<F>);

impl<F: Format> Format for Widened<F> {
    const BLOCK_BYTES: usize = LANES * 4;
    #[inline(always)]
    unsafe fn load<V: Vec16>(p: *const u8) -> V {
        // SAFETY: `p` is a position of the widened scratch, `LANES` f32 (the trait's contract).
        unsafe { V::load_f32(p) }
    }
}

/// Positions `k0..k0 + kc` of the task's two panels as f32, panel after panel, `CHUNK` positions
/// apart.
///
/// # Safety
/// The task's panels as [`Task`] describes them, `k0 + kc <= k`, `kc <= CHUNK`, and `out` holds
/// `GROUP * CHUNK * LANES` f32; `V`'s instructions run on this CPU.
#[inline(always)]
unsafe fn widen<F: Format, V: Vec16>(t: &Task, k0: usize, kc: usize, out: *mut f32) {
    for j in 0..GROUP {
        for c in 0..kc {
            // SAFETY: position `k0 + c < k` of panel `j < GROUP` exists (the caller's contract),
            // and `out` holds `GROUP * CHUNK` vectors, `c < kc <= CHUNK`.
            unsafe {
                let w = F::load::<V>(t.panels.add(j * t.panel_bytes + (k0 + c) * F::BLOCK_BYTES));
                w.store(out.add((j * CHUNK + c) * LANES));
            }
        }
    }
}

/// Rows in a tile at most, on any lanes.
const MAX_ROWS: usize = 12;

/// One tile of `rows` rows (at most [`tile_height`]).
///
/// A task with fewer than 32 columns (the matrix's last, when `n` is not a multiple of 32)
/// goes through a full-width buffer, so that [`tile`] reads and writes whole vectors only: its
/// partial loads and stores were copies of a run-time length, calls to `memcpy` that kept its
/// accumulators in memory, zeroed by a call to `memset` for every tile (1.5 KB each, ~17,000
/// a step of nanoGPT's CPU recipe).
///
/// # Safety
/// `rows <= tile_height::<V>()`; `t.x` holds `rows` rows of `t.kc` positions (row stride or, with `XT`,
/// column stride `t.ldx`), `t.w` two panels of `t.kc` positions `t.panel_stride` bytes apart,
/// `t.y` `rows` rows of `t.cols` columns (`t.ldy` apart) that no other thread touches; `V`'s
/// instructions run on this CPU.
#[inline(always)]
unsafe fn tile_rows<F: Format, V: Vec16, const XT: bool>(t: &Tile, rows: usize) {
    debug_assert!(rows <= tile_height::<V>() && tile_height::<V>() <= MAX_ROWS);
    if t.cols < GROUP * LANES {
        const WIDTH: usize = GROUP * LANES;
        let mut buf = [0f32; MAX_ROWS * WIDTH];
        if t.accumulate {
            for i in 0..rows {
                // SAFETY: the tile's rows and columns of `y` (the caller's contract).
                let row = unsafe { std::slice::from_raw_parts(t.y.add(i * t.ldy), t.cols) };
                buf[i * WIDTH..][..t.cols].copy_from_slice(row);
            }
        }
        let whole = Tile {
            y: buf.as_mut_ptr(),
            ldy: WIDTH,
            cols: WIDTH,
            ..*t
        };
        // SAFETY: as below, with `y` the buffer of whole rows (the panels are padded with zero
        // rows to whole tasks).
        unsafe { tile_rows_whole::<F, V, XT>(&whole, rows) };
        for i in 0..rows {
            // SAFETY: the tile's rows and columns of `y` (the caller's contract).
            let row = unsafe { std::slice::from_raw_parts_mut(t.y.add(i * t.ldy), t.cols) };
            row.copy_from_slice(&buf[i * WIDTH..][..t.cols]);
        }
        return;
    }
    // SAFETY: the tile's columns are whole vectors (32), as `tile_rows_whole` needs; the rest
    // of the caller's contract passes on.
    unsafe { tile_rows_whole::<F, V, XT>(t, rows) }
}

/// [`tile_rows`] for a tile of whole vectors (32 columns).
///
/// # Safety
/// As [`tile_rows`], with `t.cols` 32.
#[inline(always)]
unsafe fn tile_rows_whole<F: Format, V: Vec16, const XT: bool>(t: &Tile, rows: usize) {
    if V::PANEL_ROWS > 0 {
        for j in 0..GROUP {
            // SAFETY: panel `j < GROUP` of the tile, and its 16 columns of `y`.
            let (w, y) = unsafe { (t.w.add(j * t.panel_stride), t.y.add(j * LANES)) };
            let one = Tile {
                w,
                y,
                ahead: [t.ahead[j]; GROUP],
                ..*t
            };
            // SAFETY: `rows <= PANEL_ROWS` (6); the caller's contract, for one panel.
            unsafe {
                match rows {
                    6 => tile::<F, V, 6, XT, 1>(&one),
                    5 => tile::<F, V, 5, XT, 1>(&one),
                    4 => tile::<F, V, 4, XT, 1>(&one),
                    3 => tile::<F, V, 3, XT, 1>(&one),
                    2 => tile::<F, V, 2, XT, 1>(&one),
                    _ => tile::<F, V, 1, XT, 1>(&one),
                }
            }
        }
        return;
    }
    // SAFETY: `rows` is one of `tile`'s instances (1 to 12); the caller's contract is `tile`'s.
    unsafe {
        match rows {
            12 => tile::<F, V, 12, XT, GROUP>(t),
            11 => tile::<F, V, 11, XT, GROUP>(t),
            10 => tile::<F, V, 10, XT, GROUP>(t),
            9 => tile::<F, V, 9, XT, GROUP>(t),
            8 => tile::<F, V, 8, XT, GROUP>(t),
            7 => tile::<F, V, 7, XT, GROUP>(t),
            6 => tile::<F, V, 6, XT, GROUP>(t),
            5 => tile::<F, V, 5, XT, GROUP>(t),
            4 => tile::<F, V, 4, XT, GROUP>(t),
            3 => tile::<F, V, 3, XT, GROUP>(t),
            2 => tile::<F, V, 2, XT, GROUP>(t),
            _ => tile::<F, V, 1, XT, GROUP>(t),
        }
    }
}

/// `R` rows times `P` panels (two, or one) over the tile's positions.
///
/// # Safety
/// As [`tile_rows_whole`], with `R` rows.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // acc[i][j] reads as the formula
unsafe fn tile<F: Format, V: Vec16, const R: usize, const XT: bool, const P: usize>(t: &Tile) {
    // SAFETY: the caller's contract: `R` rows of `x` from `t.x` over `kc` positions, the `P`
    // panels' positions from `t.w`, `R` rows of `16 P` columns of `y`, and `V` runs here. Prefetches
    // past a panel's end read nothing and never fault.
    unsafe {
        let mut acc = [[V::zero(); P]; R];
        if t.accumulate {
            for i in 0..R {
                for j in 0..P {
                    acc[i][j] = V::load_f32(t.y.add(i * t.ldy + j * LANES) as *const u8);
                }
            }
        }
        // No closures here: they would not inherit the caller's target features.
        let mut w = [V::zero(); P];
        let step = if F::IN_PLACE { t.block_bytes } else { F::BLOCK_BYTES };
        // `ahead_lines` spread over the `kc` positions: a line whenever the count passes `kc`.
        let (mut line, mut count) = (0, 0);
        for c in 0..t.kc {
            if t.prefetch == 0 {
                count += t.ahead_lines;
                while count >= t.kc && line < t.ahead_lines {
                    for j in 0..P {
                        V::prefetch(t.ahead[j].wrapping_add(64 * line));
                    }
                    line += 1;
                    count -= t.kc;
                }
            }
            for j in 0..P {
                let at = t.w.add(j * t.panel_stride + c * step);
                if t.prefetch > 0 {
                    for line in 0..F::BLOCK_BYTES.div_ceil(64) {
                        V::prefetch(at.wrapping_add(t.prefetch + 64 * line));
                    }
                }
                w[j] = F::load(at);
            }
            for i in 0..R {
                let xv = V::splat(t.x.add(if XT { c * t.ldx + i } else { i * t.ldx + c }));
                for j in 0..P {
                    acc[i][j] = V::fma(xv, w[j], acc[i][j]);
                }
            }
        }
        for i in 0..R {
            let y = t.y.add(i * t.ldy);
            for j in 0..P {
                acc[i][j].store(y.add(j * LANES));
            }
        }
    }
}
