//! Checkpoint directories in the Hugging Face GPT-2 layout: `config.json`, `model.safetensors`
//! (memory-mapped on load), `tokenizer.json` and, written for `transformers`,
//! `tokenizer_config.json`. Tensor names are `transformers`' with or without
//! the `transformer.` prefix; the `attn.bias`/`attn.masked_bias` buffers of older checkpoints and
//! a stored `lm_head.weight` (tied) are ignored. Files are written to a temporary name and renamed.

use std::collections::HashMap;
use std::path::Path;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::files::write_atomic;
use crate::gpt::Gpt;
use crate::hub::{self, HubId, RepoKind};
use crate::tokenizer::Tokenizer;
use gpt_kernels::WeightFormat;

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub use crate::tokenizer::TOKENIZER_CONFIG_FILE;
/// Sharded weights: the index naming each tensor's file, as `save_pretrained` writes it.
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";
/// The older tokenizer files of GPT-2 repositories, used when there is no `tokenizer.json`.
pub const VOCAB_FILE: &str = "vocab.json";
pub const MERGES_FILE: &str = "merges.txt";
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// A `gpt-train` run directory's checkpoint with the lowest validation loss.
pub const RUN_BEST: &str = "best";
/// A `gpt-train` run directory's link to its newest checkpoint.
pub const RUN_LATEST: &str = "latest";

/// The checkpoint directory that `path` names, as every command takes one: a checkpoint itself
/// (it holds `config.json`), or a `gpt-train` run directory, which names its `best/` checkpoint
/// (lowest validation loss), else its `latest/` one (a run stopped before its first evaluation).
pub fn resolve_dir(path: &Path) -> Result<std::path::PathBuf> {
    if path.join(CONFIG_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    if !path.exists() {
        return Err(Error::MissingFile {
            path: path.to_path_buf(),
        });
    }
    [RUN_BEST, RUN_LATEST]
        .iter()
        .map(|name| path.join(name))
        .find(|dir| dir.join(CONFIG_FILE).is_file())
        .ok_or_else(|| Error::NotACheckpoint {
            path: path.to_path_buf(),
        })
}

/// A checkpoint named on a command line, found.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// A directory in the checkpoint layout (for a Hub id, its snapshot in the Hub cache).
    pub dir: std::path::PathBuf,
    /// The Hub id it was named by, if it was.
    pub hub_id: Option<HubId>,
}

/// The checkpoint that `named` names, as every command takes one and as `from_pretrained`
/// decides: a llama.cpp GGUF file; a path that exists is a checkpoint or run directory ([`resolve_dir`]); anything else
/// is a Hub id (`gpt2`, `org/name`, `org/name@revision`), found in the Hub cache or downloaded
/// into it ([`fetch_model`]); `org/name:TAG` is the repository's GGUF file of that quantization
/// ([`fetch_gguf`]), and so is a repository of GGUF files named without a tag.
pub fn resolve(named: &str) -> Result<Resolved> {
    let path = Path::new(named);
    if crate::llamacpp::is_gguf_file(path) {
        // A llama.cpp GGUF file holds the model, its config and its tokenizer.
        return Ok(Resolved {
            dir: path.to_path_buf(),
            hub_id: None,
        });
    }
    if path.exists() {
        return Ok(Resolved {
            dir: resolve_dir(path)?,
            hub_id: None,
        });
    }
    // `org/name:TAG`: one GGUF file of a Hub repository, by its quantization tag.
    let (id, tag) = match named.rsplit_once(':') {
        Some((id, tag)) if !tag.is_empty() && tag.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') => {
            (id, Some(tag))
        }
        _ => (named, None),
    };
    match HubId::parse(id, RepoKind::Model) {
        Some(id) => Ok(Resolved {
            dir: fetch_model_or_gguf(&id, tag).map_err(|e| match e {
                Error::Hub { id, reason } => Error::Hub {
                    id,
                    reason: format!("{reason} (and there is no directory of that name here)"),
                },
                other => other,
            })?,
            hub_id: Some(id),
        }),
        None => Err(Error::MissingFile {
            path: path.to_path_buf(),
        }),
    }
}

/// [`fetch_model`], or where a tag is given or the repository holds GGUF files and no
/// `config.json`, its GGUF file ([`fetch_gguf`]).
fn fetch_model_or_gguf(id: &HubId, tag: Option<&str>) -> Result<std::path::PathBuf> {
    let snapshot = hub::Snapshot::open(id)?;
    if tag.is_some() || (!snapshot.has(CONFIG_FILE) && snapshot.files.iter().any(|f| f.ends_with(".gguf"))) {
        return fetch_gguf(&snapshot, tag);
    }
    fetch_model_in(&snapshot)
}

/// The GGUF file of a Hub repository that `tag` names (the one file whose name holds it, any
/// case: `Q4_K_M` as `llama-server -hf org/repo:Q4_K_M` chooses), downloaded into the cache
/// where missing. Without a tag: the repository's only GGUF file, else its Q4_K_M one, as
/// llama.cpp defaults. Projector files (`mmproj`) are not models; files split into parts are not
/// loaded.
pub fn fetch_gguf(snapshot: &hub::Snapshot, tag: Option<&str>) -> Result<std::path::PathBuf> {
    let ggufs: Vec<&String> = (snapshot.files.iter())
        .filter(|f| f.ends_with(".gguf") && !f.contains("mmproj"))
        .collect();
    let wanted = tag.unwrap_or("Q4_K_M").to_ascii_lowercase();
    let matching: Vec<&String> = ggufs
        .iter()
        .copied()
        .filter(|f| f.to_ascii_lowercase().contains(&wanted))
        .collect();
    let file = match (matching.as_slice(), tag) {
        ([one], _) => *one,
        ([], None) if ggufs.len() == 1 => ggufs[0],
        _ => {
            let listed: Vec<&str> = ggufs.iter().map(|f| f.as_str()).collect();
            return Err(Error::Hub {
                id: snapshot.id.to_string(),
                reason: format!(
                    "{} of its {} GGUF files match `{}` (name one by its quantization, `{}:Q8_0`): {}",
                    matching.len(),
                    ggufs.len(),
                    tag.unwrap_or("Q4_K_M (the default)"),
                    snapshot.id.repo,
                    listed.join(", ")
                ),
            });
        }
    };
    snapshot.get(file)
}

/// The adapter directory that `named` names, as the server's `--lora-modules` and `gpt-train
/// merge --adapter` take one: a directory with [`crate::lora::ADAPTER_CONFIG_FILE`], a LoRA run of gpt-train
/// (its `best/` checkpoint, else `latest/`), or else a Hugging Face Hub id whose repository holds
/// an adapter (found in the Hub cache, or downloaded into it).
pub fn resolve_adapter(named: &str) -> Result<std::path::PathBuf> {
    let path = Path::new(named);
    if path.exists() {
        return [path.to_path_buf(), path.join(RUN_BEST), path.join(RUN_LATEST)]
            .into_iter()
            .find(|dir| dir.join(crate::lora::ADAPTER_CONFIG_FILE).is_file())
            .ok_or_else(|| Error::MissingFile {
                path: path.join(crate::lora::ADAPTER_CONFIG_FILE),
            });
    }
    let Some(id) = crate::hub::HubId::parse(named, crate::hub::RepoKind::Model) else {
        return Err(Error::MissingFile {
            path: path.to_path_buf(),
        });
    };
    let snapshot = crate::hub::Snapshot::open(&id)?;
    for file in [crate::lora::ADAPTER_CONFIG_FILE, crate::lora::ADAPTER_WEIGHTS_FILE] {
        if !snapshot.has(file) {
            return Err(Error::Hub {
                id: id.to_string(),
                reason: format!("the repository has no {file}: it is not a PEFT LoRA adapter"),
            });
        }
        snapshot.get(file)?;
    }
    Ok(snapshot.dir)
}

/// The snapshot directory of a model on the Hub with what loading it needs, downloaded into the
/// cache where missing: `config.json` first (an architecture other than GPT-2's is refused before
/// any weights are fetched), the weights (`model.safetensors`, or the shards its index names), the
/// tokenizer (`tokenizer.json`, or `vocab.json` and `merges.txt`), and `tokenizer_config.json` and
/// `generation_config.json` where the repository has them.
pub fn fetch_model(id: &HubId) -> Result<std::path::PathBuf> {
    fetch_model_in(&hub::Snapshot::open(id)?)
}

/// [`fetch_model`] from a repository's listing already opened.
fn fetch_model_in(snapshot: &hub::Snapshot) -> Result<std::path::PathBuf> {
    let id = &snapshot.id;
    let refuse = |reason: String| Error::Hub {
        id: id.to_string(),
        reason,
    };
    if !snapshot.has(CONFIG_FILE) {
        return Err(refuse(format!(
            "the repository has no {CONFIG_FILE}: not a transformers model ({} files: {})",
            snapshot.files.len(),
            snapshot.files.iter().take(8).cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    Config::from_file(&snapshot.get(CONFIG_FILE)?)?;
    if snapshot.has(WEIGHTS_FILE) {
        snapshot.get(WEIGHTS_FILE)?;
    } else if snapshot.has(WEIGHTS_INDEX_FILE) {
        for shard in shard_files(&snapshot.get(WEIGHTS_INDEX_FILE)?)? {
            snapshot.get(&shard)?;
        }
    } else if snapshot.has("pytorch_model.bin") || snapshot.has("pytorch_model.bin.index.json") {
        return Err(refuse(
            "the repository has its weights only as pytorch_model.bin (a pickle), which gpt-rs does not load: \
             convert it to model.safetensors (transformers: `save_pretrained(dir, safe_serialization=True)`) \
             or use a revision that has one"
                .into(),
        ));
    } else {
        return Err(refuse(format!(
            "the repository has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX_FILE})"
        )));
    }
    if snapshot.has(TOKENIZER_FILE) {
        snapshot.get(TOKENIZER_FILE)?;
    } else if snapshot.has(VOCAB_FILE) && snapshot.has(MERGES_FILE) {
        snapshot.get(VOCAB_FILE)?;
        snapshot.get(MERGES_FILE)?;
    } else {
        return Err(refuse(format!(
            "the repository has no {TOKENIZER_FILE} (nor {VOCAB_FILE} with {MERGES_FILE})"
        )));
    }
    for optional in [TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE] {
        if snapshot.has(optional) {
            snapshot.get(optional)?;
        }
    }
    Ok(snapshot.dir.clone())
}

/// The tokenizer of a model on the Hub, fetching only its tokenizer files (`tokenizer.json`, or
/// `vocab.json` and `merges.txt`).
pub fn fetch_tokenizer(id: &HubId) -> Result<Tokenizer> {
    let snapshot = hub::Snapshot::open(id)?;
    if snapshot.has(TOKENIZER_FILE) {
        return Tokenizer::from_file(&snapshot.get(TOKENIZER_FILE)?);
    }
    if snapshot.has(VOCAB_FILE) && snapshot.has(MERGES_FILE) {
        return Tokenizer::from_vocab_merges(&snapshot.get(VOCAB_FILE)?, &snapshot.get(MERGES_FILE)?);
    }
    Err(Error::Hub {
        id: id.to_string(),
        reason: format!("the repository has no {TOKENIZER_FILE} (nor {VOCAB_FILE} with {MERGES_FILE})"),
    })
}

/// The shard files that a `model.safetensors.index.json` names, each once, in order.
fn shard_files(index: &Path) -> Result<Vec<String>> {
    let corrupt = |reason: String| Error::CorruptCheckpoint {
        path: index.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| corrupt("no `weight_map` object".into()))?;
    let mut files: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| corrupt(format!("`{tensor}` maps to {file}, not a file name")))?;
        if file.contains("..") || file.starts_with('/') {
            return Err(corrupt(format!("`{tensor}` maps to `{file}`, outside the checkpoint")));
        }
        if !files.iter().any(|f| f == file) {
            files.push(file.to_string());
        }
    }
    Ok(files)
}

/// Turns candle's loading errors into ours, naming the file and the tensor.
fn loading_error(path: &Path, err: candle_core::Error) -> Error {
    match err {
        candle_core::Error::WithBacktrace { inner, .. } => loading_error(path, *inner),
        candle_core::Error::Context { inner, .. } => loading_error(path, *inner),
        candle_core::Error::CannotFindTensor { path: name }
        | candle_core::Error::SafeTensor(safetensors::SafeTensorError::TensorNotFound(name)) => Error::MissingTensor {
            path: path.to_path_buf(),
            name,
        },
        candle_core::Error::UnexpectedShape { msg, expected, got } => Error::ShapeMismatch {
            name: msg.trim_start_matches("shape mismatch for ").to_string(),
            expected: expected.dims().to_vec(),
            actual: got.dims().to_vec(),
        },
        other => Error::Candle(other),
    }
}

/// Loads the network of a checkpoint directory in `dtype` on `device`, for inference (in
/// [`Gpt::into_inference_layout`]).
pub fn load_model(dir: &Path, dtype: DType, device: &Device) -> Result<Gpt> {
    if crate::llamacpp::is_gguf_file(dir) {
        // llama.cpp's file, its matrices dequantized to `dtype`.
        let format = match dtype {
            DType::F16 => WeightFormat::F16,
            DType::BF16 => WeightFormat::Bf16,
            _ => WeightFormat::F32,
        };
        return Ok(crate::llamacpp::load(dir, Some(format), device)?.0);
    }
    let cfg = Config::from_file(&dir.join(CONFIG_FILE))?;
    let path = dir.join(WEIGHTS_FILE);
    let gguf = dir.join(crate::gguf::GGUF_FILE);
    if !path.exists() && gguf.exists() {
        if dtype != DType::F32 {
            return Err(Error::InvalidConfig(format!(
                "{} holds its weights in its own format: load it without a dtype (f32 activations)",
                gguf.display()
            )));
        }
        return crate::gguf::load_gguf(&gguf, &cfg, device);
    }
    let index = dir.join(WEIGHTS_INDEX_FILE);
    let files = if path.exists() {
        vec![path.clone()]
    } else if index.exists() {
        shard_files(&index)?.iter().map(|f| dir.join(f)).collect()
    } else if dir.join(crate::lora::ADAPTER_CONFIG_FILE).is_file() {
        let base = crate::lora::LoraConfig::from_file(&dir.join(crate::lora::ADAPTER_CONFIG_FILE))
            .ok()
            .and_then(|c| c.base_model_name_or_path)
            .unwrap_or_else(|| "BASE".into());
        return Err(Error::Adapter {
            path: dir.to_path_buf(),
            reason: format!(
                "this directory holds a LoRA adapter, not a model ({WEIGHTS_FILE} is missing): merge it into \
                 its base (`gpt-train merge --checkpoint {base} --adapter {}`)",
                dir.display()
            ),
        });
    } else {
        return Err(Error::MissingFile { path });
    };
    let path = if files.len() == 1 { files[0].clone() } else { index };
    // SAFETY: the files are mapped read-only; as with any memory-mapped checkpoint, they must not
    // be modified by another process while the model is being loaded.
    let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| Error::CorruptCheckpoint {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let prefixed = st.get("transformer.wte.weight").is_ok();
    let vb = VarBuilder::from_backend(Box::new(st), dtype, device.clone());
    let vb = if prefixed { vb.pp("transformer") } else { vb };
    Gpt::new(vb, &cfg)
        .map_err(|e| match e {
            Error::Candle(err) => loading_error(&path, err),
            other => other,
        })?
        .into_inference_layout()
}

/// Loads a checkpoint directory: the model and its tokenizer, checked against each other.
/// The config of the checkpoint `dir` (its `config.json`), or of a llama.cpp GGUF file.
pub fn load_config(dir: &Path) -> Result<Config> {
    match crate::llamacpp::is_gguf_file(dir) {
        true => crate::llamacpp::load_config(dir),
        false => Config::from_file(&dir.join(CONFIG_FILE)),
    }
}

pub fn load_dir(dir: &Path, dtype: DType, device: &Device) -> Result<(Gpt, Tokenizer)> {
    require_dir(dir)?;
    let model = load_model(dir, dtype, device)?;
    let tokenizer = model_tokenizer(dir, model.config())?;
    Ok((model, tokenizer))
}

fn require_dir(dir: &Path) -> Result<()> {
    match dir.is_dir() {
        true => Ok(()),
        false => Err(Error::MissingFile {
            path: dir.to_path_buf(),
        }),
    }
}

/// The tokenizer of `dir` (`tokenizer.json`, else `vocab.json` with `merges.txt`), checked
/// against the model's vocabulary.
pub fn load_tokenizer(dir: &Path, model_vocab: usize) -> Result<Tokenizer> {
    if crate::llamacpp::is_gguf_file(dir) {
        return crate::llamacpp::load_tokenizer(dir);
    }
    let json = dir.join(TOKENIZER_FILE);
    let tokenizer = if !json.exists() && dir.join(VOCAB_FILE).exists() {
        Tokenizer::from_vocab_merges(&dir.join(VOCAB_FILE), &dir.join(MERGES_FILE))?
    } else {
        Tokenizer::from_file(&json)?
    };
    if tokenizer.vocab_size() > model_vocab {
        return Err(Error::VocabMismatch {
            tokenizer: tokenizer.vocab_size(),
            model: model_vocab,
        });
    }
    Ok(tokenizer.with_chat_template(crate::chat::ChatTemplate::source_in(dir)?))
}

/// The end-of-sequence ids of a checkpoint of the families other than GPT-2 (whose end is its
/// tokenizer's `<|endoftext|>`): `generation_config.json`'s `eos_token_id` (a number or a list),
/// else `config.json`'s.
fn family_eos(dir: &Path, cfg: &Config) -> Vec<u32> {
    let generation = std::fs::read_to_string(dir.join(GENERATION_CONFIG_FILE))
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok());
    let ids: Vec<u32> = match generation.as_ref().map(|g| &g["eos_token_id"]) {
        Some(serde_json::Value::Number(n)) => n.as_u64().and_then(|n| u32::try_from(n).ok()).into_iter().collect(),
        Some(serde_json::Value::Array(ids)) => ids
            .iter()
            .filter_map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    };
    match ids.is_empty() {
        true => cfg.eos_ids(),
        false => ids,
    }
}

/// [`load_tokenizer`], with the end-of-sequence ids the checkpoint names where it is not GPT-2.
fn model_tokenizer(dir: &Path, cfg: &Config) -> Result<Tokenizer> {
    let tokenizer = load_tokenizer(dir, cfg.vocab_size)?;
    Ok(match cfg.is_gpt2_shaped() {
        true => tokenizer,
        false => tokenizer.with_eos(family_eos(dir, cfg)),
    })
}

/// Loads a checkpoint directory for inference with its weight matrices in `format` (`None`: as
/// stored, f32 for safetensors). On the CPU, activations are f32 whatever the format; on a GPU,
/// f16 and bf16 run the whole network in that dtype, as `load_dir` does.
///
/// `dir` may also be a llama.cpp GGUF file ([`crate::llamacpp`]).
pub fn load_dir_as(dir: &Path, format: Option<WeightFormat>, device: &Device) -> Result<(Gpt, Tokenizer)> {
    if crate::llamacpp::is_gguf_file(dir) {
        return crate::llamacpp::load(dir, format, device);
    }
    require_dir(dir)?;
    let model = match format {
        Some(f) if !device.is_cpu() && f.ggml().is_none() => load_model(dir, f.dtype(), device)?,
        Some(f) => {
            let model = load_model(dir, DType::F32, device)?;
            if model.weight_format() == Some(f) {
                model
            } else {
                model.with_weight_format(f)?
            }
        }
        None => load_model(dir, DType::F32, device)?,
    };
    let tokenizer = model_tokenizer(dir, model.config())?;
    Ok((model, tokenizer))
}

fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    }
}

/// Serialises `model`'s weights in `dtype` as `transformers`' `save_pretrained` does (with the
/// `{"format": "pt"}` metadata it requires), plus any `extra` metadata.
pub fn weights_bytes(model: &Gpt, dtype: DType, extra: &HashMap<String, String>) -> Result<Vec<u8>> {
    let tensors = model
        .named_tensors()?
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(dtype)?.contiguous()?)))
        .collect::<Result<Vec<(String, Tensor)>>>()?;
    let mut metadata = extra.clone();
    metadata.insert("format".to_string(), "pt".to_string());
    safetensors::serialize(tensors, Some(metadata)).map_err(|e| Error::Candle(candle_core::Error::wrap(e)))
}

/// Saves `model` (in `dtype`) and `tokenizer` to `dir` in the GPT-2 layout, each file atomically.
pub fn save_dir(dir: &Path, model: &Gpt, tokenizer: &Tokenizer, dtype: DType) -> Result<()> {
    save_dir_with_metadata(dir, model, tokenizer, dtype, &HashMap::new())
}

/// [`save_dir`], with `metadata` added to the safetensors header (the trainer records its step).
pub fn save_dir_with_metadata(
    dir: &Path,
    model: &Gpt,
    tokenizer: &Tokenizer,
    dtype: DType,
    metadata: &HashMap<String, String>,
) -> Result<()> {
    if tokenizer.vocab_size() > model.config().vocab_size {
        return Err(Error::VocabMismatch {
            tokenizer: tokenizer.vocab_size(),
            model: model.config().vocab_size,
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let weights = weights_bytes(model, dtype, metadata)?;
    write_atomic(&dir.join(WEIGHTS_FILE), &weights)?;
    write_side_files(dir, model, tokenizer, dtype)
}

/// Saves `model` with its weight matrices in `format` as `dir/model.gguf` (see [`crate::gguf`])
/// with the same config and tokenizer files as [`save_dir`]; any `model.safetensors` there is
/// removed (it would be loaded first).
pub fn save_gguf_dir(dir: &Path, model: &Gpt, tokenizer: &Tokenizer, format: WeightFormat) -> Result<()> {
    if tokenizer.vocab_size() > model.config().vocab_size {
        return Err(Error::VocabMismatch {
            tokenizer: tokenizer.vocab_size(),
            model: model.config().vocab_size,
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let bytes = crate::gguf::gguf_bytes(model, format)?;
    write_atomic(&dir.join(crate::gguf::GGUF_FILE), &bytes)?;
    let stale = dir.join(WEIGHTS_FILE);
    if stale.exists() {
        std::fs::remove_file(&stale).map_err(|e| Error::io(&stale, e))?;
    }
    write_side_files(dir, model, tokenizer, DType::F32)
}

/// The files of a checkpoint directory beside its weights: `config.json`, `tokenizer.json` and
/// `tokenizer_config.json` (a LoRA run's checkpoints hold these and the adapter).
pub fn write_side_files(dir: &Path, model: &Gpt, tokenizer: &Tokenizer, dtype: DType) -> Result<()> {
    let mut config = model.config().to_hf_value()?;
    config["torch_dtype"] = torch_dtype(dtype).into(); // transformers < 5
    config["dtype"] = torch_dtype(dtype).into();
    let config = serde_json::to_string_pretty(&config).map_err(|e| Error::InvalidConfig(e.to_string()))?;
    let tokenizer_config = serde_json::to_string_pretty(&tokenizer.hf_config(model.config().n_positions))
        .map_err(|e| Error::InvalidConfig(e.to_string()))?;
    tokenizer.save(&dir.join(TOKENIZER_FILE))?;
    write_atomic(&dir.join(TOKENIZER_CONFIG_FILE), tokenizer_config.as_bytes())?;
    write_atomic(&dir.join(CONFIG_FILE), config.as_bytes())
}

/// The `__metadata__` strings of a safetensors file, reading only its header.
pub fn read_metadata(path: &Path) -> Result<HashMap<String, String>> {
    use std::io::Read;
    let corrupt = |reason: String| Error::CorruptCheckpoint {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|e| corrupt(e.to_string()))?;
    let len = u64::from_le_bytes(len);
    if len > 100_000_000 {
        return Err(corrupt(format!("header of {len} bytes")));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(|e| corrupt(e.to_string()))?;
    let header: serde_json::Value = serde_json::from_slice(&header).map_err(|e| corrupt(e.to_string()))?;
    Ok(serde_json::from_value(header["__metadata__"].clone()).unwrap_or_default())
}
