//! `gpt-server`: OpenAI-compatible completions over HTTP for GPT-2-layout checkpoints.
//!
//! Request flow: `app` (routes) → `validation` (raw request → valid one, tokenised off the async
//! runtime) → `engine` (model thread, continuous batching) → events → `app` (JSON or SSE chunks,
//! with `stream`'s incremental detokenisation and stop strings).

pub mod api;
pub mod app;
pub mod engine;
pub mod error;
pub mod fold;
pub mod metrics;
pub mod openapi;
pub mod stream;
pub mod tokenize;
pub mod validation;

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};

use crate::app::AppState;
use crate::engine::{Engine, EngineConfig};
use crate::metrics::Metrics;
use crate::validation::Limits;

/// What `serve` needs beyond the checkpoint.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model_name: String,
    pub api_key: Option<String>,
    pub max_batch_size: usize,
    pub max_queue: usize,
    pub max_tokens_cap: usize,
    pub body_limit: usize,
}

/// Loads the checkpoint, starts the engine thread and returns the router's state.
pub fn load_state(
    checkpoint: &Path,
    device: &Device,
    dtype: DType,
    cfg: &ServerConfig,
) -> anyhow::Result<Arc<AppState>> {
    let (model, tokenizer) = gpt::load_dir(checkpoint, dtype, device)?;
    tracing::info!(
        checkpoint = %checkpoint.display(),
        parameters = model.num_parameters(),
        device = gpt::device_name(device),
        dtype = ?dtype,
        context = model.config().n_positions,
        vocab = model.config().vocab_size,
        "loaded model"
    );
    let limits = Limits {
        vocab_size: model.config().vocab_size,
        context: model.config().n_positions,
        max_tokens_cap: cfg.max_tokens_cap.min(model.config().n_positions),
        max_n: 16,
        max_logprobs: 20,
        max_stop: 64,
        max_prompts: 128,
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
    let openapi = openapi::document(&limits);
    let model_context = model.config().n_positions;
    let metrics = Arc::new(Metrics::new()?);
    let tokenizer = Arc::new(tokenizer);
    let engine = Engine::start(
        model,
        (*tokenizer).clone(),
        EngineConfig {
            max_batch_size: cfg.max_batch_size.max(1),
            max_queue: cfg.max_queue.max(1),
            max_prefill_tokens: 4096.max(model_context),
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
        metrics,
        body_limit: cfg.body_limit,
        created,
        openapi,
    }))
}
