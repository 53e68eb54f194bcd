//! A model of the Llama-layout and Gemma families written as llama.cpp's converter
//! (`convert_hf_to_gguf.py`) writes it: one GGUF file with llama.cpp's metadata keys and tensor
//! names, the Llama family's q and k rows interleaved as its `LlamaModel.permute` does, Gemma's
//! gains as `1 + w`, the tokenizer as `tokenizer.ggml.*` (byte-level BPE with its merges and
//! pre-tokenizer's name, or SentencePiece pieces with scores), and the chat template. What
//! [`super::load`] reads back, and what llama.cpp's tools load.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Tensor};
use gpt_kernels::WeightFormat;

use crate::arch::names::names;
use crate::arch::Family;
use crate::config::{Config, RopeScaling};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use crate::Gpt;

/// llama.cpp's `general.architecture` of a family.
fn architecture(family: Family) -> Option<&'static str> {
    Some(match family {
        Family::Llama | Family::Mistral => "llama",
        Family::Qwen2 => "qwen2",
        Family::Qwen3 => "qwen3",
        Family::Arcee => "arcee",
        Family::Gemma2 => "gemma2",
        Family::Gemma3 => "gemma3",
        Family::Gpt2 => return None,
    })
}

fn invalid(reason: String) -> Error {
    Error::InvalidConfig(format!("export to llama.cpp's GGUF: {reason}"))
}

/// Writes `model` and `tokenizer` to `path` as llama.cpp's GGUF file, the weight matrices in
/// `format` (f32, f16, bf16, q8_0, q4_0), every other tensor in f32.
pub fn save(path: &Path, model: &Gpt, tokenizer: &Tokenizer, format: WeightFormat) -> Result<()> {
    let cfg = model.config();
    let arch = architecture(cfg.variant.family).ok_or_else(|| {
        invalid("GPT-2 checkpoints export as this project's model.gguf (--dtype q8_0|q4_0 to a directory)".into())
    })?;
    let mut metadata = config_metadata(cfg, arch)?;
    metadata.extend(tokenizer_metadata(tokenizer, cfg)?);
    metadata.push(("general.name".into(), Value::String(stem(path))));
    let tensors = tensors(model, format)?;
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tmp = path.with_extension("gguf.tmp");
    let mut file = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
    candle_core::quantized::gguf_file::write(&mut file, &metadata, &tensors)?;
    file.sync_all().map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// `{arch}.*`: the network's shape, its rotary frequencies, windows and caps.
fn config_metadata(cfg: &Config, arch: &str) -> Result<Vec<(String, Value)>> {
    let v = &cfg.variant;
    let key = |k: &str| format!("{arch}.{k}");
    let u32_of = |n: usize, what: &str| u32::try_from(n).map_err(|_| invalid(format!("{what} {n} is too large")));
    let rope = v.rope.as_ref().ok_or_else(|| invalid("no rotary embedding".into()))?;
    if v.family.is_gemma() {
        // llama.cpp scales Gemma's queries by 1 / sqrt(head_dim) (n_embd / n_head for the 27B
        // models), whatever the config says.
        let expected = match (v.family, cfg.n_layer) {
            (Family::Gemma2, 46) | (Family::Gemma3, 62) => (cfg.n_embd / cfg.n_head) as f64,
            _ => cfg.head_dim() as f64,
        };
        if let Some(scalar) = v.query_pre_attn_scalar.filter(|&s| s != expected) {
            return Err(invalid(format!(
                "query_pre_attn_scalar {scalar} is not the {expected} llama.cpp assumes for this model"
            )));
        }
        if let Some(local) = v
            .rope_local
            .as_ref()
            .filter(|r| r.theta != 10_000.0 || r.scaling.is_some())
        {
            return Err(invalid(format!(
                "the sliding layers' RoPE base {} is not llama.cpp's 10000",
                local.theta
            )));
        }
    }
    let mut m = vec![
        ("general.architecture".to_string(), Value::String(arch.into())),
        (
            key("context_length"),
            Value::U32(u32_of(cfg.n_positions, "context_length")?),
        ),
        (
            key("embedding_length"),
            Value::U32(u32_of(cfg.n_embd, "embedding_length")?),
        ),
        (key("block_count"), Value::U32(u32_of(cfg.n_layer, "block_count")?)),
        (
            key("feed_forward_length"),
            Value::U32(u32_of(cfg.mlp_width(), "feed_forward_length")?),
        ),
        (
            key("attention.head_count"),
            Value::U32(u32_of(cfg.n_head, "head_count")?),
        ),
        (
            key("attention.head_count_kv"),
            Value::U32(u32_of(cfg.n_kv_head(), "head_count_kv")?),
        ),
        (
            key("attention.key_length"),
            Value::U32(u32_of(cfg.head_dim(), "key_length")?),
        ),
        (
            key("attention.value_length"),
            Value::U32(u32_of(cfg.head_dim(), "value_length")?),
        ),
        (
            key("rope.dimension_count"),
            Value::U32(u32_of(cfg.head_dim(), "head_dim")?),
        ),
        (key("rope.freq_base"), Value::F32(rope.theta as f32)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.layer_norm_epsilon as f32),
        ),
    ];
    if let Some(RopeScaling::Linear { factor }) = rope.scaling {
        m.push((key("rope.scaling.type"), Value::String("linear".into())));
        m.push((key("rope.scaling.factor"), Value::F32(factor as f32)));
    }
    if let Some(window) = v.sliding_window {
        m.push((
            key("attention.sliding_window"),
            Value::U32(u32_of(window, "sliding_window")?),
        ));
        let flags: Vec<bool> = (0..cfg.n_layer).map(|i| cfg.window(i).is_some()).collect();
        let period = if v.family == Family::Gemma3 { 6 } else { 2 };
        let default: Vec<bool> = (0..cfg.n_layer).map(|i| (i + 1) % period != 0).collect();
        if v.family.is_gemma() && flags != default {
            m.push((
                key("attention.sliding_window_pattern"),
                Value::Array(flags.into_iter().map(Value::Bool).collect()),
            ));
        }
    }
    for (name, cap) in [
        ("attn_logit_softcapping", v.attn_softcap),
        ("final_logit_softcapping", v.final_softcap),
    ] {
        if let Some(cap) = cap {
            m.push((key(name), Value::F32(cap as f32)));
        }
    }
    Ok(m)
}

/// `tokenizer.ggml.*` and the chat template, from the model's `tokenizer.json`.
fn tokenizer_metadata(tokenizer: &Tokenizer, cfg: &Config) -> Result<Vec<(String, Value)>> {
    let inner = tokenizer.inner();
    let model = serde_json::to_value(inner.get_model()).map_err(|e| invalid(e.to_string()))?;
    if model["type"] != "BPE" {
        return Err(invalid(format!(
            "a {} tokenizer has no llama.cpp form here (BPE only)",
            model["type"]
        )));
    }
    let n = tokenizer.vocab_size();
    let mut tokens = vec![String::new(); n];
    for (token, id) in inner.get_vocab(true) {
        if let Some(slot) = tokens.get_mut(id as usize) {
            *slot = token;
        }
    }
    if let Some(id) = tokens.iter().position(String::is_empty) {
        return Err(invalid(format!("the vocabulary has no token {id}")));
    }
    let added = inner.get_added_tokens_decoder();
    let byte_fallback = model["byte_fallback"].as_bool().unwrap_or(false);
    let unk = model["unk_token"].as_str();
    let types: Vec<Value> = (0..n as u32)
        .map(|id| {
            let token = &tokens[id as usize];
            Value::I32(match added.get(&id) {
                Some(t) if t.special => 3,
                Some(_) => 4,
                None if Some(token.as_str()) == unk => 2,
                None if byte_fallback && token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') => 6,
                None => 1,
            })
        })
        .collect();
    let merges: Vec<String> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            serde_json::Value::Array(pair) => format!(
                "{} {}",
                pair.first().and_then(|s| s.as_str()).unwrap_or_default(),
                pair.get(1).and_then(|s| s.as_str()).unwrap_or_default()
            ),
            other => other.as_str().unwrap_or_default().to_string(),
        })
        .collect();
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut m: Vec<(String, Value)> = Vec::new();
    if byte_fallback {
        // SentencePiece: llama.cpp merges the pair whose piece scores highest, so each piece
        // scores minus the rank of the first merge that makes it.
        let mut scores = vec![0f32; n];
        let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
        for (rank, merge) in merges.iter().enumerate().rev() {
            if let Some(&id) = ids.get(merge.replacen(' ', "", 1).as_str()) {
                scores[id] = -(rank as f32) - 1.0;
            }
        }
        let prefix = serde_json::to_string(&inner.get_normalizer())
            .unwrap_or_default()
            .contains("Prepend")
            || serde_json::to_string(&inner.get_pre_tokenizer())
                .unwrap_or_default()
                .contains("Metaspace");
        m.push(("tokenizer.ggml.model".into(), Value::String("llama".into())));
        m.push(("tokenizer.ggml.pre".into(), Value::String("default".into())));
        m.push((
            "tokenizer.ggml.scores".into(),
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ));
        m.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(prefix)));
    } else {
        m.push(("tokenizer.ggml.model".into(), Value::String("gpt2".into())));
        m.push((
            "tokenizer.ggml.pre".into(),
            Value::String(pre_tokenizer_name(inner)?.into()),
        ));
        m.push(("tokenizer.ggml.merges".into(), strings(merges)));
    }
    m.push(("tokenizer.ggml.tokens".into(), strings(tokens)));
    m.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
    if let Some(eos) = cfg.eos_ids().first().copied().or(tokenizer.eos_token_id()) {
        m.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)));
    }
    if let Some(bos) = tokenizer.bos().or(cfg.bos_token_id) {
        m.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(bos)));
    }
    m.push((
        "tokenizer.ggml.add_bos_token".into(),
        Value::Bool(tokenizer.bos().is_some()),
    ));
    if let Some(template) = tokenizer.chat_template() {
        m.push(("tokenizer.chat_template".into(), Value::String(template.into())));
    }
    Ok(m)
}

/// The name llama.cpp gives a byte-level BPE's pre-tokenizer (`tokenizer.ggml.pre`): GPT-2's
/// own, SmolLM's (digits one by one), Llama 3's or Qwen2's split.
fn pre_tokenizer_name(inner: &tokenizers::Tokenizer) -> Result<&'static str> {
    let pre = serde_json::to_value(inner.get_pre_tokenizer()).map_err(|e| invalid(e.to_string()))?;
    let parts: Vec<serde_json::Value> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"].as_array().cloned().unwrap_or_default(),
        _ => vec![pre.clone()],
    };
    let kinds: Vec<&str> = parts.iter().filter_map(|p| p["type"].as_str()).collect();
    let split = parts
        .iter()
        .find(|p| p["type"] == "Split")
        .and_then(|p| p["pattern"]["Regex"].as_str());
    Ok(match (kinds.as_slice(), split) {
        (["ByteLevel"], _) => "gpt-2",
        (["Digits", "ByteLevel"], _) => "smollm",
        (["Split", "ByteLevel"], Some(p)) if p == super::tokenizer::LLAMA3_SPLIT => "llama-bpe",
        (["Split", "ByteLevel"], Some(p)) if p == super::tokenizer::QWEN2_SPLIT => "qwen2",
        _ => {
            return Err(invalid(format!(
                "the tokenizer's pre-tokenizer {pre} has no llama.cpp name here (supported: {})",
                super::tokenizer::PRE_TOKENIZERS
            )))
        }
    })
}

/// Every tensor under llama.cpp's name: matrices in `format`, vectors in f32.
fn tensors(model: &Gpt, format: WeightFormat) -> Result<Vec<(String, QTensor)>> {
    let cfg = model.config();
    let v = &cfg.variant;
    let n = names(v.family);
    let ggml = match format {
        WeightFormat::F32 => GgmlDType::F32,
        WeightFormat::F16 => GgmlDType::F16,
        WeightFormat::Bf16 => GgmlDType::BF16,
        WeightFormat::Q8_0 => GgmlDType::Q8_0,
        WeightFormat::Q4_0 => GgmlDType::Q4_0,
    };
    let table: Vec<(String, &str)> = [
        (n.attn_norm, "attn_norm"),
        (n.mlp_norm, "ffn_norm"),
        (n.q, "attn_q"),
        (n.k, "attn_k"),
        (n.v, "attn_v"),
        (n.o, "attn_output"),
        (n.q_norm, "attn_q_norm"),
        (n.k_norm, "attn_k_norm"),
        (n.gate, "ffn_gate"),
        (n.up, "ffn_up"),
        (n.down, "ffn_down"),
    ]
    .into_iter()
    .chain(
        n.post_norms
            .map(|(a, m)| [(a, "post_attention_norm"), (m, "post_ffw_norm")])
            .into_iter()
            .flatten(),
    )
    .map(|(hf, ours)| (hf.to_string(), ours))
    .collect();
    let mut out = Vec::new();
    for (name, t) in model.named_tensors()? {
        let (stem, suffix) = name.rsplit_once('.').unwrap_or((&name, ""));
        let (gguf_name, stem) = match stem.strip_prefix("model.layers.") {
            Some(rest) => {
                let (i, rest) = rest.split_once('.').unwrap_or((rest, ""));
                let ours = table
                    .iter()
                    .find(|(hf, _)| hf == rest)
                    .map(|(_, g)| *g)
                    .ok_or_else(|| invalid(format!("no llama.cpp name for `{name}`")))?;
                (format!("blk.{i}.{ours}.{suffix}"), ours)
            }
            None if name == n.embed => ("token_embd.weight".to_string(), "token_embd"),
            None if name == n.final_norm => ("output_norm.weight".to_string(), "output_norm"),
            None if name == n.head => ("output.weight".to_string(), "output"),
            None => return Err(invalid(format!("no llama.cpp name for `{name}`"))),
        };
        // Copied out: candle's quantizer reads a tensor's storage from its start, not a view's.
        let t = Tensor::from_vec(
            t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            t.shape(),
            t.device(),
        )?;
        let t = match (v.family, stem, suffix) {
            // llama.cpp's converter interleaves the Llama family's q and k rows for its rotation.
            (f, "attn_q", _) if super::permuted_qk(f) => interleave(&t, cfg.n_head)?,
            (f, "attn_k", _) if super::permuted_qk(f) => interleave(&t, cfg.n_kv_head())?,
            // Gemma's converter stores the gains as `1 + w` (the checkpoint's `w`).
            (f, norm, "weight") if f.is_gemma() && norm.ends_with("norm") => (t + 1.0)?,
            _ => t,
        };
        let dtype = match t.rank() {
            2 if t.dim(1)? % ggml.block_size() == 0 => ggml,
            _ => GgmlDType::F32,
        };
        out.push((gguf_name, QTensor::quantize(&t, dtype)?));
    }
    if let Some(RopeScaling::Llama3 { .. }) = v.rope.as_ref().and_then(|r| r.scaling.as_ref()) {
        // Llama 3's rescaled frequencies as llama.cpp's `rope_freqs`: each one's divisor.
        let rope = v.rope.as_ref().ok_or_else(|| invalid("no rotary embedding".into()))?;
        let plain = crate::config::Rope {
            theta: rope.theta,
            scaling: None,
        }
        .inv_freq(cfg.head_dim());
        let factors: Vec<f32> = plain
            .iter()
            .zip(rope.inv_freq(cfg.head_dim()))
            .map(|(p, s)| (p / s) as f32)
            .collect();
        let len = factors.len();
        out.push((
            "rope_freqs.weight".into(),
            QTensor::quantize(
                &Tensor::from_vec(factors, len, &candle_core::Device::Cpu)?,
                GgmlDType::F32,
            )?,
        ));
    }
    Ok(out)
}

/// `LlamaModel.permute`: each head's rows `(2, hd / 2)` as `(hd / 2, 2)` (of a weight, or of
/// a bias's values).
fn interleave(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let (rows, cols) = (dims[0], dims.get(1).copied().unwrap_or(1));
    Ok(w.reshape((heads, 2, rows / heads / 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}
