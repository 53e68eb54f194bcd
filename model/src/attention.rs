//! Multi-head causal self-attention ("Attention Is All You Need", §3.2) and its KV cache.
//!
//! Two entry points share the weights: [`CausalSelfAttention::forward_t`] for whole `(B, T)`
//! windows (training, evaluation; differentiable), and [`CausalSelfAttention::forward_packed`]
//! for generation, where the new tokens of several sequences are packed into one `(N, C)` matrix
//! so the projections run once for all of them, and only the score/softmax/value step is done
//! per sequence, against that sequence's own cache.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::gpt::{dropout, Conv1D};

/// Keys and values of every layer for one sequence, so that decoding a token does not recompute
/// the prompt. Built on candle-nn's growable cache; positions continue from [`KvCache::len`].
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<candle_nn::kv_cache::KvCache>,
    len: usize,
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
        Self { layers, len: 0 }
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

    pub(crate) fn layer(&mut self, i: usize) -> &mut candle_nn::kv_cache::KvCache {
        &mut self.layers[i]
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}

/// Additive causal mask for `t_new` queries at positions `offset..offset + t_new` over
/// `offset + t_new` keys: 0 where key j <= query position, -inf above (the upper triangle).
pub fn causal_mask(t_new: usize, offset: usize, dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    let t_all = offset + t_new;
    let mask: Vec<f32> = (0..t_new)
        .flat_map(|i| (0..t_all).map(move |j| if j > offset + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(mask, (t_new, t_all), device)?.to_dtype(dtype)
}

#[derive(Debug, Clone)]
pub struct CausalSelfAttention {
    c_attn: Conv1D,
    c_proj: Conv1D,
    n_head: usize,
    head_dim: usize,
    attn_pdrop: f32,
    resid_pdrop: f32,
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
        })
    }

    fn scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Causal attention over whole windows. `train` switches on dropout and uses softmax built
    /// from differentiable ops (candle-nn's fused `softmax_last_dim` has no backward pass).
    pub fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let (b_sz, seq_len, n_embd) = x.dims3()?;
        let heads = |i: usize| -> candle_core::Result<Tensor> {
            self.c_attn
                .forward_cols(x, i * n_embd, n_embd)? // (B, T, C): q, k or v
                .reshape((b_sz, seq_len, self.n_head, self.head_dim))? // (B, T, nh, hs)
                .transpose(1, 2)? // (B, nh, T, hs)
                .contiguous()
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = (crate::ops::matmul(&q, &k.t()?)? * self.scale())?; // (B, nh, T, T)
        let att = crate::ops::causal_softmax(&att, train)?; // upper triangle masked to 0
        let att = dropout(att, self.attn_pdrop, train)?;
        let y = crate::ops::matmul(&att, &v)?; // (B, nh, T, hs)
        let y = y.transpose(1, 2)?.reshape((b_sz, seq_len, n_embd))?; // (B, T, C)
        dropout(self.c_proj.forward(&y)?, self.resid_pdrop, train)
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
            let q = heads(0)?;
            let (k, v) = cache.append(&heads(1)?, &heads(2)?)?; // (nh, offset + t, hs)
            let att = (q.matmul(&k.t()?)? * self.scale())?; // (nh, t, offset + t)
            let att = crate::ops::causal_softmax(&att, false)?; // new token i sees keys ..= offset + i
            let y = att.matmul(&v.contiguous()?)?; // (nh, t, hs)
            outputs.push(y.transpose(0, 1)?.reshape((len, n_embd))?); // (t, C)
        }
        let y = Tensor::cat(&outputs, 0)?; // (N, C)
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
