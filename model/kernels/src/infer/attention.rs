//! Causal attention of a generation step's new tokens against their sequences' KV caches, on
//! the CPU in f32: one task per (sequence, head) on candle's thread pool, reading the queries
//! from the fused `qkv` projection and the keys and values where the caches hold them.
//!
//! Why not candle's ops: per sequence and layer those are a transposed copy of the queries, a copy
//! of the whole value cache (`contiguous` on the cache's view), two small matmuls and a softmax,
//! each dispatched alone on the calling thread while the pool's other threads wait: at batch 16
//! about a fifth of a decode step. Each output row here depends only on its own query and its
//! sequence's keys and values, never on the batch (batch-invariant). With AVX-512 a prompt's
//! rows go through in groups that share the loads of its keys and values (`x86::attend512`),
//! each row computed exactly as if it were alone.

use candle_core::{Device, Layout, Result, Storage, Tensor};

use crate::Simd;

/// One sequence's keys and values for [`cached_attention`], `len` positions in order, in blocks:
/// `(n_head, B, head_dim)` tensors of `B` positions each (the same `B` for every block; the last
/// may hold fewer than `B` positions), unit stride in the last dim. A cache of one contiguous
/// buffer is one block ([`CachedKv::whole`]); the CPU's KV cache holds blocks of 64 positions.
/// A sliding-window layer's cache no longer holds the blocks its queries cannot see: `keys[0]`
/// is then block `dropped`, positions `dropped * B..`.
#[derive(Debug, Clone)]
pub struct CachedKv {
    pub keys: Vec<Tensor>,
    pub values: Vec<Tensor>,
    pub len: usize,
    /// Leading blocks no longer held.
    pub dropped: usize,
}

impl CachedKv {
    /// Keys and values `(n_head, T, head_dim)` as one block of `T` positions.
    pub fn whole(k: Tensor, v: Tensor) -> Result<Self> {
        let len = k.dims3()?.1;
        Ok(Self {
            keys: vec![k],
            values: vec![v],
            len,
            dropped: 0,
        })
    }
}

/// How a cache stores its keys and values, each read as f32: f32, or f16 (half the memory, as
/// llama.cpp keeps its cache; 11 bits of mantissa, within 2^-11 of each value).
pub(crate) trait Stored: Copy + Send + Sync + 'static {
    fn slice(cpu: &candle_core::CpuStorage) -> Result<&[Self]>;
    /// `row` as f32: itself, or widened into `buf` (at least as long as `row`).
    fn widened<'a>(row: &'a [Self], buf: &'a mut [f32]) -> &'a [f32];
}

impl Stored for f32 {
    fn slice(cpu: &candle_core::CpuStorage) -> Result<&[Self]> {
        cpu.as_slice::<f32>()
    }
    #[inline(always)]
    fn widened<'a>(row: &'a [Self], _: &'a mut [f32]) -> &'a [f32] {
        row
    }
}

impl Stored for half::f16 {
    fn slice(cpu: &candle_core::CpuStorage) -> Result<&[Self]> {
        cpu.as_slice::<half::f16>()
    }
    /// A row at a time (F16C's conversion where the CPU has it), not a value at a time.
    #[inline(always)]
    fn widened<'a>(row: &'a [Self], buf: &'a mut [f32]) -> &'a [f32] {
        use half::slice::HalfFloatSliceExt;
        let buf = &mut buf[..row.len()];
        row.convert_to_f32_slice(buf);
        buf
    }
}

/// What the kernels read: [`Stored`], with the vector loads where there are vector kernels.
#[cfg(target_arch = "x86_64")]
use x86::Load as Kv;
#[cfg(not(target_arch = "x86_64"))]
use Stored as Kv;

/// One block of [`Heads`] where its storage lies.
struct Block<'a, T> {
    data: &'a [T],
    start: usize,
    head_stride: usize,
    pos_stride: usize,
}

/// Keys or values of one sequence, read in place: `len` positions in blocks of `block`, the
/// first `dropped` blocks no longer held.
struct Heads<'a, T> {
    blocks: Vec<Block<'a, T>>,
    block: usize,
    len: usize,
    dropped: usize,
}

impl<'a, T: Stored> Heads<'a, T> {
    /// `earliest`: the first position any query reads (the caller's checks keep every read at or
    /// after it), which must be held.
    fn new(
        blocks: &'a [(candle_core::StorageRef<'a>, &'a Layout)],
        len: usize,
        dropped: usize,
        earliest: usize,
        n_head: usize,
        hs: usize,
    ) -> Result<Self> {
        let block = blocks.first().and_then(|(_, l)| l.dims().get(1).copied()).unwrap_or(0);
        if block * (dropped + blocks.len()) < len || (len > 0 && block == 0) {
            candle_core::bail!(
                "cached-attention: {len} positions in {} blocks of {block} after {dropped} dropped",
                blocks.len()
            )
        }
        if earliest < dropped * block {
            candle_core::bail!(
                "cached-attention: position {earliest} is read, but the cache holds positions from {} on",
                dropped * block
            )
        }
        let blocks = (blocks.iter())
            .map(|(storage, layout)| {
                let Storage::Cpu(cpu) = &**storage else {
                    candle_core::bail!("cached-attention: the cache is not on the CPU")
                };
                let stride = layout.stride();
                if layout.dims() != [n_head, block, hs] || stride[2] != 1 {
                    candle_core::bail!(
                        "cached-attention: a block of the cache is {:?} with strides {stride:?}, not ({n_head}, {block}, {hs})",
                        layout.dims()
                    )
                }
                Ok(Block {
                    data: T::slice(cpu)?,
                    start: layout.start_offset(),
                    head_stride: stride[0],
                    pos_stride: stride[1],
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            blocks,
            block,
            len,
            dropped,
        })
    }

    /// Head `h` at position `j`.
    #[inline(always)]
    fn row(&self, h: usize, j: usize, hs: usize) -> &[T] {
        let b = &self.blocks[j / self.block - self.dropped];
        &b.data[b.start + h * b.head_stride + (j % self.block) * b.pos_stride..][..hs]
    }

    /// Head `h` from position `j` (`j < len`) to the end of its block or of the positions held:
    /// `(pointer to position j, positions, stride between them)`, each position `hs` values
    /// long. Checked once here, for loops that would otherwise check every position. (Inlined:
    /// a call inside the kernels' loops made them keep their sums in memory, 25% slower.)
    #[inline(always)]
    fn run(&self, h: usize, j: usize, hs: usize) -> (*const T, usize, usize) {
        let n = (self.block - j % self.block).min(self.len - j);
        // The run's last position is in bounds (a panic here is a bug: the layout was checked in
        // `new`), and so then is every earlier one.
        let _ = self.row(h, j + n - 1, hs);
        (
            self.row(h, j, hs).as_ptr(),
            n,
            self.blocks[j / self.block - self.dropped].pos_stride,
        )
    }
}

/// Writes rows `row0..row0 + rows` of a `(N, ld)` f32 matrix, columns `col0..col0 + nh * hs`,
/// into positions `at..at + rows` of an `(nh, room, hs)` buffer, head after head: a step's new
/// keys or values into a sequence's cache, in place (`Tensor::inplace_op1`). CPU, the buffer in
/// f32 or f16.
pub struct WriteRows<'a> {
    pub src: &'a [f32],
    pub ld: usize,
    pub col0: usize,
    pub row0: usize,
    pub rows: usize,
    pub at: usize,
}

impl candle_core::InplaceOp1 for WriteRows<'_> {
    fn name(&self) -> &'static str {
        "write-rows"
    }

    fn cpu_fwd(&self, storage: &mut candle_core::CpuStorage, layout: &Layout) -> Result<()> {
        let &[nh, room, hs] = layout.dims() else {
            candle_core::bail!(
                "write-rows: the buffer is {:?}, not (heads, positions, head size)",
                layout.dims()
            )
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("write-rows: the buffer is not contiguous")
        };
        let width = nh * hs;
        if self.at + self.rows > room
            || self.col0 + width > self.ld
            || self.src.len() < (self.row0 + self.rows) * self.ld
        {
            candle_core::bail!(
                "write-rows: {} rows at {} of {room} positions, columns {}..{} of {}",
                self.rows,
                self.at,
                self.col0,
                self.col0 + width,
                self.ld
            )
        }
        let heads = (0..self.rows).flat_map(|i| {
            let row = &self.src[(self.row0 + i) * self.ld + self.col0..][..width];
            row.chunks_exact(hs)
                .enumerate()
                .map(move |(h, head)| ((h * room + self.at + i) * hs, head))
        });
        match storage {
            candle_core::CpuStorage::F32(data) => {
                let data = &mut data[start..end];
                heads.for_each(|(at, head)| data[at..][..hs].copy_from_slice(head));
            }
            candle_core::CpuStorage::F16(data) => {
                use half::slice::HalfFloatSliceExt;
                let data = &mut data[start..end];
                // Rounded to nearest (F16C's conversion where the CPU has it).
                heads.for_each(|(at, head)| data[at..][..hs].convert_from_f32_slice(head));
            }
            _ => candle_core::bail!("write-rows: the buffer is not f32 or f16"),
        }
        Ok(())
    }
}

/// `softmax(q k^T * scale) v` for each new token (causal: token `i` of a sequence whose cache held
/// `T - len` positions before this step sees keys `..= T - len + i`). `qkv` is `(N, 3C)`, the new
/// tokens of each sequence in turn (`lens[s]` of them); `kv[s]` are sequence `s`'s `T` keys and
/// values after this step's append. Returns `(N, C)`.
pub fn cached_attention(qkv: &Tensor, lens: &[usize], kv: &[CachedKv], n_head: usize, scale: f32) -> Result<Tensor> {
    cached_attention_on(Simd::detect(), qkv, lens, kv, n_head, n_head, scale)
}

/// [`cached_attention`] with grouped-query attention: `qkv` is `(N, (n_head + 2 n_kv_head) hs)`,
/// the queries' heads then the keys' and the values' (`n_kv_head` each, query head `h` reading
/// key/value head `h / (n_head / n_kv_head)`), the caches hold `n_kv_head` heads. Returns
/// `(N, n_head hs)`.
pub fn grouped_attention(
    qkv: &Tensor,
    lens: &[usize],
    kv: &[CachedKv],
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
    masking: Masking,
) -> Result<Tensor> {
    cached_attention_masked(Simd::detect(), qkv, lens, kv, n_head, n_kv_head, scale, masking)
}

/// [`grouped_attention`] on `simd` (`x86::attend512` on AVX-512, `x86::attend` on AVX2 and FMA,
/// `Head::attend` otherwise, for head sizes 32, 64 and 128; `Head::attend` for other sizes). A
/// given instruction set always takes the same path, so results never depend on the batch;
/// different ones agree to rounding.
///
/// # Panics
/// If this CPU does not run `simd` (see [`Simd::available`]).
pub fn cached_attention_on(
    simd: Simd,
    qkv: &Tensor,
    lens: &[usize],
    kv: &[CachedKv],
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
) -> Result<Tensor> {
    cached_attention_masked(simd, qkv, lens, kv, n_head, n_kv_head, scale, Masking::default())
}

/// What some families add to the scores before the softmax: a sliding window (a query sees its
/// own position and the `window - 1` before it: Mistral, Gemma) and soft-capping of the scores,
/// `cap * tanh(s / cap)` after the scale (Gemma 2).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Masking {
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

/// [`cached_attention_on`] with `masking`. The vector kernels take the plain causal attention;
/// a window or a cap takes `Head::attend`, row by row (the same for every batch).
#[allow(clippy::too_many_arguments)]
pub fn cached_attention_masked(
    simd: Simd,
    qkv: &Tensor,
    lens: &[usize],
    kv: &[CachedKv],
    n_head: usize,
    n_kv_head: usize,
    scale: f32,
    masking: Masking,
) -> Result<Tensor> {
    if masking.window == Some(0) {
        candle_core::bail!("cached-attention: a window of 0 positions")
    }
    assert!(simd.is_available(), "{simd:?} is not available on this CPU");
    let (n_rows, width) = qkv.dims2()?;
    let hs = width / (n_head + 2 * n_kv_head).max(1);
    let c = n_head * hs;
    if lens.iter().sum::<usize>() != n_rows
        || kv.len() != lens.len()
        || n_kv_head == 0
        || !n_head.is_multiple_of(n_kv_head)
        || hs == 0
        || (n_head + 2 * n_kv_head) * hs != width
    {
        candle_core::bail!(
            "cached-attention: {n_rows} rows of {width} for lengths {lens:?}, {n_head} heads and {n_kv_head} key/value heads"
        )
    }
    let qkv = qkv.contiguous()?;
    let (q_storage, q_layout) = qkv.storage_and_layout();
    let Storage::Cpu(q_cpu) = &*q_storage else {
        candle_core::bail!("cached-attention: qkv is not on the CPU")
    };
    let q = crate::f32_slice(q_cpu, q_layout, "cached-attention")?;
    let shape = Shape {
        n_rows,
        width,
        hs,
        n_head,
        n_kv_head,
    };
    let y = match kv.first().and_then(|kv| kv.keys.first()).map(Tensor::dtype) {
        Some(candle_core::DType::F16) => attend_all::<half::f16>(simd, q, shape, lens, kv, scale, masking)?,
        _ => attend_all::<f32>(simd, q, shape, lens, kv, scale, masking)?,
    };
    Tensor::from_vec(y, (n_rows, c), &Device::Cpu)
}

/// The sizes of [`cached_attention_masked`]'s operands, checked.
#[derive(Clone, Copy)]
struct Shape {
    n_rows: usize,
    width: usize,
    hs: usize,
    n_head: usize,
    n_kv_head: usize,
}

/// [`cached_attention_masked`] over caches stored as `T` (every block of every cache: another
/// is an error naming it); returns `(N, C)`'s values.
fn attend_all<T: Kv>(
    simd: Simd,
    q: &[f32],
    Shape {
        n_rows,
        width,
        hs,
        n_head,
        n_kv_head,
    }: Shape,
    lens: &[usize],
    kv: &[CachedKv],
    scale: f32,
    masking: Masking,
) -> Result<Vec<f32>> {
    let plain = masking == Masking::default();
    let (c, group) = (n_head * hs, n_head / n_kv_head);
    fn guards(blocks: &[Tensor]) -> Vec<(candle_core::StorageRef<'_>, &Layout)> {
        blocks.iter().map(Tensor::storage_and_layout).collect()
    }
    let guards: Vec<_> = kv.iter().map(|kv| (guards(&kv.keys), guards(&kv.values))).collect();
    let mut seqs = Vec::with_capacity(lens.len());
    let mut row0 = 0;
    for (((k, v), kv), &len) in guards.iter().zip(kv).zip(lens) {
        let t = kv.len;
        if t < len {
            candle_core::bail!("cached-attention: {len} new tokens but {t} cached positions")
        }
        // The first new row's window starts earliest (the plain kernels read from 0).
        let earliest = masking.window.map_or(0, |w| (t - len + 1).saturating_sub(w));
        let keys = Heads::<T>::new(k, t, kv.dropped, earliest, n_kv_head, hs)?;
        let values = Heads::<T>::new(v, t, kv.dropped, earliest, n_kv_head, hs)?;
        seqs.push((keys, values, row0, len, t));
        row0 += len;
    }
    let mut y = vec![0f32; n_rows * c];
    let y_at = y.as_mut_ptr() as usize;
    // Sequence `s`'s query head `h`.
    let head_of = |s: usize, h: usize| {
        let (keys, values, row0, len, t) = &seqs[s];
        Head {
            q,
            keys,
            values,
            h,
            kv_h: h / group,
            hs,
            c,
            ld: width,
            row0: *row0,
            len: *len,
            t: *t,
            scale,
            masking,
        }
    };
    // A decode step (one new token a sequence) of a grouped-query layer on AVX-512: a task per
    // key/value head and up to 4 of its query heads (2 of 128 values), which share each key's and
    // value's loads, where there are at least two such tasks a thread. (SmolLM2's 3 key/value
    // heads at batch 1 on 2 threads: the attention's samples fell from 12% to 8% of a decode
    // after 512 tokens, and the idle thread's rose by as much, perf.)
    #[cfg(target_arch = "x86_64")]
    {
        let per = x86::heads_per_task(hs / 16);
        let shared_tasks = seqs.len() * n_kv_head * group.div_ceil(per);
        if plain
            && group > 1
            && simd == Simd::Avx512
            && matches!(hs, 32 | 64 | 128)
            && lens.iter().all(|&l| l == 1)
            // The pool's threads (candle's `get_num_threads` reads the environment at each call.)
            && shared_tasks >= 2 * (candle_core::utils::barrier_pool().n_workers() + 1)
        {
            let chunks = group.div_ceil(per);
            candle_core::utils::barrier_pool().execute_chunked(shared_tasks, |range| {
                for task in range {
                    let (kv_h, chunk) = (task / chunks % n_kv_head, task % chunks);
                    let first = chunk * per;
                    let head = head_of(task / (n_kv_head * chunks), kv_h * group + first);
                    let heads = (group - first).min(per);
                    // SAFETY: each task writes these heads' columns of its sequence's row only, and
                    // `y` outlives the pool's call; AVX-512 is available (asserted by the caller).
                    unsafe {
                        let y = y_at as *mut f32;
                        match hs {
                            32 => x86::attend512_heads::<T, 2>(&head, heads, y),
                            64 => x86::attend512_heads::<T, 4>(&head, heads, y),
                            _ => x86::attend512_heads::<T, 8>(&head, heads, y),
                        }
                    }
                }
            });
            drop(guards);
            return Ok(y);
        }
    }
    candle_core::utils::barrier_pool().execute_chunked(seqs.len() * n_head, |range| {
        for task in range {
            let head = head_of(task / n_head, task % n_head);
            // SAFETY: each task writes head `h`'s columns of its sequence's rows only, and `y`
            // outlives the pool's call; `simd` is available (asserted by the caller).
            unsafe {
                let y = y_at as *mut f32;
                match (simd, hs) {
                    _ if !plain => head.attend(y),
                    #[cfg(target_arch = "x86_64")]
                    (Simd::Avx512, 32) => x86::attend512::<T, 2, 4>(&head, y),
                    #[cfg(target_arch = "x86_64")]
                    (Simd::Avx512, 64) => x86::attend512::<T, 4, 4>(&head, y),
                    #[cfg(target_arch = "x86_64")]
                    (Simd::Avx512, 128) => x86::attend512::<T, 8, 2>(&head, y),
                    #[cfg(target_arch = "x86_64")]
                    (Simd::Avx2, 32) => x86::attend::<T, 4>(&head, y),
                    #[cfg(target_arch = "x86_64")]
                    (Simd::Avx2, 64) => x86::attend::<T, 8>(&head, y),
                    #[cfg(target_arch = "x86_64")]
                    (Simd::Avx2, 128) => x86::attend::<T, 16>(&head, y),
                    _ => head.attend(y),
                }
            }
        }
    });
    drop(guards);
    Ok(y)
}

/// One (sequence, head) task: its new tokens' rows, in plain Rust (other head sizes and CPUs;
/// `x86::attend` is the same computation for head sizes 32, 64 and 128 with AVX2).
struct Head<'a, T> {
    q: &'a [f32],
    keys: &'a Heads<'a, T>,
    values: &'a Heads<'a, T>,
    /// The query head, and the key/value head it reads.
    h: usize,
    kv_h: usize,
    hs: usize,
    /// The output's width (`n_head * hs`), and the row stride of `q`.
    c: usize,
    ld: usize,
    row0: usize,
    len: usize,
    t: usize,
    scale: f32,
    masking: Masking,
}

impl<T: Stored> Head<'_, T> {
    /// # Safety
    /// `y` is `(N, C)` and no other thread writes this head's columns of these rows.
    unsafe fn attend(&self, y: *mut f32) {
        let (hs, offset) = (self.hs, self.t - self.len);
        let mut scores = vec![0f32; self.t];
        let (mut key, mut value) = (vec![0f32; hs], [0f32; LANES]);
        for i in 0..self.len {
            let row = self.row0 + i;
            let q = &self.q[row * self.ld + self.h * hs..][..hs];
            // The keys this row sees: its window's, else its whole past.
            let first = self.masking.window.map_or(0, |w| (offset + i + 1).saturating_sub(w));
            let keys = &mut scores[first..offset + i + 1];
            let mut max = f32::NEG_INFINITY;
            for (j, s) in keys.iter_mut().enumerate() {
                *s = dot(q, T::widened(self.keys.row(self.kv_h, first + j, hs), &mut key)) * self.scale;
                if let Some(cap) = self.masking.softcap {
                    *s = (*s / cap).tanh() * cap;
                }
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in keys.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            // softmax(..) v, 16 output columns at a time so that the sums stay in registers;
            // each output sums over the keys in order.
            let inv = 1.0 / sum;
            // SAFETY: within this function's contract (its `# Safety`): `y` is `(N, C)` and this task's head columns of its rows are its own; the keys and values hold `t` positions.
            let out = unsafe { y.add(row * self.c + self.h * hs) };
            let mut d0 = 0;
            while d0 < hs {
                let width = LANES.min(hs - d0);
                let mut acc = [0f32; LANES];
                for (j, &p) in keys.iter().enumerate() {
                    let v = T::widened(&self.values.row(self.kv_h, first + j, hs)[d0..d0 + width], &mut value);
                    if let Ok(v) = <&[f32; LANES]>::try_from(v) {
                        for l in 0..LANES {
                            acc[l] += p * v[l];
                        }
                    } else {
                        for (a, &x) in acc.iter_mut().zip(v) {
                            *a += p * x;
                        }
                    }
                }
                for (l, &a) in acc.iter().take(width).enumerate() {
                    // SAFETY: within this function's contract (its `# Safety`): `y` is `(N, C)` and this task's head columns of its rows are its own; the keys and values hold `t` positions.
                    unsafe { *out.add(d0 + l) = a * inv };
                }
                d0 += width;
            }
        }
    }
}

const LANES: usize = 16;

/// `a . b` with 16 partial sums, added pairwise (vectorisable without reassociation).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        let Ok::<&[f32; LANES], _>(x) = x.try_into() else {
            continue;
        };
        let Ok::<&[f32; LANES], _>(y) = y.try_into() else {
            continue;
        };
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0] + tail
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Head, Stored};

    /// Loading stored keys and values into f32 registers.
    pub(crate) trait Load: Stored {
        /// 16 values from `p`.
        ///
        /// # Safety
        /// AVX-512F available; 16 values readable at `p`.
        unsafe fn load16(p: *const Self) -> __m512;
        /// 8 values from `p`.
        ///
        /// # Safety
        /// AVX2 and F16C available; 8 values readable at `p`.
        unsafe fn load8(p: *const Self) -> __m256;
    }

    impl Load for f32 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            // SAFETY: the caller's contract.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            // SAFETY: the caller's contract.
            unsafe { _mm256_loadu_ps(p) }
        }
    }

    impl Load for half::f16 {
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> __m512 {
            // SAFETY: the caller's contract (`vcvtph2ps` is AVX-512F).
            unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
        }
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> __m256 {
            // SAFETY: the caller's contract.
            unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
        }
    }

    /// [`Head::attend`] on AVX-512 for head sizes `16 * CH`, the new tokens in groups of up to
    /// `R` rows that share each key's and value's loads (a long prompt's keys and values sit in
    /// L2, and at one row each a key's 256 bytes cost about as much as its arithmetic). Each row
    /// takes the same operations in the same order whatever its group: per key a chain of `CH`
    /// multiply-adds, then the 16 lanes summed in halves (for 16 keys at once, or for one, in
    /// the same order), the maximum, the exponentials and their sum in 16 lanes, and the values'
    /// weighted sum key after key. So a row's output depends only on its query and its
    /// sequence's cache, as in [`Head::attend`]: a prompt's rows equal those of decoding it
    /// token by token, bit for bit (tested).
    ///
    /// # Safety
    /// As [`Head::attend`]; `head.hs == 16 * CH`; the CPU must have AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn attend512<T: Load, const CH: usize, const R: usize>(head: &Head<T>, y: *mut f32) {
        let mut scores = vec![0f32; R * head.t];
        let mut i0 = 0;
        while i0 < head.len {
            let rows = (head.len - i0).min(R);
            // SAFETY: the caller's contract, for rows i0..i0 + rows of this task.
            unsafe {
                match rows {
                    1 => group::<T, CH, 1>(head, i0, &mut scores, y),
                    2 => group::<T, CH, 2>(head, i0, &mut scores, y),
                    3 => group::<T, CH, 3>(head, i0, &mut scores, y),
                    _ => group::<T, CH, 4>(head, i0, &mut scores, y),
                }
            }
            i0 += rows;
        }
    }

    /// Query heads an [`attend512_heads`] task takes at head size `16 * ch`: as many rows as
    /// [`attend512`]'s tiles take there (each row's query and sums in registers: 4 rows of up to
    /// 64 values, 2 of 128).
    pub(crate) const fn heads_per_task(ch: usize) -> usize {
        if ch > 4 {
            2
        } else {
            4
        }
    }

    /// One new token's query heads `head.h..head.h + heads` (`heads` at most
    /// [`heads_per_task`], all reading
    /// key/value head `head.kv_h`; `head.len == 1`) as the rows of one group: each key's and
    /// value's loads shared by the heads of a grouped-query layer instead of repeated by a task per
    /// head (SmolLM2's 9 query heads read 3 key/value heads). Each head's output has the bits of
    /// [`attend512`]'s: the same operations per row, in the same order.
    ///
    /// # Safety
    /// As [`attend512`]'s, for these heads' columns of the row.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn attend512_heads<T: Load, const CH: usize>(head: &Head<T>, heads: usize, y: *mut f32) {
        debug_assert!(head.len == 1 && heads >= 1 && heads <= heads_per_task(CH));
        let mut scores = vec![0f32; heads * head.t];
        // SAFETY: the caller's contract, for these heads of the task's row.
        unsafe {
            let q = |r: usize| head.q.as_ptr().add(head.row0 * head.ld + (head.h + r) * head.hs);
            let out = |r: usize| y.add(head.row0 * head.c + (head.h + r) * head.hs);
            match heads {
                1 => rows::<T, CH, 1>(head, [q(0)], [out(0)], [head.t], &mut scores),
                2 => rows::<T, CH, 2>(head, [q(0), q(1)], [out(0), out(1)], [head.t; 2], &mut scores),
                3 => rows::<T, CH, 3>(head, [0, 1, 2].map(q), [0, 1, 2].map(out), [head.t; 3], &mut scores),
                _ => rows::<T, CH, 4>(
                    head,
                    [0, 1, 2, 3].map(q),
                    [0, 1, 2, 3].map(out),
                    [head.t; 4],
                    &mut scores,
                ),
            }
        }
    }

    /// Rows `i0..i0 + R` of [`attend512`]; `scores` holds `R` rows of `head.t`.
    ///
    /// # Safety
    /// AVX-512F available; rows `i0..i0 + R` are the head's, and `y` holds their outputs (`R`
    /// rows of the head's columns) with no other thread writing them.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group<T: Load, const CH: usize, const R: usize>(
        head: &Head<T>,
        i0: usize,
        scores: &mut [f32],
        y: *mut f32,
    ) {
        let t = head.t;
        // Row r sees keys ..n[r] (causal); the group's first row sees the fewest.
        let n: [usize; R] = std::array::from_fn(|r| t - head.len + i0 + r + 1);
        // SAFETY: within this function's contract: rows `i0..i0 + R` are the head's.
        unsafe {
            let q = std::array::from_fn(|r| head.q.as_ptr().add((head.row0 + i0 + r) * head.ld + head.h * head.hs));
            let out = std::array::from_fn(|r| y.add((head.row0 + i0 + r) * head.c + head.h * head.hs));
            rows::<T, CH, R>(head, q, out, n, scores)
        }
    }

    /// `R` rows against key/value head `head.kv_h`: row `r`'s query at `q[r]` (`16 * CH` values),
    /// its output to `out[r]`, and it sees keys `..n[r]` (`n` ascending, at most `head.t`);
    /// `scores` holds `R` rows of `head.t`.
    ///
    /// # Safety
    /// AVX-512F available; the queries readable and the outputs writable (`16 * CH` values each),
    /// no other thread writing them.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rows<T: Load, const CH: usize, const R: usize>(
        head: &Head<T>,
        q: [*const f32; R],
        out: [*mut f32; R],
        n: [usize; R],
        scores: &mut [f32],
    ) {
        let (hs, t) = (head.hs, head.t);
        // SAFETY: within this function's contract; the keys and values hold `t` positions.
        unsafe {
            let q: [[__m512; CH]; R] =
                std::array::from_fn(|r| std::array::from_fn(|c| _mm512_loadu_ps(q[r].add(16 * c))));
            // Scores, every row against the keys of the last (a row's extra ones are unused):
            // 16 keys at a time, their lane sums taken together (`sums16`), then one at a time.
            let scale = _mm512_set1_ps(head.scale);
            let dot = |q: &[__m512; CH], k: *const T| {
                let mut acc = _mm512_mul_ps(q[0], T::load16(k));
                for (c, &qc) in q.iter().enumerate().skip(1) {
                    acc = _mm512_fmadd_ps(qc, T::load16(k.add(16 * c)), acc);
                }
                acc
            };
            // A decode step's keys and values come from memory (the step's weights have pushed
            // them out of cache since the last step), a head's few KiB at a time: streams too
            // short for the hardware's prefetchers, whose loads had stalled most of the
            // attention's time (perf annotate). Each run's keys are asked into L2 before they are
            // scored, and the values before the softmax. (A prompt's were just written.)
            let decode = head.len == 1;
            // Run by run of positions stored together (a block of the cache), 16 keys at once
            // while a run has them. (The run of a position the rows do not all see ends at the
            // last row's bound; a row's extra scores are never read.)
            let mut j0 = 0;
            while j0 < n[R - 1] {
                let (keys, run, stride) = head.keys.run(head.kv_h, j0, hs);
                let run = run.min(n[R - 1] - j0);
                let full = run / 16 * 16;
                if decode {
                    (0..run).for_each(|j| prefetch_row(keys.add(j * stride), hs));
                }
                for j in (0..full).step_by(16) {
                    let block = keys.add(j * stride);
                    for (r, q) in q.iter().enumerate() {
                        // The 16 products, kept in registers (slot s holds key SLOTS[s]: the
                        // permutation is its own inverse).
                        let a: [__m512; 16] = std::array::from_fn(|slot| dot(q, block.add(SLOTS[slot] * stride)));
                        let s = _mm512_mul_ps(sums16(&a), scale);
                        _mm512_storeu_ps(scores[r * t + j0 + j..][..16].as_mut_ptr(), s);
                    }
                }
                for j in full..run {
                    for (r, q) in q.iter().enumerate() {
                        scores[r * t + j0 + j] = sum16(dot(q, keys.add(j * stride))) * head.scale;
                    }
                }
                j0 += run;
            }
            // The values asked into L2 while the softmax runs.
            let mut j0 = 0;
            while decode && j0 < n[R - 1] {
                let (values, run, stride) = head.values.run(head.kv_h, j0, hs);
                let run = run.min(n[R - 1] - j0);
                (0..run).for_each(|j| prefetch_row(values.add(j * stride), hs));
                j0 += run;
            }
            // Softmax's numerators and their sum, row by row.
            let mut inv = [0f32; R];
            for r in 0..R {
                let row = &mut scores[r * t..r * t + n[r]];
                let max = crate::rows::max(row);
                for s in row.iter_mut() {
                    *s = crate::rows::exp(*s - max);
                }
                inv[r] = 1.0 / lanes_sum(row);
            }
            // The values' weighted sums: the keys all rows see together, then each row's rest.
            let mut acc = [[_mm512_setzero_ps(); CH]; R];
            let mut j0 = 0;
            while j0 < n[0] {
                let (values, run, stride) = head.values.run(head.kv_h, j0, hs);
                for j in j0..j0 + run.min(n[0] - j0) {
                    let v = values.add((j - j0) * stride);
                    let v: [__m512; CH] = std::array::from_fn(|c| T::load16(v.add(16 * c)));
                    for (r, acc) in acc.iter_mut().enumerate() {
                        let p = _mm512_set1_ps(scores[r * t + j]);
                        for (a, &v) in acc.iter_mut().zip(&v) {
                            *a = _mm512_fmadd_ps(p, v, *a);
                        }
                    }
                }
                j0 += run;
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                for j in n[0]..n[r] {
                    let v = head.values.row(head.kv_h, j, hs).as_ptr();
                    let p = _mm512_set1_ps(scores[r * t + j]);
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(p, T::load16(v.add(16 * c)), *a);
                    }
                }
                let inv = _mm512_set1_ps(inv[r]);
                for (c, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out[r].add(16 * c), _mm512_mul_ps(*a, inv));
                }
            }
        }
    }

    /// The row of `hs` values at `row` asked into L2.
    #[inline(always)]
    fn prefetch_row<T>(row: *const T, hs: usize) {
        let bytes = hs * std::mem::size_of::<T>();
        crate::simd::prefetch_lines(row as *const u8, bytes, crate::simd::CacheLevel::L2);
    }

    /// The 16 lanes' sum: halves added (lanes l and l + 8, then l + 4, l + 2, l + 1), written
    /// out so that every call site adds in this order (the reduction intrinsics leave it open).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn sum16(v: __m512) -> f32 {
        let h = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b11_10_11_10>(v, v));
        let h = _mm512_castps512_ps256(h);
        let h = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)))
    }

    /// Where [`sums16`] takes key `j`'s lanes so that its sum comes out in lane `j`.
    const SLOTS: [usize; 16] = [0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15];

    /// The lane sums of 16 vectors at once, each in [`sum16`]'s order (so a key's score is the
    /// same bits whichever way it is summed): halves of pairs of vectors swapped and added four
    /// times over. Vector `SLOTS[j]`'s sum comes out in lane `j`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn sums16(a: &[__m512; 16]) -> __m512 {
        // Lanes l + 8 onto l: b[i] holds a[i]'s 8 sums, then a[i + 8]'s.
        let b: [__m512; 8] = std::array::from_fn(|i| {
            let x = _mm512_shuffle_f32x4::<0b01_00_01_00>(a[i], a[i + 8]);
            let y = _mm512_shuffle_f32x4::<0b11_10_11_10>(a[i], a[i + 8]);
            _mm512_add_ps(x, y)
        });
        // l + 4 onto l: c[i]'s quarters hold b[i]'s two vectors', then b[i + 4]'s.
        let c: [__m512; 4] = std::array::from_fn(|i| {
            let x = _mm512_shuffle_f32x4::<0b10_00_10_00>(b[i], b[i + 4]);
            let y = _mm512_shuffle_f32x4::<0b11_01_11_01>(b[i], b[i + 4]);
            _mm512_add_ps(x, y)
        });
        // l + 2 onto l, then l + 1, within each quarter.
        let d: [__m512; 2] = std::array::from_fn(|i| {
            let x = _mm512_shuffle_ps::<0b01_00_01_00>(c[i], c[i + 2]);
            let y = _mm512_shuffle_ps::<0b11_10_11_10>(c[i], c[i + 2]);
            _mm512_add_ps(x, y)
        });
        let x = _mm512_shuffle_ps::<0b10_00_10_00>(d[0], d[1]);
        let y = _mm512_shuffle_ps::<0b11_01_11_01>(d[0], d[1]);
        _mm512_add_ps(x, y)
    }

    /// `x`'s sum in 16 lanes (element j into lane j % 16, in order), the lanes then added
    /// pairwise: vectorised, and a function of `x` alone.
    #[inline(always)]
    fn lanes_sum(x: &[f32]) -> f32 {
        let mut acc = [0f32; 16];
        let chunks = x.chunks_exact(16);
        let tail = chunks.remainder();
        for chunk in chunks {
            for l in 0..16 {
                acc[l] += chunk[l];
            }
        }
        for (a, &v) in acc.iter_mut().zip(tail) {
            *a += v;
        }
        let mut width = 16;
        while width > 1 {
            width /= 2;
            for l in 0..width {
                acc[l] += acc[l + width];
            }
        }
        acc[0]
    }

    /// [`Head::attend`] with the head's `8 * CH` values in AVX2 registers: the query, one key's
    /// product, and the output's sums (one register per 8 columns, so that consecutive keys'
    /// multiply-adds are independent).
    ///
    /// # Safety
    /// As [`Head::attend`]; `head.hs == 8 * CH`; the CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn attend<T: Load, const CH: usize>(head: &Head<T>, y: *mut f32) {
        let (hs, offset) = (head.hs, head.t - head.len);
        let mut scores = vec![0f32; head.t];
        // SAFETY: within this function's contract (its `# Safety`): `y` is `(N, C)` and this task's head columns of its rows are its own; the keys and values hold `t` positions.
        unsafe {
            for i in 0..head.len {
                let row = head.row0 + i;
                let q_at = head.q.as_ptr().add(row * head.ld + head.h * hs);
                let mut q = [_mm256_setzero_ps(); CH];
                for (c, v) in q.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(q_at.add(8 * c));
                }
                let keys = &mut scores[..offset + i + 1];
                let mut max = f32::NEG_INFINITY;
                for (j, s) in keys.iter_mut().enumerate() {
                    let k = head.keys.row(head.kv_h, j, hs).as_ptr();
                    let (mut a, mut b) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for c in (0..CH).step_by(2) {
                        a = _mm256_fmadd_ps(q[c], T::load8(k.add(8 * c)), a);
                        b = _mm256_fmadd_ps(q[c + 1], T::load8(k.add(8 * c + 8)), b);
                    }
                    let sum = _mm256_add_ps(a, b);
                    let sum = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
                    let sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
                    let sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
                    *s = _mm_cvtss_f32(sum) * head.scale;
                    max = max.max(*s);
                }
                // Two loops: the exponentials vectorise alone (`f32::exp` is a libm call each).
                for s in keys.iter_mut() {
                    *s = crate::rows::exp(*s - max);
                }
                let total: f32 = keys.iter().sum();
                let mut acc = [_mm256_setzero_ps(); CH];
                for (j, &p) in keys.iter().enumerate() {
                    let v = head.values.row(head.kv_h, j, hs).as_ptr();
                    let p = _mm256_set1_ps(p);
                    for (c, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(p, T::load8(v.add(8 * c)), *a);
                    }
                }
                let inv = _mm256_set1_ps(1.0 / total);
                let out = y.add(row * head.c + head.h * hs);
                for (c, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(8 * c), _mm256_mul_ps(*a, inv));
                }
            }
        }
    }
}
