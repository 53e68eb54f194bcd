//! Multi-head causal self-attention ("Attention Is All You Need", §3.2), with the variants of the
//! families in [`crate::arch`]: fewer key/value heads than query heads (grouped-query attention,
//! Ainslie et al., 2023), rotary positions (Su et al., 2021) and a per-head RMSNorm of q and k,
//! all applied to the rows of the one fused q, k, v projection ([`CausalSelfAttention::rotate`]).
//!
//! Two entry points share the weights: [`CausalSelfAttention::forward_t`] for whole `(B, T)`
//! windows (training, evaluation; differentiable), and [`CausalSelfAttention::forward_packed`]
//! for generation, where the new tokens of several sequences are packed into one `(N, C)` matrix
//! so the projections run once for all of them, and only the score/softmax/value step is done
//! per sequence, against that sequence's own cache ([`crate::kv_cache`]).

use std::sync::Arc;

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::kv_cache::LayerKv;
use crate::layers::{dropout, matmul, Autocast, Conv1D, Dropout, RowUpdate};

/// Packed windows (several sequences one after another in each window, positions restarting
/// at each): every row attends only to its own sequence's keys.
#[derive(Debug, Clone)]
pub(crate) struct Segments {
    /// Each row's first visible key, `(B * T)` ([`gpt_kernels::segment_starts`]).
    pub(crate) starts: Arc<[u32]>,
    /// The same as an additive `(B, 1, T, T)` mask, for candle's composite (built only for it).
    pub(crate) mask: Option<Tensor>,
    /// Each row's position in its own sequence, `(B * T)` u32: the rotations' angles.
    pub(crate) positions: Tensor,
}

/// The rotary embedding's cos and sin tables, `(n_positions, head_dim / 2)` in the activations'
/// dtype, shared by every layer.
#[derive(Debug)]
pub(crate) struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

impl RopeTables {
    /// The tables of `cfg`'s rotary embedding, if it has one. The angles are computed as
    /// `transformers` computes them, in f32 (inverse frequencies, then position times frequency),
    /// so that long positions round as they do there.
    pub(crate) fn new(
        cfg: &Config,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<Option<Arc<Self>>> {
        let Some(rope) = &cfg.variant.rope else { return Ok(None) };
        Self::of(rope, cfg, dtype, device).map(Some)
    }

    /// The tables of the frequencies `rope` for `cfg`'s heads and positions.
    pub(crate) fn of(
        rope: &crate::config::Rope,
        cfg: &Config,
        dtype: candle_core::DType,
        device: &candle_core::Device,
    ) -> candle_core::Result<Arc<Self>> {
        let inv_freq: Vec<f32> = rope.inv_freq(cfg.head_dim()).into_iter().map(|f| f as f32).collect();
        let half = inv_freq.len();
        let (mut cos, mut sin) = (
            Vec::with_capacity(cfg.n_positions * half),
            Vec::with_capacity(cfg.n_positions * half),
        );
        for pos in 0..cfg.n_positions {
            for &f in &inv_freq {
                let angle = (pos as f32 * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| Tensor::from_vec(v, (cfg.n_positions, half), device)?.to_dtype(dtype);
        Ok(Arc::new(Self {
            cos: table(cos)?,
            sin: table(sin)?,
        }))
    }
}

#[derive(Debug, Clone)]
pub struct CausalSelfAttention {
    /// q, k and v side by side: `(n_head + 2 n_kv_head) head_dim` outputs.
    pub(crate) c_attn: Conv1D,
    pub(crate) c_proj: Conv1D,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    attn_pdrop: f32,
    resid_pdrop: f32,
    pub(crate) autocast: Autocast,
    rope: Option<Arc<RopeTables>>,
    /// The per-head RMSNorm gains of q and k `(head_dim)` (QK-norm), with their epsilon.
    pub(crate) qk_norm: Option<(Tensor, Tensor, f32)>,
    /// The scores' factor: 1 / sqrt(head_dim), or of Gemma's `query_pre_attn_scalar`.
    scale: f64,
    /// A sliding window and soft-capped scores ([`gpt_kernels::Masking`]).
    masking: gpt_kernels::Masking,
}

impl CausalSelfAttention {
    /// GPT-2's attention from `vb` (`c_attn`, `c_proj`), created with its initialisation where
    /// `vb` is backed by a `VarMap`.
    pub fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let c = cfg.n_embd;
        let c_attn = Conv1D::load(vb.pp("c_attn"), c, 3 * c, cfg)?;
        let c_proj = Conv1D::load_with_std(vb.pp("c_proj"), c, c, 0.02 / (2.0 * cfg.n_layer as f64).sqrt(), cfg)?;
        Ok(Self::new(c_attn, c_proj, cfg, None, None))
    }

    /// The attention of `cfg` from its layers: `c_attn` with q, k and v side by side, the
    /// rotary tables where `cfg` has them, and QK-norm's gains.
    pub(crate) fn new(
        c_attn: Conv1D,
        c_proj: Conv1D,
        cfg: &Config,
        rope: Option<Arc<RopeTables>>,
        qk_norm: Option<(Tensor, Tensor)>,
    ) -> Self {
        Self {
            c_attn,
            c_proj,
            n_head: cfg.n_head,
            n_kv_head: cfg.n_kv_head(),
            head_dim: cfg.head_dim(),
            attn_pdrop: cfg.attn_pdrop,
            resid_pdrop: cfg.resid_pdrop,
            autocast: Autocast::Off,
            rope,
            qk_norm: qk_norm.map(|(q, k)| (q, k, cfg.layer_norm_epsilon as f32)),
            scale: cfg.attn_scale(),
            masking: gpt_kernels::Masking {
                window: None,
                softcap: cfg.variant.attn_softcap.map(|c| c as f32),
            },
        }
    }

    /// The attention with a sliding window of `window` positions (a query sees its own and the
    /// `window - 1` before it), or none.
    pub(crate) fn with_window(mut self, window: Option<usize>) -> Self {
        self.masking.window = window;
        self
    }

    /// Whether this is GPT-2's attention: as many key/value heads as query heads, no rotations,
    /// no norms of the heads (what the fused training kernels and the GPU's decode kernel take).
    pub(crate) fn is_plain(&self) -> bool {
        self.rope.is_none()
            && self.qk_norm.is_none()
            && self.n_kv_head == self.n_head
            && self.masking == gpt_kernels::Masking::default()
            && self.scale == 1.0 / (self.head_dim as f64).sqrt()
    }

    /// The widths of q, and of k and of v, in `c_attn`'s output.
    fn widths(&self) -> (usize, usize) {
        (self.n_head * self.head_dim, self.n_kv_head * self.head_dim)
    }

    /// The rows `(N, q + 2 kv)` of the fused projection with q and k normalised per head
    /// (QK-norm) and rotated to each row's position (`positions` `(N)` u32), as `transformers`'
    /// `apply_rotary_pos_emb` does (the two halves of each head as the pairs); v unchanged.
    ///
    /// `train`: for a backward pass, the kernels' differentiable RoPE and RMSNorm (candle-nn's
    /// fused ones have none; the values are the same).
    pub(crate) fn rotate(&self, qkv: &Tensor, positions: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let gains = self.qk_norm.as_ref().map(|(q, k, _)| (q, k));
        self.rotate_with(qkv, gains, positions, train)
    }

    /// [`Self::rotate`] on the residual stream's rows while a tape may record: candle's ops
    /// (the narrows, the concatenation) as one entry of the tape with the gains among its
    /// inputs, so that their gradients reach them.
    fn rotate_on_tape(&self, qkv: &Tensor, positions: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        use gpt_kernels::tape::candle_ops;
        match &self.qk_norm {
            Some((q, k, _)) => candle_ops(&[qkv, q, k], |a| {
                self.rotate_with(&a[0], Some((&a[1], &a[2])), positions, train)
            }),
            None if self.rope.is_some() => candle_ops(&[qkv], |a| self.rotate_with(&a[0], None, positions, train)),
            None => Ok(qkv.clone()),
        }
    }

    /// [`Self::rotate`] with QK-norm's gains `(q, k)` given.
    fn rotate_with(
        &self,
        qkv: &Tensor,
        gains: Option<(&Tensor, &Tensor)>,
        positions: &Tensor,
        train: bool,
    ) -> candle_core::Result<Tensor> {
        if self.rope.is_none() && gains.is_none() {
            return Ok(qkv.clone());
        }
        if !train && !qkv.track_op() && gpt_kernels::fused(qkv) && qkv.device().is_cpu() {
            if let Some(y) = self.rotate_on_host(qkv, gains, positions)? {
                return Ok(y);
            }
        }
        let (n, _) = qkv.dims2()?;
        let (qw, kvw) = self.widths();
        let hd = self.head_dim;
        let q = qkv.narrow(1, 0, qw)?.reshape((1, n, self.n_head, hd))?.contiguous()?; // (1, N, nh, hs)
        let k = qkv
            .narrow(1, qw, kvw)?
            .reshape((1, n, self.n_kv_head, hd))?
            .contiguous()?; // (1, N, nkv, hs)
        let v = qkv.narrow(1, qw + kvw, kvw)?; // (N, kv)
        let norm = |x: &Tensor, gain: &Tensor, eps: f32| match train {
            true => gpt_kernels::rms_norm(x, gain, eps),
            false => candle_nn::ops::rms_norm(x, gain, eps),
        };
        let eps = self.qk_norm.as_ref().map_or(0.0, |(_, _, eps)| *eps);
        let (q, k) = match gains {
            Some((qn, kn)) => (norm(&q, qn, eps)?, norm(&k, kn, eps)?),
            None => (q, k),
        };
        let (q, k) = match &self.rope {
            Some(rope) => {
                let positions = positions.to_dtype(candle_core::DType::U32)?;
                let cos = rope.cos.index_select(&positions, 0)?; // (N, hs / 2)
                let sin = rope.sin.index_select(&positions, 0)?;
                // candle-nn's `rope_thd` has no backward pass; the kernels' has.
                let rotate = |x: &Tensor| match train {
                    true => gpt_kernels::rope(x, &cos, &sin),
                    false => candle_nn::rotary_emb::rope_thd(x, &cos, &sin),
                };
                (rotate(&q)?, rotate(&k)?)
            }
            None => (q, k),
        };
        Tensor::cat(&[q.reshape((n, qw))?, k.reshape((n, kvw))?, v.contiguous()?], 1)
        // (N, q + 2 kv)
    }

    /// Key/value heads `(.., n_kv_head, T, hs)` repeated for their groups of query heads:
    /// `(.., n_head, T, hs)` (`transformers`' `repeat_kv`).
    fn repeat_kv(&self, x: Tensor) -> candle_core::Result<Tensor> {
        let group = self.n_head / self.n_kv_head.max(1);
        if group == 1 {
            return Ok(x);
        }
        let dims = x.dims().to_vec();
        let r = dims.len();
        let (t, hs) = (dims[r - 2], dims[r - 1]);
        let mut expanded = dims[..r - 2].to_vec();
        expanded.extend([group, t, hs]);
        let mut out = dims[..r - 3].to_vec();
        out.extend([self.n_head, t, hs]);
        x.unsqueeze(r - 2)?
            .broadcast_as(expanded.as_slice())?
            .contiguous()?
            .reshape(out)
    }

    fn scale(&self) -> f64 {
        self.scale
    }

    /// The scores `(.., T, offset + T)` of `T` queries at positions `offset..offset + T` soft-capped
    /// and masked outside their windows (-inf), where this attention has either; the causal mask
    /// is the softmax's ([`gpt_kernels::causal_softmax`]).
    fn masked(&self, att: Tensor) -> candle_core::Result<Tensor> {
        let att = match self.masking.softcap {
            Some(cap) => ((att / cap as f64)?.tanh()? * cap as f64)?,
            None => att,
        };
        let Some(window) = self.masking.window else {
            return Ok(att);
        };
        let dims = att.dims();
        let (t, keys) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let offset = keys - t;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| {
                (0..keys).map(move |j| {
                    if j + window <= offset + i {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, keys), att.device())?.to_dtype(att.dtype())?;
        att.broadcast_add(&mask)
    }

    /// Causal attention over whole windows. `train` switches on dropout (masks: its sites 0 and 1)
    /// and uses softmax built from differentiable ops (candle-nn's fused `softmax_last_dim` has no
    /// backward pass).
    pub fn forward_t(&self, x: &Tensor, train: Option<Dropout>) -> candle_core::Result<Tensor> {
        self.forward_recorded(x, train, None, None)
    }

    /// [`Self::forward_t`], also pushing the attention probabilities `(B, nh, T, T)` (after the
    /// causal softmax, before dropout) onto `record` when given: what attention-map views show.
    /// `segments`: packed windows (see [`Segments`]); `None`, one sequence a window.
    pub(crate) fn forward_recorded(
        &self,
        x: &Tensor,
        train: Option<Dropout>,
        segments: Option<&Segments>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        let (b_sz, seq_len, n_embd) = x.dims3()?;
        // GPT-2's heads, or the families' where the window attention takes them (not recording
        // their probabilities), as rows on the CPU.
        let on_rows = self.is_plain() || (record.is_none() && self.runs_on_windows(seq_len));
        if gpt_kernels::fused(x) && x.device().is_cpu() && on_rows {
            let rows = x.reshape((b_sz * seq_len, n_embd))?;
            let y = self.forward_rows(&rows, seq_len, train, segments, record)?;
            return dropout(y, self.resid_pdrop, train.map(|d| d.site(1)))?.reshape((b_sz, seq_len, n_embd));
        }
        if gpt_kernels::fused(x)
            && gpt_kernels::window_attention_runs_on(x, self.head_dim)
            && segments.is_none()
            && self.is_plain()
        {
            // f32 on a CUDA GPU: the same op (its kernels in ops.cu), one product for q, k and v;
            // the residual dropout over (B, T, C) as below (its masks count whole windows).
            // Packed windows take candle's ops below: the GPU's kernel has no segments.
            let rows = x.reshape((b_sz * seq_len, n_embd))?;
            let y = self.forward_rows(&rows, seq_len, train, None, record)?;
            return dropout(
                y.reshape((b_sz, seq_len, n_embd))?,
                self.resid_pdrop,
                train.map(|d| d.site(1)),
            );
        }
        let (qw, kvw) = self.widths();
        // Inference multiplies once and splits the product (quantized weights cannot be split);
        // training GPT-2 splits the weight (see `forward_cols`). The other families rotate the
        // rows of the whole product.
        let qkv = match train {
            None => Some(self.c_attn.forward(x)?), // (B, T, q + 2 kv)
            Some(_) if !self.is_plain() => Some(self.c_attn.forward_t(x, train.map(|d| d.site(3)))?),
            Some(_) => None,
        };
        let qkv = match qkv {
            Some(qkv) if !self.is_plain() => {
                let positions = match segments {
                    Some(s) => s.positions.clone(),
                    None => Tensor::arange(0u32, seq_len as u32, x.device())?.repeat(b_sz)?,
                };
                let rows = qkv.reshape((b_sz * seq_len, qw + 2 * kvw))?;
                Some(
                    self.rotate(&rows, &positions, train.is_some())?
                        .reshape((b_sz, seq_len, qw + 2 * kvw))?,
                )
            }
            other => other,
        };
        // A LoRA update's input dropout (sites 3 and 4 of the layer's key), one mask for q, k, v.
        let lora_x = self.c_attn.lora_input(x, train.map(|d| d.site(3)))?;
        let heads = |i: usize| -> candle_core::Result<Tensor> {
            let (start, width, n) = match i {
                0 => (0, qw, self.n_head),
                1 => (qw, kvw, self.n_kv_head),
                _ => (qw + kvw, kvw, self.n_kv_head),
            };
            match &qkv {
                Some(qkv) => qkv.narrow(2, start, width)?,
                None => self.c_attn.forward_cols(x, start, width, lora_x.as_ref())?,
            } // (B, T, width): q, k or v
            .reshape((b_sz, seq_len, n, self.head_dim))? // (B, T, n, hs)
            .transpose(1, 2)? // (B, n, T, hs)
            .contiguous()
        };
        let (q, k, v) = (heads(0)?, self.repeat_kv(heads(1)?)?, self.repeat_kv(heads(2)?)?); // (B, nh, T, hs)
        let mut att = self.masked((matmul(&q, &k.t()?, self.autocast)? * self.scale())?)?; // (B, nh, T, T)
        if let Some(segments) = segments {
            let Some(mask) = &segments.mask else {
                candle_core::bail!("attention: packed windows without their mask")
            };
            att = att.broadcast_add(&mask.to_dtype(att.dtype())?)?; // other sequences' keys: -inf
        }
        let att = gpt_kernels::causal_softmax(&att, train.is_some())?; // upper triangle masked to 0
        if let Some(record) = record {
            record.push(att.clone());
        }
        let att = dropout(att, self.attn_pdrop, train.map(|d| d.site(0)))?;
        let y = matmul(&att, &v, self.autocast)?; // (B, nh, T, hs)
        let y = y.transpose(1, 2)?.reshape((b_sz, seq_len, qw))?; // (B, T, nh * hs)
        dropout(
            self.c_proj.forward_t(&y, train.map(|d| d.site(4)))?,
            self.resid_pdrop,
            train.map(|d| d.site(1)),
        )
    }

    /// The attention's output before its residual dropout, for `x` `(B * T, C)`: windows of
    /// `seq_len` rows, f32 on the CPU. One product for q, k and v, then the tiled attention op
    /// (forward and backward; ops/window_attention.rs), which never holds the (B, nh, T, T)
    /// weights; `train` and `record` as in [`Self::forward_recorded`] (recorded probabilities
    /// are computed beside the op, from the same q and k, so the output is the same either way;
    /// not with `segments`).
    pub(crate) fn forward_rows(
        &self,
        x: &Tensor,
        seq_len: usize,
        train: Option<Dropout>,
        segments: Option<&Segments>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        if !self.is_plain() {
            if record.is_some() {
                candle_core::bail!("attention: the families' probabilities are not recorded on rows")
            }
            return self.forward_grouped_rows(x, seq_len, train, segments);
        }
        // A LoRA update's input dropout (sites 3 and 4), its masks counted in rows.
        let rows = train.map(|d| Dropout {
            first_row: d.first_row * seq_len,
            ..d
        });
        let qkv = self.c_attn.forward_t(x, rows.map(|d| d.site(3)))?; // (B*T, 3C)
        if let Some(record) = record {
            if segments.is_some() {
                candle_core::bail!("attention: probabilities are not recorded for packed windows")
            }
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
        self.attend_windows(&qkv, seq_len, train, rows, segments)
    }

    /// The tiled window attention of `qkv` `(B * T, 3 nh hs)` then `c_proj`: the attention
    /// weights' dropout (site 0) from `train`, a LoRA update's (site 4) from `rows` (`train`
    /// counted in rows).
    fn attend_windows(
        &self,
        qkv: &Tensor,
        seq_len: usize,
        train: Option<Dropout>,
        rows: Option<Dropout>,
        segments: Option<&Segments>,
    ) -> candle_core::Result<Tensor> {
        let (p, d) = match train {
            Some(d) if self.attn_pdrop > 0.0 => (self.attn_pdrop, d.site(0)),
            _ => (0.0, Dropout { key: 0, first_row: 0 }),
        };
        let y = gpt_kernels::window_attention(
            gpt_kernels::Simd::detect(),
            qkv,
            seq_len,
            self.n_head,
            self.scale() as f32,
            p,
            d.key,
            d.first_row,
            segments.map(|s| s.starts.clone()),
        )?;
        self.c_proj.forward_t(&y, rows.map(|d| d.site(4))) // (B*T, C)
    }

    /// Whether the families' heads (rotations, QK-norm, grouped key/value heads, a scale of
    /// their own) run on the fused window attention over windows of `seq_len`: neither scores
    /// soft-capped nor a sliding window shorter than the window (the kernel has neither).
    pub(crate) fn runs_on_windows(&self, seq_len: usize) -> bool {
        !self.is_plain()
            && self.masking.softcap.is_none()
            && self.masking.window.is_none_or(|w| w >= seq_len)
            && self.n_kv_head > 0
            && self.n_head.is_multiple_of(self.n_kv_head)
    }

    /// [`Self::forward_rows`] for the families' heads ([`Self::runs_on_windows`]): `x` `(B * T,
    /// C)` in windows of `seq_len`, one product for q, k and v, q and k normalised and rotated
    /// (fused ops with their backward passes), the key/value heads repeated for their groups
    /// ([`gpt_kernels::repeat_kv_heads`]), then the tiled window attention. On candle's ops
    /// (`forward_recorded`'s composite) the repeated heads, the `(B, nh, T, T)` scores and
    /// their backward pass were most of a SmolLM2-shaped training step's attention.
    fn forward_grouped_rows(
        &self,
        x: &Tensor,
        seq_len: usize,
        train: Option<Dropout>,
        segments: Option<&Segments>,
    ) -> candle_core::Result<Tensor> {
        let rows = train.map(|d| Dropout {
            first_row: d.first_row * seq_len,
            ..d
        });
        let qkv = self.c_attn.forward_t(x, rows.map(|d| d.site(3)))?; // (B*T, q + 2 kv)
        let positions = match segments {
            Some(s) => s.positions.clone(),
            None => Tensor::arange(0u32, seq_len as u32, x.device())?.repeat(x.dim(0)? / seq_len.max(1))?,
        };
        let qkv = self.rotate_on_tape(&qkv, &positions, train.is_some())?;
        let qkv = gpt_kernels::repeat_kv_heads(&qkv, self.n_head, self.n_kv_head)?; // (B*T, 3 q)
        self.attend_windows(&qkv, seq_len, train, rows, segments)
    }

    /// [`Self::rotate_with`] at inference on the CPU in f32: one pass over the rows
    /// ([`gpt_kernels::infer::rotate_qkv`], the same values as the candle ops). `None` where the
    /// tables or gains are not contiguous f32 on the CPU.
    fn rotate_on_host(
        &self,
        qkv: &Tensor,
        gains: Option<(&Tensor, &Tensor)>,
        positions: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let tables = self.rope.as_ref().map(|r| (&r.cos, &r.sin));
        let usable = |t: &Tensor| t.dtype() == candle_core::DType::F32 && t.is_contiguous() && t.device().is_cpu();
        if !tables.into_iter().chain(gains).all(|(a, b)| usable(a) && usable(b)) {
            return Ok(None);
        }
        let qkv = qkv.contiguous()?;
        let positions = positions.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
        let heads = gpt_kernels::infer::QkvHeads {
            n_head: self.n_head,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
        };
        let eps = self.qk_norm.as_ref().map_or(0.0, |(_, _, eps)| *eps);
        let (storage, layout) = qkv.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Ok(None);
        };
        let rows = gpt_kernels::f32_slice(cpu, layout, "rotate")?;
        let y = with_f32(tables, |tables| {
            with_f32(gains, |gains| {
                let norm = gains.map(|(q, k)| gpt_kernels::infer::QkNorm { q, k, eps });
                gpt_kernels::infer::rotate_qkv(rows, heads, &positions, tables, norm)
            })
        })?;
        Ok(Some(Tensor::from_vec(y, qkv.shape(), qkv.device())?))
    }

    pub(crate) fn resid_pdrop(&self) -> f32 {
        self.resid_pdrop
    }

    /// Inference on packed rows: `x` is `(N, C)`, the new tokens of each sequence in turn,
    /// `lens[s]` of them for sequence `s` (at `positions` `(N)` u32 of their sequences), whose
    /// cache for this layer is `caches[s]`. Appends the
    /// new keys and values to each cache. The adapters' updates of `c_attn` and `c_proj` apply
    /// to their rows ([`Conv1D::forward_updated`]).
    pub(crate) fn forward_packed(
        &self,
        x: &Tensor,
        lens: &[usize],
        positions: &Tensor,
        caches: &mut [&mut LayerKv],
        (attn_updates, proj_updates): (&[RowUpdate<'_>], &[RowUpdate<'_>]),
    ) -> candle_core::Result<Tensor> {
        let (qw, kvw) = self.widths();
        let qkv = self.c_attn.forward_updated(x, attn_updates)?; // (N, q + 2 kv): one matmul for every sequence
        let qkv = self.rotate(&qkv, positions, false)?; // q and k at their positions
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
                    cache.reserve(len, self.n_kv_head, self.head_dim, qkv.dtype(), qkv.device())?;
                    kv.push(cache.write_rows(rows, qw + 2 * kvw, qw, start, len)?); // (nkv, offset + t, hs)
                    start += len;
                }
                kv
            };
            let y = gpt_kernels::grouped_attention(
                &qkv,
                lens,
                &kv,
                self.n_head,
                self.n_kv_head,
                self.scale() as f32,
                self.masking,
            )?; // (N, q)
            return self.c_proj.forward_updated(&y, proj_updates);
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = self.decode_on_gpu(&qkv, lens, caches)? {
            return self.c_proj.forward_updated(&y, proj_updates);
        }
        let mut outputs = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (&len, cache) in lens.iter().zip(caches.iter_mut()) {
            let rows = qkv.narrow(0, start, len)?; // (t, q + 2 kv)
            start += len;
            let heads = |col: usize, width: usize, n: usize| -> candle_core::Result<Tensor> {
                rows.narrow(1, col, width)? // (t, n * hs)
                    .reshape((len, n, self.head_dim))? // (t, n, hs)
                    .transpose(0, 1)? // (n, t, hs)
                    .contiguous()
            };
            let (k, v) = cache.append(&heads(qw, kvw, self.n_kv_head)?, &heads(qw + kvw, kvw, self.n_kv_head)?)?; // (nkv, offset + t, hs)
            let (k, v) = (self.repeat_kv(k.contiguous()?)?, self.repeat_kv(v.contiguous()?)?); // (nh, offset + t, hs)
            let q = heads(0, qw, self.n_head)?;
            let att = self.masked((q.matmul(&k.t()?)? * self.scale())?)?; // (nh, t, offset + t)
            let att = gpt_kernels::causal_softmax(&att, false)?; // new token i sees keys ..= offset + i
            let y = att.matmul(&v.contiguous()?)?; // (nh, t, hs)
            outputs.push(y.transpose(0, 1)?.reshape((len, qw))?); // (t, nh * hs)
        }
        self.c_proj.forward_updated(&Tensor::cat(&outputs, 0)?, proj_updates) // (N, C)
    }
}

impl CausalSelfAttention {
    /// A decode step (one new token for every sequence) on CUDA with whole-buffer caches: the
    /// appends and the attention of all sequences in one kernel launch
    /// ([`gpt_kernels::infer::decode_attention`]). `None` (nothing changed but room reserved) where
    /// that does not apply, or with `GPT_CUDA_FUSED=0`.
    #[cfg(feature = "cuda")]
    fn decode_on_gpu(
        &self,
        qkv: &Tensor,
        lens: &[usize],
        caches: &mut [&mut LayerKv],
    ) -> candle_core::Result<Option<Tensor>> {
        if !qkv.device().is_cuda() || !gpt_kernels::cuda_fused() || lens.iter().any(|&t| t != 1) || !self.is_plain() {
            return Ok(None);
        }
        let mut buffers = Vec::with_capacity(caches.len());
        for cache in caches.iter_mut() {
            match cache.whole_with_room(1, self.n_head, self.head_dim, qkv.dtype(), qkv.device())? {
                Some((k, v)) if self.head_dim + cache.len < gpt_kernels::infer::DECODE_SHARED_FLOATS => {
                    buffers.push((k, v, cache.len, cache.room()))
                }
                _ => return Ok(None),
            }
        }
        let y = gpt_kernels::infer::decode_attention(
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

/// `f` on the f32 values of a pair of contiguous CPU tensors (their storage held meanwhile), or
/// on `None`.
fn with_f32<R>(
    pair: Option<(&Tensor, &Tensor)>,
    f: impl FnOnce(Option<(&[f32], &[f32])>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let Some((a, b)) = pair else { return f(None) };
    let ((sa, la), (sb, lb)) = (a.storage_and_layout(), b.storage_and_layout());
    let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cb)) = (&*sa, &*sb) else {
        candle_core::bail!("with_f32: a tensor is not on the CPU")
    };
    f(Some((
        gpt_kernels::f32_slice(ca, la, "rotate")?,
        gpt_kernels::f32_slice(cb, lb, "rotate")?,
    )))
}
