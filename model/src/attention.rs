//! Multi-head causal self-attention ("Attention Is All You Need", §3.2) and its KV cache.
//!
//! Two entry points share the weights: [`CausalSelfAttention::forward_t`] for whole `(B, T)`
//! windows (training, evaluation; differentiable), and [`CausalSelfAttention::forward_packed`]
//! for generation, where the new tokens of several sequences are packed into one `(N, C)` matrix
//! so the projections run once for all of them, and only the score/softmax/value step is done
//! per sequence, against that sequence's own cache.

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::layers::{dropout, matmul, Autocast, Conv1D, Dropout};

/// Keys and values of every layer for one sequence, so that decoding a token does not recompute
/// the prompt. Positions continue from [`KvCache::len`]. Its CPU buffers go back to the pool of
/// [`set_kv_pool_limit`] when it is dropped or cleared.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKv>,
    len: usize,
}

impl KvCache {
    /// Room is allocated in chunks of this many positions as the sequence grows, rather than the
    /// whole context up front: many short sequences then cost little memory.
    pub(crate) const CHUNK: usize = 64;

    pub fn new(cfg: &Config) -> Self {
        let chunk = Self::CHUNK.min(cfg.n_positions);
        Self {
            layers: (0..cfg.n_layer).map(|_| LayerKv::new(chunk)).collect(),
            len: 0,
        }
    }

    /// Positions already held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(LayerKv::clear);
        self.len = 0;
    }

    /// Room for `positions` in all (a sequence's expected length: its prompt and the tokens it
    /// may generate), taken at the first step instead of chunk by chunk. Each growth of whole
    /// buffers copies every layer's keys and values into new ones whose pages the OS then faults
    /// in; at batch 16 the sequences cross a chunk boundary together, and that step took
    /// 200-270 ms against 29 ms for the others (measured). Buffers already allocated and too small
    /// grow now.
    pub fn reserve(&mut self, positions: usize) -> candle_core::Result<()> {
        for layer in &mut self.layers {
            layer.want = positions;
            layer.reserve_wanted()?;
        }
        Ok(())
    }

    /// An independent copy holding the same positions: the way to share one prefilled prompt
    /// between several continuations. (There is no `Clone`: appending writes into the buffers in
    /// place, so two caches sharing them would overwrite each other.)
    pub fn fork(&self) -> candle_core::Result<Self> {
        self.prefix(self.len)
    }

    /// A cache like this one (its chunk, what it reserved) with nothing in it.
    pub fn empty_like(&self) -> Self {
        Self {
            layers: (self.layers.iter())
                .map(|l| {
                    let mut empty = LayerKv::new(l.chunk);
                    empty.want = l.want;
                    empty
                })
                .collect(),
            len: 0,
        }
    }

    /// Keeps the first `len` positions only (a step that failed half-way is undone this way).
    pub fn truncate(&mut self, len: usize) -> candle_core::Result<()> {
        if len < self.len {
            *self = self.prefix(len)?;
        }
        Ok(())
    }

    /// A new cache with copies of the first `len` positions of every layer.
    pub fn prefix(&self, len: usize) -> candle_core::Result<Self> {
        self.copy(len, false)
    }

    /// A copy of the positions held in as few whole chunks as hold them, without the room
    /// reserved beyond (a copy that is kept but not grown, as the server's prefix store does).
    pub fn compact(&self) -> candle_core::Result<Self> {
        self.copy(self.len, true)
    }

    /// Copies of the first `len` positions, in buffers of as few chunks as hold them when
    /// `exact`, else with the room reserved.
    fn copy(&self, len: usize, exact: bool) -> candle_core::Result<Self> {
        let len = len.min(self.len);
        Ok(Self {
            layers: self
                .layers
                .iter()
                .map(|layer| layer.copy(len, exact))
                .collect::<candle_core::Result<_>>()?,
            len,
        })
    }

    pub(crate) fn layer(&mut self, i: usize) -> &mut LayerKv {
        &mut self.layers[i]
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

/// One layer's keys and values, of which the first `len` positions are held, in one of two
/// layouts chosen at the first allocation:
///
/// - On the CPU in f32 (the fused attention's case), **blocks** of `chunk` positions, each a
///   pair of `(n_head, chunk, head_dim)` buffers, one more as the sequence grows (the way vLLM's
///   paged cache holds positions). Every sequence of a model then allocates buffers of one size,
///   which the pool of [`set_kv_pool_limit`] hands from a finished sequence to the next as they
///   are: a server's KV memory rises to its peak and stays there. One buffer per sequence in
///   whole chunks instead had a few sizes per model (64 to 256 positions for the default model),
///   and freed buffers of those sizes between other allocations fragmented glibc's heap, which
///   grew by 7-11% over 15-30 minutes of a soak (`BENCHMARKS.md`).
/// - Elsewhere (CUDA, half precision), two **whole** `(n_head, room, head_dim)` buffers grown by
///   whole chunks, read through candle's ops as views.
///
/// Not candle-nn's `kv_cache::KvCache`: that one is written only by `append`ing a tensor, which
/// for one decode row of one sequence costs a dozen op dispatches (split, reshape, transpose,
/// copy, narrow, for keys and values): 1.9 ms of a 30 ms decode step at batch 16 in a profile.
/// Here a batched CPU step writes every sequence's new rows straight from the fused projection
/// ([`LayerKv::write_rows`]); `append` remains for the other devices.
#[derive(Debug)]
pub(crate) struct LayerKv {
    store: Store,
    len: usize,
    chunk: usize,
    /// Positions to make room for at the first allocation ([`KvCache::reserve`]).
    want: usize,
}

#[derive(Debug)]
enum Store {
    Empty,
    Whole(Tensor, Tensor),
    Blocks(Vec<(Tensor, Tensor)>),
}

impl LayerKv {
    fn new(chunk: usize) -> Self {
        Self {
            store: Store::Empty,
            len: 0,
            chunk: chunk.max(1),
            want: 0,
        }
    }

    /// `positions`, or what was reserved if more, in whole chunks.
    fn rounded(&self, positions: usize) -> usize {
        positions.max(self.want).div_ceil(self.chunk) * self.chunk
    }

    fn clear(&mut self) {
        match std::mem::replace(&mut self.store, Store::Empty) {
            Store::Empty => {}
            Store::Whole(k, v) => pool::put(k, v),
            Store::Blocks(blocks) => blocks.into_iter().for_each(|(k, v)| pool::put(k, v)),
        }
        self.len = 0;
    }

    fn room(&self) -> usize {
        match &self.store {
            Store::Empty => 0,
            Store::Whole(k, _) => k.dims()[1],
            Store::Blocks(blocks) => blocks.len() * self.chunk,
        }
    }

    /// The `(n_head, head_dim, dtype, device)` of the buffers held, if any.
    fn kind(&self) -> Option<(usize, usize, candle_core::DType, candle_core::Device)> {
        let k = match &self.store {
            Store::Empty => return None,
            Store::Whole(k, _) => k,
            Store::Blocks(blocks) => &blocks.first()?.0,
        };
        let dims = k.dims();
        Some((dims[0], dims[2], k.dtype(), k.device().clone()))
    }

    /// Makes room for what was reserved, if buffers are held (their kind is known).
    fn reserve_wanted(&mut self) -> candle_core::Result<()> {
        match self.kind() {
            Some((n_head, head_dim, dtype, device)) => self.reserve(0, n_head, head_dim, dtype, &device),
            None => Ok(()),
        }
    }

    /// Makes room for `extra` more positions of `n_head` heads of `head_dim`, and for what was
    /// reserved, in whole chunks: new blocks, or whole buffers copied into larger ones.
    pub(crate) fn reserve(
        &mut self,
        extra: usize,
        n_head: usize,
        head_dim: usize,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<()> {
        let need = self.len + extra;
        if need.max(self.want) <= self.room() {
            return Ok(());
        }
        let room = self.rounded(need);
        if let Store::Empty = self.store {
            if in_blocks(dtype, device) {
                self.store = Store::Blocks(Vec::new());
            }
        }
        match &mut self.store {
            Store::Blocks(blocks) => {
                while blocks.len() * self.chunk < room {
                    blocks.push(buffers(n_head, self.chunk, head_dim, dtype, device)?);
                }
                Ok(())
            }
            _ => self.reallocate(room, n_head, head_dim, dtype, device),
        }
    }

    /// Whole buffers of at least `room` positions (from the pool, or new), holding what these
    /// held; these go back to the pool.
    fn reallocate(
        &mut self,
        room: usize,
        n_head: usize,
        head_dim: usize,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<()> {
        let (k, v) = buffers(n_head, room, head_dim, dtype, device)?;
        if let (Store::Whole(old_k, old_v), true) = (&self.store, self.len > 0) {
            k.slice_set(&old_k.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
            v.slice_set(&old_v.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
        }
        if let Store::Whole(old_k, old_v) = std::mem::replace(&mut self.store, Store::Whole(k, v)) {
            pool::put(old_k, old_v);
        }
        Ok(())
    }

    /// After making room for `extra` more positions, the whole buffers, for a kernel that writes
    /// the new positions itself (then [`Self::wrote`]); `None` where the cache is in blocks.
    #[cfg(feature = "cuda")]
    pub(crate) fn whole_with_room(
        &mut self,
        extra: usize,
        n_head: usize,
        head_dim: usize,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        self.reserve(extra, n_head, head_dim, dtype, device)?;
        Ok(match &self.store {
            Store::Whole(k, v) => Some((k.clone(), v.clone())),
            _ => None,
        })
    }

    /// Counts `t` positions written into the buffers of [`Self::whole_with_room`].
    #[cfg(feature = "cuda")]
    pub(crate) fn wrote(&mut self, t: usize) {
        self.len += t;
    }

    /// Where `t` positions appended now go in blocks: `(block, position in it, first of the
    /// `t`, how many)`, block after block.
    fn spans(&self, t: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            (i < t).then(|| {
                let (b, at) = ((self.len + i) / self.chunk, (self.len + i) % self.chunk);
                let n = (self.chunk - at).min(t - i);
                i += n;
                (b, at, i - n, n)
            })
        })
    }

    /// Appends keys and values `(n_head, t, head_dim)`; returns every position held, `(n_head,
    /// len, head_dim)` (views of whole buffers; blocks are copied into one).
    pub(crate) fn append(&mut self, k: &Tensor, v: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let (n_head, t, head_dim) = k.dims3()?;
        self.reserve(t, n_head, head_dim, k.dtype(), k.device())?;
        match &self.store {
            Store::Whole(kb, vb) => {
                kb.slice_set(k, 1, self.len)?;
                vb.slice_set(v, 1, self.len)?;
            }
            Store::Blocks(blocks) => {
                for (b, at, i, n) in self.spans(t) {
                    blocks[b].0.slice_set(&k.narrow(1, i, n)?.contiguous()?, 1, at)?;
                    blocks[b].1.slice_set(&v.narrow(1, i, n)?.contiguous()?, 1, at)?;
                }
            }
            Store::Empty => candle_core::bail!("kv-cache: no room reserved"),
        }
        self.len += t;
        self.held()
    }

    /// Writes `t` positions from rows `row0..row0 + t` of the `(N, 3C)` projection `qkv` (keys
    /// at columns `C..2C`, values at `2C..3C`, head after head), after [`Self::reserve`]; returns
    /// every position held. CPU, f32.
    pub(crate) fn write_rows(
        &mut self,
        qkv: &[f32],
        c: usize,
        row0: usize,
        t: usize,
    ) -> candle_core::Result<gpt_kernels::CachedKv> {
        let (n_head, head_dim) = self.kind().map(|(n, d, ..)| (n, d)).unwrap_or_default();
        if self.len + t > self.room() || n_head * head_dim != c || qkv.len() < (row0 + t) * 3 * c {
            candle_core::bail!(
                "kv-cache: {t} rows at {row0} into {} of {} positions of {n_head} x {head_dim}",
                self.len,
                self.room()
            )
        }
        let write = |k: &Tensor, v: &Tensor, row0: usize, rows: usize, at: usize| {
            for (buffer, col0) in [(k, c), (v, 2 * c)] {
                buffer.inplace_op1(&gpt_kernels::WriteRows {
                    src: qkv,
                    ld: 3 * c,
                    col0,
                    row0,
                    rows,
                    at,
                })?;
            }
            candle_core::Result::Ok(())
        };
        match &self.store {
            Store::Whole(k, v) => write(k, v, row0, t, self.len)?,
            Store::Blocks(blocks) => {
                for (b, at, i, n) in self.spans(t) {
                    write(&blocks[b].0, &blocks[b].1, row0 + i, n, at)?;
                }
            }
            Store::Empty => candle_core::bail!("kv-cache: no room reserved"),
        }
        self.len += t;
        Ok(match &self.store {
            Store::Blocks(blocks) => gpt_kernels::CachedKv {
                keys: blocks.iter().map(|(k, _)| k.clone()).collect(),
                values: blocks.iter().map(|(_, v)| v.clone()).collect(),
                len: self.len,
            },
            _ => {
                let (k, v) = self.held()?;
                gpt_kernels::CachedKv {
                    keys: vec![k],
                    values: vec![v],
                    len: self.len,
                }
            }
        })
    }

    /// Keys and values of the positions held, `(n_head, len, head_dim)`: views of whole buffers,
    /// or the blocks copied into one.
    pub(crate) fn held(&self) -> candle_core::Result<(Tensor, Tensor)> {
        match &self.store {
            Store::Whole(k, v) => Ok((k.narrow(1, 0, self.len)?, v.narrow(1, 0, self.len)?)),
            Store::Blocks(blocks) => {
                let n = self.len.div_ceil(self.chunk);
                let (k, v): (Vec<_>, Vec<_>) = blocks[..n].iter().cloned().unzip();
                Ok((
                    Tensor::cat(&k, 1)?.narrow(1, 0, self.len)?,
                    Tensor::cat(&v, 1)?.narrow(1, 0, self.len)?,
                ))
            }
            Store::Empty => candle_core::bail!("kv-cache: no room reserved"),
        }
    }

    /// A copy of the first `len` positions in fresh buffers: of as few chunks as hold them when
    /// `exact`, else with the room reserved.
    fn copy(&self, len: usize, exact: bool) -> candle_core::Result<Self> {
        let mut copy = Self::new(self.chunk);
        let len = len.min(self.len);
        if !exact {
            copy.want = self.want;
        }
        if len == 0 {
            return Ok(copy);
        }
        match &self.store {
            Store::Empty => {}
            Store::Whole(k, v) => {
                let (n_head, _, head_dim) = k.dims3()?;
                let room = if exact {
                    len.div_ceil(self.chunk) * self.chunk
                } else {
                    copy.rounded(len)
                };
                copy.reallocate(room, n_head, head_dim, k.dtype(), k.device())?;
                copy.append(&k.narrow(1, 0, len)?.contiguous()?, &v.narrow(1, 0, len)?.contiguous()?)?;
            }
            Store::Blocks(blocks) => {
                let (n_head, _, head_dim) = blocks[0].0.dims3()?;
                let (dtype, device) = (blocks[0].0.dtype(), blocks[0].0.device());
                let mut copied = Vec::new();
                // Whole blocks: the positions past `len` in the last are never read.
                for (k, v) in &blocks[..len.div_ceil(self.chunk)] {
                    let (ck, cv) = buffers(n_head, self.chunk, head_dim, dtype, device)?;
                    ck.slice_set(k, 1, 0)?;
                    cv.slice_set(v, 1, 0)?;
                    copied.push((ck, cv));
                }
                copy.store = Store::Blocks(copied);
                copy.len = len;
                if !exact {
                    copy.reserve(0, n_head, head_dim, dtype, device)?;
                }
            }
        }
        Ok(copy)
    }
}

/// Whether caches of `dtype` on `device` are held in blocks (see [`LayerKv`]): where the fused
/// CPU attention reads them, the same condition as `ops::fused` on the CPU.
fn in_blocks(dtype: candle_core::DType, device: &candle_core::Device) -> bool {
    device.is_cpu() && dtype == candle_core::DType::F32 && gpt_kernels::cpu_fused()
}

/// A pair of `(n_head, room, head_dim)` buffers: from the pool, or new.
fn buffers(
    n_head: usize,
    room: usize,
    head_dim: usize,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    match pool::take(dtype, device, n_head, room, head_dim) {
        Some(pair) => Ok(pair),
        None => {
            let fresh = || Tensor::zeros((n_head, room, head_dim), dtype, device);
            Ok((fresh()?, fresh()?))
        }
    }
}

impl Drop for LayerKv {
    fn drop(&mut self) {
        self.clear();
    }
}

/// Keeps up to `bytes` of freed CPU KV-cache buffers for reuse (0, the default, keeps none).
///
/// A server allocates a sequence's keys and values at its start and frees them at its end, tens
/// of times a second (prompts and outputs of every length, prefix-cache copies, forks for `n` and
/// beams): given back to glibc, the heap fragments and its resident size creeps up (`BENCHMARKS.md`),
/// and handing pages back (`malloc_trim`) made them fault in again at every allocation. Kept
/// here, buffers are taken again as they are (never cleared: only the positions a cache holds
/// are ever read). On the CPU in f32 every buffer is a block of the same size, so any sequence
/// takes any kept block; [`fill_kv_pool`] allocates them up front.
pub fn set_kv_pool_limit(bytes: usize) {
    pool::set_limit(bytes)
}

/// Allocates the pool of [`set_kv_pool_limit`] up to its limit at once with blocks for the
/// caches of a model of `cfg` in `dtype` on `device`, every page written, so that a server's KV
/// memory is resident from its start instead of growing to each new peak of its load (as vLLM
/// allocates its KV cache at startup). Only the CPU's f32 caches are blocks of one size (see
/// [`KvCache`]); for others nothing is allocated. Returns the bytes the pool holds.
pub fn fill_kv_pool(
    cfg: &Config,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> candle_core::Result<usize> {
    if in_blocks(dtype, device) {
        let n_head = cfg.n_head.max(1);
        let block = KvCache::CHUNK.min(cfg.n_positions).max(1);
        pool::fill(n_head, block, cfg.n_embd / n_head)?;
    }
    Ok(pool::bytes())
}

/// Bytes of freed KV-cache buffers the pool keeps now.
pub fn kv_pool_bytes() -> usize {
    pool::bytes()
}

/// The pool of [`set_kv_pool_limit`]: pairs of key and value buffers by dtype and shape, a
/// process-wide list (tens of entries; a lookup is a scan).
mod pool {
    use std::sync::Mutex;

    use candle_core::{DType, Device, Tensor};

    struct Pool {
        free: Vec<(Tensor, Tensor)>,
        bytes: usize,
        limit: usize,
    }

    static POOL: Mutex<Pool> = Mutex::new(Pool {
        free: Vec::new(),
        bytes: 0,
        limit: 0,
    });

    fn lock() -> std::sync::MutexGuard<'static, Pool> {
        // A panic elsewhere while holding the lock leaves the list consistent (each change is
        // one push or one removal): carry on with it.
        POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn size(k: &Tensor) -> usize {
        2 * k.elem_count() * k.dtype().size_in_bytes()
    }

    pub(super) fn set_limit(bytes: usize) {
        let mut pool = lock();
        pool.limit = bytes;
        while pool.bytes > pool.limit {
            let Some((k, _)) = pool.free.pop() else { break };
            pool.bytes -= size(&k);
        }
    }

    pub(super) fn bytes() -> usize {
        lock().bytes
    }

    /// A pair of `(n_head, r, head_dim)` buffers with `room <= r < 2 room`, the smallest kept.
    /// Without one, kept buffers of other sizes worth the new pair's bytes are let go first (the
    /// largest first, so that the allocator has a block the new pair fits in): the pool and the
    /// caches in use together then stay within what they held at their peak. Keeping every size
    /// instead held the peak of each size at once, and a server's memory crept up as each size
    /// had its burst (a 30-minute soak: +10% over minutes 1-14).
    pub(super) fn take(
        dtype: DType,
        device: &Device,
        n_head: usize,
        room: usize,
        head_dim: usize,
    ) -> Option<(Tensor, Tensor)> {
        if !device.is_cpu() {
            return None;
        }
        let mut pool = lock();
        let fits = |k: &Tensor| {
            let dims = k.dims();
            k.dtype() == dtype && dims[0] == n_head && dims[2] == head_dim && dims[1] >= room && dims[1] < 2 * room
        };
        let best = (pool.free.iter().enumerate())
            .filter(|(_, (k, _))| fits(k))
            .min_by_key(|(_, (k, _))| k.dims()[1])
            .map(|(i, _)| i);
        let Some(best) = best else {
            let mut wanted = 2 * n_head * room * head_dim * dtype.size_in_bytes();
            pool.free.sort_by_key(|(k, _)| size(k));
            while wanted > 0 {
                let Some((k, _)) = pool.free.pop() else { break };
                let freed = size(&k);
                pool.bytes -= freed;
                wanted = wanted.saturating_sub(freed);
            }
            return None;
        };
        let pair = pool.free.swap_remove(best);
        pool.bytes -= size(&pair.0);
        Some(pair)
    }

    /// Adds f32 CPU pairs of `(n_head, room, head_dim)` buffers while they fit under the limit,
    /// each page written (resident now, not at its first use).
    pub(super) fn fill(n_head: usize, room: usize, head_dim: usize) -> candle_core::Result<()> {
        let n = n_head * room * head_dim;
        let pair = 2 * n * 4;
        loop {
            let full = {
                let pool = lock();
                pool.bytes + pair > pool.limit
            };
            if pair == 0 || full {
                return Ok(());
            }
            let fresh = || {
                let mut data = vec![0f32; n];
                // `vec![0; n]` may leave fresh pages unmapped (calloc): write one value a page.
                for page in data.chunks_mut(1024) {
                    page[0] = std::hint::black_box(0.0);
                }
                Tensor::from_vec(data, (n_head, room, head_dim), &Device::Cpu)
            };
            put(fresh()?, fresh()?);
        }
    }

    /// Keeps `k` and `v` if there is room under the limit (CPU buffers only).
    pub(super) fn put(k: Tensor, v: Tensor) {
        if !k.device().is_cpu() || k.dims().len() != 3 {
            return;
        }
        let mut pool = lock();
        if pool.bytes + size(&k) <= pool.limit {
            pool.bytes += size(&k);
            pool.free.push((k, v));
        }
    }
}

#[derive(Debug, Clone)]
pub struct CausalSelfAttention {
    pub(crate) c_attn: Conv1D,
    pub(crate) c_proj: Conv1D,
    n_head: usize,
    head_dim: usize,
    attn_pdrop: f32,
    resid_pdrop: f32,
    pub(crate) autocast: Autocast,
}

impl CausalSelfAttention {
    pub fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let c = cfg.n_embd;
        Ok(Self {
            c_attn: Conv1D::load(vb.pp("c_attn"), c, 3 * c, cfg)?,
            c_proj: Conv1D::load_with_std(vb.pp("c_proj"), c, c, 0.02 / (2.0 * cfg.n_layer as f64).sqrt(), cfg)?,
            n_head: cfg.n_head,
            head_dim: cfg.head_dim(),
            attn_pdrop: cfg.attn_pdrop,
            resid_pdrop: cfg.resid_pdrop,
            autocast: Autocast::Off,
        })
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Causal attention over whole windows. `train` switches on dropout (masks: its sites 0 and 1)
    /// and uses softmax built from differentiable ops (candle-nn's fused `softmax_last_dim` has no
    /// backward pass).
    pub fn forward_t(&self, x: &Tensor, train: Option<Dropout>) -> candle_core::Result<Tensor> {
        self.forward_recorded(x, train, None)
    }

    /// [`Self::forward_t`], also pushing the attention probabilities `(B, nh, T, T)` (after the
    /// causal softmax, before dropout) onto `record` when given: what attention-map views show.
    pub fn forward_recorded(
        &self,
        x: &Tensor,
        train: Option<Dropout>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        let (b_sz, seq_len, n_embd) = x.dims3()?;
        if gpt_kernels::fused(x) && x.device().is_cpu() {
            let rows = x.reshape((b_sz * seq_len, n_embd))?;
            let y = self.forward_rows(&rows, seq_len, train, record)?;
            return dropout(y, self.resid_pdrop, train.map(|d| d.site(1)))?.reshape((b_sz, seq_len, n_embd));
        }
        if gpt_kernels::fused(x) && gpt_kernels::window_attention_runs_on(x, self.head_dim) {
            // f32 on a CUDA GPU: the same op (its kernels in ops.cu), one product for q, k and v;
            // the residual dropout over (B, T, C) as below (its masks count whole windows).
            let rows = x.reshape((b_sz * seq_len, n_embd))?;
            let y = self.forward_rows(&rows, seq_len, train, record)?;
            return dropout(
                y.reshape((b_sz, seq_len, n_embd))?,
                self.resid_pdrop,
                train.map(|d| d.site(1)),
            );
        }
        // Inference multiplies once and splits the product (quantized weights cannot be split);
        // training splits the weight (see `forward_cols`).
        let qkv = match train {
            None => Some(self.c_attn.forward(x)?), // (B, T, 3C)
            Some(_) => None,
        };
        let heads = |i: usize| -> candle_core::Result<Tensor> {
            match &qkv {
                Some(qkv) => qkv.narrow(2, i * n_embd, n_embd)?,
                None => self.c_attn.forward_cols(x, i * n_embd, n_embd)?,
            } // (B, T, C): q, k or v
            .reshape((b_sz, seq_len, self.n_head, self.head_dim))? // (B, T, nh, hs)
            .transpose(1, 2)? // (B, nh, T, hs)
            .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = (matmul(&q, &k.t()?, self.autocast)? * self.scale())?; // (B, nh, T, T)
        let att = gpt_kernels::causal_softmax(&att, train.is_some())?; // upper triangle masked to 0
        if let Some(record) = record {
            record.push(att.clone());
        }
        let att = dropout(att, self.attn_pdrop, train.map(|d| d.site(0)))?;
        let y = matmul(&att, &v, self.autocast)?; // (B, nh, T, hs)
        let y = y.transpose(1, 2)?.reshape((b_sz, seq_len, n_embd))?; // (B, T, C)
        dropout(self.c_proj.forward(&y)?, self.resid_pdrop, train.map(|d| d.site(1)))
    }

    /// The attention's output before its residual dropout, for `x` `(B * T, C)`: windows of
    /// `seq_len` rows, f32 on the CPU. One product for q, k and v, then the tiled attention op
    /// (forward and backward; ops/window_attention.rs), which never holds the (B, nh, T, T)
    /// weights; `train` and `record` as in [`Self::forward_recorded`] (recorded probabilities
    /// are computed beside the op, from the same q and k, so the output is the same either way).
    pub(crate) fn forward_rows(
        &self,
        x: &Tensor,
        seq_len: usize,
        train: Option<Dropout>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        let qkv = self.c_attn.forward(x)?; // (B*T, 3C)
        if let Some(record) = record {
            let (rows, width) = qkv.dims2()?;
            let heads = |i: usize| -> candle_core::Result<Tensor> {
                qkv.narrow(1, i * width / 3, width / 3)?
                    .reshape((rows / seq_len, seq_len, self.n_head, self.head_dim))?
                    .transpose(1, 2)? // (B, nh, T, hs)
                    .contiguous()
            };
            let att = (heads(0)?.matmul(&heads(1)?.t()?)? * self.scale())?;
            record.push(gpt_kernels::causal_softmax(&att, false)?); // (B, nh, T, T)
        }
        let (p, d) = match train {
            Some(d) if self.attn_pdrop > 0.0 => (self.attn_pdrop, d.site(0)),
            _ => (0.0, Dropout { key: 0, first_row: 0 }),
        };
        let y = gpt_kernels::window_attention(
            gpt_kernels::Simd::detect(),
            &qkv,
            seq_len,
            self.n_head,
            self.scale() as f32,
            p,
            d.key,
            d.first_row,
        )?;
        self.c_proj.forward(&y) // (B*T, C)
    }

    pub(crate) fn resid_pdrop(&self) -> f32 {
        self.resid_pdrop
    }

    /// Inference on packed rows: `x` is `(N, C)`, the new tokens of each sequence in turn,
    /// `lens[s]` of them for sequence `s`, whose cache for this layer is `caches[s]`. Appends the
    /// new keys and values to each cache.
    pub(crate) fn forward_packed(
        &self,
        x: &Tensor,
        lens: &[usize],
        caches: &mut [&mut LayerKv],
    ) -> candle_core::Result<Tensor> {
        let (_n_rows, n_embd) = x.dims2()?;
        let qkv = self.c_attn.forward(x)?; // (N, 3C): one matmul for every sequence
        if gpt_kernels::fused(&qkv) && qkv.device().is_cpu() {
            // On the CPU in f32: the new keys and values go straight from `qkv` into the caches,
            // and one fused op attends for every sequence at once (ops/attention.rs).
            let qkv = qkv.contiguous()?;
            let kv = {
                let (storage, layout) = qkv.storage_and_layout();
                let candle_core::Storage::Cpu(cpu) = &*storage else {
                    candle_core::bail!("forward_packed: qkv is not on the CPU")
                };
                let rows = gpt_kernels::f32_slice(cpu, layout, "forward_packed")?;
                let mut start = 0;
                let mut kv = Vec::with_capacity(lens.len());
                for (&len, cache) in lens.iter().zip(caches.iter_mut()) {
                    cache.reserve(len, self.n_head, self.head_dim, qkv.dtype(), qkv.device())?;
                    kv.push(cache.write_rows(rows, n_embd, start, len)?); // (nh, offset + t, hs)
                    start += len;
                }
                kv
            };
            let y = gpt_kernels::cached_attention(&qkv, lens, &kv, self.n_head, self.scale() as f32)?; // (N, C)
            return self.c_proj.forward(&y);
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = self.decode_on_gpu(&qkv, lens, caches)? {
            return self.c_proj.forward(&y);
        }
        let mut outputs = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (&len, cache) in lens.iter().zip(caches.iter_mut()) {
            let rows = qkv.narrow(0, start, len)?; // (t, 3C)
            start += len;
            let heads = |i: usize| -> candle_core::Result<Tensor> {
                rows.narrow(1, i * n_embd, n_embd)? // (t, C)
                    .reshape((len, self.n_head, self.head_dim))? // (t, nh, hs)
                    .transpose(0, 1)? // (nh, t, hs)
                    .contiguous()
            };
            let (k, v) = cache.append(&heads(1)?, &heads(2)?)?; // (nh, offset + t, hs)
            let q = heads(0)?;
            let att = (q.matmul(&k.t()?)? * self.scale())?; // (nh, t, offset + t)
            let att = gpt_kernels::causal_softmax(&att, false)?; // new token i sees keys ..= offset + i
            let y = att.matmul(&v.contiguous()?)?; // (nh, t, hs)
            outputs.push(y.transpose(0, 1)?.reshape((len, n_embd))?); // (t, C)
        }
        self.c_proj.forward(&Tensor::cat(&outputs, 0)?) // (N, C)
    }
}

impl CausalSelfAttention {
    /// A decode step (one new token for every sequence) on CUDA with whole-buffer caches: the
    /// appends and the attention of all sequences in one kernel launch
    /// ([`gpt_kernels::cuda::decode_attention`]). `None` (nothing changed but room reserved) where
    /// that does not apply, or with `GPT_CUDA_FUSED=0`.
    #[cfg(feature = "cuda")]
    fn decode_on_gpu(
        &self,
        qkv: &Tensor,
        lens: &[usize],
        caches: &mut [&mut LayerKv],
    ) -> candle_core::Result<Option<Tensor>> {
        if !qkv.device().is_cuda() || !gpt_kernels::cuda_fused() || lens.iter().any(|&t| t != 1) {
            return Ok(None);
        }
        let mut buffers = Vec::with_capacity(caches.len());
        for cache in caches.iter_mut() {
            match cache.whole_with_room(1, self.n_head, self.head_dim, qkv.dtype(), qkv.device())? {
                Some((k, v)) if self.head_dim + cache.len < gpt_kernels::cuda::DECODE_SHARED_FLOATS => {
                    buffers.push((k, v, cache.len, cache.room()))
                }
                _ => return Ok(None),
            }
        }
        let y = gpt_kernels::cuda::decode_attention(
            &qkv.contiguous()?,
            &buffers,
            self.n_head,
            self.head_dim,
            self.scale() as f32,
        )?;
        caches.iter_mut().for_each(|cache| cache.wrote(1));
        Ok(Some(y))
    }

    pub(crate) fn c_attn(&self) -> &Conv1D {
        &self.c_attn
    }

    pub(crate) fn c_proj(&self) -> &Conv1D {
        &self.c_proj
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::{LayerKv, Store};

    /// Blocks take appended positions across their boundaries, and give back what was appended,
    /// in one piece or from the fused projection's rows; copies of a prefix hold the same.
    #[test]
    fn blocks_hold_what_was_appended_across_their_boundaries() -> candle_core::Result<()> {
        let (n_head, hs, dev) = (2, 4, Device::Cpu);
        let mut kv = LayerKv::new(8);
        let k = Tensor::randn(0f32, 1.0, (n_head, 21, hs), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (n_head, 21, hs), &dev)?;
        kv.append(&k.narrow(1, 0, 5)?.contiguous()?, &v.narrow(1, 0, 5)?.contiguous()?)?;
        assert!(matches!(&kv.store, Store::Blocks(b) if b.len() == 1));
        let (held_k, held_v) = kv.append(&k.narrow(1, 5, 16)?.contiguous()?, &v.narrow(1, 5, 16)?.contiguous()?)?;
        assert!(matches!(&kv.store, Store::Blocks(b) if b.len() == 3));
        let same = |a: &Tensor, b: &Tensor| -> candle_core::Result<bool> {
            Ok(a.flatten_all()?.to_vec1::<f32>()? == b.flatten_all()?.to_vec1::<f32>()?)
        };
        assert!(same(&held_k, &k)? && same(&held_v, &v)?);
        let prefix = kv.copy(13, true)?;
        assert!(matches!(&prefix.store, Store::Blocks(b) if b.len() == 2));
        assert!(same(&prefix.held()?.0, &k.narrow(1, 0, 13)?)?);

        // From a `(N, 3C)` projection: rows 1..11 written after 5 positions, over two blocks.
        let c = n_head * hs;
        let qkv = Tensor::randn(0f32, 1.0, (12, 3 * c), &dev)?;
        let rows = qkv.flatten_all()?.to_vec1::<f32>()?;
        let mut kv = LayerKv::new(8);
        kv.reserve(5, n_head, hs, DType::F32, &dev)?;
        kv.write_rows(&rows, c, 0, 5)?;
        kv.reserve(10, n_head, hs, DType::F32, &dev)?;
        let cached = kv.write_rows(&rows, c, 1, 10)?;
        assert_eq!((cached.keys.len(), cached.len), (2, 15));
        let heads = |col: usize, from: usize, n: usize| {
            qkv.narrow(0, from, n)?
                .narrow(1, col * c, c)?
                .reshape((n, n_head, hs))?
                .transpose(0, 1)
        };
        let (held_k, held_v) = kv.held()?;
        assert!(same(&held_k.narrow(1, 5, 10)?, &heads(1, 1, 10)?)?);
        assert!(same(&held_v.narrow(1, 0, 5)?, &heads(2, 0, 5)?)?);
        Ok(())
    }
}
