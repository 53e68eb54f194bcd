//! Speculative decoding in the server, side by side: three servers in-process on the same model
//! (plain, with the draft model, with n-grams; speculation allowed at every batch size unless
//! `MAX_BATCH` says otherwise, to find where it stops paying), greedy requests of validation text (the last 10% of the corpus),
//! at each concurrency the three servers in turn, `ROUNDS` times; aggregate tokens/s per server
//! and the ratios. Prints one JSON object per concurrency.
//!
//!     [TARGET=weights] [DRAFT=weights/draft] [K=6] [NEW_TOKENS=128] [ROUNDS=3] \
//!     [MAX_BATCH=N|default] \
//!         cargo bench -p gpt-server --bench speculative -- [CONCURRENCY...]

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use gpt_server::{ServerConfig, Speculative};
use serde_json::json;

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator_for_serving();
    gpt::device::fix_cpu_thread_count(); // as gpt-server does
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

/// A server in-process; its completions URL.
async fn serve(target: &std::path::Path, speculative: Option<Speculative>) -> anyhow::Result<String> {
    let cfg = ServerConfig {
        model_name: "bench".into(),
        speculative,
        prefix_cache_mib: 0, // every round computes its prompts again
        ..ServerConfig::default()
    };
    let state = gpt_server::load_state(target, &Device::Cpu, None, &cfg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/completions", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, gpt_server::app::app(state)).await });
    Ok(url)
}

/// `prompts` at once to `url`: (tokens generated, seconds, the texts).
async fn burst(
    client: &reqwest::Client,
    url: &str,
    prompts: &[String],
    new_tokens: usize,
) -> anyhow::Result<(usize, f64, Vec<String>)> {
    let start = Instant::now();
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let body = json!({"prompt": p, "max_tokens": new_tokens, "temperature": 0});
            let request = client.post(url).json(&body).send();
            async move { anyhow::Ok(request.await?.json::<serde_json::Value>().await?) }
        })
        .collect();
    let mut tokens = 0;
    let mut texts = Vec::new();
    for resp in futures_util::future::join_all(tasks).await {
        let resp = resp?;
        tokens += resp["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
        texts.push(resp["choices"][0]["text"].as_str().unwrap_or_default().to_string());
    }
    Ok((tokens, start.elapsed().as_secs_f64(), texts))
}

async fn run() -> anyhow::Result<()> {
    let levels: Vec<usize> = std::env::args().skip(1).filter_map(|s| s.parse().ok()).collect();
    let levels = if levels.is_empty() {
        vec![1, 2, 4, 8, 16]
    } else {
        levels
    };
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target = PathBuf::from(env_or("TARGET", &repo.join("weights").to_string_lossy()));
    let draft = PathBuf::from(env_or("DRAFT", &repo.join("weights/draft").to_string_lossy()));
    let k: usize = env_or("K", "6").parse()?;
    let new_tokens: usize = env_or("NEW_TOKENS", "128").parse()?;
    let rounds: usize = env_or("ROUNDS", "3").parse()?;
    // MAX_BATCH=default: the server's defaults for each proposer.
    let max_batch = match env_or("MAX_BATCH", "").as_str() {
        "" => Some(usize::MAX),
        "default" => None,
        n => Some(n.parse()?),
    };
    let spec = |draft: Option<PathBuf>| {
        let max_batch = max_batch.unwrap_or(match draft {
            Some(_) => gpt_server::engine::speculate::DRAFT_MAX_BATCH,
            None => gpt_server::engine::speculate::NGRAM_MAX_BATCH,
        });
        Some(Speculative {
            draft,
            num_tokens: k,
            max_batch,
        })
    };
    let urls = [
        ("plain", serve(&target, None).await?),
        ("draft", serve(&target, spec(Some(draft.clone()))).await?),
        ("ngram", serve(&target, spec(None)).await?),
    ];
    let text = std::fs::read_to_string(repo.join("data/tinyshakespeare.txt"))?;
    let chars: Vec<char> = text.chars().collect();
    let val = &chars[chars.len() * 9 / 10..];
    let client = reqwest::Client::new();
    for (_, url) in &urls {
        burst(&client, url, &["warm".to_string()], 4).await?;
    }
    for clients in levels {
        let mut totals = [(0usize, 0.0f64); 3];
        for round in 0..rounds {
            // 64 characters each, from spread-out places, other ones each round.
            let prompts: Vec<String> = (0..clients)
                .map(|c| {
                    let at = ((round * clients + c) * 7919 * 64) % (val.len() - 64);
                    val[at..at + 64].iter().collect()
                })
                .collect();
            // Each round starts with another server (the first of a round ran slower or faster
            // in trials, by a few percent).
            let mut texts: Vec<Vec<String>> = vec![Vec::new(); urls.len()];
            for j in 0..urls.len() {
                let i = (j + round) % urls.len();
                let (tokens, secs, out) = burst(&client, &urls[i].1, &prompts, new_tokens).await?;
                texts[i] = out;
                totals[i].0 += tokens;
                totals[i].1 += secs;
            }
            for (i, (name, _)) in urls.iter().enumerate().skip(1) {
                anyhow::ensure!(texts[i] == texts[0], "{name}: greedy output differs from plain");
            }
        }
        let rate = |i: usize| totals[i].0 as f64 / totals[i].1;
        println!(
            "{}",
            json!({
                "clients": clients,
                "new_tokens_each": new_tokens,
                "k": k,
                "max_batch": max_batch.map_or("default".to_string(), |m| m.to_string()),
                "plain_tok_per_s": rate(0),
                "draft_tok_per_s": rate(1),
                "ngram_tok_per_s": rate(2),
                "draft_vs_plain": rate(1) / rate(0),
                "ngram_vs_plain": rate(2) / rate(0),
            })
        );
    }
    Ok(())
}
