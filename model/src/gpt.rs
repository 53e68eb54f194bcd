//! The GPT-2 network (Radford et al., 2019, "Language Models are Unsupervised Multitask
//! Learners"): token + position embeddings, `n_layer` pre-LayerNorm blocks of causal
//! self-attention and a GELU MLP with residuals, a final LayerNorm and an LM head tied to the
//! token embedding. Layer names follow `transformers`' `GPT2LMHeadModel`, so `vb.pp(..)` paths
//! are the checkpoint's tensor names.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, LayerNorm, VarBuilder};

use crate::attention::{CausalSelfAttention, Segments};
use crate::config::{Activation, Config, PositionEmbedding};
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::layers::{dropout, layer_norm, load_layer_norm, Autocast, Conv1D, Dropout, RowUpdate, Weight};
use gpt_kernels::{MatmulPrecision, WeightFormat};

mod step;

use step::BlockUpdates;
pub use step::{LogitsFor, SeqStep};

#[derive(Debug, Clone)]
struct Mlp {
    c_fc: Conv1D,
    c_proj: Conv1D,
    activation: Activation,
    resid_pdrop: f32,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt(); // GPT-2's scaled residual init
        Ok(Self {
            c_fc: Conv1D::load(vb.pp("c_fc"), cfg.n_embd, cfg.mlp_width(), cfg)?,
            c_proj: Conv1D::load_with_std(vb.pp("c_proj"), cfg.mlp_width(), cfg.n_embd, proj_std, cfg)?,
            activation: cfg.activation_function,
            resid_pdrop: cfg.resid_pdrop,
        })
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
            // The same GELU as the packed kernel's epilogue, so that rows without an update of
            // `c_fc` get what they get in a step without adapters.
            Activation::GeluNew => gpt_kernels::gelu(&self.c_fc.forward_updated(x, fc)?)?, // (N, 4C)
            Activation::Gelu => self.c_fc.forward_updated(x, fc)?.gelu_erf()?,
            Activation::Relu => self.c_fc.forward_updated(x, fc)?.relu()?,
        };
        self.c_proj.forward_updated(&h, proj)
    }

    /// `c_fc` and the activation; `drop` keys a LoRA update's input dropout.
    fn activated(&self, x: &Tensor, drop: Option<Dropout>) -> candle_core::Result<Tensor> {
        match self.activation {
            Activation::GeluNew => self.c_fc.forward_gelu_t(x, drop), // (.., 4C), tanh approximation
            Activation::Gelu => self.c_fc.forward_t(x, drop)?.gelu_erf(),
            Activation::Relu => self.c_fc.forward_t(x, drop)?.relu(),
        }
    }
}

#[derive(Debug, Clone)]
struct Block {
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Block {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        Ok(Self {
            ln_1: load_layer_norm(vb.pp("ln_1"), cfg)?,
            attn: CausalSelfAttention::load(vb.pp("attn"), cfg)?,
            ln_2: load_layer_norm(vb.pp("ln_2"), cfg)?,
            mlp: Mlp::load(vb.pp("mlp"), cfg)?,
        })
    }

    fn forward_t(
        &self,
        x: &Tensor,
        train: Option<Dropout>,
        segments: Option<&Segments>,
        record: Option<&mut Vec<Tensor>>,
    ) -> candle_core::Result<Tensor> {
        let x =
            (x + self
                .attn
                .forward_recorded(&layer_norm(&self.ln_1, x, train.is_some())?, train, segments, record)?)?;
        &x + self
            .mlp
            .forward_t(&layer_norm(&self.ln_2, &x, train.is_some())?, train)?
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
        let x = add(x, &h, self.attn.resid_pdrop(), 1)?;
        let rows = train.map(|d| Dropout {
            first_row: d.first_row * seq_len,
            ..d
        });
        let h = self
            .mlp
            .forward_undropped(&layer_norm(&self.ln_2, &x, train.is_some())?, rows)?;
        add(&x, &h, self.mlp.resid_pdrop, 2)
    }

    /// Inference on packed rows ([`CausalSelfAttention::forward_packed`]), with the adapters'
    /// updates of this block's layers on their rows.
    fn forward_packed(
        &self,
        x: &Tensor,
        lens: &[usize],
        caches: &mut [&mut crate::kv_cache::LayerKv],
        updates: &BlockUpdates<'_>,
    ) -> candle_core::Result<Tensor> {
        let [c_attn, attn_proj, c_fc, mlp_proj] = updates;
        let x =
            (x + self
                .attn
                .forward_packed(&layer_norm(&self.ln_1, x, false)?, lens, caches, (c_attn, attn_proj))?)?;
        &x + self
            .mlp
            .forward_updated(&layer_norm(&self.ln_2, &x, false)?, c_fc, mlp_proj)?
    }
}

#[derive(Debug, Clone)]
pub struct Gpt {
    wte: Weight, // (V, C), also the LM head
    wpe: Tensor, // (n_positions, C), learned or the fixed sinusoid table
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    cfg: Config,
    autocast: Autocast,
    /// Activation checkpointing of every block while training on the tape
    /// ([`Gpt::with_activation_checkpointing`]).
    checkpointing: bool,
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
    pub fn new(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let init = Init::Randn { mean: 0.0, stdev: 0.02 };
        let wte = vb.get_with_hints((cfg.vocab_size, cfg.n_embd), "wte.weight", init)?;
        let wpe = match cfg.position_embedding {
            PositionEmbedding::Learned => vb.get_with_hints((cfg.n_positions, cfg.n_embd), "wpe.weight", init)?,
            PositionEmbedding::Sinusoidal => {
                sinusoidal_table(cfg.n_positions, cfg.n_embd, vb.device())?.to_dtype(vb.dtype())?
            }
        };
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::load(vb.pp(format!("h.{i}")), cfg))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let ln_f = load_layer_norm(vb.pp("ln_f"), cfg)?;
        Ok(Self {
            wte: Weight::Dense(wte),
            wpe,
            blocks,
            ln_f,
            cfg: cfg.clone(),
            autocast: Autocast::Off,
            checkpointing: false,
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.wpe.device()
    }

    /// The dtype of activations (and of the weights, unless [`Gpt::with_weight_format`] changed
    /// them).
    pub fn dtype(&self) -> DType {
        self.wpe.dtype()
    }

    /// Whether [`Gpt::loss`]'s backward pass can run on a tape ([`gpt_kernels::tape::record`],
    /// then [`gpt_kernels::tape::Tape::backward`]) instead of candle's `backward`: the fused CPU
    /// path in f32 (dense weights), with GPT-2's GELU. Elsewhere the forward pass runs candle ops
    /// that the tape does not record (the tape's backward pass would refuse them).
    /// `GPT_CPU_TAPE=0` in the environment turns it off, to compare.
    pub fn trains_on_tape(&self) -> bool {
        gpt_kernels::tape::enabled()
            && self.device().is_cpu()
            && gpt_kernels::fused(&self.wpe)
            && self.cfg.activation_function == Activation::GeluNew
            && matches!(&self.wte, Weight::Dense(w) if w.dtype() == DType::F32)
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg)
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

    fn forward_recorded(
        &self,
        idx: &Tensor,
        positions: Option<&Tensor>,
        train: Option<Dropout>,
        record: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let (b_sz, seq_len) = idx.dims2()?;
        let x = self.forward_hidden(idx, positions, train, record)?; // (B*T, C)
        let logits = self.wte.forward(&x, self.autocast)?; // (B*T, V)
        Ok(logits.reshape((b_sz, seq_len, self.cfg.vocab_size))?)
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
        let tok = self.wte.rows(&idx.flatten_all()?, self.dtype())?; // (B*T, C)
        let fused_rows = tok.device().is_cpu() && gpt_kernels::fused(&tok);
        let (pos, segments) = match positions {
            None => (gpt_kernels::tape::first_rows(&self.wpe, seq_len)?, None), // (T, C)
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
                let pos = gpt_kernels::tape::embedding(&self.wpe, &ids)?; // (B*T, C)
                (pos, Some(Segments { starts, mask }))
            }
        };
        let segments = segments.as_ref();
        if fused_rows {
            // f32 on the CPU: the residual stream as rows (`Block::forward_rows`); the
            // embeddings' masks count elements from the shard's first window.
            let x = gpt_kernels::add_tiled(&tok, &pos)?;
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
        let pos = match segments {
            Some(_) => pos.reshape((b_sz, seq_len, self.cfg.n_embd))?,
            None => pos,
        };
        let mut x = dropout(
            gpt_kernels::add_tiled(&tok, &pos)?,
            self.cfg.embd_pdrop,
            train.map(|d| d.site(0)),
        )?;
        for (i, block) in self.blocks.iter().enumerate() {
            x = block.forward_t(&x, train.map(|d| d.site(i as u64 + 1)), segments, record.as_deref_mut())?;
            // (B, T, C)
        }
        let x = layer_norm(&self.ln_f, &x, train.is_some())?;
        Ok(x.reshape((b_sz * seq_len, self.cfg.n_embd))?) // (B*T, C)
    }

    /// Mean next-token cross-entropy of `(B, T)` windows `idx` against `targets` `(B, T)` (u32),
    /// with label smoothing `eps` (see [`gpt_kernels::cross_entropy`]); `train` as in
    /// [`Gpt::forward`], and then differentiable. On the CPU in f32 the LM head and the loss are
    /// one op that never holds the whole logits ([`gpt_kernels::lm_head_loss`]); elsewhere the
    /// logits, then the cross-entropy.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor, train: Option<Dropout>, eps: f32) -> Result<Tensor> {
        self.loss_in(idx, None, targets, train, eps)
    }

    /// [`Gpt::loss`] over packed windows, `positions` as in [`Gpt::forward_at`]: the mean over
    /// every sequence's targets, each sequence seeing only itself.
    pub fn loss_at(
        &self,
        idx: &Tensor,
        positions: &Tensor,
        targets: &Tensor,
        train: Option<Dropout>,
        eps: f32,
    ) -> Result<Tensor> {
        self.loss_in(idx, Some(positions), targets, train, eps)
    }

    fn loss_in(
        &self,
        idx: &Tensor,
        positions: Option<&Tensor>,
        targets: &Tensor,
        train: Option<Dropout>,
        eps: f32,
    ) -> Result<Tensor> {
        let hidden = self.forward_hidden(idx, positions, train, None)?; // (B*T, C)
        let targets = targets.flatten_all()?;
        match &self.wte {
            Weight::Dense(w)
                if hidden.device().is_cpu()
                    && gpt_kernels::fused(&hidden)
                    && w.dtype() == DType::F32
                    && targets.dtype() == DType::U32 =>
            {
                Ok(gpt_kernels::lm_head_loss(
                    &hidden,
                    w,
                    &targets,
                    eps,
                    train.is_some(),
                    self.autocast,
                )?)
            }
            _ => {
                let logits = self.wte.forward(&hidden, self.autocast)?.to_dtype(DType::F32)?; // (B*T, V)
                Ok(gpt_kernels::cross_entropy(&logits, &targets, eps)?)
            }
        }
    }

    /// The weights under `transformers`' names (`transformer.` prefix, as `save_pretrained`
    /// writes them; the tied LM head is not stored separately).
    /// Quantized weights are dequantized to f32.
    pub fn named_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![
            ("transformer.wte.weight".to_string(), self.wte.tensor()?),
            ("transformer.wpe.weight".to_string(), self.wpe.clone()),
        ];
        let mut ln = |name: String, ln: &LayerNorm| {
            out.push((format!("{name}.weight"), ln.weight().clone()));
            if let Some(b) = ln.bias() {
                out.push((format!("{name}.bias"), b.clone()));
            }
        };
        for (i, b) in self.blocks.iter().enumerate() {
            ln(format!("transformer.h.{i}.ln_1"), &b.ln_1);
            ln(format!("transformer.h.{i}.ln_2"), &b.ln_2);
        }
        ln("transformer.ln_f".to_string(), &self.ln_f);
        for (i, b) in self.blocks.iter().enumerate() {
            let p = format!("transformer.h.{i}");
            for (name, conv) in [
                ("attn.c_attn", b.attn.c_attn()),
                ("attn.c_proj", b.attn.c_proj()),
                ("mlp.c_fc", &b.mlp.c_fc),
                ("mlp.c_proj", &b.mlp.c_proj),
            ] {
                out.push((format!("{p}.{name}.weight"), conv.weight_in_out()?));
                out.push((format!("{p}.{name}.bias"), conv.bias.clone()));
            }
        }
        Ok(out)
    }

    /// The model with the matrix products of [`Gpt::forward`] and [`Gpt::loss`] under `autocast` (see [`Autocast`]).
    pub fn with_autocast(mut self, autocast: Autocast) -> Self {
        self.autocast = autocast;
        for block in &mut self.blocks {
            block.attn.autocast = autocast;
            for conv in [
                &mut block.attn.c_attn,
                &mut block.attn.c_proj,
                &mut block.mlp.c_fc,
                &mut block.mlp.c_proj,
            ] {
                conv.autocast = autocast;
            }
        }
        self
    }

    pub fn autocast(&self) -> Autocast {
        self.autocast
    }

    /// The model with every parameter detached from gradient tracking: the same weights (shared,
    /// not copied) and settings, for passes that take no gradient, such as evaluation during
    /// training. A pass over a model whose parameters are variables builds candle's graph, which
    /// holds every activation of the pass until its result is dropped: as much memory as
    /// training's activations (the peak of a run with activation checkpointing).
    pub fn detached(&self) -> Gpt {
        let eps = self.cfg.layer_norm_epsilon;
        let ln = |ln: &LayerNorm| crate::layers::detached_layer_norm(ln, eps);
        Gpt {
            wte: self.wte.detached(),
            wpe: self.wpe.detach(),
            blocks: self
                .blocks
                .iter()
                .map(|b| {
                    let mut attn = b.attn.clone();
                    attn.c_attn = attn.c_attn.detached();
                    attn.c_proj = attn.c_proj.detached();
                    Block {
                        ln_1: ln(&b.ln_1),
                        attn,
                        ln_2: ln(&b.ln_2),
                        mlp: Mlp {
                            c_fc: b.mlp.c_fc.detached(),
                            c_proj: b.mlp.c_proj.detached(),
                            ..b.mlp.clone()
                        },
                    }
                })
                .collect(),
            ln_f: ln(&self.ln_f),
            cfg: self.cfg.clone(),
            autocast: self.autocast,
            checkpointing: self.checkpointing,
        }
    }

    /// The model with activation checkpointing (`on`) while training on the tape
    /// ([`Gpt::trains_on_tape`]): each block keeps only its input for the backward pass and runs
    /// again when the gradient reaches it ([`gpt_kernels::tape::checkpoint`]). The gradients are
    /// the same, bit for bit; the activations kept shrink from every block's to one block's, for
    /// about one more forward pass of compute. Elsewhere (candle's backward) it changes nothing.
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.checkpointing = on;
        self
    }

    pub fn activation_checkpointing(&self) -> bool {
        self.checkpointing
    }

    /// The model as inference holds it: on the CPU with f32 activations, every weight matrix
    /// (the linear layers and the tied LM head) packed for [`gpt_kernels::PackedMatrix`]'s kernel
    /// in f32; elsewhere each linear layer's weight in contiguous `(out, in)` memory (GPT-2
    /// checkpoints store `(in, out)`). For loaded models only: training keeps its variables as
    /// created.
    pub fn into_inference_layout(self) -> Result<Self> {
        let format = match self.dtype() {
            DType::F32 if self.device().is_cpu() => WeightFormat::F32,
            _ => {
                let mut model = self;
                for conv in model.convs_mut() {
                    if let Weight::Dense(w) = &conv.weight {
                        let w = Weight::Dense(w.contiguous()?);
                        conv.set_weight(w);
                    }
                }
                return Ok(model);
            }
        };
        self.with_weight_format(format)
    }

    /// The model with its weight matrices (every linear layer and the tied LM head, which is also
    /// the token embedding) held in `format` for inference; see [`WeightFormat`]. Biases,
    /// LayerNorms and the position table stay as they are, and so do activations: on the CPU
    /// in f32, with every format packed for [`gpt_kernels::PackedMatrix`] (half-precision weights
    /// widened and quantized blocks scaled in registers). Quantized formats need rows whose
    /// length is a multiple of the format's block (32 for q8_0 and q4_0), and run on the CPU.
    pub fn with_weight_format(mut self, format: WeightFormat) -> Result<Self> {
        if format.ggml().is_some() && !self.device().is_cpu() {
            return Err(Error::InvalidConfig(format!(
                "--dtype {format} runs on the CPU only; use f16 or bf16 on a GPU"
            )));
        }
        let device = self.device().clone();
        for (name, weight) in self.matrices_mut() {
            *weight = weight.converted(format, &name, &device)?;
        }
        Ok(self)
    }

    /// The model with its CPU products at `precision` (see [`MatmulPrecision`]). `High` needs
    /// f32 or bf16 weights packed for the CPU ([`Gpt::into_inference_layout`] on the CPU) and a
    /// CPU with AMX-BF16; it keeps a second copy of every weight matrix (the same bytes again).
    pub fn with_matmul_precision(mut self, precision: MatmulPrecision) -> Result<Self> {
        for (name, weight) in self.matrices_mut() {
            match weight {
                // In place (a loaded model's matrices are not shared: no copy of the f32 panels).
                Weight::Packed(p) => std::sync::Arc::make_mut(p)
                    .set_precision(precision)
                    .map_err(|e| Error::InvalidConfig(format!("--matmul-precision {precision} for `{name}`: {e}")))?,
                Weight::Dense(_) if precision == MatmulPrecision::Highest => {}
                Weight::Dense(_) => {
                    return Err(Error::InvalidConfig(format!(
                        "--matmul-precision {precision} applies to f32 or bf16 weights on the CPU; `{name}` is held \
                         as a {:?} tensor on {:?}",
                        weight.tensor()?.dtype(),
                        self.device()
                    )))
                }
            }
        }
        Ok(self)
    }

    /// Every weight matrix (`(out, in)`) under its checkpoint name: the tied LM head and token
    /// embedding `transformer.wte.weight`, then each block's linear layers. For conversions: the
    /// layers stop using the `(in, out)` tensors they were created with (training's path).
    pub fn matrices_mut(&mut self) -> Vec<(String, &mut Weight)> {
        for conv in self.convs_mut() {
            conv.in_out = None;
        }
        let mut out = vec![("transformer.wte.weight".to_string(), &mut self.wte)];
        for (name, conv) in Self::named_convs_mut(&mut self.blocks) {
            out.push((format!("{name}.weight"), &mut conv.weight));
        }
        out
    }

    /// Each block's linear layers under their names (`transformer.h.0.attn.c_attn`).
    fn named_convs_mut(blocks: &mut [Block]) -> Vec<(String, &mut Conv1D)> {
        let mut out = Vec::new();
        for (i, block) in blocks.iter_mut().enumerate() {
            for (name, conv) in [
                ("attn.c_attn", &mut block.attn.c_attn),
                ("attn.c_proj", &mut block.attn.c_proj),
                ("mlp.c_fc", &mut block.mlp.c_fc),
                ("mlp.c_proj", &mut block.mlp.c_proj),
            ] {
                out.push((format!("transformer.h.{i}.{name}"), conv));
            }
        }
        out
    }

    /// The format of the weight matrices (that of the LM head).
    pub fn weight_format(&self) -> Option<WeightFormat> {
        match &self.wte {
            Weight::Dense(w) => WeightFormat::ALL
                .into_iter()
                .find(|f| f.ggml().is_none() && f.dtype() == w.dtype()),
            Weight::Packed(p) => Some(p.format()),
        }
    }

    /// Adds `adapter`'s low-rank updates to the outputs of the layers it adapts (without
    /// changing their weights), or with `None` removes any. The adapter must be for a model of
    /// this one's shape ([`crate::lora::Adapter::load`] checks it against the config).
    pub fn set_adapter(&mut self, adapter: Option<&crate::lora::Adapter>) -> Result<()> {
        if let Some(adapter) = adapter {
            for (name, _, _) in adapter.config.layers(&self.cfg)? {
                if !adapter.layers.contains_key(&name) {
                    return Err(crate::Error::InvalidConfig(format!(
                        "the adapter has no update for `{name}`"
                    )));
                }
            }
        }
        for (name, conv) in Self::named_convs_mut(&mut self.blocks) {
            conv.lora = adapter.and_then(|a| a.layers.get(&name)).cloned();
        }
        Ok(())
    }

    fn convs_mut(&mut self) -> impl Iterator<Item = &mut Conv1D> {
        self.blocks.iter_mut().flat_map(|b| {
            [
                &mut b.attn.c_attn,
                &mut b.attn.c_proj,
                &mut b.mlp.c_fc,
                &mut b.mlp.c_proj,
            ]
        })
    }

    /// Number of trainable parameters (the tied LM head counted once; neither a sinusoid table
    /// nor the fixed zero biases of `bias: false` counted).
    pub fn num_parameters(&self) -> usize {
        let (v, c) = self.wte.dims();
        let mut n = v * c;
        if self.cfg.position_embedding == PositionEmbedding::Learned {
            n += self.wpe.elem_count();
        }
        let ln = |ln: &LayerNorm| {
            ln.weight().elem_count()
                + if self.cfg.bias {
                    ln.bias().map_or(0, |b| b.elem_count())
                } else {
                    0
                }
        };
        n += ln(&self.ln_f);
        for b in &self.blocks {
            n += ln(&b.ln_1) + ln(&b.ln_2);
            for conv in [&b.attn.c_attn, &b.attn.c_proj, &b.mlp.c_fc, &b.mlp.c_proj] {
                let (out, inp) = conv.weight.dims();
                n += out * inp + if self.cfg.bias { out } else { 0 };
            }
        }
        n
    }
}
