//! Checkpoints with quantized weights: a directory like a safetensors checkpoint (`config.json`,
//! `tokenizer.json`, `tokenizer_config.json`) whose weights are in `model.gguf`, so that a
//! quantized model loads without being quantized again at every start.
//!
//! The GGUF file holds the tensors under `transformers`' GPT-2 names with the `transformer.`
//! prefix, each weight matrix `(out, in)` (PyTorch's `Linear` order, GGML's block order) in the
//! file's weight format, every other tensor in f32; its metadata names the format
//! (`gpt.weight_format`) and holds the model's `config.json` (`gpt.config`). It is this project's
//! layout, not llama.cpp's `gpt2` architecture.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::gpt::Gpt;
use crate::layers::Weight;
use gpt_kernels::PackedMatrix;
use gpt_kernels::WeightFormat;

pub const GGUF_FILE: &str = "model.gguf";

/// The bytes of `model.gguf` for `model` with its weight matrices in `format`.
pub fn gguf_bytes(model: &Gpt, format: WeightFormat) -> Result<Vec<u8>> {
    // The other tensors come from the model as given, whose dense matrices cost nothing to list
    // (the converted model's quantized ones would be dequantized only to be skipped).
    let named = model.named_tensors()?;
    let mut model = model.clone().with_weight_format(format)?;
    let mut tensors: Vec<(String, Arc<QTensor>)> = Vec::new();
    let mut matrices = HashMap::new();
    for (name, weight) in model.matrices_mut() {
        let q = match &*weight {
            Weight::Packed(p) => Arc::new(p.to_qtensor()?),
            Weight::Quant(q) => q.clone(),
            Weight::Recoded { stored, .. } => Arc::new(QTensor::quantize(&weight.dense(DType::F32)?, *stored)?),
            Weight::Dense(w) => Arc::new(QTensor::quantize(
                &w.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?,
                dense_ggml(format),
            )?),
        };
        matrices.insert(name, q);
    }
    for (name, t) in named {
        match matrices.remove(&name) {
            Some(q) => tensors.push((name, q)),
            None => {
                let t = t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?;
                tensors.push((name, Arc::new(QTensor::quantize(&t, GgmlDType::F32)?)));
            }
        }
    }
    let config =
        serde_json::to_string(&model.config().to_hf_value()?).map_err(|e| Error::InvalidConfig(e.to_string()))?;
    let metadata = [
        ("general.architecture", gguf_file::Value::String("gpt-rs".into())),
        ("gpt.weight_format", gguf_file::Value::String(format.to_string())),
        ("gpt.config", gguf_file::Value::String(config)),
    ];
    let metadata: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v.as_ref())).collect();
    let mut bytes = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut bytes, &metadata, &tensors)?;
    Ok(bytes.into_inner())
}

/// The checkpoint names and `(out, in)` shapes of the weight matrices of `cfg`'s network, in
/// [`Gpt::matrices_mut`]'s order.
fn matrix_shapes(cfg: &Config) -> Vec<(String, (usize, usize))> {
    let (c, w) = (cfg.n_embd, cfg.mlp_width());
    let mut out = vec![("transformer.wte.weight".to_string(), (cfg.vocab_size, c))];
    for i in 0..cfg.n_layer {
        for (name, shape) in [
            ("attn.c_attn", (3 * c, c)),
            ("attn.c_proj", (c, c)),
            ("mlp.c_fc", (w, c)),
            ("mlp.c_proj", (c, w)),
        ] {
            out.push((format!("transformer.h.{i}.{name}.weight"), shape));
        }
    }
    out
}

fn dense_ggml(format: WeightFormat) -> GgmlDType {
    match format {
        WeightFormat::F16 => GgmlDType::F16,
        WeightFormat::Bf16 => GgmlDType::BF16,
        _ => GgmlDType::F32,
    }
}

/// Loads the network of `path` (a `model.gguf` written by [`gguf_bytes`]) with `cfg`, its weight
/// matrices in the file's format, on `device` (quantized formats: the CPU only).
pub fn load_gguf(path: &Path, cfg: &Config, device: &Device) -> Result<Gpt> {
    let corrupt = |reason: String| Error::CorruptCheckpoint {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let content = gguf_file::Content::read(&mut file).map_err(|e| corrupt(e.to_string()))?;
    let format = match content.metadata.get("gpt.weight_format") {
        Some(gguf_file::Value::String(s)) => s.parse::<WeightFormat>()?,
        _ => {
            return Err(corrupt(
                "no `gpt.weight_format` metadata: not written by gpt-train export".into(),
            ))
        }
    };
    if format.ggml().is_some() && !device.is_cpu() {
        return Err(Error::InvalidConfig(format!(
            "{} holds {format} weights, which run on the CPU only",
            path.display()
        )));
    }
    let mut read = |name: &str| -> Result<QTensor> {
        content
            .tensor(&mut file, name, &Device::Cpu)
            .map_err(|e| corrupt(format!("tensor `{name}`: {e}")))
    };
    // Every tensor but the weight matrices, which get shaped placeholders (a broadcast zero,
    // no memory) until the file's own blocks replace them below.
    let zero = Tensor::zeros(1, DType::F32, device)?;
    let mut tensors = HashMap::new();
    let matrix_names = matrix_shapes(cfg);
    for name in content.tensor_infos.keys() {
        if matrix_names.iter().any(|(n, _)| n == name) {
            continue;
        }
        let t = read(name)?.dequantize(&Device::Cpu)?.to_device(device)?;
        tensors.insert(name.trim_start_matches("transformer.").to_string(), t);
    }
    for (name, (out, inp)) in &matrix_names {
        let shape = if name.ends_with("wte.weight") {
            (*out, *inp)
        } else {
            (*inp, *out)
        };
        tensors.insert(
            name.trim_start_matches("transformer.").to_string(),
            zero.broadcast_as(shape)?,
        );
    }
    let mut model = Gpt::new(VarBuilder::from_tensors(tensors, DType::F32, device), cfg)?;
    for (name, weight) in model.matrices_mut() {
        let q = read(&name)?;
        let expected = weight.dims();
        let dims = q.shape().dims().to_vec();
        if dims != [expected.0, expected.1] {
            return Err(Error::ShapeMismatch {
                name,
                expected: vec![expected.0, expected.1],
                actual: dims,
            });
        }
        *weight = match WeightFormat::from_ggml(q.dtype()) {
            _ if device.is_cpu() => Weight::Packed(Arc::new(PackedMatrix::from_qtensor(&q)?)),
            Some(f) if f.ggml().is_none() => {
                Weight::Dense(q.dequantize(&Device::Cpu)?.to_dtype(f.dtype())?.to_device(device)?)
            }
            _ => {
                return Err(corrupt(format!(
                    "tensor `{name}` is {:?}, which runs on the CPU only",
                    q.dtype()
                )))
            }
        };
    }
    Ok(model)
}
