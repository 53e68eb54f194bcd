//! Serving benchmark: aggregate generated tokens/s and time to first token (p50, p99) with 1, 4
//! and 16 concurrent streaming clients, GPT-2-small shape with random weights on the CPU (weight
//! format `WEIGHTS`, default f32), server in-process on a loopback port; then the time to first
//! token of a request whose 512-token prefix is in the prefix cache against the same request
//! cold (`PREFIX=0` skips it). Prints one JSON object per measurement.
//!
//!     [WEIGHTS=f32|f16|bf16|q8_0|q4_0] [PREFIX=512] \
//!         cargo bench -p gpt-server --bench concurrency -- [NEW_TOKENS] [CONCURRENCY...]

use std::time::Instant;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use futures_util::StreamExt;
use gpt_server::ServerConfig;
use serde_json::json;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One streaming request: (time to first token, tokens received).
async fn stream(
    client: &reqwest::Client,
    url: &str,
    prompt: &[u32],
    new_tokens: usize,
) -> anyhow::Result<(f64, usize)> {
    let start = Instant::now();
    let body = json!({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    let resp = client.post(url).json(&body).send().await?;
    let mut bytes = resp.bytes_stream();
    let (mut ttft, mut buffer, mut tokens) = (None, String::new(), 0);
    while let Some(chunk) = bytes.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            let Ok(chunk) = serde_json::from_str::<serde_json::Value>(data) else {
                continue;
            };
            if chunk["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                ttft.get_or_insert_with(|| start.elapsed().as_secs_f64());
            }
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
        }
    }
    Ok((ttft.unwrap_or(f64::NAN), tokens))
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator_for_serving();
    gpt::device::fix_cpu_thread_count(); // as gpt-server does
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let new_tokens: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(64);
    let levels: Vec<usize> = args.iter().skip(1).filter_map(|s| s.parse().ok()).collect();
    let levels = if levels.is_empty() { vec![1, 4, 16] } else { levels };

    let dir = tempfile::tempdir()?;
    let cfg = gpt::Config::gpt2_small();
    let varmap = VarMap::new();
    let model = gpt::Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cfg)?;
    // A character vocabulary of exactly 50257 entries (U+0100 onwards, below the surrogates),
    // so that every generated token is visible text, as with GPT-2's own tokenizer.
    let chars: String = (0x100u32..0x100 + cfg.vocab_size as u32)
        .filter_map(char::from_u32)
        .collect();
    let corpus = dir.path().join("chars.txt");
    std::fs::write(&corpus, chars)?;
    let tok = gpt::Tokenizer::train_char(&[corpus])?;
    anyhow::ensure!(tok.vocab_size() == cfg.vocab_size, "vocabulary of {}", tok.vocab_size());
    gpt::save_dir(dir.path(), &model, &tok, DType::F32)?;
    drop(model);

    let server_cfg = ServerConfig {
        model_name: "bench".into(),
        api_key: None,
        max_batch_size: 16,
        max_queue: 64,
        max_tokens_cap: 1024,
        body_limit: 1 << 20,
        ..ServerConfig::default()
    };
    let weights: Option<gpt::WeightFormat> = std::env::var("WEIGHTS").ok().map(|w| w.parse()).transpose()?;
    let state = gpt_server::load_state(dir.path(), &Device::Cpu, weights, &server_cfg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/completions", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, gpt_server::app::app(state)).await });
    let client = reqwest::Client::new();
    stream(&client, &url, &[1, 2, 3], 4).await?; // warm-up

    for clients in levels {
        let start = Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let (client, url) = (client.clone(), url.clone());
                let prompt: Vec<u32> = (0..16).map(|i| ((i * 31 + c * 7) % 320) as u32).collect();
                tokio::spawn(async move { stream(&client, &url, &prompt, new_tokens).await })
            })
            .collect();
        let mut ttfts = Vec::new();
        let mut tokens = 0;
        for t in tasks {
            let (ttft, n) = t.await??;
            ttfts.push(ttft);
            tokens += n;
        }
        let secs = start.elapsed().as_secs_f64();
        ttfts.sort_by(f64::total_cmp);
        println!(
            "{}",
            json!({
                "weights": weights.unwrap_or_default().to_string(),
                "clients": clients,
                "new_tokens_each": new_tokens,
                "tokens": tokens,
                "wall_s": secs,
                "aggregate_tok_per_s": tokens as f64 / secs,
                "ttft_p50_s": percentile(&ttfts, 0.5),
                "ttft_p99_s": percentile(&ttfts, 0.99),
            })
        );
    }

    // Prefix caching: a prompt of PREFIX shared tokens and 16 of its own, cold (the prefix never
    // seen) and then cached (the same prefix, other 16 tokens); one new token each, medians of 5
    // distinct prefixes.
    let prefix: usize = std::env::var("PREFIX").ok().and_then(|v| v.parse().ok()).unwrap_or(512);
    if prefix > 0 {
        let (mut cold, mut cached) = (Vec::new(), Vec::new());
        for r in 0..5usize {
            let shared: Vec<u32> = (0..prefix).map(|i| ((i * 131 + r * 977 + 5) % 50000) as u32).collect();
            let with = |tail: usize| -> Vec<u32> {
                let mut p = shared.clone();
                p.extend((0..16).map(|i| ((i * 17 + tail * 1013) % 50000) as u32));
                p
            };
            cold.push(stream(&client, &url, &with(1), 1).await?.0);
            cached.push(stream(&client, &url, &with(2), 1).await?.0);
        }
        cold.sort_by(f64::total_cmp);
        cached.sort_by(f64::total_cmp);
        let (c, h) = (percentile(&cold, 0.5), percentile(&cached, 0.5));
        println!(
            "{}",
            json!({
                "weights": weights.unwrap_or_default().to_string(),
                "prefix_tokens": prefix, "suffix_tokens": 16,
                "ttft_cold_p50_s": c, "ttft_cached_p50_s": h, "speedup": c / h,
            })
        );
    }
    Ok(())
}
