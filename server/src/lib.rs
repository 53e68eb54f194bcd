//! `gpt-server`: OpenAI-compatible completions over HTTP for GPT-2-layout checkpoints.
//!
//! Request flow: `app` (the router and its middleware) → `state::ModelRequest` (the body parsed,
//! the model checked) → a handler in `routes` → `validation` (raw request → valid one, tokenised
//! off the async runtime, into the engine's `ValidRequest`) → `engine` (model thread, continuous
//! batching, incremental detokenisation and stop strings) → events → `fold` and `respond` (JSON or
//! SSE chunks).

pub mod adapters;
pub mod api;
pub mod app;
pub mod chat;
pub mod engine;
pub mod error;
pub mod fold;
mod gbnf;
pub mod metrics;
pub mod openapi;
pub mod respond;
pub mod routes;
pub mod serve;
pub mod state;
pub mod structured;
pub mod tools;
pub mod validation;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;

use anyhow::Context;

use crate::engine::{Engine, EngineConfig};
use crate::metrics::Metrics;
use crate::state::AppState;
use crate::validation::Limits;
use gpt::chat::ChatTemplate;

/// What `serve` needs beyond the checkpoint.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model_name: String,
    pub api_key: Option<String>,
    pub max_batch_size: usize,
    pub max_queue: usize,
    /// Prompt tokens prefilled together in one step, at most (a longer prompt still runs, alone).
    pub max_batch_prefill_tokens: usize,
    pub max_tokens_cap: usize,
    pub body_limit: usize,
    /// A Jinja chat template file, instead of the checkpoint's own (or the fallback).
    pub chat_template: Option<PathBuf>,
    /// Origins allowed to call the API from a browser; `*` for any.
    pub cors_origins: Vec<String>,
    /// MiB of KV cache kept for prefix caching (0: off).
    pub prefix_cache_mib: usize,
    /// MiB of KV cache allocated at startup and kept for reuse (`gpt::set_kv_pool_limit`,
    /// `gpt::fill_kv_pool`); `None`: [`default_kv_cache_bytes`].
    pub kv_cache_mib: Option<usize>,
    /// What the KV cache stores (`gpt::KvCacheDtype`: f16 on the CPU where the weights are
    /// quantized or 16-bit, by default).
    pub kv_cache_dtype: gpt::KvCacheDtype,
    /// How the CPU's products with f32 or bf16 weights round (`high`: bf16 products on AMX tiles).
    pub matmul_precision: gpt::MatmulPrecision,
    /// A request running longer is ended (`None`: no limit).
    pub request_timeout: Option<std::time::Duration>,
    /// A stream whose client reads nothing for this long is dropped.
    pub stream_timeout: std::time::Duration,
    /// `/metrics` wants `Authorization: Bearer KEY` (`None`: open, as `/health` is).
    pub metrics_key: Option<String>,
    /// Speculative decoding, if on.
    pub speculative: Option<Speculative>,
    /// LoRA adapters served beside the model from the start (`--lora-modules`).
    pub lora_modules: Vec<adapters::LoraModule>,
    /// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` are routed (vLLM's
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub runtime_lora_updating: bool,
}

/// Speculative decoding's settings (see `engine::speculate`).
#[derive(Debug, Clone)]
pub struct Speculative {
    /// The draft model's checkpoint directory; `None`: n-gram lookup.
    pub draft: Option<PathBuf>,
    /// Tokens proposed per step at most.
    pub num_tokens: usize,
    /// Speculate only while at most this many sequences run.
    pub max_batch: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "default".into(),
            api_key: None,
            max_batch_size: 16,
            max_queue: 256,
            max_batch_prefill_tokens: 1024,
            max_tokens_cap: 1024,
            body_limit: 1 << 20,
            chat_template: None,
            cors_origins: Vec::new(),
            prefix_cache_mib: 256,
            kv_cache_mib: None,
            kv_cache_dtype: gpt::KvCacheDtype::Auto,
            matmul_precision: gpt::MatmulPrecision::Highest,
            request_timeout: Some(std::time::Duration::from_secs(600)),
            stream_timeout: std::time::Duration::from_secs(60),
            metrics_key: None,
            speculative: None,
            lora_modules: Vec::new(),
            runtime_lora_updating: false,
        }
    }
}

/// The chat template: `--chat-template FILE`, else `chat_template` in the checkpoint's
/// `tokenizer_config.json`, else the plain fallback for base models
/// ([`gpt::chat::FALLBACK_TEMPLATE`]); see [`ChatTemplate::for_checkpoint`].
pub fn load_chat_template(checkpoint: &Path, file: Option<&Path>) -> anyhow::Result<ChatTemplate> {
    Ok(ChatTemplate::for_checkpoint(checkpoint, file)?)
}

/// The KV cache a server holds at most at once: a full batch of sequences at the model's whole
/// context, and the prefix cache at its bound; at most 1 GiB (past it, blocks are allocated as
/// sequences need them and freed when they end).
pub fn default_kv_cache_bytes(
    cfg: &gpt::Config,
    dtype: candle_core::DType,
    max_batch: usize,
    prefix_cache: usize,
) -> usize {
    let per_position = cfg.kv_bytes_per_token(dtype);
    (max_batch.max(1) * cfg.n_positions * per_position + prefix_cache).min(1 << 30)
}

/// Loads the checkpoint, starts the engine thread and returns the router's state.
pub fn load_state(
    checkpoint: &Path,
    device: &Device,
    format: Option<gpt::WeightFormat>,
    cfg: &ServerConfig,
) -> anyhow::Result<Arc<AppState>> {
    let (model, tokenizer) = gpt::load_dir_as(checkpoint, format, device)?;
    let model = model.with_matmul_precision(cfg.matmul_precision)?;
    let kv_dtype = cfg.kv_cache_dtype.resolve(&model);
    let model = model.with_kv_cache_dtype(kv_dtype)?;
    tracing::info!(
        checkpoint = %checkpoint.display(),
        parameters = model.num_parameters(),
        device = gpt::device_name(device),
        dtype = ?model.dtype(),
        weights = model.weight_format().map_or("?".to_string(), |f| f.to_string()),
        matmul_precision = %cfg.matmul_precision,
        kv_cache = ?kv_dtype,
        context = model.config().n_positions,
        vocab = model.config().vocab_size,
        "loaded model"
    );
    if device.is_cpu() {
        // A full prefill budget's activations (f32) of the widest layer come from the heap.
        let c = model.config();
        let widest = c.qkv_width().max(c.mlp_in_width());
        gpt::device::keep_step_buffers(cfg.max_batch_prefill_tokens.max(1) * widest * 4);
    }
    let limits = Limits {
        vocab_size: model.config().vocab_size,
        context: model.config().n_positions,
        max_tokens_cap: cfg.max_tokens_cap.min(model.config().n_positions),
        max_n: 16,
        max_logprobs: 20,
        max_stop: 64,
        template_stops: 0,
        max_prompts: 128,
        n_layer: model.config().n_layer,
        n_head: model.config().n_head,
        max_attention_tokens: routes::attention::MAX_ATTENTION_TOKENS.min(model.config().n_positions),
        alphabet: tokenizer.is_char_level().then(|| {
            let mut chars: Vec<char> = tokenizer
                .inner()
                .get_vocab(true)
                .keys()
                .filter_map(|t| {
                    let mut it = t.chars();
                    it.next().filter(|_| it.next().is_none())
                })
                .collect();
            chars.sort_unstable();
            chars
        }),
    };
    let chat_template = load_chat_template(checkpoint, cfg.chat_template.as_deref())?;
    let openapi = openapi::document(&limits, cfg.runtime_lora_updating);
    let metrics = Arc::new(Metrics::new()?);
    let grammars = Arc::new(engine::constraint::Grammars::new(&tokenizer, model.config().vocab_size));
    metrics.register(grammars.collectors())?;
    let tokenizer = Arc::new(tokenizer);
    let adapters = Arc::new(adapters::Adapters::new(
        &cfg.model_name,
        model.config(),
        model.dtype(),
        model.device(),
    ));
    for module in &cfg.lora_modules {
        if let Some(base) = module.base_model_name.as_deref().filter(|b| *b != cfg.model_name) {
            anyhow::bail!(
                "--lora-modules: the adapter `{}` is for the base model `{base}`, but this server serves `{}`",
                module.name,
                cfg.model_name
            );
        }
        adapters
            .load(&module.name, &module.path, false)
            .context("--lora-modules")?;
    }
    let attention_model = model.clone(); // shares the weights
    let fingerprint = fingerprint(&format!(
        "{} {:?} {:?} {}",
        env!("CARGO_PKG_VERSION"),
        model.config(),
        cfg.matmul_precision,
        cfg.model_name
    ));
    let kv_bytes = match cfg.kv_cache_mib {
        Some(mib) => mib << 20,
        None => default_kv_cache_bytes(
            model.config(),
            model.kv_cache_dtype(),
            cfg.max_batch_size,
            cfg.prefix_cache_mib << 20,
        ),
    };
    gpt::set_kv_pool_limit(kv_bytes);
    let kv_held = gpt::fill_kv_pool(model.config(), model.kv_cache_dtype(), model.device())?;
    tracing::info!(
        limit_mib = kv_bytes >> 20,
        allocated_mib = kv_held >> 20,
        "KV cache: blocks allocated at startup and reused (--kv-cache-mib)"
    );
    let speculate = match &cfg.speculative {
        None => None,
        Some(spec) => {
            let draft = match &spec.draft {
                None => None,
                Some(dir) => {
                    let (draft, draft_tokenizer) = gpt::load_dir_as(dir, format, device)
                        .with_context(|| format!("loading the draft model in {}", dir.display()))?;
                    let draft = draft.with_matmul_precision(cfg.matmul_precision)?;
                    let draft_kv = cfg.kv_cache_dtype.resolve(&draft);
                    let draft = draft.with_kv_cache_dtype(draft_kv)?;
                    gpt::speculative::check_draft((&model, &*tokenizer), (&draft, &draft_tokenizer))
                        .with_context(|| format!("the draft model in {}", dir.display()))?;
                    tracing::info!(
                        draft = %dir.display(),
                        parameters = draft.num_parameters(),
                        "speculative decoding with a draft model"
                    );
                    Some(draft)
                }
            };
            tracing::info!(
                proposer = if draft.is_some() { "draft" } else { "ngram" },
                num_speculative_tokens = spec.num_tokens,
                max_batch = spec.max_batch,
                "speculative decoding on"
            );
            Some(engine::speculate::SpeculateConfig {
                draft,
                max_tokens: spec.num_tokens,
                max_batch: spec.max_batch,
            })
        }
    };
    let engine = Engine::start(
        model,
        (*tokenizer).clone(),
        EngineConfig {
            max_batch_size: cfg.max_batch_size.max(1),
            max_queue: cfg.max_queue.max(1),
            max_prefill_tokens: cfg.max_batch_prefill_tokens.max(1),
            prefix_cache_bytes: cfg.prefix_cache_mib << 20,
            request_timeout: cfg.request_timeout,
            stream_timeout: cfg.stream_timeout,
            speculate,
        },
        metrics.clone(),
    )?;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(Arc::new(AppState {
        engine,
        tokenizer,
        limits,
        model_name: cfg.model_name.clone(),
        api_key: cfg.api_key.clone(),
        metrics_key: cfg.metrics_key.clone(),
        metrics,
        body_limit: cfg.body_limit,
        created,
        openapi,
        chat_template,
        attention_model,
        cors_origins: cfg.cors_origins.clone(),
        fingerprint,
        grammars,
        adapters,
        runtime_lora_updating: cfg.runtime_lora_updating,
    }))
}

/// `system_fingerprint`: what a response depends on besides the request (the server's version,
/// the model's configuration, the arithmetic's precision), hashed.
fn fingerprint(what: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    what.hash(&mut h);
    format!("fp_{:012x}", h.finish() & 0xffff_ffff_ffff)
}
