//! Helpers shared by the test suites of every crate (a dev-dependency of each): the repository's
//! files and corpus, tensor comparisons, [`fake_hub`], a stand-in for the Hugging Face Hub, and
//! [`write_llama_cpp_gguf`], a checkpoint of the fixtures as llama.cpp's converter writes it.

pub mod fake_hub;

use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::Tensor;

/// `path` under the repository root.
pub fn repo(path: &str) -> PathBuf {
    // This crate sits at tests/support.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// The repository's copy of tinyshakespeare (`data/`).
/// The random-weight checkpoints `transformers` saved of each decoder family
/// (`tests/fixtures/make_family_fixtures.py`), by case.
pub const FAMILY_CASES: [&str; 10] = [
    "llama-gqa",
    "llama3-scaled",
    "qwen2-bias",
    "qwen3-qknorm",
    "arcee-relu2",
    "mistral",
    "mistral-window",
    "gemma2-softcap",
    "gemma3-local",
    "gemma3-scalar",
];

/// The directory of a case of [`FAMILY_CASES`].
pub fn family_dir(case: &str) -> PathBuf {
    repo("tests/fixtures/families").join(case)
}

/// `tests/fixtures/check_family_load.py` on each `(checkpoint, case)` pair in one process:
/// `transformers` loads each checkpoint and must give the case's `expected.safetensors` logits
/// within 1e-4. Fails with what it printed otherwise.
pub fn check_in_transformers(pairs: &[(PathBuf, PathBuf)]) -> anyhow::Result<()> {
    let mut check = std::process::Command::new(python());
    check.arg(repo("tests/fixtures/check_family_load.py"));
    for (checkpoint, case) in pairs {
        check.arg(checkpoint).arg(case);
    }
    let run = check.output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    anyhow::ensure!(
        run.status.success() && said.matches("worst difference").count() == pairs.len(),
        "{said}"
    );
    Ok(())
}

pub fn shakespeare_path() -> PathBuf {
    repo("data/tinyshakespeare.txt")
}

/// The first `chars` characters of tinyshakespeare (all of it for `usize::MAX`).
pub fn shakespeare(chars: usize) -> anyhow::Result<String> {
    let path = shakespeare_path();
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(text.chars().take(chars).collect())
}

/// The largest absolute difference between two tensors of one shape (on `a`'s device).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    let b = b.to_device(a.device())?;
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// `len` values uniform in [-1, 1) from a splitmix64 stream keyed by `seed`: full-rank
/// matrices, as gradients are (values in an arithmetic pattern make low-rank ones).
pub fn uniform(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The Python the tests that need its packages run (`GPT_TEST_PYTHON`), else `python3`.
pub fn python() -> String {
    std::env::var("GPT_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The `transformers` checkpoint in `dir` (Llama, Mistral, Qwen2 or Qwen3, with a byte-level BPE
/// `tokenizer.json`) written to `path` as llama.cpp's converter (`convert_hf_to_gguf.py`) writes
/// it: GGUF metadata, llama.cpp's tensor names, the Llama family's q and k rows permuted as its
/// `LlamaModel.permute` does, the tokenizer as `tokenizer.ggml.*`; matrices in `format`, vectors
/// in f32.
pub fn write_llama_cpp_gguf(dir: &Path, path: &Path, format: GgmlDType) -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::QTensor;
    use candle_core::Device;
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let n = |k: &str| cfg[k].as_u64().unwrap_or(0) as u32;
    let model_type = cfg["model_type"].as_str().unwrap_or_default();
    let arch = match model_type {
        "mistral" => "llama",
        "gemma3_text" => "gemma3",
        other => other,
    };
    let gemma = arch.starts_with("gemma");
    let (n_head, n_kv) = (n("num_attention_heads") as usize, n("num_key_value_heads") as usize);
    let head_dim = cfg["head_dim"]
        .as_u64()
        .map_or(n("hidden_size") as usize / n_head, |d| d as usize);
    let theta = cfg["rope_parameters"]["rope_theta"]
        .as_f64()
        .or(cfg["rope_parameters"]["full_attention"]["rope_theta"].as_f64())
        .or(cfg["rope_theta"].as_f64())
        .unwrap_or(1e4);
    let global_rope = match cfg["rope_parameters"].get("full_attention") {
        Some(p) => p.clone(),
        None => cfg["rope_parameters"].clone(),
    };
    let key = |k: &str| format!("{arch}.{k}");
    let tokenizer: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json"))?)?;
    let vocab = tokenizer["model"]["vocab"]
        .as_object()
        .ok_or_else(|| anyhow::anyhow!("vocab"))?;
    let mut tokens = vec![String::new(); vocab.len()];
    for (token, id) in vocab {
        tokens[id.as_u64().unwrap_or(0) as usize] = token.clone();
    }
    let merges: Vec<String> = tokenizer["model"]["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            serde_json::Value::Array(pair) => {
                format!("{} {}", pair[0].as_str().unwrap_or(""), pair[1].as_str().unwrap_or(""))
            }
            other => other.as_str().unwrap_or_default().to_string(),
        })
        .collect();
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    let mut types = vec![Value::I32(1); tokens.len()];
    types[0] = Value::I32(3); // <|endoftext|>, a control token
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (key("block_count"), Value::U32(n("num_hidden_layers"))),
        (key("context_length"), Value::U32(n("max_position_embeddings"))),
        (key("embedding_length"), Value::U32(n("hidden_size"))),
        (key("feed_forward_length"), Value::U32(n("intermediate_size"))),
        (key("attention.head_count"), Value::U32(n_head as u32)),
        (key("attention.head_count_kv"), Value::U32(n_kv as u32)),
        (key("attention.key_length"), Value::U32(head_dim as u32)),
        (key("rope.freq_base"), Value::F32(theta as f32)),
        (
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("gpt-2".into())),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        ("tokenizer.ggml.merges".into(), strings(merges)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
    ];
    // What llama.cpp's converter writes of Gemma's and Mistral's windows, soft-caps and rotary
    // scaling (Gemma 3's sliding layers' base is llama.cpp's own, 10000).
    if let Some(window) = cfg["sliding_window"].as_u64() {
        metadata.push((key("attention.sliding_window"), Value::U32(window as u32)));
        // Gemma 3's files carry no pattern where it is llama.cpp's own (five sliding layers to
        // one global); another is written as the converter writes Gemma 3n's, a flag a layer.
        let types: Vec<bool> = cfg["layer_types"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| t.as_str() == Some("sliding_attention"))
            .collect();
        let default = (0..types.len()).map(|i| (i + 1) % 6 != 0).collect::<Vec<_>>();
        if arch == "gemma3" && types != default {
            metadata.push((
                key("attention.sliding_window_pattern"),
                Value::Array(types.into_iter().map(Value::Bool).collect()),
            ));
        }
    }
    for name in ["attn_logit_softcapping", "final_logit_softcapping"] {
        if let Some(cap) = cfg[name].as_f64() {
            metadata.push((key(name), Value::F32(cap as f32)));
        }
    }
    if global_rope["rope_type"].as_str() == Some("linear") {
        metadata.push((key("rope.scaling.type"), Value::String("linear".into())));
        metadata.push((
            key("rope.scaling.factor"),
            Value::F32(global_rope["factor"].as_f64().unwrap_or(1.0) as f32),
        ));
    }
    // llama.cpp's `LlamaModel.permute`: each head's rows (h, 2, hd/2) -> (h, hd/2, 2).
    let permute = |w: &Tensor, heads: usize| -> anyhow::Result<Tensor> {
        let (rows, cols) = w.dims2()?;
        Ok(w.reshape((heads, 2, rows / heads / 2, cols))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((rows, cols))?)
    };
    // Gemma's `post_attention_layernorm` is the attention's output norm, its MLP norm
    // `pre_feedforward_layernorm`.
    let post_attention = if gemma { "post_attention_norm" } else { "ffn_norm" };
    let names = [
        ("model.embed_tokens", "token_embd"),
        ("model.norm", "output_norm"),
        ("lm_head", "output"),
        ("input_layernorm", "attn_norm"),
        ("post_attention_layernorm", post_attention),
        ("pre_feedforward_layernorm", "ffn_norm"),
        ("post_feedforward_layernorm", "post_ffw_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    let mut tensors = Vec::new();
    for (name, t) in candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)? {
        let (stem, suffix) = name.rsplit_once('.').unwrap_or((&name, ""));
        let (layer, stem) = match stem.strip_prefix("model.layers.") {
            Some(rest) => {
                let (i, rest) = rest.split_once('.').unwrap_or((rest, ""));
                (Some(i.to_string()), rest.to_string())
            }
            None => (None, stem.to_string()),
        };
        let ours = names
            .iter()
            .find(|(hf, _)| *hf == stem)
            .map(|(_, g)| *g)
            .ok_or_else(|| anyhow::anyhow!("{name}"))?;
        let t = match (arch, ours, suffix) {
            ("llama" | "arcee", "attn_q", "weight") => permute(&t, n_head)?,
            ("llama" | "arcee", "attn_k", "weight") => permute(&t, n_kv)?,
            // Gemma's converter stores the norms' gains as `1 + w`.
            (_, norm, "weight") if gemma && norm.ends_with("norm") => (t + 1.0)?,
            _ => t,
        };
        let gguf_name = match layer {
            Some(i) => format!("blk.{i}.{ours}.{suffix}"),
            None => format!("{ours}.{suffix}"),
        };
        let dtype = if t.rank() == 2 { format } else { GgmlDType::F32 };
        tensors.push((gguf_name, QTensor::quantize(&t, dtype)?));
    }
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(path)?;
    candle_core::quantized::gguf_file::write(&mut out, &metadata, &tensors)?;
    Ok(())
}
