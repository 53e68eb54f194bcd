//! The building blocks that the network and its attention share: GPT-2's `Conv1D` linear layer,
//! LayerNorm, dropout, and the precision of the matrix products (autocast).

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{Init, LayerNorm, VarBuilder};

use crate::config::Config;
use gpt_kernels::{PackedMatrix, WeightFormat};

pub use gpt_kernels::Autocast;

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
    /// A tensor: while training, a transposed view of GPT-2's `(in, out)` variable; for inference
    /// on a GPU, contiguous `(out, in)` memory ([`crate::Gpt::into_inference_layout`]).
    Dense(Tensor),
    /// Packed for the CPU's inference kernel ([`PackedMatrix`]), in any [`WeightFormat`].
    Packed(Arc<PackedMatrix>),
    /// A llama.cpp block format the packed kernel has no form for (Q5_K, Q6_K), multiplied by
    /// candle's quantized matrices (`QMatMul`), as stored.
    Quant(Arc<candle_core::quantized::QTensor>),
    /// A llama.cpp block format held as the codes of one the packed kernel has, with the same
    /// values (Q4_K's to within a 256th of a quantization step): Q4_1 as Q4_0 (a Q4_1 block's `d·q + m` is Q4_0's `d·(q − 8)` of the same codes and
    /// scale plus the block's offset `m + 8d`), Q5_0 as Q8_0 (`d·(q − 16)`: the same scale, each
    /// code widened to a byte), Q5_1 as Q8_0 plus the offset `m + 16d`; Q4_K as Q4_0 with an
    /// offset per sub-block, its scales rounded to f16 (`llamacpp::q4k_codes`). `x Wᵀ` is the codes'
    /// product plus `(Σ of x over each block) · offsetsᵀ`, a product 32 times narrower. Q5's
    /// blocks of 32 take 34 bytes instead of 22 or 24. (candle's own products of these formats
    /// ran at a quarter of llama.cpp's decode rate and a twentieth of its prefill's,
    /// `BENCHMARKS.md`.)
    Recoded {
        codes: Arc<PackedMatrix>,
        /// Each block's offset per output (none: Q5_0), in the order the product's tasks read
        /// them: Q4_1's and Q5_1's as each block's f16 minimum `m` ([`PackedMatrix::group_mins`]),
        /// Q4_K's as f32 offsets ([`PackedMatrix::group_offsets`]);
        /// [`PackedMatrix::offsets_by_block`] gives them back as f32 `(in / 32, out)`.
        offsets: Option<Tensor>,
        /// The format the values came in (and go back out in: `gpt::gguf`).
        stored: candle_core::quantized::GgmlDType,
    },
}

/// `x Wᵀ` for a frozen weight held packed or quantized, differentiable in `x` (`dx = dy W`,
/// [`Weight::input_gradient`]): an adapter trains on a base left in its block format, as QLoRA
/// trains on a 4-bit base, holding the base's bytes rather than an f32 copy four to eight times
/// larger. The products are the inference kernels' (activations to int8 where the weights are
/// quantized, as llama.cpp's); the gradient's are f32 on the dequantized values.
struct FrozenProduct(Weight);

impl candle_core::CustomOp1 for FrozenProduct {
    fn name(&self) -> &'static str {
        "frozen-product"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        if let Weight::Packed(p) = &self.0 {
            return candle_core::CustomOp1::cpu_fwd(&**p, storage, layout);
        }
        let x = gpt_kernels::f32_slice(storage, layout, "frozen-product")?;
        let x = Tensor::from_slice(x, layout.shape(), &Device::Cpu)?;
        let y = self.0.forward_frozen(&x)?;
        let shape = y.shape().clone();
        Ok((candle_core::CpuStorage::F32(y.flatten_all()?.to_vec1::<f32>()?), shape))
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.0.input_gradient(dy).map(Some)
    }
}

/// `offsets_t` `(blocks, rows)` as the `(rows, blocks * 32)` values it adds: each block's offset
/// over its 32 positions.
fn spread_offsets(offsets_t: &Tensor) -> candle_core::Result<Tensor> {
    let (blocks, rows) = offsets_t.dims2()?;
    offsets_t
        .t()?
        .unsqueeze(2)?
        .broadcast_as((rows, blocks, 32))?
        .contiguous()?
        .reshape((rows, blocks * 32))
}

impl Weight {
    /// The same weight, detached from gradient tracking.
    pub(crate) fn detached(&self) -> Self {
        match self {
            Self::Dense(w) => Self::Dense(w.detach()),
            other => other.clone(),
        }
    }

    /// `x @ W^T` for `x` `(rows, in)`, under `autocast` for dense weights. Differentiable in `x`
    /// for every form (a frozen packed or quantized base under a training adapter: QLoRA).
    pub fn forward(&self, x: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => matmul_wt(x, w, autocast),
            _ if x.track_op() => x.apply_op1(FrozenProduct(self.clone())),
            _ => self.forward_frozen(x),
        }
    }

    /// [`Self::forward`] of a packed or quantized weight, not differentiable.
    fn forward_frozen(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => matmul_wt(x, w, Autocast::Off),
            Self::Packed(p) => p.matmul(x),
            Self::Quant(q) => candle_core::quantized::QMatMul::from_arc(q.clone())?.forward(&x.contiguous()?),
            // The offsets' product in the same pass, each task adding its columns' terms.
            Self::Recoded { codes, offsets, .. } => match offsets {
                Some(offsets) => codes.matmul_offsets(x, offsets),
                None => codes.matmul(x),
            },
        }
    }

    /// `dy W` for `dy` `(rows, out)`: the gradient of `x Wᵀ` with respect to `x`, without a
    /// dense copy of a packed `W` (dequantized a few hundred rows at a time; candle's quantized
    /// matrices, the k-quants, dequantized whole for the product, one layer at a time).
    pub(crate) fn input_gradient(&self, dy: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => dy.matmul(&w.to_dtype(dy.dtype())?),
            Self::Packed(p) => p.input_gradient(dy),
            Self::Quant(q) => dy.matmul(&q.dequantize(&q.device())?),
            Self::Recoded { codes, offsets, .. } => {
                let dx = codes.input_gradient(dy)?; // (N, in)
                let Some(offsets) = offsets else { return Ok(dx) };
                // Each block's offset adds `dy · offsetsᵀ` to its 32 inputs' gradients.
                let (n, k) = dx.dims2()?;
                let per_block = dy.matmul(&codes.offsets_by_block(offsets)?.t()?)?; // (N, in / 32)
                dx + per_block.unsqueeze(2)?.broadcast_as((n, k / 32, 32))?.reshape((n, k))?
            }
        }
    }

    /// `W` as a tensor `(out, in)` in `dtype` (dequantized if quantized).
    pub fn dense(&self, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => w.to_dtype(dtype),
            Self::Packed(p) => p.dense()?.to_dtype(dtype),
            Self::Quant(q) => q.dequantize(&q.device())?.to_dtype(dtype),
            Self::Recoded { codes, offsets, .. } => match offsets {
                Some(offsets) => (codes.dense()? + spread_offsets(&codes.offsets_by_block(offsets)?)?)?.to_dtype(dtype),
                None => codes.dense()?.to_dtype(dtype),
            },
        }
    }

    /// The weights as a tensor in their own dtype (f32 for the quantized formats, dequantized).
    pub fn tensor(&self) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => Ok(w.clone()),
            Self::Packed(p) => self.dense(p.format().dtype()),
            Self::Quant(_) | Self::Recoded { .. } => self.dense(DType::F32),
        }
    }

    /// Bytes held: the tensor's, the packed panels', the quantized blocks' (and offsets').
    pub fn bytes(&self) -> usize {
        match self {
            Self::Dense(w) => w.elem_count() * w.dtype().size_in_bytes(),
            Self::Packed(p) => p.size_in_bytes(),
            Self::Quant(q) => q.storage_size_in_bytes(),
            Self::Recoded { codes, offsets, .. } => {
                codes.size_in_bytes()
                    + offsets
                        .as_ref()
                        .map_or(0, |o| o.elem_count() * o.dtype().size_in_bytes())
            }
        }
    }

    pub fn dims(&self) -> (usize, usize) {
        match self {
            Self::Dense(w) => {
                let dims = w.dims();
                (dims[0], dims[1])
            }
            Self::Packed(p) => p.dims(),
            Self::Quant(q) => {
                let dims = q.shape().dims();
                (dims[0], dims.get(1).copied().unwrap_or(1))
            }
            Self::Recoded { codes, .. } => codes.dims(),
        }
    }

    /// Rows `ids` (1-D) of `W` in `dtype`: the token embedding of a tied LM head.
    pub fn rows(&self, ids: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(w) => gpt_kernels::tape::embedding(w, ids)?.to_dtype(dtype),
            Self::Packed(p) => p.rows(&ids.to_vec1::<u32>()?)?.to_dtype(dtype),
            Self::Quant(q) => q.embedding(ids)?.to_dtype(dtype),
            Self::Recoded { codes, offsets, .. } => {
                let ids = ids.to_vec1::<u32>()?;
                let rows = codes.rows(&ids)?;
                match offsets {
                    Some(offsets) => {
                        let picked = codes.offsets_of_rows(offsets, &ids)?.t()?; // (in / 32, n)
                        (rows + spread_offsets(&picked)?)?.to_dtype(dtype)
                    }
                    None => rows.to_dtype(dtype),
                }
            }
        }
    }

    /// The weight held in `format` for inference on `device` (see [`WeightFormat`]): packed on
    /// the CPU, a dense tensor elsewhere (quantized formats: the CPU only).
    pub fn converted(&self, format: WeightFormat, name: &str, device: &Device) -> crate::Result<Self> {
        if let Some(ggml) = format.ggml() {
            let (_, d_in) = self.dims();
            if !d_in.is_multiple_of(ggml.block_size()) {
                return Err(crate::Error::InvalidConfig(format!(
                    "cannot store `{name}` as {format}: its rows have {d_in} values, not a multiple of the \
                     format's block of {}",
                    ggml.block_size()
                )));
            }
        }
        if device.is_cpu() {
            return Ok(Self::Packed(Arc::new(PackedMatrix::from_dense(
                &self.dense(DType::F32)?,
                format,
            )?)));
        }
        if format.ggml().is_some() {
            return Err(crate::Error::InvalidConfig(format!(
                "{format} weights run on the CPU only"
            )));
        }
        Ok(Self::Dense(self.dense(format.dtype())?.contiguous()?))
    }
}

/// `x @ w^T` for a 2-D `w` `(out, in)` with candle's matmul, under `autocast`: training, and
/// inference off the CPU (where weights are [`Weight::Packed`]).
fn matmul_wt(x: &Tensor, w: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
    // f32 on the CPU: the packed kernel or bf16 products, forward and backward
    // (`ops::linear_product`).
    if x.device().is_cpu() && gpt_kernels::fused(x) && w.dtype() == DType::F32 && x.rank() == 2 {
        return gpt_kernels::linear_product(x, w, autocast);
    }
    let w = if x.device().is_cpu() {
        w.clone()
    } else {
        blas_operand(w)?
    };
    if x.dtype() != w.dtype() && autocast == Autocast::Off {
        return x.matmul(&w.to_dtype(x.dtype())?.t()?);
    }
    matmul(x, &w.t()?, autocast)
}

/// `m` as an operand that candle's CUDA matmul accepts: row-major or column-major (its
/// transpose row-major) as it is, else copied row-major. A block of columns of a weight
/// (`Conv1D::forward_cols`: q, k or v of GPT-2's fused `c_attn`) is neither: cuBLAS could take
/// its leading dimension, but candle checks for plain layouts and fails. The copy is a view's
/// `contiguous()`, so its gradient flows back into the variable.
pub(crate) fn blas_operand(m: &Tensor) -> candle_core::Result<Tensor> {
    if m.rank() != 2 || m.is_contiguous() || m.t()?.is_contiguous() {
        return Ok(m.clone());
    }
    m.contiguous()
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
    /// The `(in, out)` tensor as created (the variable, while training), of which `weight` is
    /// the transposed view: the CPU's fused training product ([`gpt_kernels::affine`]) takes it
    /// so that the gradient lands on the variable directly. `None` once `weight` is converted
    /// for inference ([`Conv1D::set_weight`]).
    pub(crate) in_out: Option<Tensor>,
    /// A LoRA adapter's update added to the output ([`crate::Gpt::set_adapter`]).
    pub(crate) lora: Option<crate::lora::LoraLayer>,
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
            in_out: Some(weight),
            lora: None,
        })
    }

    /// A layer from a checkpoint's `(out, in)` weight (PyTorch's `Linear`, as the families other
    /// than GPT-2 store theirs; quantized in a GGUF file) and its bias, for inference.
    pub(crate) fn from_weight(weight: Weight, bias: Tensor) -> Self {
        Self {
            weight,
            bias,
            autocast: Autocast::Off,
            in_out: None,
            lora: None,
        }
    }

    /// Replaces the weight (a conversion for inference), dropping the `(in, out)` tensor it no
    /// longer views.
    pub(crate) fn set_weight(&mut self, weight: Weight) {
        self.weight = weight;
        self.in_out = None;
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
    /// `lora_x`: the LoRA update's input where it differs from `x` ([`Conv1D::lora_input`]).
    pub fn forward_cols(
        &self,
        x: &Tensor,
        start: usize,
        len: usize,
        lora_x: Option<&Tensor>,
    ) -> candle_core::Result<Tensor> {
        let part = match &self.weight {
            Weight::Dense(w) => Weight::Dense(w.narrow(0, start, len)?),
            Weight::Packed(_) | Weight::Quant(_) | Weight::Recoded { .. } => {
                candle_core::bail!("forward_cols: the weight is packed for inference")
            }
        };
        let y = linear(x, &part, &self.bias.narrow(0, start, len)?, self.autocast)?;
        match &self.lora {
            Some(lora) => y + lora.delta(lora_x.unwrap_or(x), Some((start, len)))?,
            None => Ok(y),
        }
    }

    /// The LoRA update's input while training: `x` dropped out with the adapter's
    /// `lora_dropout` (PEFT's placement: `B A dropout(x)`, the base's product on `x` itself),
    /// the masks keyed by `drop` and counted from its row of `x`'s first dimension. `None`
    /// where it is `x`: no adapter, no dropout, or not training.
    pub(crate) fn lora_input(&self, x: &Tensor, drop: Option<Dropout>) -> candle_core::Result<Option<Tensor>> {
        match (&self.lora, drop) {
            (Some(lora), Some(d)) if lora.dropout > 0.0 => {
                Ok(Some(gpt_kernels::dropout(x, lora.dropout, d.key, d.first_row)?))
            }
            _ => Ok(None),
        }
    }
}

/// `(.., in)` → `(.., out)`, as one 2-D matmul over all leading dimensions, then GELU (tanh
/// form) if `gelu`. Packed weights add the bias and apply GELU in the kernel's epilogue (where
/// no gradient is asked of `x`).
fn linear_act(
    x: &Tensor,
    weight: &Weight,
    bias: &Tensor,
    autocast: Autocast,
    gelu: bool,
) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let d_in = dims.pop().unwrap_or(0);
    let rows: usize = dims.iter().product();
    // A reshape is a node of the backward graph even when it changes nothing: none for 2-D.
    let x = if dims.len() == 1 {
        x.clone()
    } else {
        x.reshape((rows, d_in))?
    };
    let y = match weight {
        // The epilogue has no backward pass: under a training adapter the product is
        // `Weight::forward`'s, differentiable in `x`.
        Weight::Packed(p) if !x.track_op() => p.matmul_bias(&x, bias, gelu)?,
        Weight::Recoded { codes, offsets, .. } if !x.track_op() => match offsets {
            Some(offsets) => codes.matmul_offsets_bias(&x, offsets, bias, gelu)?,
            None => codes.matmul_bias(&x, bias, gelu)?,
        },
        _ => {
            let y = gpt_kernels::add_tiled(&weight.forward(&x, autocast)?, bias)?; // (rows, out)
            if gelu {
                gpt_kernels::gelu(&y)?
            } else {
                y
            }
        }
    };
    dims.push(bias.dim(0)?);
    if dims.len() == 2 {
        Ok(y)
    } else {
        y.reshape(dims)
    }
}

fn linear(x: &Tensor, weight: &Weight, bias: &Tensor, autocast: Autocast) -> candle_core::Result<Tensor> {
    linear_act(x, weight, bias, autocast, false)
}

impl Conv1D {
    /// GELU (tanh form) of the layer's output, fused with it where the weight is packed.
    pub fn forward_gelu(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_gelu_t(x, None)
    }

    /// [`Conv1D::forward_gelu`] while training: `drop` keys the LoRA update's input dropout
    /// ([`Conv1D::lora_input`]).
    pub(crate) fn forward_gelu_t(&self, x: &Tensor, drop: Option<Dropout>) -> candle_core::Result<Tensor> {
        let lora_x = self.lora_input(x, drop)?;
        match (self.fused_affine(x, true, lora_x.as_ref()), &self.lora) {
            (Some(y), _) => y,
            (None, Some(lora)) => (linear(x, &self.weight, &self.bias, self.autocast)?
                + lora.delta(lora_x.as_ref().unwrap_or(x), None)?)?
            .gelu(),
            (None, None) => linear_act(x, &self.weight, &self.bias, self.autocast, true),
        }
    }

    /// [`Module::forward`] while training: `drop` keys the LoRA update's input dropout
    /// ([`Conv1D::lora_input`]).
    pub(crate) fn forward_t(&self, x: &Tensor, drop: Option<Dropout>) -> candle_core::Result<Tensor> {
        let lora_x = self.lora_input(x, drop)?;
        match (self.fused_affine(x, false, lora_x.as_ref()), &self.lora) {
            (Some(y), _) => y,
            (None, Some(lora)) => {
                linear(x, &self.weight, &self.bias, self.autocast)? + lora.delta(lora_x.as_ref().unwrap_or(x), None)?
            }
            (None, None) => linear(x, &self.weight, &self.bias, self.autocast),
        }
    }
}

impl Conv1D {
    /// The same layer with every tensor detached from gradient tracking (see
    /// [`crate::Gpt::detached`]).
    pub(crate) fn detached(&self) -> Self {
        Self {
            weight: self.weight.detached(),
            bias: self.bias.detach(),
            autocast: self.autocast,
            in_out: self.in_out.as_ref().map(Tensor::detach),
            lora: self.lora.as_ref().map(crate::lora::LoraLayer::detached),
        }
    }

    /// `x @ W + b`, then GELU if `gelu`, as one fused node ([`gpt_kernels::affine`],
    /// [`gpt_kernels::affine_gelu`]) where it applies: f32, 2-D `x` (the residual stream as
    /// rows), the `(in, out)` tensor at hand; on the CPU products under the layer's autocast and
    /// LoRA updates on the tape too; with `GPT_CUDA_TAPE=1` on a GPU, f32 products (cuBLAS)
    /// without an adapter.
    fn fused_affine(&self, x: &Tensor, gelu: bool, lora_x: Option<&Tensor>) -> Option<candle_core::Result<Tensor>> {
        let on_gpu = || gpt_kernels::cuda_tape() && self.lora.is_none() && self.autocast == Autocast::Off;
        match &self.in_out {
            Some(w)
                if x.rank() == 2
                    && gpt_kernels::fused(x)
                    && (x.device().is_cpu() || on_gpu())
                    && w.dtype() == DType::F32
                    && self.bias.dtype() == DType::F32 =>
            {
                Some(match &self.lora {
                    None if gelu => gpt_kernels::affine_gelu(x, w, &self.bias, self.autocast),
                    None => gpt_kernels::affine(x, w, &self.bias, self.autocast),
                    Some(lora) => self.lora_affine(x, lora_x.unwrap_or(x), w, lora, gelu),
                })
            }
            _ => None,
        }
    }
}

impl Conv1D {
    /// [`Conv1D::fused_affine`] with a LoRA update, every op on the tape: the base's product
    /// (its weight frozen when it is not a variable, as in a LoRA run: no `dW` computed), the
    /// update `s · (lora_x Aᵀ) Bᵀ` as two products, their sum, then GELU if `gelu`.
    fn lora_affine(
        &self,
        x: &Tensor,
        lora_x: &Tensor,
        w: &Tensor,
        lora: &crate::lora::LoraLayer,
        gelu: bool,
    ) -> candle_core::Result<Tensor> {
        let y = if w.is_variable() {
            gpt_kernels::affine(x, w, &self.bias, self.autocast)?
        } else {
            gpt_kernels::frozen_affine(x, w, &self.bias, self.autocast)?
        };
        let low = gpt_kernels::linear_product(lora_x, &lora.a, Autocast::Off)?; // (rows, r)
        let delta = gpt_kernels::scaled_linear_product(&low, &lora.b, lora.scale as f32, Autocast::Off)?;
        let y = gpt_kernels::add_dropout(&y, &delta, 0.0, 0, 0)?;
        if gelu {
            gpt_kernels::gelu(&y)
        } else {
            Ok(y)
        }
    }
}

/// One adapter's update of one layer in a packed step: the rows it applies to (indices into the
/// step's rows, also as a u32 tensor on the model's device) and the adapter's low-rank matrices
/// for this layer.
#[derive(Clone, Copy)]
pub(crate) struct RowUpdate<'a> {
    pub rows: &'a [u32],
    pub ids: &'a Tensor,
    pub lora: &'a crate::lora::LoraLayer,
}

impl Conv1D {
    /// Inference on the packed rows of several sequences, some of them with a LoRA adapter
    /// (Punica's and S-LoRA's batching): the base's product once for every row, then each
    /// adapter's `s · (x_g Aᵀ) Bᵀ` for its rows `g` only, added into those rows. Before any
    /// activation: the caller applies it to the sum. Without updates, [`Module::forward`].
    pub(crate) fn forward_updated(&self, x: &Tensor, updates: &[RowUpdate<'_>]) -> candle_core::Result<Tensor> {
        if updates.is_empty() {
            return self.forward(x);
        }
        let mut y = linear(x, &self.weight, &self.bias, self.autocast)?; // (N, out)
        if let Some(y) = add_updates_on_host(x, &y, updates)? {
            return Ok(y);
        }
        for u in updates {
            let delta = u.lora.delta(&x.index_select(u.ids, 0)?, None)?; // (rows, out)
            y = y.index_add(u.ids, &delta.to_dtype(y.dtype())?, 0)?;
        }
        Ok(y)
    }
}

/// `y` with every update added to its rows by [`gpt_kernels::infer::lora_rows`], where `x` and
/// `y` are f32 on the CPU and the adapters are not being trained; else `None`.
fn add_updates_on_host(x: &Tensor, y: &Tensor, updates: &[RowUpdate<'_>]) -> candle_core::Result<Option<Tensor>> {
    if !(x.device().is_cpu() && x.dtype() == DType::F32 && y.dtype() == DType::F32) {
        return Ok(None);
    }
    let mut matrices = Vec::with_capacity(updates.len());
    for u in updates {
        match u.lora.host_matrices()? {
            Some(m) => matrices.push(m),
            None => return Ok(None),
        }
    }
    let x = x.contiguous()?;
    let (n_rows, d_in) = x.dims2()?;
    let d_out = y.dim(1)?;
    let mut out = y.flatten_all()?.to_vec1::<f32>()?; // (N * out)
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("LoRA update: x is not on the host")
    };
    let xs = gpt_kernels::f32_slice(cpu, layout, "LoRA update")?;
    for (u, (a, b_t)) in updates.iter().zip(matrices) {
        gpt_kernels::infer::lora_rows(xs, d_in, &mut out, d_out, u.rows, a, b_t, u.lora.scale as f32);
    }
    Ok(Some(Tensor::from_vec(out, (n_rows, d_out), x.device())?))
}

impl Module for Conv1D {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_t(x, None)
    }
}

/// LayerNorm that uses candle-nn's fused kernel at inference and the differentiable composite
/// when training (the fused kernel has no backward pass).
/// An RMSNorm (a `LayerNorm` that removes no mean) takes candle-nn's fused `rms_norm` at inference.
pub(crate) fn layer_norm(ln: &LayerNorm, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
    match (train, ln.bias()) {
        (true, Some(bias)) => gpt_kernels::layer_norm(x, ln.weight(), bias, ln.eps() as f32),
        // On the CPU in f32 the kernels' pass, whose bits `add_then_norm`'s fused one gives too.
        (false, _) if !ln.remove_mean() => match gpt_kernels::fused(x) && x.device().is_cpu() {
            true => gpt_kernels::rms_norm(x, ln.weight(), ln.eps() as f32),
            false => candle_nn::ops::rms_norm(&x.contiguous()?, ln.weight(), ln.eps() as f32),
        },
        // candle's fused RMSNorm has no backward pass: training takes the kernels' (a composite
        // of candle's ops off the CPU).
        (true, None) if !ln.remove_mean() => gpt_kernels::rms_norm(x, ln.weight(), ln.eps() as f32),
        _ => ln.forward(&x.contiguous()?),
    }
}

/// Inference's residual add and the norm after it: `(x + h, ln(x + h))`, in one pass for an
/// RMSNorm on the CPU in f32 ([`gpt_kernels::add_rms_norm`], the same bits), else the two ops.
pub(crate) fn add_then_norm(x: &Tensor, h: &Tensor, ln: &LayerNorm) -> candle_core::Result<(Tensor, Tensor)> {
    if !ln.remove_mean() {
        if let Some(pair) = gpt_kernels::add_rms_norm(x, h, ln.weight(), ln.eps() as f32)? {
            return Ok(pair);
        }
    }
    let sum = (x + h)?;
    let normed = layer_norm(ln, &sum, false)?;
    Ok((sum, normed))
}

/// `ln` with its gain and bias detached from gradient tracking; `eps` is its epsilon (candle's
/// `LayerNorm` does not give it back).
pub(crate) fn detached_layer_norm(ln: &LayerNorm, eps: f64) -> LayerNorm {
    if !ln.remove_mean() {
        return LayerNorm::rms_norm(ln.weight().detach(), eps);
    }
    match ln.bias() {
        Some(b) => LayerNorm::new(ln.weight().detach(), b.detach(), eps),
        None => LayerNorm::new_no_bias(ln.weight().detach(), eps),
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
            key: gpt_kernels::rng::key(&[self.key, site]),
            ..self
        }
    }
}

/// Dropout while training (`train` is `Some`), and only when it drops anything.
pub(crate) fn dropout(x: Tensor, p: f32, train: Option<Dropout>) -> candle_core::Result<Tensor> {
    match train {
        Some(d) if p > 0.0 => gpt_kernels::dropout(&x, p, d.key, d.first_row),
        _ => Ok(x),
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::blas_operand;

    #[test]
    fn a_column_block_of_a_weight_becomes_a_row_major_copy_with_its_gradient() -> candle_core::Result<()> {
        let in_out = Var::from_tensor(&candle_core::Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((4, 6))?)?;
        // (out, in), as Conv1D holds it: already a BLAS operand as a whole, so not copied.
        let w = in_out.as_tensor().t()?;
        let whole = blas_operand(&w)?;
        assert!(!whole.is_contiguous() && whole.t()?.is_contiguous());
        // Rows 1..3 of (out, in) are columns 1..3 of the variable: neither layout, so copied.
        let block = w.narrow(0, 1, 2)?;
        assert!(!block.is_contiguous() && !block.t()?.is_contiguous());
        let op = blas_operand(&block)?;
        assert!(op.is_contiguous());
        assert_eq!(op.to_vec2::<f32>()?, block.to_vec2::<f32>()?);
        let grads = (op * 2.0)?.sum_all()?.backward()?;
        let g = grads.get(in_out.as_tensor()).expect("a gradient for the variable");
        let expect: Vec<Vec<f32>> = (0..4).map(|_| vec![0., 2., 2., 0., 0., 0.]).collect();
        assert_eq!(g.to_vec2::<f32>()?, expect);
        Ok(())
    }
}
