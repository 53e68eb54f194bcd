//! The decoder (GPT-2: Radford et al., 2019, "Language Models are Unsupervised Multitask
//! Learners"): token (+ position) embeddings, `n_layer` pre-norm blocks of causal self-attention
//! and an MLP with residuals, a final norm and an LM head, tied to the token embedding or its
//! own. The families of [`crate::arch`] differ in the norm (LayerNorm or RMSNorm), the positions
//! (learned or rotary), the MLP (GELU or gated SiLU) and the attention's heads
//! ([`crate::config::Variant`]); GPT-2's layer names follow `transformers`' `GPT2LMHeadModel`, so
//! `vb.pp(..)` paths are the checkpoint's tensor names, and the others' are mapped by their
//! family's file. This file holds the layers and the forward pass; the loss
//! and the rest of training's entry points are in `gpt/train.rs`, the weights' names, formats
//! and adapters in `gpt/weights.rs`, the batched generation step in `gpt/step.rs`.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, LayerNorm, VarBuilder};

use crate::attention::{CausalSelfAttention, RopeTables, Segments};
use crate::config::{Activation, Config, PositionEmbedding};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::layers::{
    add_then_norm, dropout, layer_norm, load_layer_norm, Autocast, Conv1D, Dropout, RowUpdate, Weight,
};

mod step;
mod train;
mod weights;

use step::BlockUpdates;
pub use step::{LogitsFor, SeqStep};

#[derive(Debug, Clone)]
pub(crate) struct Mlp {
    /// The up projection; gated: the gate's and the up projection's outputs side by side.
    pub(crate) c_fc: Conv1D,
    pub(crate) c_proj: Conv1D,
    activation: Activation,
    gated: bool,
    resid_pdrop: f32,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt(); // GPT-2's scaled residual init
        Ok(Self {
            c_fc: Conv1D::load(vb.pp("c_fc"), cfg.n_embd, cfg.mlp_width(), cfg)?,
            c_proj: Conv1D::load_with_std(vb.pp("c_proj"), cfg.mlp_width(), cfg.n_embd, proj_std, cfg)?,
            activation: cfg.activation_function,
            gated: false,
            resid_pdrop: cfg.resid_pdrop,
        })
    }

    /// The MLP of `cfg` from its layers (gated: `c_fc` the gate and the up projection side by
    /// side).
    pub(crate) fn new(c_fc: Conv1D, c_proj: Conv1D, cfg: &Config) -> Self {
        Self {
            c_fc,
            c_proj,
            activation: cfg.activation_function,
            gated: cfg.variant.gated_mlp,
            resid_pdrop: cfg.resid_pdrop,
        }
    }

    /// `act(gate) * up` for the gated MLP's `(.., 2 I)` projection: the kernels' op for the
    /// families' SiLU and GELU-tanh gates (one pass each way on the CPU), candle's ops otherwise.
    fn gate(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let act = match self.activation {
            Activation::Silu => gpt_kernels::GateActivation::Silu,
            Activation::GeluNew => gpt_kernels::GateActivation::GeluTanh,
            act @ (Activation::Gelu | Activation::Relu | Activation::Relu2) => {
                let last = candle_core::D::Minus1;
                let width = h.dim(last)? / 2;
                let (gate, up) = (h.narrow(last, 0, width)?, h.narrow(last, width, width)?);
                return activation(&gate, act)? * up;
            }
        };
        gpt_kernels::gated(h, act)
    }

    /// `train`: this layer's dropout key; the MLP's masks are its site 2.
    fn forward_t(&self, x: &Tensor, train: Option<Dropout>) -> candle_core::Result<Tensor> {
        dropout(
            self.forward_undropped(x, train)?,
            self.resid_pdrop,
            train.map(|d| d.site(2)),
        )
        // (.., C)
    }

    /// The MLP's output before its residual dropout; `train` (its first row counted in `x`'s
    /// first dimension) keys a LoRA update's input dropout (sites 5 and 6).
    fn forward_undropped(&self, x: &Tensor, train: Option<Dropout>) -> candle_core::Result<Tensor> {
        self.c_proj
            .forward_t(&self.activated(x, train.map(|d| d.site(5)))?, train.map(|d| d.site(6)))
    }

    /// [`Mlp::forward_undropped`] on packed rows, with adapters' updates of `c_fc` and `c_proj`
    /// on their rows ([`Conv1D::forward_updated`]).
    fn forward_updated(&self, x: &Tensor, fc: &[RowUpdate<'_>], proj: &[RowUpdate<'_>]) -> candle_core::Result<Tensor> {
        if fc.is_empty() && proj.is_empty() {
            return self.forward_undropped(x, None);
        }
        let h = match self.activation {
            _ if fc.is_empty() => return self.c_proj.forward_updated(&self.activated(x, None)?, proj),
            _ if self.gated => self.gate(&self.c_fc.forward_updated(x, fc)?)?,
            // The same GELU as the packed kernel's epilogue, so that rows without an update of
            // `c_fc` get what they get in a step without adapters.
            Activation::GeluNew => gpt_kernels::gelu(&self.c_fc.forward_updated(x, fc)?)?, // (N, 4C)
            act => activation(&self.c_fc.forward_updated(x, fc)?, act)?,
        };
        self.c_proj.forward_updated(&h, proj)
    }

    /// `c_fc` and the activation; `drop` keys a LoRA update's input dropout.
    fn activated(&self, x: &Tensor, drop: Option<Dropout>) -> candle_core::Result<Tensor> {
        if self.gated {
            return self.gate(&self.c_fc.forward_t(x, drop)?); // (.., I)
        }
        match self.activation {
            Activation::GeluNew => self.c_fc.forward_gelu_t(x, drop), // (.., 4C), tanh approximation
            act => activation(&self.c_fc.forward_t(x, drop)?, act),
        }
    }
}

/// `act(h)`: candle's ops, or the kernels' fused op for squared ReLU (GPT-2's GELU-tanh and the
/// SiLU and GELU-tanh gates have theirs elsewhere).
fn activation(h: &Tensor, act: Activation) -> candle_core::Result<Tensor> {
    match act {
        Activation::GeluNew => h.gelu(),
        Activation::Gelu => h.gelu_erf(),
        Activation::Relu => h.relu(),
        Activation::Relu2 => gpt_kernels::relu2(h),
        Activation::Silu => candle_nn::ops::silu(h),
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Block {
    pub(crate) ln_1: LayerNorm,
    pub(crate) attn: CausalSelfAttention,
    pub(crate) ln_2: LayerNorm,
    pub(crate) mlp: Mlp,
    /// Norms of the attention's and the MLP's outputs before their residual adds (Gemma).
    pub(crate) post_norms: Option<(LayerNorm, LayerNorm)>,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        Ok(Self {
            ln_1: load_layer_norm(vb.pp("ln_1"), cfg)?,
            attn: CausalSelfAttention::load(vb.pp("attn"), cfg)?,
            ln_2: load_layer_norm(vb.pp("ln_2"), cfg)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
            post_norms: None,
        })
    }

    /// The attention's output `h` through its post-norm, where the block has one (`train`: for a
    /// backward pass).
    fn post_attn(&self, h: Tensor, train: bool) -> candle_core::Result<Tensor> {
        match &self.post_norms {
            Some((attn, _)) => layer_norm(attn, &h, train),
            None => Ok(h),
        }
    }

    /// The MLP's output `h` through its post-norm, where the block has one.
    fn post_mlp(&self, h: Tensor, train: bool) -> candle_core::Result<Tensor> {
        match &self.post_norms {
            Some((_, mlp)) => layer_norm(mlp, &h, train),
            None => Ok(h),
        }
    }

    fn forward_t(
        &self,
        x: &Tensor,
        train: Option<Dropout>,
        segments: Option<&Segments>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        let h = self
            .attn
            .forward_recorded(&layer_norm(&self.ln_1, x, train.is_some())?, train, segments, record)?;
        let x = (x + self.post_attn(h, train.is_some())?)?;
        let h = self
            .mlp
            .forward_t(&layer_norm(&self.ln_2, &x, train.is_some())?, train)?;
        &x + self.post_mlp(h, train.is_some())?
    }

    /// [`Block::forward_t`] on the residual stream as rows, `x` `(B * T, C)` in windows of
    /// `seq_len` (f32 on the CPU): every step one fused node of the backward graph, and no
    /// reshapes (each would be a node too). Dropout masks as in [`Block::forward_t`].
    fn forward_rows(
        &self,
        x: &Tensor,
        seq_len: usize,
        train: Option<Dropout>,
        segments: Option<&Segments>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        // The residual dropouts (sites 1 and 2), keyed as in `forward_t`; on rows, the masks
        // count elements from the shard's first window's first row.
        let add = |x: &Tensor, h: &Tensor, p: f32, site: u64| match train {
            Some(d) => gpt_kernels::add_dropout(x, h, p, d.site(site).key, d.first_row * seq_len),
            None => x + h,
        };
        let h = self.attn.forward_rows(
            &layer_norm(&self.ln_1, x, train.is_some())?,
            seq_len,
            train,
            segments,
            record,
        )?;
        let x = add(x, &self.post_attn(h, train.is_some())?, self.attn.resid_pdrop(), 1)?;
        let rows = train.map(|d| Dropout {
            first_row: d.first_row * seq_len,
            ..d
        });
        let h = self
            .mlp
            .forward_undropped(&layer_norm(&self.ln_2, &x, train.is_some())?, rows)?;
        add(&x, &self.post_mlp(h, train.is_some())?, self.mlp.resid_pdrop, 2)
    }

    /// Inference on packed rows ([`CausalSelfAttention::forward_packed`]), with the adapters'
    /// updates of this block's layers on their rows: `x` the residual stream and `normed` its
    /// `ln_1`; gives the stream after the block and, where `next` (the next block's `ln_1`) is
    /// given, its norm, each residual add fused with the norm after it ([`add_then_norm`]).
    #[allow(clippy::too_many_arguments)]
    fn forward_packed(
        &self,
        x: &Tensor,
        normed: &Tensor,
        next: Option<&LayerNorm>,
        lens: &[usize],
        positions: &Tensor,
        caches: &mut [&mut crate::kv_cache::LayerKv],
        updates: &BlockUpdates<'_>,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let [c_attn, attn_proj, c_fc, mlp_proj] = updates;
        let h = self
            .attn
            .forward_packed(normed, lens, positions, caches, (c_attn, attn_proj))?;
        let (x, normed) = add_then_norm(x, &self.post_attn(h, false)?, &self.ln_2)?;
        let h = self.post_mlp(self.mlp.forward_updated(&normed, c_fc, mlp_proj)?, false)?;
        match next {
            Some(ln) => add_then_norm(&x, &h, ln).map(|(x, normed)| (x, Some(normed))),
            None => Ok(((&x + h)?, None)),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Gpt {
    wte: Weight, // (V, C), also the LM head where it is tied
    /// `(n_positions, C)`, learned or the fixed sinusoid table; none with rotary positions.
    wpe: Option<Tensor>,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// An untied LM head `(V, C)`.
    lm_head: Option<Weight>,
    cfg: Config,
    autocast: Autocast,
    /// Activation checkpointing of every block while training on the tape
    /// ([`Gpt::with_activation_checkpointing`]).
    checkpointing: bool,
    /// What the CPU's KV cache stores, where not the activations' dtype
    /// ([`Gpt::with_kv_cache_dtype`]).
    kv_dtype: Option<DType>,
}

/// The `(n_positions, n_embd)` table PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(..).
pub fn sinusoidal_table(n_positions: usize, n_embd: usize, device: &Device) -> candle_core::Result<Tensor> {
    let table: Vec<f32> = (0..n_positions)
        .flat_map(|pos| {
            (0..n_embd).map(move |j| {
                let freq = 10000f64.powf(-((j - j % 2) as f64) / n_embd as f64);
                let angle = pos as f64 * freq;
                (if j % 2 == 0 { angle.sin() } else { angle.cos() }) as f32
            })
        })
        .collect();
    Tensor::from_vec(table, (n_positions, n_embd), device)
}

impl Gpt {
    /// Builds the network from `vb`, rooted where GPT-2's `transformer.` module is (tensor names
    /// `wte.weight`, `h.0.attn.c_attn.weight`, ...). With a `VarMap`-backed builder the weights
    /// are created with GPT-2's initialisation.
    ///
    /// The other families are loaded from their checkpoints' names ([`Gpt::new_family`]).
    pub fn new(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        if !cfg.is_gpt2_shaped() {
            return Self::new_family(vb, cfg);
        }
        let init = Init::Randn { mean: 0.0, stdev: 0.02 };
        let wte = vb.get_with_hints((cfg.vocab_size, cfg.n_embd), "wte.weight", init)?;
        let wpe = match cfg.position_embedding {
            PositionEmbedding::Learned => vb.get_with_hints((cfg.n_positions, cfg.n_embd), "wpe.weight", init)?,
            PositionEmbedding::Sinusoidal => {
                sinusoidal_table(cfg.n_positions, cfg.n_embd, vb.device())?.to_dtype(vb.dtype())?
            }
            PositionEmbedding::Rope => {
                return Err(Error::InvalidConfig(
                    "GPT-2 with rotary positions is not a family here".into(),
                ))
            }
        };
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::load(vb.pp(format!("h.{i}")), cfg))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let ln_f = load_layer_norm(vb.pp("ln_f"), cfg)?;
        Ok(Self {
            wte: Weight::Dense(wte),
            wpe: Some(wpe),
            blocks,
            ln_f,
            lm_head: None,
            cfg: cfg.clone(),
            autocast: Autocast::Off,
            checkpointing: false,
            kv_dtype: None,
        })
    }

    /// A network of one of the Llama-layout families ([`crate::arch::llama`]) from `vb`, rooted
    /// where the checkpoint's names start (`model.embed_tokens.weight`, ...), for inference.
    fn new_family(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let weights = crate::arch::llama::weights_from_hf(&vb, cfg, false)?;
        Self::from_family_weights(cfg, weights, vb.dtype(), vb.device())
    }

    /// The network of `cfg` to train, its weights the variables `vb` makes: [`Gpt::new`] for
    /// GPT-2; the other families hold each tensor they compute with as one variable (q, k, v
    /// stacked, gate and up stacked, Gemma's gains as `1 + w`), so that the optimizer's updates
    /// are what the next step computes with. Set them from a checkpoint with
    /// [`crate::arch::llama::trainable_tensors`]; [`Gpt::named_tensors`] gives the checkpoint's
    /// names back.
    pub fn new_trainable(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        if cfg.is_gpt2_shaped() {
            return Self::new(vb, cfg);
        }
        let weights = crate::arch::llama::weights_from_hf(&vb, cfg, true)?;
        Self::from_family_weights(cfg, weights, vb.dtype(), vb.device())
    }

    /// The network of a Llama-layout family from its weights, however they were read (a
    /// `transformers` checkpoint, a llama.cpp GGUF file); activations in `dtype` on `device`.
    pub(crate) fn from_family_weights(
        cfg: &Config,
        weights: crate::arch::llama::FamilyWeights,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        let rope = RopeTables::new(cfg, dtype, device)?;
        // Gemma 3's sliding layers rotate with a base of their own.
        let local_rope = match &cfg.variant.rope_local {
            Some(local) => Some(RopeTables::of(local, cfg, dtype, device)?),
            None => None,
        };
        let norm = |gain: Tensor| LayerNorm::rms_norm(gain, cfg.layer_norm_epsilon);
        let blocks = weights
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let rope = match (&local_rope, cfg.window(i)) {
                    (Some(local), Some(_)) => Some(local.clone()),
                    _ => rope.clone(),
                };
                Block {
                    ln_1: norm(l.attn_norm),
                    attn: CausalSelfAttention::new(
                        Conv1D::from_weight(l.qkv.0, l.qkv.1),
                        Conv1D::from_weight(l.o.0, l.o.1),
                        cfg,
                        rope,
                        l.qk_norm,
                    )
                    .with_window(cfg.window(i)),
                    ln_2: norm(l.mlp_norm),
                    mlp: Mlp::new(
                        Conv1D::from_weight(l.gate_up.0, l.gate_up.1),
                        Conv1D::from_weight(l.down.0, l.down.1),
                        cfg,
                    ),
                    post_norms: l.post_norms.map(|(attn, mlp)| (norm(attn), norm(mlp))),
                }
            })
            .collect();
        Ok(Self {
            wte: weights.embed,
            wpe: None,
            blocks,
            ln_f: norm(weights.final_norm),
            lm_head: weights.head,
            cfg: cfg.clone(),
            autocast: Autocast::Off,
            checkpointing: false,
            kv_dtype: None,
        })
    }

    /// The LM head: its own, or the token embedding where tied.
    pub(crate) fn head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.wte)
    }

    /// The token embeddings `(N, C)` of `ids` `(N)`, scaled by sqrt(n_embd) where the family
    /// scales them (Gemma: by the factor rounded to the activations' dtype, as `transformers`).
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let x = self.wte.rows(ids, self.dtype())?;
        match self.cfg.variant.embed_scale {
            // One of candle's ops: an entry of a recording tape.
            true => gpt_kernels::tape::candle_ops(&[&x], |a| a[0].affine((self.cfg.n_embd as f64).sqrt(), 0.0)),
            false => Ok(x),
        }
    }

    /// The LM head's logits of final hidden states `(rows, C)`, soft-capped where the family
    /// caps them (Gemma 2: `cap * tanh(logits / cap)`), in the head's dtype.
    pub(crate) fn head_logits(&self, hidden: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.head().forward(hidden, self.autocast)?;
        match self.cfg.variant.final_softcap {
            Some(cap) => (logits.to_dtype(DType::F32)? / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.ln_f.weight().device()
    }

    /// The dtype of activations (and of the weights, unless [`Gpt::with_weight_format`] changed
    /// them).
    pub fn dtype(&self) -> DType {
        self.ln_f.weight().dtype()
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::stored_as(&self.cfg, self.kv_cache_dtype())
    }

    /// The dtype of the keys and values its caches hold ([`Gpt::with_kv_cache_dtype`]).
    pub fn kv_cache_dtype(&self) -> DType {
        self.kv_dtype.unwrap_or(self.dtype())
    }

    /// The model with caches that hold keys and values in `dtype`: the activations' own, or on
    /// the CPU with f32 activations f16 (half the memory a position takes, as llama.cpp keeps
    /// its cache; each value rounded to f16's 11 bits once, when written, and read as f32 by the
    /// fused attention). Anything else is an error that names it.
    pub fn with_kv_cache_dtype(mut self, dtype: DType) -> Result<Self> {
        let activations = self.dtype();
        // The blocks the fused CPU attention reads (`GPT_CPU_FUSED` not 0) may hold f16.
        let blocks = activations == DType::F32 && self.device().is_cpu() && gpt_kernels::cpu_fused();
        self.kv_dtype = match dtype {
            d if d == activations => None,
            DType::F16 if blocks => Some(DType::F16),
            other => {
                let or = if blocks { " or F16" } else { "" };
                let device = crate::device_name(self.device());
                return Err(crate::Error::InvalidConfig(format!(
                    "a KV cache in {other:?}: with {activations:?} activations on {device} it holds {activations:?}{or}"
                )));
            }
        };
        Ok(self)
    }

    /// The model over whole windows, no cache: logits `(B, T, V)` in f32 for every position of
    /// `idx` `(B, T)`. `train` (`Some` while training) switches on dropout, with masks from its
    /// key, and the differentiable paths. Training and evaluation go through [`Gpt::loss`],
    /// which is this pass with the LM head and the cross-entropy fused.
    pub fn forward(&self, idx: &Tensor, train: Option<Dropout>) -> Result<Tensor> {
        Ok(self.forward_recorded(idx, None, train, None)?.to_dtype(DType::F32)?)
    }

    /// [`Gpt::forward`] over packed windows: several sequences one after another in each
    /// window, `positions` `(B, T)` (u32) each row's position in its own sequence (0 where one
    /// starts, else one more than the row before; Hugging Face's `position_ids` for packing).
    /// Each sequence gets the logits it gets alone: its own positions' embeddings, and attention
    /// that never crosses into another sequence.
    pub fn forward_at(&self, idx: &Tensor, positions: &Tensor, train: Option<Dropout>) -> Result<Tensor> {
        Ok(self
            .forward_recorded(idx, Some(positions), train, None)?
            .to_dtype(DType::F32)?)
    }

    /// [`Gpt::forward`] for inference, with every layer's attention probabilities
    /// `(B, n_head, T, T)` in f32 (each row sums to 1, zero above the diagonal) from the same
    /// pass: what `transformers` returns with `output_attentions=True`.
    pub fn forward_with_attentions(&self, idx: &Tensor) -> Result<(Tensor, Vec<Tensor>)> {
        let mut attentions = Vec::with_capacity(self.cfg.n_layer);
        let logits = self.forward_recorded(idx, None, None, Some(&mut attentions))?;
        let attentions = attentions
            .into_iter()
            .map(|a| a.to_dtype(DType::F32))
            .collect::<candle_core::Result<_>>()?;
        Ok((logits.to_dtype(DType::F32)?, attentions))
    }

    /// An embedding of each window of `idx` `(B, T)`: the final norm's output at its last
    /// position, L2-normalised, `(B, C)` in f32 (the pooling vLLM and the decoder embedding
    /// models, E5-Mistral and Qwen3-Embedding, use for causal decoders: only the last position
    /// has read the whole text).
    pub fn embeddings(&self, idx: &Tensor) -> Result<Tensor> {
        let (b_sz, seq_len) = idx.dims2()?;
        let hidden = self.forward_hidden(idx, None, None, None)?.to_dtype(DType::F32)?; // (B*T, C)
        let last = hidden
            .reshape((b_sz, seq_len, self.cfg.n_embd))?
            .narrow(1, seq_len - 1, 1)?
            .squeeze(1)?; // (B, C)
        unit_rows(&last)
    }

    fn forward_recorded(
        &self,
        idx: &Tensor,
        positions: Option<&Tensor>,
        train: Option<Dropout>,
        record: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len) = idx.dims2()?;
        let x = self.forward_hidden(idx, positions, train, record)?; // (B*T, C)
        let logits = self.head_logits(&x)?; // (B*T, V)
        Ok(logits.reshape((b_sz, seq_len, self.cfg.vocab_size))?)
    }

    /// Whether a family other than GPT-2 runs its windows of `seq_len` as rows of the residual
    /// stream (`Block::forward_rows`, every op then one of the tape's): on the CPU in f32, every
    /// layer's attention on the fused window attention (no soft-capped scores, no sliding
    /// window shorter than `seq_len`) and the MLP's activation on a fused op (a SiLU or GELU-tanh
    /// gate; ungated, squared ReLU or GELU-tanh).
    pub(crate) fn family_runs_on_rows(&self, seq_len: usize) -> bool {
        let fused_activation = match self.cfg.variant.gated_mlp {
            true => matches!(self.cfg.activation_function, Activation::Silu | Activation::GeluNew),
            false => matches!(self.cfg.activation_function, Activation::Relu2 | Activation::GeluNew),
        };
        !self.cfg.is_gpt2_shaped()
            && self.device().is_cpu()
            && fused_activation
            && self.blocks.iter().all(|b| b.attn.runs_on_windows(seq_len))
    }

    /// The final LayerNorm's output `(B*T, C)` for `(B, T)` windows: the LM head's input;
    /// `positions` for packed windows (see [`Gpt::forward_at`]).
    fn forward_hidden(
        &self,
        idx: &Tensor,
        positions: Option<&Tensor>,
        train: Option<Dropout>,
        mut record: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len) = idx.dims2()?;
        if seq_len > self.cfg.n_positions {
            return Err(Error::ContextOverflow {
                needed: seq_len,
                max: self.cfg.n_positions,
            });
        }
        let tok = self.embed(&idx.flatten_all()?)?; // (B*T, C)

        // The residual stream as rows (every op then one of the tape's): f32 on the CPU, or with
        // `GPT_CUDA_TAPE=1` on a GPU whose attention kernel takes the heads (not packed windows:
        // it has no segments).
        let head_dim = self.cfg.n_embd / self.cfg.n_head.max(1);
        let fused_rows = gpt_kernels::fused(&tok)
            && ((self.cfg.is_gpt2_shaped()
                && (tok.device().is_cpu()
                    || (gpt_kernels::cuda_tape()
                        && positions.is_none()
                        && gpt_kernels::window_attention_runs_on(&tok, head_dim))))
                || (record.is_none() && self.family_runs_on_rows(seq_len)));
        let (pos, segments) = match positions {
            None => (
                self.wpe
                    .as_ref()
                    .map(|wpe| gpt_kernels::tape::first_rows(wpe, seq_len))
                    .transpose()?,
                None,
            ), // (T, C)
            Some(positions) => {
                if positions.dims() != idx.dims() {
                    return Err(Error::Positions(format!(
                        "{:?}, not the inputs' {:?}",
                        positions.dims(),
                        idx.dims()
                    )));
                }
                let ids = positions.flatten_all()?.to_dtype(DType::U32)?;
                let starts = gpt_kernels::segment_starts(&ids.to_vec1::<u32>()?, seq_len)
                    .map_err(|e| Error::Positions(e.to_string()))?;
                let mask = match fused_rows {
                    true => None, // the CPU's attention op takes the starts
                    false => Some(gpt_kernels::segment_mask(
                        &starts,
                        seq_len,
                        self.dtype(),
                        self.device(),
                    )?),
                };
                let pos = self
                    .wpe
                    .as_ref()
                    .map(|wpe| gpt_kernels::tape::embedding(wpe, &ids))
                    .transpose()?; // (B*T, C)
                (
                    pos,
                    Some(Segments {
                        starts,
                        mask,
                        positions: ids,
                    }),
                )
            }
        };
        let segments = segments.as_ref();
        if fused_rows {
            // The residual stream as rows (`Block::forward_rows`); the embeddings' masks count
            // elements from the shard's first window.
            let x = match &pos {
                Some(pos) => gpt_kernels::add_tiled(&tok, pos)?,
                None => tok,
            };
            let mut x = dropout(
                x,
                self.cfg.embd_pdrop,
                train.map(|d| Dropout {
                    first_row: d.first_row * seq_len,
                    ..d.site(0)
                }),
            )?;
            for (i, block) in self.blocks.iter().enumerate() {
                let train = train.map(|d| d.site(i as u64 + 1));
                x = match train {
                    Some(_) if self.checkpointing && record.is_none() => {
                        let (block, segments) = (block.clone(), segments.cloned());
                        let segment: gpt_kernels::tape::Segment = std::sync::Arc::new(move |x| {
                            block.forward_rows(x, seq_len, train, segments.as_ref(), None)
                        });
                        gpt_kernels::tape::checkpoint(&x, segment)?
                    }
                    _ => block.forward_rows(&x, seq_len, train, segments, record.as_deref_mut())?,
                };
            }
            return Ok(layer_norm(&self.ln_f, &x, train.is_some())?); // (B*T, C)
        }
        // (B, T, C). Dropout sites: the embeddings 0, block i's layer key i + 1.
        let tok = tok.reshape((b_sz, seq_len, self.cfg.n_embd))?;
        let x = match (pos, segments) {
            (Some(pos), Some(_)) => gpt_kernels::add_tiled(&tok, &pos.reshape((b_sz, seq_len, self.cfg.n_embd))?)?,
            (Some(pos), None) => gpt_kernels::add_tiled(&tok, &pos)?,
            (None, _) => tok,
        };
        let mut x = dropout(x, self.cfg.embd_pdrop, train.map(|d| d.site(0)))?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward_t(&x, train.map(|d| d.site(i as u64 + 1)), segments, record.as_deref_mut())?;
            // (B, T, C)
        }
        let x = layer_norm(&self.ln_f, &x, train.is_some())?;
        Ok(x.reshape((b_sz * seq_len, self.cfg.n_embd))?) // (B*T, C)
    }
}

/// Each row of `x` `(rows, C)` scaled to unit length (kept from dividing by zero by 1e-12, as
/// `torch.nn.functional.normalize`): embeddings, here and in the server's engine.
pub fn unit_rows(x: &Tensor) -> Result<Tensor> {
    let norm = x.sqr()?.sum_keepdim(1)?.sqrt()?.clamp(1e-12, f64::MAX)?;
    Ok(x.broadcast_div(&norm)?)
}
