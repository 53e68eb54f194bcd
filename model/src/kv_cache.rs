//! The KV cache: each sequence's keys and values, layer by layer, so that decoding a token does
//! not recompute the prompt. On the CPU in f32 they are held in blocks of [`KvCache::CHUNK`]
//! positions that the fused attention reads where they are; elsewhere in one buffer per layer
//! that grows. Freed buffers go back to the pool of [`crate::kv_pool`]. A sliding-window layer's
//! blocks go back once its queries can no longer see them (Mistral's rolling cache, in blocks).

use candle_core::{DType, Tensor};

use crate::config::Config;
use crate::kv_pool::pool;

/// What a server's KV cache stores (`--kv-cache-dtype`): `f32`, `f16` (on the CPU; half the
/// memory, as llama.cpp's default cache), or `auto`: f16 where any weight matrix is already held
/// in a lossy format (quantized, f16 or bf16), f32 where all are f32, whose outputs then stay
/// those of `transformers` to f32's rounding. On a GPU the cache is in the activations' dtype.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    #[default]
    Auto,
    F32,
    F16,
}

impl KvCacheDtype {
    /// The dtype `model`'s caches would store ([`crate::Gpt::with_kv_cache_dtype`]'s argument).
    /// Off the CPU, and where the fused CPU attention is off (`GPT_CPU_FUSED=0`), the
    /// activations' dtype whatever was asked.
    pub fn resolve(self, model: &crate::Gpt) -> DType {
        let blocks = model.device().is_cpu() && model.dtype() == DType::F32 && gpt_kernels::cpu_fused();
        match self {
            _ if !blocks => model.dtype(),
            Self::F32 => DType::F32,
            Self::F16 => DType::F16,
            Self::Auto if model.matrices_are_f32() => DType::F32,
            Self::Auto => DType::F16,
        }
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            _ => Err(crate::Error::InvalidConfig(format!(
                "unknown KV cache dtype `{s}`: expected auto, f32 or f16"
            ))),
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::F32 => "f32",
            Self::F16 => "f16",
        })
    }
}

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
        Self::stored_as(cfg, DType::F32)
    }

    /// A cache whose blocks on the CPU hold keys and values in `stored` (f32 or f16: see
    /// [`crate::Gpt::with_kv_cache_dtype`]); elsewhere, and for other dtypes, they are held in
    /// the activations' dtype.
    pub fn stored_as(cfg: &Config, stored: DType) -> Self {
        let chunk = Self::CHUNK.min(cfg.n_positions);
        Self {
            layers: (0..cfg.n_layer)
                .map(|l| LayerKv::new(chunk, cfg.window(l), stored))
                .collect(),
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
                    let mut empty = LayerKv::new(l.chunk, l.window, l.stored);
                    empty.want = l.want;
                    empty
                })
                .collect(),
            len: 0,
        }
    }

    /// Keeps the first `len` positions only, in place: the buffers stay, and the next positions
    /// are written over what follows. A step that failed half-way is undone this way (its layers
    /// may hold more than the cache counted), and speculative decoding drops the proposals the
    /// model rejected, every step, so this copies nothing. An error, changing nothing, where a
    /// sliding-window layer no longer holds what a query at `len` would see (a window's blocks
    /// go only when a step's first new position stops seeing them, so going back to where that
    /// step began is always possible).
    pub fn truncate(&mut self, len: usize) -> candle_core::Result<()> {
        for layer in &self.layers {
            layer.check_window(len.min(layer.len))?;
        }
        for layer in &mut self.layers {
            layer.len = layer.len.min(len);
        }
        self.len = self.len.min(len);
        Ok(())
    }

    /// The fewest positions [`KvCache::prefix`] and [`KvCache::truncate`] can keep: 0, unless a
    /// sliding-window layer gave back blocks that a query at an earlier position would see.
    pub fn shortest_prefix(&self) -> usize {
        (self.layers.iter())
            .filter_map(|l| l.window.filter(|_| l.dropped > 0).map(|w| l.first_held() + w - 1))
            .max()
            .unwrap_or(0)
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
///   pair of `(n_kv_head, chunk, head_dim)` buffers, one more as the sequence grows (the way vLLM's
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
    pub(crate) len: usize,
    chunk: usize,
    /// Positions to make room for at the first allocation ([`KvCache::reserve`]).
    want: usize,
    /// A sliding-window layer's window (positions a query sees, itself included).
    window: Option<usize>,
    /// In blocks: the leading blocks given back, whose positions no query sees any more.
    dropped: usize,
    /// The dtype of the blocks (f32 or f16; the fused attention reads either as f32).
    stored: DType,
}

#[derive(Debug)]
enum Store {
    Empty,
    Whole(Tensor, Tensor),
    Blocks(Vec<(Tensor, Tensor)>),
}

impl LayerKv {
    fn new(chunk: usize, window: Option<usize>, stored: DType) -> Self {
        Self {
            store: Store::Empty,
            len: 0,
            chunk: chunk.max(1),
            want: 0,
            window,
            dropped: 0,
            stored: match stored {
                DType::F16 => DType::F16,
                _ => DType::F32,
            },
        }
    }

    /// Positions to make room for beside those needed now: what was reserved, except in blocks
    /// under a sliding window, which take a block as they need one and give the oldest back.
    fn wanted(&self) -> usize {
        match (&self.store, self.window) {
            (Store::Blocks(_), Some(_)) => 0,
            _ => self.want,
        }
    }

    /// `positions`, or what was reserved if more, in whole chunks.
    fn rounded(&self, positions: usize) -> usize {
        positions.max(self.wanted()).div_ceil(self.chunk) * self.chunk
    }

    fn clear(&mut self) {
        match std::mem::replace(&mut self.store, Store::Empty) {
            Store::Empty => {}
            Store::Whole(k, v) => pool::put(k, v),
            Store::Blocks(blocks) => blocks.into_iter().for_each(|(k, v)| pool::put(k, v)),
        }
        self.len = 0;
        self.dropped = 0;
    }

    pub(crate) fn room(&self) -> usize {
        match &self.store {
            Store::Empty => 0,
            Store::Whole(k, _) => k.dims()[1],
            Store::Blocks(blocks) => (self.dropped + blocks.len()) * self.chunk,
        }
    }

    /// The first position held (0 unless a sliding window's blocks were given back).
    fn first_held(&self) -> usize {
        self.dropped * self.chunk
    }

    /// An error where a query at position `len` would see positions no longer held.
    fn check_window(&self, len: usize) -> candle_core::Result<()> {
        let sees = self.window.map_or(0, |w| (len + 1).saturating_sub(w));
        if sees < self.first_held() {
            candle_core::bail!(
                "kv-cache: a query at position {len} sees position {sees}, but this sliding-window layer holds positions from {} on",
                self.first_held()
            )
        }
        Ok(())
    }

    /// In blocks under a sliding window: gives back to the pool the blocks that the next
    /// position's query (at `len`) and every later one no longer see, but for one block's worth
    /// of positions before the window: going back up to a block (speculative decoding's rejected
    /// proposals, a draft's among them) then always finds what it needs.
    fn forget_unseen(&mut self) {
        let (Some(w), Store::Blocks(blocks)) = (self.window, &mut self.store) else {
            return;
        };
        // Whole blocks before the window and the slack.
        let unseen = (self.len + 1).saturating_sub(w + self.chunk) / self.chunk;
        let n = unseen.saturating_sub(self.dropped).min(blocks.len());
        for (k, v) in blocks.drain(..n) {
            pool::put(k, v);
        }
        self.dropped += n;
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
        // The layout first: a sliding window's blocks reserve nothing ahead (`wanted`).
        if let Store::Empty = self.store {
            if in_blocks(dtype, device) {
                self.store = Store::Blocks(Vec::new());
            }
        }
        self.forget_unseen();
        let need = self.len + extra;
        if need.max(self.wanted()) <= self.room() {
            return Ok(());
        }
        let room = self.rounded(need);
        match &mut self.store {
            Store::Blocks(blocks) => {
                while (self.dropped + blocks.len()) * self.chunk < room {
                    blocks.push(buffers(n_head, self.chunk, head_dim, self.stored, device)?);
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

    /// Where `t` positions appended now go in blocks: `(block held, position in it, first of
    /// the `t`, how many)`, block after block.
    fn spans(&self, t: usize) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            (i < t).then(|| {
                let (b, at) = ((self.len + i) / self.chunk - self.dropped, (self.len + i) % self.chunk);
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
                    blocks[b]
                        .0
                        .slice_set(&k.narrow(1, i, n)?.to_dtype(self.stored)?.contiguous()?, 1, at)?;
                    blocks[b]
                        .1
                        .slice_set(&v.narrow(1, i, n)?.to_dtype(self.stored)?.contiguous()?, 1, at)?;
                }
            }
            Store::Empty => candle_core::bail!("kv-cache: no room reserved"),
        }
        self.len += t;
        let (held_k, held_v) = self.held()?;
        Ok((held_k.to_dtype(k.dtype())?, held_v.to_dtype(v.dtype())?))
    }

    /// Writes `t` positions from rows `row0..row0 + t` of the `(N, ld)` projection `qkv` (the
    /// queries in its first `q_width` columns, then the keys and the values, `kv_width` each,
    /// head after head), after [`Self::reserve`]; returns every position held. CPU, f32 (the
    /// blocks f32 or f16).
    pub(crate) fn write_rows(
        &mut self,
        qkv: &[f32],
        ld: usize,
        q_width: usize,
        row0: usize,
        t: usize,
    ) -> candle_core::Result<gpt_kernels::CachedKv> {
        let (n_head, head_dim) = self.kind().map(|(n, d, ..)| (n, d)).unwrap_or_default();
        let kv_width = n_head * head_dim;
        if self.len + t > self.room() || q_width + 2 * kv_width != ld || qkv.len() < (row0 + t) * ld {
            candle_core::bail!(
                "kv-cache: {t} rows at {row0} into {} of {} positions of {n_head} x {head_dim}",
                self.len,
                self.room()
            )
        }
        let write = |k: &Tensor, v: &Tensor, row0: usize, rows: usize, at: usize| {
            for (buffer, col0) in [(k, q_width), (v, q_width + kv_width)] {
                buffer.inplace_op1(&gpt_kernels::WriteRows {
                    src: qkv,
                    ld,
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
                dropped: self.dropped,
            },
            _ => {
                let (k, v) = self.held()?;
                gpt_kernels::CachedKv {
                    keys: vec![k],
                    values: vec![v],
                    len: self.len,
                    dropped: 0,
                }
            }
        })
    }

    /// Keys and values of the positions held, `(n_head, len, head_dim)`: views of whole buffers,
    /// or the blocks copied into one, in the dtype they are stored in (an error where a sliding
    /// window gave some back).
    pub(crate) fn held(&self) -> candle_core::Result<(Tensor, Tensor)> {
        if self.dropped > 0 {
            candle_core::bail!(
                "kv-cache: positions before {} are no longer held (a sliding window)",
                self.first_held()
            )
        }
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
        let mut copy = Self::new(self.chunk, self.window, self.stored);
        let len = len.min(self.len);
        self.check_window(len)?;
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
                let mut copied = Vec::new();
                // Whole blocks: the positions past `len` in the last are never read. (At least
                // `dropped` blocks: a query at `len` sees from a held position, checked above.)
                for (k, v) in &blocks[..len.div_ceil(self.chunk) - self.dropped] {
                    let (n_head, _, head_dim) = k.dims3()?;
                    let (ck, cv) = buffers(n_head, self.chunk, head_dim, k.dtype(), k.device())?;
                    ck.slice_set(k, 1, 0)?;
                    cv.slice_set(v, 1, 0)?;
                    copied.push((ck, cv));
                }
                copy.store = Store::Blocks(copied);
                copy.len = len;
                copy.dropped = self.dropped;
                if let (false, Some((n_head, head_dim, dtype, device))) = (exact, copy.kind()) {
                    copy.reserve(0, n_head, head_dim, dtype, &device)?;
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

/// Allocates the pool of [`crate::set_kv_pool_limit`] up to its limit at once with blocks for the
/// caches of a model of `cfg` whose caches store `stored` ([`crate::Gpt::kv_cache_dtype`]) on
/// `device`, every page written, so that a server's KV memory is resident from its start instead
/// of growing to each new peak of its load (as vLLM allocates its KV cache at startup). Only the
/// CPU's caches of f32 activations are blocks of one size (see [`KvCache`]), in f32 or f16; for
/// others nothing is allocated. Returns the bytes the pool holds.
pub fn fill_kv_pool(cfg: &Config, stored: DType, device: &candle_core::Device) -> candle_core::Result<usize> {
    if matches!(stored, DType::F32 | DType::F16) && in_blocks(DType::F32, device) {
        let block = KvCache::CHUNK.min(cfg.n_positions).max(1);
        pool::fill(stored, cfg.n_kv_head().max(1), block, cfg.head_dim())?;
    }
    Ok(pool::bytes())
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
        let mut kv = LayerKv::new(8, None, DType::F32);
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
        let mut kv = LayerKv::new(8, None, DType::F32);
        kv.reserve(5, n_head, hs, DType::F32, &dev)?;
        kv.write_rows(&rows, 3 * c, c, 0, 5)?;
        kv.reserve(10, n_head, hs, DType::F32, &dev)?;
        let cached = kv.write_rows(&rows, 3 * c, c, 1, 10)?;
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

        // Grouped-query: 2 key/value heads beside 6 query heads, each in its own columns.
        let (q_width, kv_width) = (3 * c, c);
        let qkv = Tensor::randn(0f32, 1.0, (4, q_width + 2 * kv_width), &dev)?;
        let rows = qkv.flatten_all()?.to_vec1::<f32>()?;
        let mut kv = LayerKv::new(8, None, DType::F32);
        kv.reserve(4, n_head, hs, DType::F32, &dev)?;
        kv.write_rows(&rows, q_width + 2 * kv_width, q_width, 0, 4)?;
        let (held_k, held_v) = kv.held()?;
        let heads = |col: usize| qkv.narrow(1, col, kv_width)?.reshape((4, n_head, hs))?.transpose(0, 1);
        assert!(same(&held_k, &heads(q_width)?)? && same(&held_v, &heads(q_width + kv_width)?)?);
        // A width that is not the queries' and two caches' is refused.
        assert!(kv.write_rows(&rows, q_width + 2 * kv_width, c, 0, 1).is_err());

        // Blocks in f16: what the fused projection's rows write, and what is appended, is held
        // rounded to f16 (read back as f32 by `append`); the pool's f16 blocks are not f32's.
        let mut kv = LayerKv::new(8, None, DType::F16);
        kv.reserve(4, n_head, hs, DType::F32, &dev)?;
        kv.write_rows(&rows, q_width + 2 * kv_width, q_width, 0, 4)?;
        let (held_k, held_v) = kv.held()?;
        assert_eq!(held_k.dtype(), DType::F16);
        let rounded = |t: Tensor| t.to_dtype(DType::F16)?.to_dtype(DType::F32);
        let (held_k, held_v) = (held_k.to_dtype(DType::F32)?, held_v.to_dtype(DType::F32)?);
        assert!(same(&held_k, &rounded(heads(q_width)?)?)? && same(&held_v, &rounded(heads(q_width + kv_width)?)?)?);
        assert!(!same(&held_k, &heads(q_width)?)?, "rounded, not the f32 values");
        let (k, v) = (heads(q_width)?.contiguous()?, heads(q_width + kv_width)?.contiguous()?);
        let (all_k, _) = kv.append(&k.narrow(1, 0, 2)?, &v.narrow(1, 0, 2)?)?;
        assert_eq!(all_k.dtype(), DType::F32);
        assert!(same(&all_k.narrow(1, 4, 2)?, &rounded(k.narrow(1, 0, 2)?)?)?);
        let copy = kv.copy(6, true)?;
        assert!(matches!(&copy.store, Store::Blocks(b) if b[0].0.dtype() == DType::F16));
        Ok(())
    }

    /// Under a window of 10 in blocks of 8, decoding one position at a time: the blocks before
    /// the next query's window and a block of slack go back, at most four are held, and every
    /// position the query sees reads as in a cache without a window; a copy or a check that
    /// needs a position given back is an error.
    #[test]
    fn a_sliding_window_holds_only_the_blocks_its_queries_see() -> candle_core::Result<()> {
        let (n_head, hs, dev) = (2, 4, Device::Cpu);
        let c = n_head * hs;
        let qkv = Tensor::randn(0f32, 1.0, (100, 3 * c), &dev)?;
        let rows = qkv.flatten_all()?.to_vec1::<f32>()?;
        let (chunk, w) = (8, 10);
        let (mut local, mut global) = (
            LayerKv::new(chunk, Some(w), DType::F32),
            LayerKv::new(chunk, None, DType::F32),
        );
        // Both reserve a long sequence (`KvCache::reserve`): the window takes blocks as it goes.
        (local.want, global.want) = (100, 100);
        let read = |blocks: &[Tensor], dropped: usize, j: usize| -> candle_core::Result<Vec<f32>> {
            blocks[j / chunk - dropped]
                .narrow(1, j % chunk, 1)?
                .flatten_all()?
                .to_vec1::<f32>()
        };
        for step in 0..100 {
            local.reserve(1, n_head, hs, DType::F32, &dev)?;
            global.reserve(1, n_head, hs, DType::F32, &dev)?;
            let seen = local.write_rows(&rows, 3 * c, c, step, 1)?;
            let all = global.write_rows(&rows, 3 * c, c, step, 1)?;
            let first = (step + 1).saturating_sub(w);
            let slack = first.saturating_sub(chunk);
            assert_eq!(
                seen.dropped,
                slack / chunk,
                "step {step}: every block before the slack goes"
            );
            assert!(seen.keys.len() <= 4, "step {step}: {} blocks", seen.keys.len());
            assert_eq!(all.dropped, 0);
            for j in first..=step {
                assert_eq!(read(&seen.keys, seen.dropped, j)?, read(&all.keys, 0, j)?);
                assert_eq!(read(&seen.values, seen.dropped, j)?, read(&all.values, 0, j)?);
            }
        }
        assert_eq!(global.room(), 104, "without a window, the reservation is taken at once");
        // A query at 99 saw from 90, with a block of slack before: blocks from 80 on are held.
        assert_eq!(local.dropped, 10);
        assert!(local.check_window(89).is_ok() && local.check_window(88).is_err());
        assert!(local.copy(50, true).is_err() && local.held().is_err());
        let copy = local.copy(90, true)?;
        assert_eq!((copy.len, copy.dropped), (90, 10));
        Ok(())
    }
}
