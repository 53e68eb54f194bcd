//! The building blocks that the network and its attention share: GPT-2's `Conv1D` linear layer,
//! LayerNorm, dropout, and the precision of the matrix products (autocast).

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Module, Tensor};
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

/// A weight matrix `W` of shape `(out, in)` (PyTorch's `Linear` order), applied as `x @ W^T`.
#[derive(Debug, Clone)]
pub enum Weight {
    /// A tensor: while training, a transposed view of GPT-2's `(in, out)` variable; for
    /// inference, contiguous `(out, in)` memory ([`crate::Gpt::into_inference_layout`]), in f32,
    /// f16 or bf16.
    Dense(Tensor),
    /// GGML blocks (q8_0, q4_0, ...), multiplied by candle's quantized kernels. Inference only.
    Quantized(Arc<QTensor>),
}

impl Weight {
    /// `x @ W^T` for `x` `(rows, in)`, under `autocast` for dense weights.
    pub fn forward(&self, x: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => matmul_wt(x, w, autocast),
            Self::Quantized(q) => x.contiguous()?.apply_op1_no_bwd(q.as_ref()),
        }
    }

    /// `W` as a tensor `(out, in)` in `dtype` (dequantized if quantized).
    pub fn dense(&self, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => w.to_dtype(dtype),
            Self::Quantized(q) => q.dequantize(&q.device())?.to_dtype(dtype),
        }
    }

    /// The dense tensor as held, or the dequantized weights in f32.
    pub fn tensor(&self) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => Ok(w.clone()),
            q => q.dense(DType::F32),
        }
    }

    pub fn dims(&self) -> (usize, usize) {
        let dims = match self {
            Self::Dense(w) => w.dims().to_vec(),
            Self::Quantized(q) => q.shape().dims().to_vec(),
        };
        (dims[0], dims[1])
    }

    /// Rows `ids` of `W` in `dtype`: the token embedding lookup of a tied LM head.
    pub fn rows(&self, ids: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => w.embedding(ids)?.to_dtype(dtype),
            Self::Quantized(q) => q.embedding(ids)?.to_dtype(dtype),
        }
    }

    /// The weight held in `format` for inference (see [`WeightFormat`]), from this one.
    pub fn converted(&self, format: WeightFormat, name: &str) -> crate::Result<Self> {
        let w = self.dense(DType::F32)?.contiguous()?;
        Ok(match format.ggml() {
            Some(ggml) => {
                let block = ggml.block_size();
                let (_, d_in) = self.dims();
                if !d_in.is_multiple_of(block) {
                    return Err(crate::Error::InvalidConfig(format!(
                        "cannot store `{name}` as {format}: its rows have {d_in} values, not a multiple of the \
                         format's block of {block}"
                    )));
                }
                Self::Quantized(Arc::new(QTensor::quantize(&w, ggml)?))
            }
            None => Self::Dense(w.to_dtype(format.dtype())?),
        })
    }
}

/// `x @ w^T` for a 2-D `w` `(out, in)`. On the CPU, with f32 activations and `w` in contiguous
/// `(out, in)` memory and not being trained, this is [`crate::ops::matmul_wt`]: weights read at
/// the machine's bandwidth, half-precision weights widened in registers. Elsewhere candle's
/// matmul, under `autocast`.
pub fn matmul_wt(x: &Tensor, w: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
    // Every row count takes the kernel, prefill too (128 tokens: 413 tokens/s, candle's gemm
    // 428): its results do not depend on the batch, so cached prefixes and batching change no
    // answer.
    if x.device().is_cpu()
        && x.dtype() == DType::F32
        && x.rank() == 2
        && w.is_contiguous()
        && !w.track_op()
        && autocast == Autocast::Off
    {
        return crate::ops::matmul_wt(x, w);
    }
    if x.dtype() != w.dtype() && autocast == Autocast::Off {
        return x.matmul(&w.to_dtype(x.dtype())?.t()?);
    }
    matmul(x, &w.t()?, autocast)
}

/// How inference holds the weight matrices (the linear layers and the tied LM head); biases,
/// LayerNorms and activations stay in the model's dtype. `f16` and `bf16` halve the bytes a
/// decode step reads, `q8_0` (8-bit, blocks of 32 with an f16 scale: 8.5 bits per weight) and
/// `q4_0` (4.5 bits) quarter and eighth them, using candle's quantized CPU kernels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WeightFormat {
    #[default]
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
}

impl WeightFormat {
    pub const ALL: [Self; 5] = [Self::F32, Self::F16, Self::Bf16, Self::Q8_0, Self::Q4_0];

    /// The GGML block type, for the quantized formats.
    pub fn ggml(self) -> Option<GgmlDType> {
        match self {
            Self::Q8_0 => Some(GgmlDType::Q8_0),
            Self::Q4_0 => Some(GgmlDType::Q4_0),
            _ => None,
        }
    }

    /// The tensor dtype of the dense formats (f32 for the quantized ones, their compute type).
    pub fn dtype(self) -> DType {
        match self {
            Self::F16 => DType::F16,
            Self::Bf16 => DType::BF16,
            _ => DType::F32,
        }
    }

    pub fn from_ggml(dtype: GgmlDType) -> Option<Self> {
        match dtype {
            GgmlDType::F32 => Some(Self::F32),
            GgmlDType::F16 => Some(Self::F16),
            GgmlDType::BF16 => Some(Self::Bf16),
            GgmlDType::Q8_0 => Some(Self::Q8_0),
            GgmlDType::Q4_0 => Some(Self::Q4_0),
            _ => None,
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
        })
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        Self::ALL.into_iter().find(|f| f.to_string() == s).ok_or_else(|| {
            crate::Error::InvalidConfig(format!(
                "unknown weight format `{s}`: expected f32, f16, bf16, q8_0 or q4_0"
            ))
        })
    }
}

/// GPT-2's `Conv1D`: a linear layer whose weight is `(in, out)` in checkpoints. candle-nn's
/// `Linear` stores `(out, in)`; keeping GPT-2's variable shape means checkpoints load and save
/// without transposes, and the layer sees it as `(out, in)` through a transposed view (see
/// [`Weight`]).
#[derive(Debug, Clone)]
pub struct Conv1D {
    pub(crate) weight: Weight, // (out, in)
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
            weight: Weight::Dense(weight.t()?),
            bias,
            autocast: Autocast::Off,
        })
    }

    /// GPT-2's `(in, out)` weight (dequantized to f32 if quantized).
    pub fn weight_in_out(&self) -> candle_core::Result<Tensor> {
        self.weight.tensor()?.t()
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
    /// Dense weights only (the training path).
    pub fn forward_cols(&self, x: &Tensor, start: usize, len: usize) -> candle_core::Result<Tensor> {
        let part = match &self.weight {
            Weight::Dense(w) => Weight::Dense(w.narrow(0, start, len)?),
            Weight::Quantized(_) => candle_core::bail!("forward_cols: the weight is quantized"),
        };
        linear(x, &part, &self.bias.narrow(0, start, len)?, self.autocast)
    }
}

/// `(.., in)` → `(.., out)`, as one 2-D matmul over all leading dimensions.
fn linear(x: &Tensor, weight: &Weight, bias: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let d_in = dims.pop().unwrap_or(0);
    let rows: usize = dims.iter().product();
    let y = weight.forward(&x.reshape((rows, d_in))?, autocast)?; // (rows, out)
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
