//! The building blocks that the network and its attention share: GPT-2's `Conv1D` linear layer,
//! LayerNorm, dropout, and the precision of the matrix products (autocast).

use candle_core::{Module, Tensor};
use candle_nn::{Init, LayerNorm, VarBuilder};

use crate::config::Config;

/// The matrix products of [`crate::Gpt::forward_t`] (projections, attention scores and values,
/// LM head) in f32, or as `torch.autocast(dtype=torch.bfloat16)`: f32 operands cast to bf16,
/// multiplied (tensor cores on a GPU), the product returned in f32; parameters, gradients,
/// LayerNorm, softmax, GELU and the loss stay f32. A setting of the model
/// ([`crate::Gpt::with_autocast`]); `gpt-train --dtype bf16` sets it. (No f16: without loss
/// scaling its gradients underflow.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Autocast {
    #[default]
    Off,
    Bf16,
}

/// `a @ b`, under `autocast`; differentiable.
pub fn matmul(a: &Tensor, b: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
    match autocast {
        Autocast::Bf16 if a.dtype() == candle_core::DType::F32 => a
            .to_dtype(candle_core::DType::BF16)?
            .matmul(&b.to_dtype(candle_core::DType::BF16)?)?
            .to_dtype(candle_core::DType::F32),
        _ => a.matmul(b),
    }
}

/// GPT-2's `Conv1D`: a linear layer whose weight is `(in, out)`. candle-nn's `Linear` stores
/// `(out, in)`; keeping GPT-2's shape means checkpoints load and save without transposes. For
/// inference the same `(in, out)` weight may be a transposed view of `(out, in)` memory, see
/// [`crate::Gpt::into_inference_layout`].
#[derive(Debug, Clone)]
pub struct Conv1D {
    pub(crate) weight: Tensor, // (in, out)
    pub(crate) bias: Tensor,   // (out,)
    pub(crate) autocast: Autocast,
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
        Ok(Self {
            weight,
            bias,
            autocast: Autocast::Off,
        })
    }
}

/// A layer's bias: a parameter, or with `bias: false` fixed zeros that are not trained (nanoGPT's
/// bias-free variant; saved as zeros, so the checkpoint keeps GPT-2's layout).
pub(crate) fn bias(vb: VarBuilder, size: usize, cfg: &Config) -> candle_core::Result<Tensor> {
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
            self.autocast,
        )
    }
}

/// `(.., in)` → `(.., out)`, as one 2-D matmul over all leading dimensions.
fn linear(x: &Tensor, weight: &Tensor, bias: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let d_in = dims.pop().unwrap_or(0);
    let rows: usize = dims.iter().product();
    let y = matmul(&x.reshape((rows, d_in))?, weight, autocast)?; // (rows, out)
    let y = crate::ops::add_tiled(&y, bias)?;
    dims.push(bias.dim(0)?);
    y.reshape(dims)
}

impl Module for Conv1D {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        linear(x, &self.weight, &self.bias, self.autocast)
    }
}

/// LayerNorm that uses candle-nn's fused kernel at inference and the differentiable composite
/// when training (the fused kernel has no backward pass).
pub(crate) fn layer_norm(ln: &LayerNorm, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
    match (train, ln.bias()) {
        (true, Some(bias)) => crate::ops::layer_norm(x, ln.weight(), bias, ln.eps() as f32),
        _ => ln.forward(&x.contiguous()?),
    }
}

pub(crate) fn load_layer_norm(vb: VarBuilder, cfg: &Config) -> candle_core::Result<LayerNorm> {
    let weight = vb.get_with_hints(cfg.n_embd, "weight", Init::Const(1.0))?;
    Ok(LayerNorm::new(
        weight,
        bias(vb, cfg.n_embd, cfg)?,
        cfg.layer_norm_epsilon,
    ))
}

/// Training, as opposed to inference: dropout is on, and its masks come from a counter-based
/// generator ([`crate::rng`]) keyed by `key` (the trainer derives it from the run's seed, the step
/// and the micro-batch) and by each dropout's place in the network, and indexed from row
/// `first_row` of the batch (so that a batch split into shards draws the masks of the whole).
/// Reproducible from its key on every device, and after a resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropout {
    pub key: u64,
    pub first_row: usize,
}

impl Dropout {
    /// The masks of one dropout site: sub-key `site` of this one.
    pub fn site(self, site: u64) -> Self {
        Self {
            key: crate::rng::key(&[self.key, site]),
            ..self
        }
    }
}

/// Dropout while training (`train` is `Some`), and only when it drops anything.
pub(crate) fn dropout(x: Tensor, p: f32, train: Option<Dropout>) -> candle_core::Result<Tensor> {
    match train {
        Some(d) if p > 0.0 => crate::ops::dropout(&x, p, d.key, d.first_row),
        _ => Ok(x),
    }
}
