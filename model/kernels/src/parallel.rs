//! Element-wise and row-wise passes spread over candle's thread pool (the one the packed products
//! run on), in chunks of a fixed size: which chunk a thread takes varies from run to run, but
//! every output value is computed by one chunk alone, so the results do not depend on it (nor on
//! the number of threads). Each chunk runs compiled for the CPU's widest vectors
//! ([`crate::simd::vectorised`]). Reductions over rows (a bias's or LayerNorm's gradient) are
//! split by columns for the same reason: each column is still summed row after row.
//!
//! When training runs one data-parallel shard per thread, the pool has no workers and these run
//! inline on the shard's thread. rayon's `par_chunks_mut` would do the same job on a second pool
//! of threads competing with this one for the same cores.

use std::ops::Range;

/// Values of work per chunk below which a pass stays on the calling thread (the pool's wake-up
/// and barrier cost a few microseconds).
pub(crate) const GRAIN: usize = 1 << 14;

/// `out`'s start, for the pool's threads to write disjoint chunks of.
struct Base<T>(*mut T);

impl<T> Base<T> {
    /// The chunk `range` of the slice this points into.
    ///
    /// # Safety
    /// `range` within the slice, and no other live reference to any of it.
    unsafe fn chunk<'a>(&self, range: Range<usize>) -> &'a mut [T] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(range.start), range.len()) }
    }
}

// SAFETY: `Base` is only used below to hand disjoint chunks of one slice to the pool's threads.
unsafe impl<T: Send> Send for Base<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for Base<T> {}

/// Whether `items` chunks are worth the pool: more than one, and a pool with workers.
fn spread(items: usize) -> bool {
    #[cfg(test)]
    if SERIAL.get() {
        return false;
    }
    items > 1 && candle_core::utils::barrier_pool().n_workers() > 0
}

#[cfg(test)]
thread_local! {
    static SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with every pass here on the calling thread (tests compare the two).
#[cfg(test)]
pub(crate) fn serially<R>(f: impl FnOnce() -> R) -> R {
    SERIAL.set(true);
    let r = f();
    SERIAL.set(false);
    r
}

/// `f(start, chunk)` for the consecutive chunks of `grain` values of `out` (the last may be
/// shorter), `start` the chunk's offset in `out`; on one thread, one call for the whole of `out`
/// (so `f` must take any run of whole chunks).
pub(crate) fn chunks_mut<T: Send>(out: &mut [T], grain: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let (len, grain) = (out.len(), grain.max(1));
    let items = len.div_ceil(grain);
    let f = |start: usize, chunk: &mut [T]| {
        crate::simd::vectorised(
            #[inline(always)]
            || f(start, chunk),
        )
    };
    if !spread(items) {
        f(0, out);
        return;
    }
    let base = Base(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(items, |range| {
        for i in range {
            let chunk = i * grain..((i + 1) * grain).min(len);
            // SAFETY: chunk `i` is handed to one call only, and `out` is borrowed mutably here.
            f(chunk.start, unsafe { base.chunk(chunk) });
        }
    });
}

/// As [`chunks_mut`] over two slices of one length at once: `f(start, a_chunk, b_chunk)`.
///
/// # Panics
/// If the slices' lengths differ.
pub(crate) fn chunks_mut2<T: Send, U: Send>(
    a: &mut [T],
    b: &mut [U],
    grain: usize,
    f: impl Fn(usize, &mut [T], &mut [U]) + Sync,
) {
    assert_eq!(a.len(), b.len(), "chunks_mut2: slices of different lengths");
    let base_b = Base(b.as_mut_ptr());
    chunks_mut(
        a,
        grain,
        #[inline(always)]
        |start, ca| {
            // SAFETY: `b`'s chunk beside `a`'s, handed to this call only; `b` is borrowed mutably.
            f(start, ca, unsafe { base_b.chunk(start..start + ca.len()) });
        },
    );
}

/// The column sums of `values`, rows of `n` values: each column summed row after row, the
/// columns split over the pool (so any split gives the same bits).
pub(crate) fn column_sums(values: &[f32], n: usize) -> Vec<f32> {
    let n = n.max(1);
    let mut sums = vec![0f32; n];
    let grain = (GRAIN / (values.len() / n).max(1)).max(16);
    chunks_mut(
        &mut sums,
        grain,
        #[inline(always)]
        |j0, sums| {
            for row in values.chunks_exact(n) {
                sums.iter_mut().zip(&row[j0..]).for_each(|(s, &v)| *s += v);
            }
        },
    );
    sums
}

/// A new vector of `len` values, `f(start, chunk)` writing every value of each chunk of `grain`.
pub(crate) fn collect(
    len: usize,
    grain: usize,
    f: impl Fn(usize, &mut [std::mem::MaybeUninit<f32>]) + Sync,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    chunks_mut(&mut out.spare_capacity_mut()[..len], grain, f);
    // SAFETY: `f` wrote every value of every chunk, and the chunks cover `0..len`.
    unsafe { out.set_len(len) };
    out
}

/// Bytes of a product's right operand in one block of columns, and of its left operand in one
/// block of rows: a block of each stays in a core's L2 (1 MiB on Zen 4) while the register
/// tiles go over it.
const BLOCK_BYTES: usize = 256 << 10;

/// A multiple of every packed kernel's register tile height (12 rows on AVX-512, 2 on AVX2 and
/// the portable lanes), so that only a product's last block of rows has a short tile.
const TILE_ROWS: usize = 12;

/// The work of a product `a @ B^T` on the packed kernels (f32 and bf16), whose task is a group
/// of output columns, in blocks so that each operand comes from memory about once: the tasks in
/// blocks of [`BLOCK_BYTES`] of `B`'s panels, each such block's rows in blocks of
/// [`BLOCK_BYTES`] of `a`, and for each block of rows every task of the column block. A task
/// over all rows read the whole of `a` once per task: the LM head's `dW = dY^T h` in bf16 (`a`
/// 50257 x 512, 51 MB) ran at half the kernel's rate. An `a` of at most two blocks (a prefill's
/// few hundred rows) is one block of rows: tasks in order, each over all rows, as before.
/// Blocking changes no result: each output is still one chain along `k`.
pub(crate) struct ProductBlocks {
    m: usize,
    tasks: usize,
    /// Tasks per block of columns (the last may hold fewer).
    per_block: usize,
    /// Rows per block of rows, a multiple of [`TILE_ROWS`] (the last block may hold fewer).
    block_rows: usize,
    row_blocks: usize,
}

impl ProductBlocks {
    /// `m` rows of `row_bytes` bytes of `a`, `tasks` of `task_bytes` bytes of `B`'s panels.
    pub(crate) fn new(m: usize, tasks: usize, task_bytes: usize, row_bytes: usize) -> Self {
        let row_bytes = row_bytes.max(1);
        let block_rows = if m * row_bytes <= 2 * BLOCK_BYTES {
            m.max(1)
        } else {
            (BLOCK_BYTES / row_bytes / TILE_ROWS).max(1) * TILE_ROWS
        };
        let per_block = if block_rows >= m {
            tasks
        } else {
            let col_blocks = tasks.div_ceil((BLOCK_BYTES / task_bytes.max(1)).max(1));
            tasks.div_ceil(col_blocks.max(1))
        };
        Self {
            m,
            tasks,
            per_block: per_block.max(1),
            block_rows,
            row_blocks: m.div_ceil(block_rows),
        }
    }

    /// Items for the pool: one task on one block of rows each.
    pub(crate) fn items(&self) -> usize {
        self.tasks * self.row_blocks
    }

    /// Item `i`'s task, first row and rows: column block by column block, in each its row
    /// blocks in turn, in each its tasks.
    pub(crate) fn item(&self, i: usize) -> (usize, usize, usize) {
        let block_items = self.per_block * self.row_blocks;
        let (cb, rest) = (i / block_items, i % block_items);
        let in_block = self.per_block.min(self.tasks - cb * self.per_block);
        let (rb, j) = (rest / in_block, rest % in_block);
        let r0 = rb * self.block_rows;
        (cb * self.per_block + j, r0, self.block_rows.min(self.m - r0))
    }

    /// `(tasks per column block, rows per row block, row blocks)`.
    #[cfg(test)]
    pub(crate) fn shape(&self) -> (usize, usize, usize) {
        (self.per_block, self.block_rows, self.row_blocks)
    }
}

/// Rows per chunk for a pass over rows of `cols` values: about [`GRAIN`] values, whole rows.
pub(crate) fn rows_per_chunk(cols: usize) -> usize {
    (GRAIN / cols.max(1)).max(1)
}

/// `f(i, row_i, &mut out[i])` for each row of `values` (`cols` values each) beside its slot in
/// `out`, in chunks of whole rows.
pub(crate) fn rows_with<U: Send>(
    values: &mut [f32],
    cols: usize,
    out: &mut [U],
    f: impl Fn(usize, &mut [f32], &mut U) + Sync,
) {
    let cols = cols.max(1);
    assert_eq!(
        values.len(),
        out.len() * cols,
        "rows_with: {} rows for {} slots",
        values.len() / cols,
        out.len()
    );
    let per_chunk = rows_per_chunk(cols);
    let base = Base(values.as_mut_ptr());
    chunks_mut(
        out,
        per_chunk,
        #[inline(always)]
        |row0, slots| {
            // SAFETY: the rows of this chunk of slots, handed to this call only; `values` is
            // borrowed mutably here.
            let rows = unsafe { base.chunk(row0 * cols..(row0 + slots.len()) * cols) };
            for (i, (row, slot)) in rows.chunks_exact_mut(cols).zip(slots).enumerate() {
                f(row0 + i, row, slot);
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every task's every row is one item's, once, for products that fit one block of rows and
    /// products that do not (a short last column block, a short last row block).
    #[test]
    fn product_blocks_cover_every_row_of_every_task_once() {
        for (m, tasks, task_bytes, row_bytes, want) in [
            (1, 1, 1 << 10, 4, (1, 1, 1)),
            (150, 24, 100 << 10, 3072, (24, 150, 1)),
            (1024, 24, 100 << 10, 3072, (2, 84, 13)),
            (1024, 7, 80 << 10, 3072, (3, 84, 13)),
            (50257, 24, 32 << 10, 1024, (8, 252, 200)),
            (100, 7, 300 << 10, 8192, (1, 24, 5)),
            (1024, 0, 80 << 10, 3072, (1, 84, 13)),
        ] {
            let b = ProductBlocks::new(m, tasks, task_bytes, row_bytes);
            assert_eq!(b.shape(), want, "{m} rows, {tasks} tasks");
            let mut seen = vec![0u8; m * tasks];
            for i in 0..b.items() {
                let (task, r0, rows) = b.item(i);
                assert!(
                    task < tasks && rows > 0 && r0 + rows <= m,
                    "item {i}: {task} {r0} {rows}"
                );
                seen[task * m + r0..task * m + r0 + rows]
                    .iter_mut()
                    .for_each(|s| *s += 1);
            }
            assert!(seen.iter().all(|&s| s == 1), "{m} rows, {tasks} tasks");
        }
    }
}
