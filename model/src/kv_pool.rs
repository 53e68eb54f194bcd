//! The pool of freed KV-cache buffers, kept for reuse instead of handed back to the allocator.

/// Keeps up to `bytes` of freed CPU KV-cache buffers for reuse (0, the default, keeps none).
///
/// A server allocates a sequence's keys and values at its start and frees them at its end, tens
/// of times a second (prompts and outputs of every length, prefix-cache copies, forks for `n` and
/// beams): given back to glibc, the heap fragments and its resident size creeps up (`BENCHMARKS.md`),
/// and handing pages back (`malloc_trim`) made them fault in again at every allocation. Kept
/// here, buffers are taken again as they are (never cleared: only the positions a cache holds
/// are ever read). On the CPU in f32 every buffer is a block of the same size, so any sequence
/// takes any kept block; [`crate::fill_kv_pool`] allocates them up front.
pub fn set_kv_pool_limit(bytes: usize) {
    pool::set_limit(bytes)
}

/// Bytes of freed KV-cache buffers the pool keeps now.
pub fn kv_pool_bytes() -> usize {
    pool::bytes()
}

/// The pool of [`set_kv_pool_limit`]: pairs of key and value buffers by dtype and shape, a
/// process-wide list (tens of entries; a lookup is a scan).
pub(crate) mod pool {
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

    pub(crate) fn set_limit(bytes: usize) {
        let mut pool = lock();
        pool.limit = bytes;
        while pool.bytes > pool.limit {
            let Some((k, _)) = pool.free.pop() else { break };
            pool.bytes -= size(&k);
        }
    }

    pub(crate) fn bytes() -> usize {
        lock().bytes
    }

    /// A pair of `(n_head, r, head_dim)` buffers with `room <= r < 2 room`, the smallest kept.
    /// Without one, kept buffers of other sizes worth the new pair's bytes are let go first (the
    /// largest first, so that the allocator has a block the new pair fits in): the pool and the
    /// caches in use together then stay within what they held at their peak. Keeping every size
    /// instead held the peak of each size at once, and a server's memory crept up as each size
    /// had its burst (a 30-minute soak: +10% over minutes 1-14).
    pub(crate) fn take(
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

    /// Adds CPU pairs of `(n_head, room, head_dim)` buffers in `dtype` (f32 or f16) while they
    /// fit under the limit, each page written (resident now, not at its first use).
    pub(crate) fn fill(dtype: DType, n_head: usize, room: usize, head_dim: usize) -> candle_core::Result<()> {
        let n = n_head * room * head_dim;
        let pair = 2 * n * dtype.size_in_bytes();
        loop {
            let full = {
                let pool = lock();
                pool.bytes + pair > pool.limit
            };
            if pair == 0 || full {
                return Ok(());
            }
            // `vec![0; n]` may leave fresh pages unmapped (calloc): one value written a page.
            fn resident<T: candle_core::WithDType>(
                n: usize,
                shape: (usize, usize, usize),
            ) -> candle_core::Result<Tensor> {
                let mut data = vec![T::from_f64(0.0); n];
                for page in data.chunks_mut(4096 / std::mem::size_of::<T>()) {
                    page[0] = std::hint::black_box(T::from_f64(0.0));
                }
                Tensor::from_vec(data, shape, &Device::Cpu)
            }
            let fresh = || match dtype {
                DType::F16 => resident::<half::f16>(n, (n_head, room, head_dim)),
                _ => resident::<f32>(n, (n_head, room, head_dim)),
            };
            put(fresh()?, fresh()?);
        }
    }

    /// Keeps `k` and `v` if there is room under the limit (CPU buffers only).
    pub(crate) fn put(k: Tensor, v: Tensor) {
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
