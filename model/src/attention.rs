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
/// the prompt. Built on candle-nn's growable cache; positions continue from [`KvCache::len`].
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<candle_nn::kv_cache::KvCache>,
    len: usize,
    chunk: usize,
}

impl KvCache {
    /// Room is allocated in chunks of this many positions as the sequence grows, rather than the
    /// whole context up front: many short sequences then cost little memory.
    const CHUNK: usize = 64;

    pub fn new(cfg: &Config) -> Self {
        let chunk = Self::CHUNK.min(cfg.n_positions);
        // Per layer, k and v are stored as (n_head, T, head_dim): concatenated along dim 1.
        let layers = (0..cfg.n_layer)
            .map(|_| candle_nn::kv_cache::KvCache::new(1, chunk))
            .collect();
        Self { layers, len: 0, chunk }
    }

    /// Positions already held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(|c| c.reset());
        self.len = 0;
    }

    /// An independent copy holding the same positions: the way to share one prefilled prompt
    /// between several continuations. (`Clone` would share storage: candle-nn's cache appends by
    /// writing into its buffer in place, so two clones would overwrite each other.)
    pub fn fork(&self) -> candle_core::Result<Self> {
        self.prefix(self.len)
    }

    /// A cache like this one with nothing in it.
    pub fn empty_like(&self) -> Self {
        let chunk = self.chunk;
        Self {
            layers: (0..self.layers.len())
                .map(|_| candle_nn::kv_cache::KvCache::new(1, chunk))
                .collect(),
            len: 0,
            chunk,
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
        self.copy(len, self.chunk)
    }

    /// A copy of the positions held in buffers of exactly their size (a copy that is kept but
    /// not grown, as the server's prefix store does: smaller, and quicker to allocate).
    pub fn compact(&self) -> candle_core::Result<Self> {
        self.copy(self.len, self.len.max(1))
    }

    /// Copies of the first `len` positions in buffers of `room` positions (growing by `room`).
    fn copy(&self, len: usize, room: usize) -> candle_core::Result<Self> {
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &self.layers {
            let mut copy = candle_nn::kv_cache::KvCache::new(1, room);
            if let (Some(k), Some(v)) = (layer.k()?, layer.v()?) {
                let keep = len.min(k.dim(1)?);
                if keep > 0 {
                    // `append` writes into a fresh buffer: a deep copy.
                    copy.append(
                        &k.narrow(1, 0, keep)?.contiguous()?,
                        &v.narrow(1, 0, keep)?.contiguous()?,
                    )?;
                }
            }
            layers.push(copy);
        }
        Ok(Self {
            layers,
            len: len.min(self.len),
            chunk: self.chunk,
        })
    }

    pub(crate) fn layer(&mut self, i: usize) -> &mut candle_nn::kv_cache::KvCache {
        &mut self.layers[i]
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
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
        let att = crate::ops::causal_softmax(&att, train.is_some())?; // upper triangle masked to 0
        if let Some(record) = record {
            record.push(att.clone());
        }
        let att = dropout(att, self.attn_pdrop, train.map(|d| d.site(0)))?;
        let y = matmul(&att, &v, self.autocast)?; // (B, nh, T, hs)
        let y = y.transpose(1, 2)?.reshape((b_sz, seq_len, n_embd))?; // (B, T, C)
        dropout(self.c_proj.forward(&y)?, self.resid_pdrop, train.map(|d| d.site(1)))
    }

    /// Inference on packed rows: `x` is `(N, C)`, the new tokens of each sequence in turn,
    /// `lens[s]` of them for sequence `s`, whose cache for this layer is `caches[s]`. Appends the
    /// new keys and values to each cache.
    pub fn forward_packed(
        &self,
        x: &Tensor,
        lens: &[usize],
        caches: &mut [&mut candle_nn::kv_cache::KvCache],
    ) -> candle_core::Result<Tensor> {
        let (_n_rows, n_embd) = x.dims2()?;
        let qkv = self.c_attn.forward(x)?; // (N, 3C): one matmul for every sequence

        // On the CPU in f32, one fused op attends for every sequence at once (ops/attention.rs).
        let fused = crate::ops::fused(&qkv) && qkv.device().is_cpu();
        let (mut kv, mut outputs) = (Vec::with_capacity(lens.len()), Vec::with_capacity(lens.len()));
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
            if fused {
                kv.push((k, v));
                continue;
            }
            let q = heads(0)?;
            let att = (q.matmul(&k.t()?)? * self.scale())?; // (nh, t, offset + t)
            let att = crate::ops::causal_softmax(&att, false)?; // new token i sees keys ..= offset + i
            let y = att.matmul(&v.contiguous()?)?; // (nh, t, hs)
            outputs.push(y.transpose(0, 1)?.reshape((len, n_embd))?); // (t, C)
        }
        let y = if fused {
            crate::ops::cached_attention(&qkv, lens, &kv, self.n_head, self.scale() as f32)?
        } else {
            Tensor::cat(&outputs, 0)?
        }; // (N, C)
        self.c_proj.forward(&y)
    }
}

impl CausalSelfAttention {
    pub(crate) fn c_attn(&self) -> &Conv1D {
        &self.c_attn
    }

    pub(crate) fn c_proj(&self) -> &Conv1D {
        &self.c_proj
    }
}
