//! Structured outputs' cost: aggregate generated tokens/s of N concurrent streams under a JSON
//! schema against the same streams unconstrained, side by side (alternating rounds), GPT-2-small
//! shape with random weights and GPT-2's own 50,257-token tokenizer, the server in-process on a
//! loopback port; then the mask's own time per token on that vocabulary, and the compile time of a
//! large schema. Prints one JSON object per measurement.
//!
//!     GPT2_TOKENIZER_DIR=$PWD/target/gpt2-tokenizer [ROUNDS=2] \
//!         cargo bench -p gpt-server --bench structured -- [NEW_TOKENS] [CONCURRENCY...]

use std::time::Instant;

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use futures_util::StreamExt;
use gpt_server::engine::constraint::{Grammar, Grammars};
use gpt_server::ServerConfig;
use serde_json::{json, Value};

/// Strings dominate what a model writes in JSON, and a string's mask is the costly kind (most of
/// the vocabulary is allowed, token by token): a schema whose output is mostly strings.
fn schema() -> Value {
    json!({"type": "object", "properties": {
        "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "year": {"type": "integer"}, "story": {"type": "string"}},
        "required": ["title", "tags", "year", "story"], "additionalProperties": false})
}

/// A large schema: 300 properties of assorted types, nested objects, enums and patterns.
fn large_schema() -> Value {
    let mut props = serde_json::Map::new();
    for i in 0..300 {
        let p = match i % 6 {
            0 => json!({"type": "string", "maxLength": 40}),
            1 => json!({"type": "integer", "minimum": 0, "maximum": 100000}),
            2 => json!({"enum": ["red", "green", "blue", format!("v{i}")]}),
            3 => json!({"type": "array", "items": {"type": "number"}, "maxItems": 8}),
            4 => json!({"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"}),
            _ => json!({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "string"}},
                        "required": ["a"], "additionalProperties": false}),
        };
        props.insert(format!("field_{i}"), p);
    }
    json!({"type": "object", "properties": props, "additionalProperties": false})
}

/// One streaming request: tokens received.
async fn stream(client: &reqwest::Client, url: &str, body: Value) -> anyhow::Result<usize> {
    let resp = client.post(url).json(&body).send().await?;
    anyhow::ensure!(resp.status().is_success(), "{}", resp.text().await?);
    let mut bytes = resp.bytes_stream();
    let (mut buffer, mut tokens) = (String::new(), 0);
    while let Some(chunk) = bytes.next().await {
        buffer.push_str(&String::from_utf8_lossy(&chunk?));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(Ok(chunk)) = event.trim().strip_prefix("data: ").map(serde_json::from_str::<Value>) else {
                continue;
            };
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
        }
    }
    Ok(tokens)
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator_for_serving();
    gpt::device::fix_cpu_thread_count();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let new_tokens: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(64);
    let levels: Vec<usize> = args.iter().skip(1).filter_map(|s| s.parse().ok()).collect();
    let levels = if levels.is_empty() { vec![1, 16] } else { levels };
    let tok_dir = std::env::var("GPT2_TOKENIZER_DIR")
        .map_err(|_| anyhow::anyhow!("set GPT2_TOKENIZER_DIR to a directory with GPT-2's tokenizer.json"))?;
    let tok = gpt::Tokenizer::from_file(&std::path::Path::new(&tok_dir).join("tokenizer.json"))?;

    // Mask time per token along a constrained walk, and a large schema's compile time.
    let grammars = Grammars::new(&tok, tok.vocab_size());
    let start = Instant::now();
    grammars
        .compile(&Grammar::JsonSchema(large_schema().to_string()))
        .map_err(anyhow::Error::msg)?;
    let compile_s = start.elapsed().as_secs_f64();
    let compiled = grammars
        .compile(&Grammar::JsonSchema(schema().to_string()))
        .map_err(anyhow::Error::msg)?;
    let text = r#"{"title": "The Tempest of a thousand nights", "tags": ["storm", "island", "magic"], "year": 1611, "story": "Prospero, the rightful Duke of Milan, and his daughter Miranda have been stranded for twelve years on an island"}"#;
    let ids = tok.encode(text)?;
    let mut c = compiled.start();
    let mut logits = vec![0f32; tok.vocab_size()];
    let start = Instant::now();
    for &id in &ids {
        c.mask(&mut logits).map_err(anyhow::Error::msg)?;
        c.commit(id).map_err(anyhow::Error::msg)?;
    }
    let mask_us = start.elapsed().as_secs_f64() * 1e6 / ids.len() as f64;
    println!(
        "{}",
        json!({"large_schema_properties": 300, "compile_s": compile_s,
               "mask_and_commit_us_per_token": mask_us, "tokens_walked": ids.len()})
    );

    let dir = tempfile::tempdir()?;
    let cfg = gpt::Config::gpt2_small();
    let varmap = VarMap::new();
    let model = gpt::Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cfg)?;
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
    let state = gpt_server::load_state(dir.path(), &Device::Cpu, None, &server_cfg)?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/v1/completions", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, gpt_server::app::app(state)).await });
    let client = reqwest::Client::new();
    let body = |c: usize, constrained: bool| {
        let prompt: Vec<u32> = (0..16).map(|i| ((i * 31 + c * 7) % 50000) as u32).collect();
        let mut b = json!({"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": true,
                           "ignore_eos": true, "stream_options": {"include_usage": true}});
        if constrained {
            b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "story", "schema": schema()}});
        }
        b
    };
    stream(&client, &url, body(0, true)).await?; // warm-up (and the schema compiled)

    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    for clients in levels {
        for round in 0..rounds {
            for constrained in [false, true] {
                let start = Instant::now();
                let tasks: Vec<_> = (0..clients)
                    .map(|c| {
                        let (client, url, b) = (client.clone(), url.clone(), body(c, constrained));
                        tokio::spawn(async move { stream(&client, &url, b).await })
                    })
                    .collect();
                let mut tokens = 0;
                for t in tasks {
                    tokens += t.await??;
                }
                let secs = start.elapsed().as_secs_f64();
                println!(
                    "{}",
                    json!({"clients": clients, "round": round, "constrained": constrained, "tokens": tokens,
                           "wall_s": secs, "aggregate_tok_per_s": tokens as f64 / secs})
                );
            }
        }
    }
    Ok(())
}
