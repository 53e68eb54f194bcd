//! How the network's weights are named and held: under `transformers`' names for checkpoints,
//! in the formats and precisions inference runs (packed, half precision, quantized), with a LoRA
//! adapter's updates attached, and counted.

use candle_core::{DType, Tensor};
use candle_nn::LayerNorm;
use gpt_kernels::{MatmulPrecision, WeightFormat};

use super::{Block, Gpt};
use crate::config::{Config, PositionEmbedding};
use crate::error::{Error, Result};
use crate::layers::{Conv1D, Weight};

impl Gpt {
    /// The weights under `transformers`' names (`transformer.` prefix, as `save_pretrained`
    /// writes them; the tied LM head is not stored separately).
    /// Quantized weights are dequantized to f32.
    pub fn named_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        if !self.cfg.is_gpt2_shaped() {
            return self.family_tensors();
        }
        let mut out = vec![("transformer.wte.weight".to_string(), self.wte.tensor()?)];
        if let Some(wpe) = &self.wpe {
            out.push(("transformer.wpe.weight".to_string(), wpe.clone()));
        }
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

    /// [`Gpt::named_tensors`] for the Llama-layout families, under `transformers`' names
    /// ([`crate::arch::llama`]): the fused q, k, v and gate, up products split back into the
    /// checkpoint's matrices, the biases only where the family has them.
    fn family_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        use crate::arch::names::{layer, names};
        let cfg = &self.cfg;
        let n = names(cfg.variant.family);
        let (qw, kvw, w) = (cfg.q_width(), cfg.kv_width(), cfg.mlp_width());
        // Gemma's checkpoints store a norm's gain `1 + w` as `w`.
        let gain = |ln: &Tensor| -> Result<Tensor> {
            Ok(match cfg.variant.family.is_gemma() {
                true => (ln - 1.0)?,
                false => ln.clone(),
            })
        };
        let mut out = vec![(n.embed.to_string(), self.wte.tensor()?)];
        for (i, b) in self.blocks.iter().enumerate() {
            let p = layer(i);
            let mut linear = |name: &str, conv: &Conv1D, start: usize, len: usize, bias: bool| -> Result<()> {
                let weight = conv.weight.tensor()?.narrow(0, start, len)?;
                out.push((format!("{p}.{name}.weight"), weight));
                if bias {
                    out.push((format!("{p}.{name}.bias"), conv.bias.narrow(0, start, len)?));
                }
                Ok(())
            };
            let (attn, mlp, v) = (&b.attn, &b.mlp, &cfg.variant);
            linear(n.q, attn.c_attn(), 0, qw, v.qkv_bias)?;
            linear(n.k, attn.c_attn(), qw, kvw, v.qkv_bias)?;
            linear(n.v, attn.c_attn(), qw + kvw, kvw, v.qkv_bias)?;
            linear(n.o, attn.c_proj(), 0, cfg.n_embd, v.o_bias)?;
            for (j, part) in n.mlp_in(v.gated_mlp).into_iter().enumerate() {
                linear(part, &mlp.c_fc, j * w, w, v.mlp_bias)?;
            }
            linear(n.down, &mlp.c_proj, 0, cfg.n_embd, v.mlp_bias)?;
            out.push((format!("{p}.{}.weight", n.attn_norm), gain(b.ln_1.weight())?));
            out.push((format!("{p}.{}.weight", n.mlp_norm), gain(b.ln_2.weight())?));
            if let (Some((attn_name, mlp_name)), Some((attn_norm, mlp_norm))) = (n.post_norms, &b.post_norms) {
                out.push((format!("{p}.{attn_name}.weight"), gain(attn_norm.weight())?));
                out.push((format!("{p}.{mlp_name}.weight"), gain(mlp_norm.weight())?));
            }
            if let Some((q, k, _)) = &attn.qk_norm {
                out.push((format!("{p}.{}.weight", n.q_norm), gain(q)?));
                out.push((format!("{p}.{}.weight", n.k_norm), gain(k)?));
            }
        }
        out.push((n.final_norm.to_string(), gain(self.ln_f.weight())?));
        if let Some(head) = &self.lm_head {
            out.push((n.head.to_string(), head.tensor()?));
        }
        Ok(out)
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
                Weight::Dense(_) | Weight::Quant(_) | Weight::Recoded { .. }
                    if precision == MatmulPrecision::Highest => {}
                Weight::Dense(_) | Weight::Quant(_) | Weight::Recoded { .. } => {
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
        if let Some(head) = &mut self.lm_head {
            out.push(("lm_head.weight".to_string(), head));
        }
        for (name, conv) in Self::named_convs_mut(&self.cfg, &mut self.blocks) {
            out.push((format!("{name}.weight"), &mut conv.weight));
        }
        out
    }

    /// Each block's linear layers under their products' names
    /// ([`crate::lora::block_products`]: `transformer.h.0.attn.c_attn`,
    /// `model.layers.0.self_attn.qkv_proj`, ...).
    fn named_convs_mut<'a>(cfg: &Config, blocks: &'a mut [Block]) -> Vec<(String, &'a mut Conv1D)> {
        let mut out = Vec::new();
        for (i, block) in blocks.iter_mut().enumerate() {
            let names = crate::lora::block_products(cfg, i);
            let convs = [
                &mut block.attn.c_attn,
                &mut block.attn.c_proj,
                &mut block.mlp.c_fc,
                &mut block.mlp.c_proj,
            ];
            out.extend(names.into_iter().zip(convs));
        }
        out
    }

    /// The model with its token embedding and LM head as dense f32 tensors, the blocks' matrices
    /// left as they are: QLoRA's base, whose embeddings stay unquantized, and on which the
    /// training loss takes the fused LM head and cross-entropy (no `(rows, vocab)` logits).
    pub fn with_dense_embeddings(mut self) -> Result<Self> {
        self.wte = Weight::Dense(self.wte.dense(DType::F32)?);
        if let Some(head) = &mut self.lm_head {
            *head = Weight::Dense(head.dense(DType::F32)?);
        }
        Ok(self)
    }

    /// Bytes of the matrices a decode step reads, as held: every block's, and the LM head (the
    /// token embedding where tied; of a separate embedding only a row is read). Against a
    /// machine's memory bandwidth, the bound on batch-1 decode.
    pub fn weight_bytes(&self) -> usize {
        let blocks: usize = (self.blocks.iter())
            .flat_map(|b| [&b.attn.c_attn, &b.attn.c_proj, &b.mlp.c_fc, &b.mlp.c_proj])
            .map(|conv| conv.weight.bytes())
            .sum();
        blocks + self.head().bytes()
    }

    /// Whether every weight matrix (the blocks', the head's) is held in f32.
    pub fn matrices_are_f32(&self) -> bool {
        let f32 = |w: &Weight| match w {
            Weight::Dense(t) => t.dtype() == DType::F32,
            Weight::Packed(p) => p.format() == WeightFormat::F32,
            Weight::Quant(_) | Weight::Recoded { .. } => false,
        };
        f32(self.head())
            && (self.blocks.iter())
                .flat_map(|b| [&b.attn.c_attn, &b.attn.c_proj, &b.mlp.c_fc, &b.mlp.c_proj])
                .all(|c| f32(&c.weight))
    }

    /// The format of the weight matrices (that of the LM head).
    pub fn weight_format(&self) -> Option<WeightFormat> {
        match &self.wte {
            Weight::Dense(w) => WeightFormat::ALL
                .into_iter()
                .find(|f| f.ggml().is_none() && f.dtype() == w.dtype()),
            Weight::Packed(p) => Some(p.format()),
            Weight::Quant(_) | Weight::Recoded { .. } => None,
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
        for (name, conv) in Self::named_convs_mut(&self.cfg, &mut self.blocks) {
            conv.lora = adapter.and_then(|a| a.compute.get(&name)).cloned();
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
        if let (PositionEmbedding::Learned, Some(wpe)) = (self.cfg.position_embedding, &self.wpe) {
            n += wpe.elem_count();
        }
        if let Some(head) = &self.lm_head {
            let (v, c) = head.dims();
            n += v * c;
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
        let var = &self.cfg.variant;
        for b in &self.blocks {
            n += ln(&b.ln_1) + ln(&b.ln_2);
            if let Some((attn, mlp)) = &b.post_norms {
                n += ln(attn) + ln(mlp);
            }
            if let Some((q, k, _)) = &b.attn.qk_norm {
                n += q.elem_count() + k.elem_count();
            }
            for (conv, family_bias) in [
                (&b.attn.c_attn, var.qkv_bias),
                (&b.attn.c_proj, var.o_bias),
                (&b.mlp.c_fc, var.mlp_bias),
                (&b.mlp.c_proj, var.mlp_bias),
            ] {
                let (out, inp) = conv.weight.dims();
                n += out * inp + if self.cfg.bias || family_bias { out } else { 0 };
            }
        }
        n
    }
}
