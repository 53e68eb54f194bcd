//! llama.cpp's GGUF files, as llama.cpp, Ollama and LM Studio users download them: the config
//! from the metadata (`{arch}.block_count`, `.embedding_length`, `.attention.head_count_kv`,
//! `.rope.freq_base`, ...), the tensors by llama.cpp's names (`token_embd`, `blk.N.attn_q`,
//! `output`, absent where the head is tied), and the tokenizer and chat template from the file
//! itself (`tokenizer.ggml.*`, `tokenizer.chat_template`). The file's weight matrices stay in
//! their block formats: packed for the project's kernels where they have the format (F32, F16,
//! BF16, Q8_0, Q4_0; Q4_1 and Q4_K as Q4_0 codes with an offset per block, Q5_0 as Q8_0 codes,
//! Q5_1 as Q8_0 codes with an offset per block), else multiplied by candle's quantized matrices
//! (Q5_K, Q6_K). The file comes from a stranger: every count, size and offset is checked against
//! the file before anything is read or allocated, and each error names the file and the field.

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use gpt_kernels::{PackedMatrix, WeightFormat};

use crate::arch::llama::{FamilyWeights, LayerWeights};
use crate::arch::Family;
use crate::config::{Config, PositionEmbedding, Rope, RopeScaling, Variant};
use crate::error::{Error, Result};
use crate::layers::Weight;
use crate::tokenizer::Tokenizer;
use crate::Gpt;

mod export;
mod tokenizer;
pub use export::save;
use tokenizer::tokenizer;

/// The `general.architecture`s loaded, and their families. llama.cpp writes Mistral's and
/// SmolLM's checkpoints as `llama`.
const ARCHITECTURES: [(&str, Family); 6] = [
    ("llama", Family::Llama),
    ("qwen2", Family::Qwen2),
    ("qwen3", Family::Qwen3),
    ("arcee", Family::Arcee),
    ("gemma2", Family::Gemma2),
    ("gemma3", Family::Gemma3),
];

/// Whether llama.cpp's converter stores `family`'s q and k rows permuted (its `LlamaModel.permute`,
/// for the interleaved rotation its `llama` graph applies; Arcee's converter inherits it).
fn permuted_qk(family: Family) -> bool {
    matches!(family, Family::Llama | Family::Mistral | Family::Arcee)
}

/// The longest context accepted from a file's `context_length` (the rotary tables are made for
/// every position).
const MAX_CONTEXT: u64 = 1 << 20;

/// Whether `path` is a GGUF file (by its magic, not its name).
pub fn is_gguf_file(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// A GGUF file's header, read and checked.
struct File<'a> {
    path: &'a Path,
    file: std::fs::File,
    content: Content,
    arch: String,
}

impl<'a> File<'a> {
    fn corrupt(&self, reason: String) -> Error {
        corrupt(self.path, reason)
    }

    fn open(path: &'a Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let file_size = file.metadata().map_err(|e| Error::io(path, e))?.len();
        // candle's reader checks every count and length against the file; an alignment of 0
        // would still divide by zero in it, so a panic there is an error here too.
        let content = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| Content::read(&mut file)))
            .map_err(|_| corrupt(path, "the header could not be read (an alignment of 0?)".into()))?
            .map_err(|e| corrupt(path, format!("not a GGUF file llama.cpp could read: {e}")))?;
        let arch = match content.metadata.get("general.architecture") {
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(corrupt(path, "`general.architecture` is not a string".into())),
            None => return Err(corrupt(path, "no `general.architecture`".into())),
        };
        let mut gguf = Self {
            path,
            file,
            content,
            arch,
        };
        gguf.check_tensors(file_size)?;
        Ok(gguf)
    }

    /// Every tensor's extent within the file, without overflow or overlap.
    fn check_tensors(&mut self, file_size: u64) -> Result<()> {
        let data = self.content.tensor_data_offset;
        let mut extents = Vec::with_capacity(self.content.tensor_infos.len());
        for (name, info) in &self.content.tensor_infos {
            let dims = info.shape.dims();
            let elems = dims
                .iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .ok_or_else(|| self.corrupt(format!("tensor `{name}`: dimensions {dims:?} overflow")))?;
            let block = info.ggml_dtype.block_size();
            if !elems.is_multiple_of(block) {
                return Err(self.corrupt(format!(
                    "tensor `{name}`: {elems} values are not whole blocks of {block} ({:?})",
                    info.ggml_dtype
                )));
            }
            let bytes = (elems / block)
                .checked_mul(info.ggml_dtype.type_size())
                .ok_or_else(|| self.corrupt(format!("tensor `{name}`: its size overflows")))?
                as u64;
            let start = data.checked_add(info.offset);
            match start.and_then(|s| s.checked_add(bytes)) {
                Some(end) if end <= file_size => extents.push((start.unwrap_or(0), end, name.as_str())),
                _ => {
                    return Err(self.corrupt(format!(
                        "tensor `{name}`: {bytes} bytes at offset {} run past the end of the file ({file_size} bytes)",
                        info.offset
                    )))
                }
            }
        }
        extents.sort();
        for pair in extents.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(self.corrupt(format!("tensors `{}` and `{}` overlap", pair[0].2, pair[1].2)));
            }
        }
        Ok(())
    }

    fn meta(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    /// An unsigned integer of any width (a negative or non-integer value is an error).
    fn uint(&self, key: &str) -> Result<Option<u64>> {
        let v = match self.meta(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match *v {
            Value::U8(n) => Some(n as u64),
            Value::U16(n) => Some(n as u64),
            Value::U32(n) => Some(n as u64),
            Value::U64(n) => Some(n),
            Value::I8(n) => u64::try_from(n).ok(),
            Value::I16(n) => u64::try_from(n).ok(),
            Value::I32(n) => u64::try_from(n).ok(),
            Value::I64(n) => u64::try_from(n).ok(),
            _ => None,
        };
        n.map(Some)
            .ok_or_else(|| self.corrupt(format!("`{key}` is {v:?}, not a non-negative integer")))
    }

    fn need_uint(&self, key: &str) -> Result<u64> {
        self.uint(key)?.ok_or_else(|| self.corrupt(format!("no `{key}`")))
    }

    /// `key` as a size of at least 1 and at most `max`.
    fn size(&self, key: &str, max: u64) -> Result<usize> {
        match self.need_uint(key)? {
            n @ 1.. if n <= max => Ok(n as usize),
            n => Err(self.corrupt(format!("`{key}` is {n}, outside 1..={max}"))),
        }
    }

    fn float(&self, key: &str) -> Result<Option<f64>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(v) => Err(self.corrupt(format!("`{key}` is {v:?}, not a number"))),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.corrupt(format!("`{key}` is {v:?}, not a bool"))),
        }
    }

    fn string(&self, key: &str) -> Result<Option<&str>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(self.corrupt(format!("`{key}` is not a string"))),
        }
    }

    /// An array whose every item `item` reads (`kind` names what it must be).
    fn array<'s, T>(&'s self, key: &str, kind: &str, item: impl Fn(&'s Value) -> Option<T>) -> Result<Option<Vec<T>>> {
        match self.meta(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| item(v).ok_or_else(|| self.corrupt(format!("`{key}`[{i}] is {v:?}, not {kind}"))))
                .collect::<Result<_>>()
                .map(Some),
            Some(_) => Err(self.corrupt(format!("`{key}` is not an array"))),
        }
    }

    /// An array of strings.
    fn strings(&self, key: &str) -> Result<Option<Vec<&str>>> {
        self.array(key, "a string", |v| match v {
            Value::String(s) => Some(s.as_str()),
            _ => None,
        })
    }

    /// An array of integers.
    fn ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.array(key, "an integer", |v| match *v {
            Value::I32(n) => Some(n as i64),
            Value::U32(n) => Some(n as i64),
            Value::I8(n) => Some(n as i64),
            Value::U8(n) => Some(n as i64),
            _ => None,
        })
    }

    /// An array of numbers, as f32.
    fn floats(&self, key: &str) -> Result<Option<Vec<f32>>> {
        self.array(key, "a number", |v| match *v {
            Value::F32(x) => Some(x),
            Value::F64(x) => Some(x as f32),
            _ => None,
        })
    }

    /// Tensor `name`, checked to be `dims` (PyTorch's order: `(out, in)` for a matrix).
    fn tensor(&mut self, name: &str, dims: &[usize]) -> Result<QTensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| Error::MissingTensor {
                path: self.path.to_path_buf(),
                name: name.to_string(),
            })?;
        if info.shape.dims() != dims {
            return Err(Error::ShapeMismatch {
                name: format!("{name} in {}", self.path.display()),
                expected: dims.to_vec(),
                actual: info.shape.dims().to_vec(),
            });
        }
        let path = self.path;
        self.content
            .tensor(&mut self.file, name, &Device::Cpu)
            .map_err(|e| corrupt(path, format!("tensor `{name}`: {e}")))
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A vector (norm gain, bias) in f32.
    fn vector(&mut self, name: &str, len: usize) -> Result<Tensor> {
        Ok(self.tensor(name, &[len])?.dequantize(&Device::Cpu)?)
    }
}

fn corrupt(path: &Path, reason: String) -> Error {
    Error::CorruptCheckpoint {
        path: path.to_path_buf(),
        reason,
    }
}

/// The config of the file's network, from its metadata.
fn config(f: &File, vocab_size: usize) -> Result<Config> {
    let family = ARCHITECTURES
        .iter()
        .find(|(name, _)| *name == f.arch)
        .map(|&(_, family)| family)
        .ok_or_else(|| {
            f.corrupt(format!(
                "general.architecture `{}` is not supported (supported: {})",
                f.arch,
                ARCHITECTURES.map(|(name, _)| name).join(", ")
            ))
        })?;
    let key = |k: &str| format!("{}.{k}", f.arch);
    const MAX: u64 = 1 << 20;
    let n_embd = f.size(&key("embedding_length"), MAX)?;
    let n_head = f.size(&key("attention.head_count"), 4096)?;
    let n_kv_head = match f.uint(&key("attention.head_count_kv"))? {
        Some(_) => f.size(&key("attention.head_count_kv"), 4096)?,
        None => n_head,
    };
    let head_dim = match f.uint(&key("attention.key_length"))? {
        Some(_) => f.size(&key("attention.key_length"), 4096)?,
        None => n_embd / n_head,
    };
    let theta = f.float(&key("rope.freq_base"))?.unwrap_or(10_000.0);
    let scaling = match f.string(&key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling::Linear {
            factor: f
                .float(&key("rope.scaling.factor"))?
                .ok_or_else(|| f.corrupt(format!("no `{}`", key("rope.scaling.factor"))))?,
        }),
        Some(other) => {
            return Err(f.corrupt(format!(
                "`{}` is `{other}`, which is not supported (supported: none, linear)",
                key("rope.scaling.type")
            )))
        }
    };
    let ids = |k: &str| -> Result<Option<u32>> {
        f.uint(k)?
            .map(|n| u32::try_from(n).map_err(|_| f.corrupt(format!("`{k}` {n} is not a token id"))))
            .transpose()
    };
    let eos = ids("tokenizer.ggml.eos_token_id")?;
    // Llama 3's end of a turn is a token of its own beside the end of text.
    let eot = ids("tokenizer.ggml.eot_token_id")?;
    let eos_token_ids: Vec<u32> = eos.into_iter().chain(eot.filter(|&t| Some(t) != eos)).collect();
    let n_layer = f.size(&key("block_count"), 4096)?;
    let gemma = family.is_gemma();
    let window = match f.uint(&key("attention.sliding_window"))? {
        Some(_) => Some(f.size(&key("attention.sliding_window"), MAX_CONTEXT)?),
        None => None,
    };
    // Which layers slide: the file's `sliding_window_pattern` (a period, or a flag per layer,
    // true where the layer slides), else as llama.cpp's `set_swa_pattern` for the family (Gemma
    // 2 every other layer from the first, Gemma 3 five of six).
    let pattern_key = key("attention.sliding_window_pattern");
    let sliding_layers: Vec<bool> = match (window, f.meta(&pattern_key)) {
        (None, _) | (_, None) if !gemma => Vec::new(),
        (_, Some(Value::Array(flags))) => {
            if flags.len() != n_layer {
                return Err(f.corrupt(format!(
                    "`{pattern_key}` has {} flags for {n_layer} layers",
                    flags.len()
                )));
            }
            flags
                .iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::Bool(b) => Ok(*b),
                    other => Err(f.corrupt(format!("`{pattern_key}`[{i}] is {other:?}, not a bool"))),
                })
                .collect::<Result<_>>()?
        }
        (_, Some(_)) => {
            let period = f.size(&pattern_key, 4096)?;
            (0..n_layer).map(|i| (i + 1) % period != 0).collect()
        }
        (_, None) => {
            let period = if family == Family::Gemma3 { 6 } else { 2 };
            (0..n_layer).map(|i| (i + 1) % period != 0).collect()
        }
    };
    // llama.cpp scales Gemma's queries by 1 / sqrt(head_dim), and the 27B models' (46 and 62
    // layers) by 1 / sqrt(n_embd / n_head), as their `query_pre_attn_scalar`s say.
    let query_pre_attn_scalar = match (family, n_layer) {
        (Family::Gemma2, 46) | (Family::Gemma3, 62) => Some((n_embd / n_head) as f64),
        _ if gemma => Some(head_dim as f64),
        _ => None,
    };
    let softcap = |k: &str| -> Result<Option<f64>> { Ok(f.float(&key(k))?.filter(|&c| gemma && c > 0.0)) };
    let variant = Variant {
        family,
        n_kv_head: Some(n_kv_head),
        head_dim: Some(head_dim),
        rms_norm: true,
        gated_mlp: family.gated_mlp(),
        rope: Some(Rope { theta, scaling }),
        qkv_bias: f.has("blk.0.attn_q.bias"),
        o_bias: f.has("blk.0.attn_output.bias"),
        mlp_bias: f.has("blk.0.ffn_up.bias"),
        qk_norm: f.has("blk.0.attn_q_norm.weight"),
        eos_token_ids,
        post_norms: f.has("blk.0.post_attention_norm.weight"),
        embed_scale: gemma,
        query_pre_attn_scalar,
        attn_softcap: softcap("attn_logit_softcapping")?,
        final_softcap: softcap("final_logit_softcapping")?,
        // Mistral's window applies to every layer (llama.cpp's `llama` files of it carry none).
        sliding_window: window,
        sliding_layers,
        // llama.cpp's Gemma 3: the sliding layers rotate with base 10000, unscaled.
        rope_local: (family == Family::Gemma3).then_some(Rope {
            theta: 10_000.0,
            scaling: None,
        }),
    };
    let cfg = Config {
        vocab_size,
        n_positions: f.size(&key("context_length"), MAX_CONTEXT)?,
        n_embd,
        n_layer,
        n_head,
        n_inner: Some(f.size(&key("feed_forward_length"), MAX)?),
        layer_norm_epsilon: f.float(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
        activation_function: family.activation(),
        resid_pdrop: 0.0,
        embd_pdrop: 0.0,
        attn_pdrop: 0.0,
        tie_word_embeddings: !f.has("output.weight"),
        scale_attn_weights: true,
        scale_attn_by_inverse_layer_idx: false,
        bos_token_id: ids("tokenizer.ggml.bos_token_id")?,
        eos_token_id: eos,
        position_embedding: PositionEmbedding::Rope,
        bias: false,
        variant,
    };
    cfg.validate().map_err(|e| f.corrupt(e.to_string()))?;
    Ok(cfg)
}

/// llama.cpp's converter interleaves the two halves of each head of the Llama family's q and k
/// rows (`LlamaModel.permute`, for its rotation of neighbouring pairs); this puts each head's
/// rows back in `transformers`' order (the halves apart), moving whole rows of blocks, so that
/// the one rotation of [`crate::attention`] applies.
fn unpermute_rows(q: QTensor, n_head: usize) -> Result<QTensor> {
    let (rows, cols) = q.shape().dims2()?;
    let hd = rows / n_head;
    let row_bytes = cols / q.dtype().block_size() * q.dtype().type_size();
    let data = q.data()?;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (ours, theirs) = (h * hd + j * hd / 2 + i, h * hd + 2 * i + j);
                out[ours * row_bytes..][..row_bytes].copy_from_slice(&data[theirs * row_bytes..][..row_bytes]);
            }
        }
    }
    Ok(qtensor_from_ggml(q.dtype(), &out, vec![rows, cols], &Device::Cpu)?)
}

/// Matrices of one block format and width stacked by rows (their blocks side by side, as they
/// are stored): one product for q, k and v, or for gate and up. Q5_0 beside Q8_0 (llama.cpp's
/// Q4_K_M keeps some `attn_v` in Q8_0) stacks as Q8_0, its values recoded exactly; other mixes
/// (Q6_K beside Q5_0) are dequantized to f32 first.
fn stack(parts: Vec<QTensor>) -> Result<QTensor> {
    let is = |d: GgmlDType| parts.iter().any(|p| p.dtype() == d);
    let parts = match is(GgmlDType::Q5_0) && is(GgmlDType::Q8_0) {
        true => (parts.into_iter())
            .map(|p| match p.dtype() {
                GgmlDType::Q5_0 => recoded_codes(&p).map(|(codes, _)| codes),
                _ => Ok(p),
            })
            .collect::<Result<Vec<_>>>()?,
        false => parts,
    };
    let dtype = parts[0].dtype();
    let cols = parts[0].shape().dims2()?.1;
    let rows: usize = parts.iter().map(|p| p.shape().dims()[0]).sum();
    if parts.iter().all(|p| p.dtype() == dtype) {
        let mut bytes = Vec::new();
        for p in &parts {
            bytes.extend_from_slice(&p.data()?);
        }
        return Ok(qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &Device::Cpu)?);
    }
    let dense = parts
        .iter()
        .map(|p| p.dequantize(&Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(QTensor::quantize(&Tensor::cat(&dense, 0)?, GgmlDType::F32)?)
}

/// A matrix as inference holds it on `device`: packed for the project's kernels where they have
/// its format or one of the same values ([`Weight::Recoded`]), else candle's quantized matrix
/// (the CPU only); dense in `dtype` off the CPU.
pub fn weight(q: QTensor, dtype: DType, device: &Device) -> Result<Weight> {
    if !device.is_cpu() {
        return Ok(Weight::Dense(q.dequantize(device)?.to_dtype(dtype)?));
    }
    // The formats held as the codes of one the packed kernel has ([`recoded_codes`], [`q4k_codes`]).
    let recoded = match q.dtype() {
        GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1 => Some(recoded_codes(&q)?),
        GgmlDType::Q4K => q4k_codes(&q)?.map(|(codes, offsets)| (codes, Some(offsets))),
        _ => None,
    };
    Ok(match (recoded, WeightFormat::from_ggml(q.dtype())) {
        (Some((codes, offsets)), _) => {
            let codes = PackedMatrix::from_qtensor(&codes)?;
            // Q4_1's and Q5_1's minima as the file holds them (f16), Q4_K's offsets in f32.
            let group = |o: Tensor| match o.dtype() {
                DType::F16 => codes.group_mins(&o),
                _ => codes.group_offsets(&o),
            };
            Weight::Recoded {
                offsets: offsets.map(group).transpose()?,
                codes: Arc::new(codes),
                stored: q.dtype(),
            }
        }
        (None, Some(_)) => Weight::Packed(Arc::new(PackedMatrix::from_qtensor(&q)?)),
        (None, None) => Weight::Quant(Arc::new(q)),
    })
}

/// A Q4_1, Q5_0 or Q5_1 matrix as codes of a format the packed kernel has, and for Q4_1 and Q5_1
/// each block's `m` `(in / 32, out)` f16: each block (`d`, for Q4_1 and Q5_1 `m`, for Q5 the fifth
/// bits `qh`, then the low four bits) as a block of the same scale `d` and the codes `q − 8`
/// (Q4_0) or `q − 16` (Q8_0, a byte each), with the offset `m + 8d` or `m + 16d`
/// ([`PackedMatrix::group_mins`]): the same values (ggml's `dequantize_row_q5_0` reads the codes
/// this way).
fn recoded_codes(q: &QTensor) -> Result<(QTensor, Option<Tensor>)> {
    let (rows, cols) = q.shape().dims2()?;
    let stored = q.dtype();
    let (block_bytes, codes_dtype, minima) = match stored {
        GgmlDType::Q4_1 => (20, GgmlDType::Q4_0, true),
        GgmlDType::Q5_0 => (22, GgmlDType::Q8_0, false),
        GgmlDType::Q5_1 => (24, GgmlDType::Q8_0, true),
        other => return Err(candle_core::Error::Msg(format!("{other:?} has no recoded form")).into()),
    };
    let blocks = cols / 32;
    let data = q.data()?;
    if data.len() != rows * blocks * block_bytes {
        return Err(candle_core::Error::Msg(format!(
            "a {stored:?} matrix ({rows}, {cols}) holds {} bytes, not {}",
            data.len(),
            rows * blocks * block_bytes
        ))
        .into());
    }
    let mut codes = Vec::with_capacity(rows * blocks * codes_dtype.type_size());
    let mut mins = Vec::with_capacity(if minima { rows * blocks } else { 0 });
    for block in data.chunks_exact(block_bytes) {
        codes.extend_from_slice(&block[..2]);
        let rest = match minima {
            true => {
                mins.push(half::f16::from_le_bytes([block[2], block[3]]));
                &block[4..]
            }
            false => &block[2..],
        };
        match stored {
            GgmlDType::Q4_1 => codes.extend_from_slice(rest),
            _ => {
                let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
                let qs = &rest[4..20];
                let mut wide = [0u8; 32];
                for (j, &byte) in qs.iter().enumerate() {
                    let low = (byte & 0x0F) | ((((qh >> j) << 4) & 0x10) as u8);
                    let high = (byte >> 4) | (((qh >> (j + 12)) & 0x10) as u8);
                    wide[j] = (low as i8 - 16) as u8;
                    wide[j + 16] = (high as i8 - 16) as u8;
                }
                codes.extend_from_slice(&wide);
            }
        }
    }
    let codes = qtensor_from_ggml(codes_dtype, &codes, vec![rows, cols], &Device::Cpu)?;
    let mins = match minima {
        true => Some(
            Tensor::from_vec(mins, (rows, blocks), &Device::Cpu)?
                .t()?
                .contiguous()?, // (in / 32, out)
        ),
        false => None,
    };
    Ok((codes, mins))
}

/// A Q4_K matrix as Q4_0 codes with an offset per block of 32: each of a super-block's eight
/// sub-blocks of 32, `d·sc·q − dmin·m` (`sc`, `m` its 6-bit scale and minimum, `q` its 4-bit
/// codes, in ggml's `dequantize_row_q4_K` order), becomes a Q4_0 block of scale `s = d·sc` and
/// codes `q − 8`, with the offset `8·d·sc − dmin·m` (f32). The block scale is f16, which holds
/// `d·sc` (an f16 times a 6-bit integer) to within 2⁻¹¹ of itself: each value moves by at most
/// `|s − d·sc|·8`, a 256th of the sub-block's own quantization step `d·sc` (where llama.cpp's
/// product rounds the activations to 8 bits). 18 bytes per 32 values, as stored, plus a 4-byte
/// offset. On this project's Q4_0 kernel one token's product ran 1.06-1.88x faster than
/// through candle's `QMatMul` (in × out 1536×576 to 8192×2048, EPYC Zen 3, BENCHMARKS.md), 512
/// tokens' at 0.65-1.15x.
/// Q5_K stays in candle's form: as Q8_0 codes (34 bytes per 32 values against 22) its products
/// ran 2x faster at 512 tokens but up to 20% slower at one, the rate decode runs at. None where
/// a scale does not fit in an f16 (the matrix then stays in candle's form too).
fn q4k_codes(q: &QTensor) -> Result<Option<(QTensor, Tensor)>> {
    const QK_K: usize = 256;
    const BLOCK_BYTES: usize = 144; // d, dmin (f16), 12 bytes of scales, 128 of codes
    let (rows, cols) = q.shape().dims2()?;
    let data = q.data()?;
    if !cols.is_multiple_of(QK_K) || data.len() != rows * cols / QK_K * BLOCK_BYTES {
        return Err(candle_core::Error::Msg(format!(
            "a Q4_K matrix ({rows}, {cols}) holds {} bytes, not {} blocks of {BLOCK_BYTES}",
            data.len(),
            rows * cols / QK_K
        ))
        .into());
    }
    let blocks = cols / 32;
    let mut codes = Vec::with_capacity(rows * blocks * GgmlDType::Q4_0.type_size());
    let mut offsets = Vec::with_capacity(rows * blocks);
    for sb in data.chunks_exact(BLOCK_BYTES) {
        let d = half::f16::from_le_bytes([sb[0], sb[1]]).to_f32();
        let dmin = half::f16::from_le_bytes([sb[2], sb[3]]).to_f32();
        let (scales, qs) = (&sb[4..16], &sb[16..]);
        for j in 0..8 {
            // ggml's `get_scale_min_k4`: eight 6-bit scales and minima packed in 12 bytes.
            let (sc, m) = match j < 4 {
                true => (scales[j] & 63, scales[j + 4] & 63),
                false => (
                    (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                    (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
                ),
            };
            let scale = d * f32::from(sc); // exact in f32: 11 bits times 6
            let s = half::f16::from_f32(scale);
            if !s.is_finite() {
                return Ok(None);
            }
            offsets.push(8.0 * scale - dmin * f32::from(m));
            codes.extend_from_slice(&s.to_le_bytes());
            // Sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c + 32; a Q4_0
            // block holds its values i and i + 16 in byte i's low and high nibbles.
            let bytes = &qs[32 * (j / 2)..][..32];
            let code = |l: usize| match j % 2 {
                0 => bytes[l] & 0xF,
                _ => bytes[l] >> 4,
            };
            codes.extend((0..16).map(|l| code(l) | (code(l + 16) << 4)));
        }
    }
    let codes = qtensor_from_ggml(GgmlDType::Q4_0, &codes, vec![rows, cols], &Device::Cpu)?;
    let offsets = Tensor::from_vec(offsets, (rows, blocks), &Device::Cpu)?
        .t()?
        .contiguous()?; // (in / 32, out)
    Ok(Some((codes, offsets)))
}

/// The model of a llama.cpp GGUF file and its tokenizer, on `device` (activations f32 on the CPU;
/// the file's block formats kept unless `format` asks for another).
pub fn load(path: &Path, format: Option<WeightFormat>, device: &Device) -> Result<(Gpt, Tokenizer)> {
    let (mut f, cfg) = header(path)?;
    let vocab_size = cfg.vocab_size;
    let tokenizer = tokenizer(&f, &cfg)?;
    let dtype = match device.is_cpu() {
        true => DType::F32,
        false => format.map_or(DType::F16, |f| f.dtype()),
    };
    let (c, qw, kvw, w) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.mlp_width());
    let to = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(device)?) };
    let mut layers = Vec::with_capacity(cfg.n_layer);
    for i in 0..cfg.n_layer {
        let b = |name: &str| format!("blk.{i}.{name}");
        let mut q = f.tensor(&b("attn_q.weight"), &[qw, c])?;
        let mut k = f.tensor(&b("attn_k.weight"), &[kvw, c])?;
        let permuted = permuted_qk(cfg.variant.family);
        if permuted {
            q = unpermute_rows(q, cfg.n_head)?;
            k = unpermute_rows(k, cfg.n_kv_head())?;
        }
        let v = f.tensor(&b("attn_v.weight"), &[kvw, c])?;
        let mut bias = |name: &str, len: usize, has: bool| -> Result<Tensor> {
            match has {
                true => to(f.vector(&b(name), len)?),
                false => Ok(Tensor::zeros(len, dtype, device)?),
            }
        };
        // The Llama family's q and k biases are interleaved as their rows are.
        let heads = |b: Tensor, n: usize| -> Result<Tensor> {
            match permuted {
                true => Ok(b.reshape((n, (), 2))?.transpose(1, 2)?.contiguous()?.flatten_all()?),
                false => Ok(b),
            }
        };
        let qkv_bias = match cfg.variant.qkv_bias {
            true => Tensor::cat(
                &[
                    heads(bias("attn_q.bias", qw, true)?, cfg.n_head)?,
                    heads(bias("attn_k.bias", kvw, true)?, cfg.n_kv_head())?,
                    bias("attn_v.bias", kvw, true)?,
                ],
                0,
            )?,
            false => Tensor::zeros(qw + 2 * kvw, dtype, device)?,
        };
        let o_bias = bias("attn_output.bias", c, cfg.variant.o_bias)?;
        let gated = cfg.variant.gated_mlp;
        let gate_up_bias = match (cfg.variant.mlp_bias, gated) {
            (true, true) => Tensor::cat(&[bias("ffn_gate.bias", w, true)?, bias("ffn_up.bias", w, true)?], 0)?,
            (true, false) => bias("ffn_up.bias", w, true)?,
            (false, _) => Tensor::zeros(cfg.mlp_in_width(), dtype, device)?,
        };
        let down_bias = bias("ffn_down.bias", c, cfg.variant.mlp_bias)?;
        let qk_norm = match cfg.variant.qk_norm {
            true => Some((
                to(f.vector(&b("attn_q_norm.weight"), cfg.head_dim())?)?,
                to(f.vector(&b("attn_k_norm.weight"), cfg.head_dim())?)?,
            )),
            false => None,
        };
        let o = f.tensor(&b("attn_output.weight"), &[c, qw])?;
        // An ungated MLP (Arcee's) has no gate: up alone.
        let gate = match gated {
            true => Some(f.tensor(&b("ffn_gate.weight"), &[w, c])?),
            false => None,
        };
        let up = f.tensor(&b("ffn_up.weight"), &[w, c])?;
        let gate_up = match gate {
            Some(gate) => stack(vec![gate, up])?,
            None => up,
        };
        let down = f.tensor(&b("ffn_down.weight"), &[c, w])?;
        // Gemma's norms after the attention and the MLP (their gains stored as `1 + w`).
        let post_norms = match cfg.variant.post_norms {
            true => Some((
                to(f.vector(&b("post_attention_norm.weight"), c)?)?,
                to(f.vector(&b("post_ffw_norm.weight"), c)?)?,
            )),
            false => None,
        };
        layers.push(LayerWeights {
            attn_norm: to(f.vector(&b("attn_norm.weight"), c)?)?,
            qkv: (weight(stack(vec![q, k, v])?, dtype, device)?, qkv_bias),
            o: (weight(o, dtype, device)?, o_bias),
            qk_norm,
            mlp_norm: to(f.vector(&b("ffn_norm.weight"), c)?)?,
            post_norms,
            gate_up: (weight(gate_up, dtype, device)?, gate_up_bias),
            down: (weight(down, dtype, device)?, down_bias),
        });
    }
    let embed = weight(f.tensor("token_embd.weight", &[vocab_size, c])?, dtype, device)?;
    let head = match cfg.tie_word_embeddings {
        true => None,
        false => Some(weight(f.tensor("output.weight", &[vocab_size, c])?, dtype, device)?),
    };
    let weights = FamilyWeights {
        embed,
        layers,
        final_norm: to(f.vector("output_norm.weight", c)?)?,
        head,
    };
    let mut model = Gpt::from_family_weights(&cfg, weights, dtype, device)?;
    if let Some(format) = format {
        model = model.with_weight_format(format)?;
    }
    Ok((model, tokenizer))
}

/// The file's header and the config of its network (the vocabulary's size from the embedding's
/// rows; Llama 3's per-frequency rotary factors from `rope_freqs`).
fn header(path: &Path) -> Result<(File<'_>, Config)> {
    let mut f = File::open(path)?;
    let embed_dims = f
        .content
        .tensor_infos
        .get("token_embd.weight")
        .map(|i| i.shape.dims().to_vec())
        .ok_or_else(|| Error::MissingTensor {
            path: path.to_path_buf(),
            name: "token_embd.weight".into(),
        })?;
    let [vocab_size, _] = embed_dims[..] else {
        return Err(f.corrupt(format!("token_embd.weight is {embed_dims:?}, not a matrix")));
    };
    let mut cfg = config(&f, vocab_size)?;
    if let Some(factors) = rope_factors(&mut f, cfg.head_dim())? {
        if let Some(rope) = &mut cfg.variant.rope {
            rope.scaling = Some(RopeScaling::PerFrequency(factors));
        }
    }
    Ok((f, cfg))
}

/// The config of a GGUF file's network, without reading its weights.
pub fn load_config(path: &Path) -> Result<Config> {
    Ok(header(path)?.1)
}

/// A GGUF file's tokenizer, without reading its weights.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let (f, cfg) = header(path)?;
    tokenizer(&f, &cfg)
}

/// A chat template's source with the text of its BOS and EOS tokens.
pub type TemplateSource = (String, Option<String>, Option<String>);

/// A GGUF file's chat template (`tokenizer.chat_template`) with the text of its BOS and EOS
/// tokens, which templates write as `bos_token` and `eos_token`.
pub fn chat_template(path: &Path) -> Result<Option<TemplateSource>> {
    let f = File::open(path)?;
    let Some(source) = f.string("tokenizer.chat_template")? else {
        return Ok(None);
    };
    let tokens = f.strings("tokenizer.ggml.tokens")?.unwrap_or_default();
    let token = |key: &str| -> Result<Option<String>> {
        Ok(f.uint(key)?
            .and_then(|id| tokens.get(id as usize))
            .map(|t| t.to_string()))
    };
    Ok(Some((
        source.to_string(),
        token("tokenizer.ggml.bos_token_id")?,
        token("tokenizer.ggml.eos_token_id")?,
    )))
}

/// Llama 3.1's rescaled rotary frequencies, as llama.cpp's converter stores them: a
/// `rope_freqs.weight` vector of `head_dim / 2` divisors.
fn rope_factors(f: &mut File, head_dim: usize) -> Result<Option<Vec<f64>>> {
    if !f.has("rope_freqs.weight") {
        return Ok(None);
    }
    let factors = f.vector("rope_freqs.weight", head_dim / 2)?.to_vec1::<f32>()?;
    if let Some(bad) = factors.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
        return Err(f.corrupt(format!("rope_freqs.weight holds {bad}, not a positive divisor")));
    }
    Ok(Some(factors.into_iter().map(f64::from).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q4_K matrices run as Q4_0 codes with an offset per block: their values are candle's
    /// dequantization of the same blocks to within the f16 block scale's rounding (a 256th of a
    /// quantization step), and the product computes with them.
    #[test]
    fn q4_k_matrices_are_recoded_with_their_values() -> anyhow::Result<()> {
        let (rows, cols) = (24, 512);
        let w = (Tensor::randn(0f32, 0.05, (rows, cols), &Device::Cpu)? + 0.01)?;
        let x = Tensor::randn(0f32, 1.0, (5, cols), &Device::Cpu)?;
        let q = QTensor::quantize(&w, GgmlDType::Q4K)?;
        let exact = q.dequantize(&Device::Cpu)?;
        let weight = weight(q, DType::F32, &Device::Cpu)?;
        assert!(
            matches!(
                &weight,
                Weight::Recoded {
                    stored: GgmlDType::Q4K,
                    offsets: Some(_),
                    ..
                }
            ),
            "not recoded"
        );
        let diff = (weight.dense(DType::F32)? - &exact)?.abs()?;
        let (diff, largest) = (
            diff.flatten_all()?.max(0)?.to_scalar::<f32>()?,
            exact.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?,
        );
        // |s − d·sc|·8, with d·sc about the sub-block's range (at most twice the largest value)
        // over 15 codes: twice that for the quantizer's choice of scale. A code read wrong moves a
        // value by at least d·sc, 128 times more.
        let bound = 8.0 * 2f32.powi(-11) * 4.0 * largest / 15.0;
        assert!(diff <= bound, "values {diff} from candle's (bound {bound})");
        let y = weight.forward(&x, crate::layers::Autocast::Off)?;
        let reference = x.matmul(&exact.t()?)?;
        let scale = reference.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let d = (y - &reference)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(d < 0.02 * scale, "product {d} from the f32 one's (largest {scale})");
        Ok(())
    }

    /// Q4_1 and Q5_1 matrices held as codes and offsets give candle's dequantized values back
    /// through every use: the whole matrix, rows of it (a tied head's token embeddings: the
    /// offsets of a few columns of the tasks' table, one past the first group of 32), the product
    /// and the gradient of the product. 70 rows: the last group of columns is partial.
    #[test]
    fn offset_formats_give_their_values_through_every_use() -> anyhow::Result<()> {
        let (rows, cols) = (70, 128);
        let w = (Tensor::randn(0f32, 0.05, (rows, cols), &Device::Cpu)? + 0.01)?;
        let x = Tensor::randn(0f32, 1.0, (3, cols), &Device::Cpu)?;
        let dy = Tensor::randn(0f32, 1.0, (3, rows), &Device::Cpu)?;
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_1] {
            let q = QTensor::quantize(&w, dtype)?;
            let exact = q.dequantize(&Device::Cpu)?;
            let weight = weight(q, DType::F32, &Device::Cpu)?;
            assert!(
                matches!(&weight, Weight::Recoded { offsets: Some(_), .. }),
                "{dtype:?} not recoded"
            );
            let close = |a: &Tensor, b: &Tensor, what: &str| -> anyhow::Result<()> {
                let d = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                anyhow::ensure!(
                    d <= 1e-5 * scale.max(1e-6),
                    "{dtype:?} {what}: {d} off (largest {scale})"
                );
                Ok(())
            };
            close(&weight.dense(DType::F32)?, &exact, "values")?;
            let ids = Tensor::new(&[69u32, 0, 33, 5][..], &Device::Cpu)?;
            close(&weight.rows(&ids, DType::F32)?, &exact.index_select(&ids, 0)?, "rows")?;
            // The product quantizes the activations to 8 bits, as llama.cpp's does.
            let y = weight.forward(&x, crate::layers::Autocast::Off)?;
            let reference = x.matmul(&exact.t()?)?;
            let scale = reference.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let d = (y - &reference)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(
                d < 0.02 * scale,
                "{dtype:?} product {d} from the f32 one's (largest {scale})"
            );
            close(&weight.input_gradient(&dy)?, &dy.matmul(&exact)?, "input gradient")?;
        }
        Ok(())
    }
}
