//! What training asks of the network beyond the forward pass: the loss (the LM head and the
//! cross-entropy fused on the CPU), whether its backward pass can run on the tape, mixed
//! precision, activation checkpointing, and a detached copy for passes that take no gradient.

use candle_core::{DType, Tensor};
use candle_nn::LayerNorm;

use super::{Block, Gpt, Mlp};
use crate::config::Activation;
use crate::error::Result;
use crate::layers::{Autocast, Dropout, Weight};

impl Gpt {
    /// Whether [`Gpt::loss`]'s backward pass can run on a tape ([`gpt_kernels::tape::record`],
    /// then [`gpt_kernels::tape::Tape::backward`]) instead of candle's `backward`: the fused path
    /// in f32 (dense weights), with GPT-2's GELU, or the other families' layers where they run
    /// as rows on the CPU ([`Gpt::family_runs_on_rows`]); on a CUDA GPU, with `GPT_CUDA_TAPE=1`
    /// ([`gpt_kernels::cuda_tape`]), also f32 products (no autocast), no LoRA adapter, heads the
    /// GPU's attention kernel takes, and windows that are not packed ([`Gpt::loss`], not
    /// [`Gpt::loss_at`]: the kernel has no segments). Elsewhere the forward pass runs candle ops
    /// that the tape does not record (its backward pass would refuse them). `GPT_CPU_TAPE=0` in
    /// the environment turns it off on the CPU, to compare.
    pub fn trains_on_tape(&self) -> bool {
        let on_cpu = || self.device().is_cpu() && gpt_kernels::tape::enabled();
        let on_gpu = || {
            let head_dim = self.cfg.n_embd / self.cfg.n_head.max(1);
            self.device().is_cuda()
                && gpt_kernels::cuda_tape()
                && self.autocast == Autocast::Off
                && !self.has_adapter()
                && gpt_kernels::window_attention_runs_on(self.ln_f.weight(), head_dim)
        };
        // The other families: on the CPU, as rows at every window length up to the context,
        // logits that are not soft-capped (candle's ops outside the fused head and loss), and no
        // adapter (their stacked updates are made of the layers' matrices by candle's ops,
        // outside the pass: `Adapter::restack`).
        let family = || {
            on_cpu()
                && self.family_runs_on_rows(self.cfg.n_positions)
                && self.cfg.variant.final_softcap.is_none()
                && !self.has_adapter()
        };
        let gpt2 = || {
            (on_cpu() || on_gpu()) && self.cfg.is_gpt2_shaped() && self.cfg.activation_function == Activation::GeluNew
        };
        gpt_kernels::fused(self.ln_f.weight())
            && (gpt2() || family())
            && matches!(&self.wte, Weight::Dense(w) if w.dtype() == DType::F32)
            && self.matrices_are_dense()
    }

    /// Whether every block's matrix is a tensor (a base held packed or quantized under a QLoRA
    /// adapter trains on candle's ops: its products are not tape ops).
    fn matrices_are_dense(&self) -> bool {
        (self.blocks.iter())
            .flat_map(|b| [&b.attn.c_attn, &b.attn.c_proj, &b.mlp.c_fc, &b.mlp.c_proj])
            .all(|c| matches!(c.weight, Weight::Dense(_)))
    }

    /// Whether any layer carries a LoRA adapter.
    fn has_adapter(&self) -> bool {
        (self.blocks.iter())
            .flat_map(|b| [&b.attn.c_attn, &b.attn.c_proj, &b.mlp.c_fc, &b.mlp.c_proj])
            .any(|c| c.lora.is_some())
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
        match self.head() {
            _ if self.cfg.variant.final_softcap.is_some() => {
                let logits = self.head_logits(&hidden)?.to_dtype(DType::F32)?; // (B*T, V)
                Ok(gpt_kernels::cross_entropy(&logits, &targets, eps)?)
            }
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
            // On a GPU, the LM head and the loss are candle's ops, one entry on a recording
            // tape (their backward candle's).
            Weight::Dense(w) => Ok(gpt_kernels::tape::candle_ops(&[&hidden, w], |a| {
                let logits = Weight::Dense(a[1].clone())
                    .forward(&a[0], self.autocast)?
                    .to_dtype(DType::F32)?; // (B*T, V)
                gpt_kernels::cross_entropy(&logits, &targets, eps)
            })?),
            _ => {
                let logits = self.head().forward(&hidden, self.autocast)?.to_dtype(DType::F32)?; // (B*T, V)
                Ok(gpt_kernels::cross_entropy(&logits, &targets, eps)?)
            }
        }
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
            wpe: self.wpe.as_ref().map(Tensor::detach),
            lm_head: self.lm_head.as_ref().map(Weight::detached),
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
                        post_norms: b.post_norms.as_ref().map(|(a, m)| (ln(a), ln(m))),
                    }
                })
                .collect(),
            ln_f: ln(&self.ln_f),
            cfg: self.cfg.clone(),
            autocast: self.autocast,
            checkpointing: self.checkpointing,
            kv_dtype: self.kv_dtype,
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
}
