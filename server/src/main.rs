//! `gpt-server`: command line, start-up and graceful shutdown.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use gpt_server::{app::app, load_state, ServerConfig};

/// Serves a GPT checkpoint with the OpenAI completions API. Every flag can also be set with the
/// environment variable named in its help.
#[derive(Parser)]
#[command(name = "gpt-server", version)]
struct Args {
    /// Checkpoint directory (config.json, model.safetensors, tokenizer.json), a gpt-train run
    /// directory (its best/ checkpoint), a llama.cpp GGUF file, or a Hugging Face Hub id (`gpt2`,
    /// `org/name@revision`, `org/name:Q4_K_M` for a repository's GGUF file: the shared Hub cache,
    /// downloaded into it if missing; HF_HUB_OFFLINE=1 reads the cache only); default: weights/.
    #[arg(long, env = "GPT_SERVER_CHECKPOINT")]
    checkpoint: Option<PathBuf>,
    #[arg(long, env = "GPT_SERVER_HOST", default_value = "127.0.0.1")]
    host: String,
    #[arg(long, env = "GPT_SERVER_PORT", default_value_t = 8080)]
    port: u16,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, env = "GPT_SERVER_DEVICE", default_value = "auto")]
    device: String,
    /// Weight format: f32, f16, bf16, q8_0 or q4_0 (default: as stored; f32 for
    /// model.safetensors). On the CPU activations stay f32 and the formats shrink what each
    /// decode step reads; q8_0 and q4_0 quantize at load (CPU only). On a GPU f16 and bf16 run
    /// the whole network in that dtype.
    #[arg(long, env = "GPT_SERVER_DTYPE")]
    dtype: Option<gpt::WeightFormat>,
    /// How the CPU's products with f32 or bf16 weights round: `highest` (f32) or `high` (each f32
    /// operand as two bf16, three products on AMX tiles, as PyTorch's
    /// `set_float32_matmul_precision("high")`; two for bf16 weights: relative error ~1e-5,
    /// prefill 1.3-1.45x faster, 1.6-2.2x with bf16 weights; Intel Sapphire Rapids or later).
    #[arg(long, env = "GPT_SERVER_MATMUL_PRECISION", default_value = "highest")]
    matmul_precision: gpt::MatmulPrecision,
    /// The name clients pass as `model` (default: the Hub id, the checkpoint directory's name, or
    /// `default` for the model in weights/).
    #[arg(long, env = "GPT_SERVER_MODEL_NAME")]
    model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every route that reads the model: /v1/*,
    /// /tokenize, /detokenize, /tokenizer_info (/health and /metrics stay open).
    #[arg(long, env = "GPT_SERVER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Require `Authorization: Bearer KEY` on /metrics.
    #[arg(long, env = "GPT_SERVER_METRICS_KEY", hide_env_values = true)]
    metrics_key: Option<String>,
    /// Sequences decoded together in one step.
    #[arg(long, env = "GPT_SERVER_MAX_BATCH_SIZE", default_value_t = 16)]
    max_batch_size: usize,
    /// Requests waiting beyond the batch before new ones get 503 (a few seconds of throughput:
    /// a burst or a slower minute waits instead of failing).
    // A waiting request holds only its prompt's tokens. At 64, a 30-minute soak at 80% of
    // saturation on the default model (~66 requests/s) had 44 503s in its slow minutes.
    #[arg(long, env = "GPT_SERVER_MAX_QUEUE", default_value_t = 256)]
    max_queue: usize,
    /// Prompt tokens prefilled together in one step, at most (a longer prompt still runs, alone).
    /// A step's activations grow with it: under bursts a larger budget raises the peak memory
    /// and not the throughput.
    #[arg(long, env = "GPT_SERVER_MAX_BATCH_PREFILL_TOKENS", default_value_t = 1024)]
    max_batch_prefill_tokens: usize,
    /// Largest max_tokens a request may ask for.
    #[arg(long, env = "GPT_SERVER_MAX_TOKENS_CAP", default_value_t = 1024)]
    max_tokens_cap: usize,
    /// Largest request body, bytes.
    #[arg(long, env = "GPT_SERVER_BODY_LIMIT", default_value_t = 1 << 20)]
    body_limit: usize,
    /// A Jinja chat template for /v1/chat/completions (default: `chat_template` in the
    /// checkpoint's tokenizer_config.json, else a plain USER:/ASSISTANT: script).
    #[arg(long, env = "GPT_SERVER_CHAT_TEMPLATE")]
    chat_template: Option<PathBuf>,
    /// An origin allowed to call the API from a browser (CORS); repeat it for several, `*` for
    /// any. None by default. The variable takes a comma-separated list.
    #[arg(long = "cors-origin", env = "GPT_SERVER_CORS_ORIGINS", value_delimiter = ',')]
    cors_origins: Vec<String>,
    /// MiB of KV cache kept for prefix caching: prompts that start like a recent one (a system
    /// prompt, few-shot examples) reuse its cache instead of prefilling it again. 0 turns it off.
    #[arg(long, env = "GPT_SERVER_PREFIX_CACHE_MIB", default_value_t = 256)]
    prefix_cache_mib: usize,
    /// MiB of KV cache allocated at startup (on the CPU in blocks of 64 positions) and
    /// kept: sequences take blocks from it and give them back, so that memory stays flat under
    /// a long mixed load; past it, blocks are allocated and freed as needed. 0: none. Default: a
    /// full batch at the whole context plus the prefix cache's bound, at most 1024.
    #[arg(long, env = "GPT_SERVER_KV_CACHE_MIB")]
    kv_cache_mib: Option<usize>,
    /// What the KV cache stores: f32, f16 (on the CPU: half the memory a position takes, as
    /// llama.cpp's cache; each key and value rounded to f16 once) or auto: f16 where the weights
    /// are quantized, f16 or bf16, f32 with f32 weights (outputs then equal `transformers`' to
    /// f32's rounding). On a GPU the cache is in the activations' dtype.
    #[arg(long, env = "GPT_SERVER_KV_CACHE_DTYPE", default_value = "auto")]
    kv_cache_dtype: gpt::KvCacheDtype,
    /// After Ctrl-C / SIGTERM, how long in-flight generations may run before they are cut.
    #[arg(long, env = "GPT_SERVER_SHUTDOWN_GRACE_SECS", default_value_t = 10)]
    shutdown_grace_secs: u64,
    /// A request running longer (from its arrival) is ended: a stream's choices with
    /// `finish_reason: "length"`, a whole response with a 504. 0: no limit.
    #[arg(long, env = "GPT_SERVER_REQUEST_TIMEOUT_SECS", default_value_t = 600)]
    request_timeout_secs: u64,
    /// A stream whose client reads none of its waiting output for this long is dropped and its
    /// sequence freed (until then the stream's buffer holds at most 64 events: its sequence
    /// pauses while it is full).
    #[arg(long, env = "GPT_SERVER_STREAM_TIMEOUT_SECS", default_value_t = 60)]
    stream_timeout_secs: u64,
    /// A connection whose client has not sent a request's headers within this many seconds is
    /// closed (slow or idle clients).
    #[arg(long, env = "GPT_SERVER_HEADER_TIMEOUT_SECS", default_value_t = 10)]
    header_timeout_secs: u64,
    /// Connections served at once; more wait in the listen backlog (and never beyond the process's
    /// open-file limit, raised at start to its hard limit).
    #[arg(long, env = "GPT_SERVER_MAX_CONNECTIONS", default_value_t = 4096)]
    max_connections: usize,
    /// Each connection's kernel send buffer, KiB (SO_SNDBUF). Unset, the kernel sizes it (up to
    /// 4 MiB on Linux): a client that stops reading then holds that much before its stream
    /// pauses and, after --stream-timeout-secs, is dropped.
    #[arg(long, env = "GPT_SERVER_SEND_BUFFER_KIB")]
    send_buffer_kib: Option<usize>,
    /// Speculative decoding: `ngram` (prompt lookup: what followed the latest earlier occurrence
    /// of the last tokens is proposed), `draft` (a smaller model proposes, --draft-checkpoint)
    /// or `off`. The model checks the proposals in one step; greedy output is the same, sampled
    /// output has the same distribution. Default: `draft` with --draft-checkpoint, or when
    /// serving the default model (its draft in weights/draft/); else off.
    #[arg(long, env = "GPT_SERVER_SPECULATIVE")]
    speculative: Option<gpt::speculative::Mode>,
    /// The draft model for speculative decoding: a checkpoint directory, a gpt-train run
    /// directory or a Hub id, with the served model's tokenizer.
    #[arg(long, env = "GPT_SERVER_DRAFT_CHECKPOINT")]
    draft_checkpoint: Option<PathBuf>,
    /// Tokens proposed per step at most (adapted per sequence as they are accepted, 1 to 16).
    #[arg(long, env = "GPT_SERVER_NUM_SPECULATIVE_TOKENS", default_value_t = 6)]
    num_speculative_tokens: usize,
    /// Speculate only while at most this many sequences run: above it, proposals cost more
    /// than they save. Default: 8 with a draft model, 4 with n-grams (measured on the default
    /// model: BENCHMARKS.md, "Speculative decoding").
    #[arg(long, env = "GPT_SERVER_SPECULATIVE_MAX_BATCH")]
    speculative_max_batch: Option<usize>,
    /// LoRA adapters served beside the model, each `NAME=PATH` (vLLM's flag): PATH a PEFT
    /// adapter directory (adapter_config.json, adapter_model.safetensors), a gpt-train LoRA run
    /// or a Hub id; or vLLM's JSON form `{"name": .., "path": .., "base_model_name": ..}`. A
    /// request chooses one with `model: NAME`. Several follow the flag, or repeat it; the
    /// variable takes one.
    #[arg(long, env = "GPT_SERVER_LORA_MODULES", num_args = 1.., value_parser = parse_lora_module)]
    lora_modules: Vec<gpt_server::adapters::LoraModule>,
    /// Accepted for vLLM's command lines: adapters are always enabled here.
    #[arg(long)]
    enable_lora: bool,
    /// Mount `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's endpoints, which
    /// it mounts with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), behind the API key if there is one.
    #[arg(long, env = "GPT_SERVER_ALLOW_RUNTIME_LORA_UPDATING")]
    allow_runtime_lora_updating: bool,
}

fn parse_lora_module(spec: &str) -> Result<gpt_server::adapters::LoraModule, String> {
    gpt_server::adapters::parse_module(spec)
}

/// `weights/` under the working directory, else next to this source tree (for `cargo run`).
fn default_checkpoint() -> PathBuf {
    let local = PathBuf::from("weights");
    if local.join("config.json").exists() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights")
}

/// The speculative decoding the flags ask for; `named` is the served checkpoint as named.
fn speculative_settings(args: &Args, named: &Path) -> Result<Option<gpt_server::Speculative>> {
    use gpt::speculative::Mode;
    let default_draft = default_checkpoint().join("draft");
    let serves_default = {
        let canonical = |dir: &Path| dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        canonical(named) == canonical(&default_checkpoint())
    };
    let mode = match (args.speculative, &args.draft_checkpoint) {
        (Some(mode), _) => mode,
        (None, Some(_)) => Mode::Draft,
        (None, None) if serves_default && default_draft.join("config.json").exists() => Mode::Draft,
        (None, None) => Mode::Off,
    };
    if !(1..=gpt_server::engine::speculate::MAX_TOKENS).contains(&args.num_speculative_tokens) {
        anyhow::bail!(
            "--num-speculative-tokens must be between 1 and {}, got {}",
            gpt_server::engine::speculate::MAX_TOKENS,
            args.num_speculative_tokens
        );
    }
    let draft = match (mode, &args.draft_checkpoint) {
        (Mode::Off, None) => return Ok(None),
        (Mode::Ngram, None) => None,
        (Mode::Draft, Some(path)) => Some(
            gpt::checkpoint::resolve(&path.to_string_lossy())
                .context("--draft-checkpoint: pass a checkpoint directory, a gpt-train run directory or a Hub id")?
                .dir,
        ),
        (Mode::Draft, None) if serves_default && default_draft.join("config.json").exists() => Some(default_draft),
        (Mode::Draft, None) => anyhow::bail!("--speculative draft needs --draft-checkpoint"),
        (_, Some(_)) => anyhow::bail!("--draft-checkpoint is given but --speculative is not `draft`"),
    };
    let max_batch = args.speculative_max_batch.unwrap_or(match draft {
        Some(_) => gpt_server::engine::speculate::DRAFT_MAX_BATCH,
        None => gpt_server::engine::speculate::NGRAM_MAX_BATCH,
    });
    Ok(Some(gpt_server::Speculative {
        draft,
        num_tokens: args.num_speculative_tokens,
        max_batch,
    }))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

fn main() -> Result<()> {
    // Process-wide settings first, while this is the only thread.
    gpt::device::tune_cpu_allocator_for_serving();
    gpt::device::fix_cpu_thread_count();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let args = Args::parse();
    let named = args.checkpoint.clone().unwrap_or_else(default_checkpoint);
    // A Hub id may mean a download: off the async runtime.
    let resolved = tokio::task::spawn_blocking({
        let named = named.to_string_lossy().into_owned();
        move || gpt::checkpoint::resolve(&named)
    })
    .await?
    .context("--checkpoint: pass a checkpoint directory, a gpt-train run directory, a GGUF file or a Hub id")?;
    let checkpoint = resolved.dir.clone();
    let device = gpt::parse_device(&args.device)?;
    let dtype = args.dtype;
    // The default model is `default` however it is named: left out, or given as a path to the
    // same directory (the Docker image names /app/weights); a Hub model is named by its id; any
    // other checkpoint after its directory.
    let model_name = args.model_name.clone().unwrap_or_else(|| {
        if let Some(id) = &resolved.hub_id {
            return id.to_string();
        }
        let canonical = |dir: &Path| dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        let dir = canonical(&named);
        if dir == canonical(&default_checkpoint()) {
            return "default".into();
        }
        dir.file_name()
            .map_or("gpt".into(), |n| n.to_string_lossy().into_owned())
    });
    // A Hub id may mean a download: off the async runtime's workers.
    let speculative = tokio::task::block_in_place(|| speculative_settings(&args, &named))?;
    let cfg = ServerConfig {
        model_name,
        api_key: args.api_key.clone(),
        max_batch_size: args.max_batch_size,
        max_queue: args.max_queue,
        max_batch_prefill_tokens: args.max_batch_prefill_tokens,
        max_tokens_cap: args.max_tokens_cap,
        body_limit: args.body_limit,
        chat_template: args.chat_template.clone(),
        cors_origins: args.cors_origins.clone(),
        prefix_cache_mib: args.prefix_cache_mib,
        kv_cache_mib: args.kv_cache_mib,
        kv_cache_dtype: args.kv_cache_dtype,
        matmul_precision: args.matmul_precision,
        request_timeout: (args.request_timeout_secs > 0).then(|| Duration::from_secs(args.request_timeout_secs)),
        stream_timeout: Duration::from_secs(args.stream_timeout_secs),
        metrics_key: args.metrics_key.clone(),
        speculative,
        lora_modules: args.lora_modules.clone(),
        runtime_lora_updating: args.allow_runtime_lora_updating,
    };
    let state = tokio::task::spawn_blocking({
        let checkpoint = checkpoint.clone();
        move || load_state(&checkpoint, &device, dtype, &cfg)
    })
    .await?
    .with_context(|| format!("loading the checkpoint in {}", checkpoint.display()))?;

    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    tracing::info!(address = %listener.local_addr()?, model = %state.model_name, "listening");
    let grace = Duration::from_secs(args.shutdown_grace_secs);
    // A failed engine serves nothing more: exit non-zero (after a moment for the in-flight
    // answers to go out), for Docker or any supervisor to restart the server.
    let watched = state.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if watched.engine.failed() {
                tracing::error!("the engine failed: exiting (status 1) for a supervisor to restart the server");
                tokio::time::sleep(Duration::from_secs(1)).await;
                std::process::exit(1);
            }
        }
    });
    let files = gpt_server::serve::raise_open_files_limit();
    let serve_cfg = gpt_server::serve::ServeConfig {
        header_read_timeout: Duration::from_secs(args.header_timeout_secs.max(1)),
        max_connections: args.max_connections.min((files as usize).saturating_sub(64).max(16)),
        send_buffer: args.send_buffer_kib.map(|kib| kib.saturating_mul(1024)),
    };
    tracing::info!(
        max_connections = serve_cfg.max_connections,
        open_files = files,
        "accepting connections"
    );
    let engine_state = state.clone();
    let shutdown = async move {
        shutdown_signal().await;
        tracing::info!(
            grace_secs = grace.as_secs(),
            "shutting down: no new connections; finishing generations"
        );
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            tracing::warn!("grace period over: cutting the remaining generations");
            engine_state.engine.cut_all();
        });
    };
    gpt_server::serve::serve(listener, app(state), serve_cfg, shutdown).await;
    tracing::info!("stopped");
    Ok(())
}
