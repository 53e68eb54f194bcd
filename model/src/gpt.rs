//! The GPT-2 network (Radford et al., 2019, "Language Models are Unsupervised Multitask
//! Learners"): token + position embeddings, `n_layer` pre-LayerNorm blocks of causal
//! self-attention and a GELU MLP with residuals, a final LayerNorm and an LM head tied to the
//! token embedding. Layer names follow `transformers`' `GPT2LMHeadModel`, so `vb.pp(..)` paths
//! are the checkpoint's tensor names.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, LayerNorm, VarBuilder};

use crate::attention::{CausalSelfAttention, KvCache};
use crate::config::{Activation, Config, PositionEmbedding};
use crate::error::{Error, Result};

/// GPT-2's `Conv1D`: a linear layer whose weight is stored `(in, out)`. candle-nn's `Linear`
/// stores `(out, in)`; keeping GPT-2's layout means checkpoints load and save without transposes.
#[derive(Debug, Clone)]
pub struct Conv1D {
    weight: Tensor, // (in, out)
    bias: Tensor,   // (out,)
}

impl Conv1D {
    pub fn load(vb: VarBuilder, d_in: usize, d_out: usize, cfg: &Config) -> candle_core::Result<Self> {
        Self::load_with_std(vb, d_in, d_out, 0.02, cfg)
    }

    pub(crate) fn load_with_std(
        vb: VarBuilder,
        d_in: usize,
        d_out: usize,
        stdev: f64,
        cfg: &Config,
    ) -> candle_core::Result<Self> {
        let weight = vb.get_with_hints((d_in, d_out), "weight", Init::Randn { mean: 0.0, stdev })?;
        let bias = bias(vb, d_out, cfg)?;
        Ok(Self { weight, bias })
    }
}

/// A layer's bias: a parameter, or with `bias: false` fixed zeros that are not trained (nanoGPT's
/// bias-free variant; saved as zeros, so the checkpoint keeps GPT-2's layout).
fn bias(vb: VarBuilder, size: usize, cfg: &Config) -> candle_core::Result<Tensor> {
    if cfg.bias {
        vb.get_with_hints(size, "bias", Init::Const(0.0))
    } else {
        Tensor::zeros(size, vb.dtype(), vb.device())
    }
}

impl Conv1D {
    /// Output columns `start..start + len` only: `x @ W[:, cols] + b[cols]`. Splitting the
    /// weight rather than the output keeps the backward pass's zero-padding at weight size.
    pub fn forward_cols(&self, x: &Tensor, start: usize, len: usize) -> candle_core::Result<Tensor> {
        linear(
            x,
            &self.weight.narrow(1, start, len)?,
            &self.bias.narrow(0, start, len)?,
        )
    }
}

/// `(.., in)` → `(.., out)`, as one 2-D matmul over all leading dimensions.
fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let d_in = dims.pop().unwrap_or(0);
    let rows: usize = dims.iter().product();
    let y = crate::ops::matmul(&x.reshape((rows, d_in))?, weight)?; // (rows, out)
    let y = crate::ops::add_tiled(&y, bias)?;
    dims.push(bias.dim(0)?);
    y.reshape(dims)
}

impl Module for Conv1D {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        linear(x, &self.weight, &self.bias)
    }
}

/// LayerNorm that uses candle-nn's fused kernel at inference and the differentiable composite
/// when training (the fused kernel has no backward pass).
fn layer_norm(ln: &LayerNorm, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
    match (train, ln.bias()) {
        (true, Some(bias)) => crate::ops::layer_norm(x, ln.weight(), bias, ln.eps() as f32),
        _ => ln.forward(&x.contiguous()?),
    }
}

fn load_layer_norm(vb: VarBuilder, cfg: &Config) -> candle_core::Result<LayerNorm> {
    let weight = vb.get_with_hints(cfg.n_embd, "weight", Init::Const(1.0))?;
    Ok(LayerNorm::new(
        weight,
        bias(vb, cfg.n_embd, cfg)?,
        cfg.layer_norm_epsilon,
    ))
}

/// Dropout in training only, and only when it drops anything (candle's draws a mask even at 0).
pub(crate) fn dropout(x: Tensor, p: f32, train: bool) -> candle_core::Result<Tensor> {
    if train && p > 0.0 {
        candle_nn::ops::dropout(&x, p)
    } else {
        Ok(x)
    }
}

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

    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = self.c_fc.forward(x)?; // (.., 4C)
        let h = match self.activation {
            Activation::GeluNew => crate::ops::gelu(&h)?, // tanh approximation
            Activation::Gelu => h.gelu_erf()?,
            Activation::Relu => h.relu()?,
        };
        dropout(self.c_proj.forward(&h)?, self.resid_pdrop, train) // (.., C)
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

    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let x = (x + self.attn.forward_t(&layer_norm(&self.ln_1, x, train)?, train)?)?;
        &x + self.mlp.forward_t(&layer_norm(&self.ln_2, &x, train)?, train)?
    }

    fn forward_packed(
        &self,
        x: &Tensor,
        lens: &[usize],
        caches: &mut [&mut candle_nn::kv_cache::KvCache],
    ) -> candle_core::Result<Tensor> {
        let x = (x + self
            .attn
            .forward_packed(&layer_norm(&self.ln_1, x, false)?, lens, caches)?)?;
        &x + self.mlp.forward_t(&layer_norm(&self.ln_2, &x, false)?, false)?
    }
}

/// One sequence's part in a batched generation step: its new tokens and its cache.
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

/// Which positions of a generation step get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// The last new token of each sequence: `(n_seqs, vocab)`. What sampling needs.
    Last,
    /// Every new token, sequences in order: `(Σ new tokens, vocab)`.
    All,
}

#[derive(Debug, Clone)]
pub struct Gpt {
    wte: Tensor, // (V, C), also the LM head
    wpe: Tensor, // (n_positions, C), learned or the fixed sinusoid table
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    cfg: Config,
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
            wte,
            wpe,
            blocks,
            ln_f,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.wte.device()
    }

    pub fn dtype(&self) -> DType {
        self.wte.dtype()
    }

    /// A fresh cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.cfg)
    }

    /// Logits for every position of `idx` `(B, T)` → `(B, T, V)`, no cache. `train` enables
    /// dropout and the differentiable paths; use it when gradients are needed.
    pub fn forward_t(&self, idx: &Tensor, train: bool) -> Result<Tensor> {
        let (b_sz, seq_len) = idx.dims2()?;
        if seq_len > self.cfg.n_positions {
            return Err(Error::ContextOverflow {
                needed: seq_len,
                max: self.cfg.n_positions,
            });
        }
        let tok = self
            .wte
            .index_select(&idx.flatten_all()?, 0)?
            .reshape((b_sz, seq_len, self.cfg.n_embd))?; // (B, T, C)
        let pos = self.wpe.narrow(0, 0, seq_len)?; // (T, C)
        let mut x = dropout(crate::ops::add_tiled(&tok, &pos)?, self.cfg.embd_pdrop, train)?;
        for block in &self.blocks {
            x = block.forward_t(&x, train)?; // (B, T, C)
        }
        let x = layer_norm(&self.ln_f, &x, train)?;
        let logits = crate::ops::matmul(&x.reshape((b_sz * seq_len, self.cfg.n_embd))?, &self.wte.t()?)?; // (B*T, V)
        Ok(logits.reshape((b_sz, seq_len, self.cfg.vocab_size))?)
    }

    /// Inference logits `(B, T, V)` in f32 for whole windows.
    pub fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        Ok(self.forward_t(idx, false)?.to_dtype(DType::F32)?)
    }

    /// One generation step for several sequences at once, each with its own cache and length.
    /// The new tokens of all sequences are packed into one matrix, so the projections, the MLP
    /// and the LM head run once per step; attention runs per sequence against its cache. Each
    /// cache grows by its sequence's new tokens. Returns f32 logits, see [`LogitsFor`].
    ///
    /// Every input is checked before any cache is touched: on error no cache has changed.
    pub fn forward_step(&self, seqs: &mut [SeqStep<'_>], which: LogitsFor) -> Result<Tensor> {
        if seqs.is_empty() {
            return Err(Error::EmptyInput("no sequences in the step"));
        }
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        for seq in seqs.iter() {
            if seq.tokens.is_empty() {
                return Err(Error::EmptyInput("a sequence has no new tokens"));
            }
            let needed = seq.cache.len() + seq.tokens.len();
            if needed > self.cfg.n_positions {
                return Err(Error::ContextOverflow {
                    needed,
                    max: self.cfg.n_positions,
                });
            }
            if let Some(&id) = seq.tokens.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
                return Err(Error::TokenOutOfVocab {
                    id,
                    vocab_size: self.cfg.vocab_size,
                });
            }
            ids.extend_from_slice(seq.tokens);
            positions.extend((seq.cache.len()..needed).map(|p| p as u32));
        }
        let lens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let n_rows = ids.len();
        let device = self.device();
        let ids = Tensor::from_vec(ids, n_rows, device)?;
        let positions = Tensor::from_vec(positions, n_rows, device)?;
        let mut x = (self.wte.embedding(&ids)? + self.wpe.embedding(&positions)?)?; // (N, C)
        for (layer, block) in self.blocks.iter().enumerate() {
            let mut caches: Vec<_> = seqs.iter_mut().map(|s| s.cache.layer(layer)).collect();
            x = block.forward_packed(&x, &lens, &mut caches)?; // (N, C)
        }
        for (seq, &len) in seqs.iter_mut().zip(&lens) {
            seq.cache.advance(len);
        }
        let x = match which {
            LogitsFor::All => x,
            LogitsFor::Last => {
                let last: Vec<u32> = lens
                    .iter()
                    .scan(0, |end, &len| {
                        *end += len;
                        Some(*end as u32 - 1)
                    })
                    .collect();
                x.index_select(&Tensor::new(last, device)?, 0)? // (n_seqs, C)
            }
        };
        let x = layer_norm(&self.ln_f, &x, false)?;
        Ok(x.matmul(&self.wte.t()?)?.to_dtype(DType::F32)?) // (rows, V)
    }

    /// The weights under `transformers`' names (`transformer.` prefix, as `save_pretrained`
    /// writes them; the tied LM head is not stored separately).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            ("transformer.wte.weight".to_string(), self.wte.clone()),
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
                out.push((format!("{p}.{name}.weight"), conv.weight.clone()));
                out.push((format!("{p}.{name}.bias"), conv.bias.clone()));
            }
        }
        out
    }

    /// Number of trainable parameters (the tied LM head counted once; neither a sinusoid table
    /// nor the fixed zero biases of `bias: false` counted).
    pub fn num_parameters(&self) -> usize {
        let sinusoidal = self.cfg.position_embedding == PositionEmbedding::Sinusoidal;
        self.named_tensors()
            .iter()
            .filter(|(name, _)| !(sinusoidal && name.ends_with("wpe.weight")))
            .filter(|(name, _)| self.cfg.bias || !name.ends_with(".bias"))
            .map(|(_, t)| t.elem_count())
            .sum()
    }
}
