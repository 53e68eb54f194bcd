//! A server on an ephemeral port over the fixture checkpoint, and small client helpers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, D};
use gpt_server::app::AppState;
pub use gpt_server::ServerConfig;
use serde_json::Value;

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2")
}

pub fn config() -> ServerConfig {
    ServerConfig {
        model_name: "tiny".into(),
        api_key: None,
        max_batch_size: 16,
        max_queue: 64,
        max_tokens_cap: 1024,
        body_limit: 1 << 20,
        ..ServerConfig::default()
    }
}

pub struct Server {
    pub url: String,
    pub state: Arc<AppState>,
    pub client: reqwest::Client,
}

pub async fn start(checkpoint: &Path, cfg: ServerConfig) -> anyhow::Result<Server> {
    let state = gpt_server::load_state(checkpoint, &Device::Cpu, None, &cfg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let router = gpt_server::app::app(state.clone());
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(Server {
        url,
        state,
        client: reqwest::Client::new(),
    })
}

impl Server {
    pub async fn post(&self, body: Value) -> anyhow::Result<(u16, Value)> {
        self.post_to("/v1/completions", body).await
    }

    pub async fn post_to(&self, path: &str, body: Value) -> anyhow::Result<(u16, Value)> {
        let resp = self.send(path, body).await?;
        let status = resp.status().as_u16();
        Ok((status, resp.json().await?))
    }

    /// POSTs `body` as JSON to `path`.
    async fn send(&self, path: &str, body: Value) -> anyhow::Result<reqwest::Response> {
        Ok(self
            .client
            .post(format!("{}{path}", self.url))
            .json(&body)
            .send()
            .await?)
    }

    pub async fn get(&self, path: &str) -> anyhow::Result<Value> {
        Ok(serde_json::from_str(&self.get_text(path).await?)?)
    }

    pub async fn get_text(&self, path: &str) -> anyhow::Result<String> {
        Ok(self
            .client
            .get(format!("{}{path}", self.url))
            .send()
            .await?
            .text()
            .await?)
    }

    /// A whole stream: the parsed `data:` chunks before `[DONE]` (which must come last).
    pub async fn stream(&self, body: Value) -> anyhow::Result<Vec<Value>> {
        self.stream_at("/v1/completions", body).await
    }

    /// A whole stream from `path`.
    pub async fn stream_at(&self, path: &str, body: Value) -> anyhow::Result<Vec<Value>> {
        let resp = self.send(path, body).await?;
        assert_eq!(resp.status().as_u16(), 200);
        let text = resp.text().await?;
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
        Ok(data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d))
            .collect::<Result<_, _>>()?)
    }

    /// POSTs to another path and returns the JSON of a 200.
    pub async fn call(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        let (status, json) = self.post_to(path, body).await?;
        anyhow::ensure!(status == 200, "{path}: {status} {json}");
        Ok(json)
    }

    /// The server's token ids of `text`.
    pub async fn tokenize(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let r = self.call("/tokenize", serde_json::json!({"prompt": text})).await?;
        Ok(serde_json::from_value(r["tokens"].clone())?)
    }

    pub async fn detokenize(&self, ids: &[u32]) -> anyhow::Result<String> {
        let r = self.call("/detokenize", serde_json::json!({"tokens": ids})).await?;
        Ok(r["prompt"].as_str().unwrap_or_default().to_string())
    }

    pub async fn metrics(&self) -> anyhow::Result<String> {
        self.get_text("/metrics").await
    }
}

/// The text of choice `index` assembled from stream chunks, and its finish reason.
pub fn streamed_text(chunks: &[Value], index: u64) -> (String, Option<String>) {
    let mut text = String::new();
    let mut finish = None;
    for c in chunks {
        for choice in c["choices"].as_array().into_iter().flatten() {
            if choice["index"] == index {
                text.push_str(choice["text"].as_str().unwrap_or_default());
                if let Some(f) = choice["finish_reason"].as_str() {
                    finish = Some(f.to_string());
                }
            }
        }
    }
    (text, finish)
}

/// The model crate's own greedy generation, decoded.
pub fn reference_greedy(prompt: &str, max_tokens: usize) -> anyhow::Result<String> {
    let (model, tok) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    let ids = tok.encode(prompt)?;
    let mut sampler = gpt::Sampler::new(gpt::SamplingParams::default());
    let out = gpt::generate(&model, &ids, max_tokens, &mut sampler, tok.eos_token_id())?;
    Ok(tok.decode(&out)?)
}

/// A random model large enough that a 1000-token generation takes seconds on the CPU, with the
/// fixture's tokenizer: for tests that must catch a generation in flight. Its weights come from a
/// seeded generator, so every run generates the same tokens (no early end-of-text).
pub fn slow_checkpoint() -> anyhow::Result<tempfile::TempDir> {
    random_checkpoint(gpt::Config {
        n_positions: 1024,
        n_embd: 512,
        n_layer: 8,
        n_head: 8,
        ..gpt::Config::tiny(320)
    })
}

/// A randomly initialised (seeded) model of shape `cfg` with the fixture's tokenizer (320 tokens).
pub fn random_checkpoint(cfg: gpt::Config) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    let varmap = candle_nn::VarMap::new();
    let vb = gpt_train::init::seeded_var_builder(&varmap, 7, &Device::Cpu);
    let model = gpt::Gpt::new(vb, &cfg)?;
    let tok = gpt::Tokenizer::from_file(&fixture().join("tokenizer.json"))?;
    gpt::save_dir(dir.path(), &model, &tok, DType::F32)?;
    Ok(dir)
}

/// The server's log lines (stdout), kept for failure messages.
pub type Log = Arc<std::sync::Mutex<Vec<String>>>;

/// The `gpt-server` binary on `checkpoint` with `extra` flags and `env`, on an ephemeral port:
/// the process, its base URL (read from its log) and its log.
pub fn spawn_binary(
    checkpoint: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<(std::process::Child, String, Log)> {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let mut command = Command::new(env!("CARGO_BIN_EXE_gpt-server"));
    command
        .args([
            "--checkpoint",
            checkpoint.to_str().unwrap_or_default(),
            "--port",
            "0",
            "--device",
            "cpu",
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn()?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut lines = std::io::BufReader::new(stdout).lines();
    let addr = loop {
        let line = lines
            .next()
            .ok_or_else(|| anyhow::anyhow!("the server exited before listening"))??;
        if let Some(rest) = line.split("address=").nth(1) {
            break rest.split_whitespace().next().unwrap_or_default().to_string();
        }
    };
    let log = Log::default();
    let sink = log.clone();
    std::thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            if let Ok(mut log) = sink.lock() {
                log.push(line);
            }
        }
    });
    Ok((child, format!("http://{addr}"), log))
}

/// The fixture's texts and the log-softmax of the logits `transformers` computed for them.
pub fn reference() -> anyhow::Result<Vec<(String, Vec<u32>, Tensor)>> {
    let json: Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json"))?)?;
    let mut logits = candle_core::safetensors::load(fixture().join("expected.safetensors"), &Device::Cpu)?;
    let mut out = Vec::new();
    for (i, case) in json["cases"].as_array().into_iter().flatten().enumerate() {
        let l = logits
            .remove(&format!("logits_{i}"))
            .ok_or_else(|| anyhow::anyhow!("logits_{i}"))?;
        out.push((
            case["text"].as_str().unwrap_or_default().to_string(),
            serde_json::from_value(case["ids"].clone())?,
            candle_nn::ops::log_softmax(&l, D::Minus1)?,
        ));
    }
    Ok(out)
}
