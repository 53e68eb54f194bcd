//! The completions API over a real socket: greedy and sampled generation, streaming, stop
//! strings, logprobs, echo, n, concurrency and cancellation, and the heap trimmed after a burst.

mod common;

use std::time::Duration;

use common::{config, fixture, reference_greedy, start, streamed_text};
use serde_json::json;

const PROMPT: &str = "First Citizen:\nBefore we proceed";

#[tokio::test]
async fn greedy_streamed_and_whole_texts_match_the_model_crate() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 20, "temperature": 0});
    let (status, whole) = server.post(body.clone()).await?;
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "text_completion");
    let text = whole["choices"][0]["text"].as_str().unwrap_or_default().to_string();
    let reference = reference_greedy(PROMPT, 20)?;
    assert!(!reference.is_empty());
    assert_eq!(text, reference);

    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let chunks = server.stream(streaming).await?;
    assert!(chunks.len() > 2, "one chunk per token group");
    let (streamed, finish) = streamed_text(&chunks, 0);
    assert_eq!(streamed, text);
    assert_eq!(finish.as_deref(), whole["choices"][0]["finish_reason"].as_str());
    let usage = &whole["usage"];
    assert_eq!(
        usage["total_tokens"],
        usage["prompt_tokens"].as_u64().unwrap_or(0) + usage["completion_tokens"].as_u64().unwrap_or(0)
    );
    Ok(())
}

#[tokio::test]
async fn seeded_sampling_is_reproducible_and_max_tokens_gives_length() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let body = |seed: i64| json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": seed});
    let (_, a) = server.post(body(7)).await?;
    let (_, b) = server.post(body(7)).await?;
    let (_, c) = server.post(body(8)).await?;
    assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"]);
    assert_ne!(a["choices"][0]["text"], c["choices"][0]["text"]);
    // No end-of-text token is likely in 5 tokens: the length limit ends it.
    let (_, short) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 3, "temperature": 0}))
        .await?;
    assert_eq!(short["choices"][0]["finish_reason"], "length");
    assert_eq!(short["usage"]["completion_tokens"], 3);
    Ok(())
}

#[tokio::test]
async fn a_stop_string_ends_the_text_and_never_appears() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let full = reference_greedy(PROMPT, 30)?;
    // A stop string from the middle of the greedy text, on character boundaries.
    let chars: Vec<(usize, char)> = full.char_indices().collect();
    let (start, _) = chars[chars.len() / 2];
    let end = chars.get(chars.len() / 2 + 2).map_or(full.len(), |c| c.0);
    let stop = full[start..end].to_string();
    let expected = &full[..full.find(&stop).unwrap_or(0)];
    for stream in [false, true] {
        let body = json!({"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stop": ["zzzz-never", stop], "stream": stream});
        let (text, finish) = if stream {
            streamed_text(&server.stream(body).await?, 0)
        } else {
            let (_, r) = server.post(body).await?;
            (
                r["choices"][0]["text"].as_str().unwrap_or_default().to_string(),
                r["choices"][0]["finish_reason"].as_str().map(String::from),
            )
        };
        assert_eq!(text, expected, "stream: {stream}");
        assert!(!text.contains(&stop));
        assert_eq!(finish.as_deref(), Some("stop"));
    }
    Ok(())
}

#[tokio::test]
async fn logprobs_echo_and_n() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let (status, r) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3}))
        .await?;
    assert_eq!(status, 200, "{r}");
    let lp = &r["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().cloned().unwrap_or_default();
    assert_eq!(tokens.len(), 6);
    for (i, top) in lp["top_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let chosen = lp["token_logprobs"][i].as_f64().unwrap_or(1.0);
        assert!(chosen <= 0.0);
        let values: Vec<f64> = top
            .as_object()
            .map(|m| m.values().filter_map(|v| v.as_f64()).collect())
            .unwrap_or_default();
        assert!(!values.is_empty() && values.len() <= 3);
        assert!(
            values.windows(2).all(|w| w[0] >= w[1]),
            "top logprobs sorted: {values:?}"
        );
        assert!(values.iter().all(|&v| v <= 0.0));
        assert!((values[0] - chosen).abs() < 1e-5, "greedy picks the most likely token");
    }

    let (_, e) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": true, "logprobs": 1}))
        .await?;
    let text = e["choices"][0]["text"].as_str().unwrap_or_default();
    assert!(text.starts_with(PROMPT) && text.len() > PROMPT.len(), "{text:?}");
    let lp = &e["choices"][0]["logprobs"];
    assert!(
        lp["token_logprobs"][0].is_null(),
        "the first prompt token has no logprob"
    );
    assert_eq!(
        lp["tokens"].as_array().map(Vec::len),
        Some(e["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize + 4)
    );

    let (_, many) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3}))
        .await?;
    let choices = many["choices"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        choices
            .iter()
            .map(|c| c["index"].as_u64().unwrap_or(9))
            .collect::<Vec<_>>(),
        [0, 1, 2]
    );
    let completion_tokens = many["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    assert!(
        completion_tokens > 0 && completion_tokens <= 3 * 8,
        "{completion_tokens}"
    );
    let chunks = server
        .stream(json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 3, "n": 3, "stream": true}))
        .await?;
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(
            streamed_text(&chunks, i as u64).0,
            choice["text"].as_str().unwrap_or_default()
        );
    }
    Ok(())
}

#[tokio::test]
async fn eight_simultaneous_streams_match_their_solo_runs() -> anyhow::Result<()> {
    let server = std::sync::Arc::new(start(&fixture(), config()).await?);
    let prompts: Vec<String> = (0..8).map(|i| format!("{PROMPT} {}", "speak ".repeat(i))).collect();
    let mut solo = Vec::new();
    for p in &prompts {
        let (_, r) = server
            .post(json!({"prompt": p, "max_tokens": 16, "temperature": 0}))
            .await?;
        solo.push(r["choices"][0]["text"].as_str().unwrap_or_default().to_string());
    }
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (server, body) = (
                server.clone(),
                json!({"prompt": p, "max_tokens": 16, "temperature": 0, "stream": true}),
            );
            tokio::spawn(async move { server.stream(body).await })
        })
        .collect();
    for (h, expected) in handles.into_iter().zip(&solo) {
        let chunks = h.await??;
        assert_eq!(&streamed_text(&chunks, 0).0, expected);
    }
    Ok(())
}

#[tokio::test]
async fn a_client_that_disconnects_is_dropped_and_others_finish() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    let server = std::sync::Arc::new(start(slow.path(), config()).await?);
    let url = format!("{}/v1/completions", server.url);
    // Long enough (1000 tokens, seconds here) that it is still running when the client leaves.
    let long = json!({"prompt": "x", "max_tokens": 1000, "temperature": 1.0, "seed": 1, "stream": true});
    let short = json!({"prompt": PROMPT, "max_tokens": 10, "temperature": 0});
    let (_, solo) = server.post(short.clone()).await?;
    let mut resp = server.client.post(&url).json(&long).send().await?;
    assert!(resp.chunk().await?.is_some(), "got the first chunk");
    let others: Vec<_> = (0..3)
        .map(|_| {
            let (server, mut body) = (server.clone(), short.clone());
            body["stream"] = json!(true);
            tokio::spawn(async move { server.stream(body).await })
        })
        .collect();
    drop(resp); // disconnect mid-stream
    for h in others {
        let chunks = h.await??;
        assert_eq!(
            streamed_text(&chunks, 0).0,
            solo["choices"][0]["text"].as_str().unwrap_or_default()
        );
    }
    let mut text = String::new();
    for _ in 0..100 {
        text = server.metrics().await?;
        if metric(&text, "gpt_cancelled_total") >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(&text, "gpt_cancelled_total"), 1.0, "{text}");
    assert!(
        metric(&text, "gpt_generated_tokens_total") < 1000.0,
        "the long generation was cut short"
    );
    Ok(())
}

/// The value of an unlabelled metric.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn the_heap_is_trimmed_once_idle_after_a_burst_past_the_batch_and_not_otherwise() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    let server = std::sync::Arc::new(
        start(
            slow.path(),
            common::ServerConfig {
                max_batch_size: 1,
                ..config()
            },
        )
        .await?,
    );
    let short = json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0});
    // One request at a time never queues more than a batch holds: no trim.
    for _ in 0..3 {
        assert_eq!(server.post(short.clone()).await?.0, 200);
    }
    assert_eq!(metric(&server.metrics().await?, "gpt_heap_trims_total"), 0.0);

    // A burst: one request runs (the batch holds one) while three wait behind it.
    let url = format!("{}/v1/completions", server.url);
    let long = json!({"prompt": "x", "max_tokens": 100, "temperature": 0, "stream": true});
    let mut first = server.client.post(&url).json(&long).send().await?;
    assert!(first.chunk().await?.is_some());
    let burst: Vec<_> = (0..3)
        .map(|_| {
            let (server, body) = (server.clone(), short.clone());
            tokio::spawn(async move { server.post(body).await })
        })
        .collect();
    let mut queued = 0.0;
    for _ in 0..500 {
        queued = metric(&server.metrics().await?, "gpt_queue_depth");
        if queued == 3.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(queued, 3.0, "the burst queued behind the running request");
    // Not while the burst is served: only once the engine is idle.
    assert_eq!(metric(&server.metrics().await?, "gpt_heap_trims_total"), 0.0);
    while first.chunk().await?.is_some() {}
    for h in burst {
        assert_eq!(h.await??.0, 200);
    }
    let mut trims = 0.0;
    for _ in 0..200 {
        trims = metric(&server.metrics().await?, "gpt_heap_trims_total");
        if trims > 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(trims, 1.0, "one trim once the burst was served");

    // Back to one at a time: no further trim.
    for _ in 0..3 {
        assert_eq!(server.post(short.clone()).await?.0, 200);
    }
    assert_eq!(metric(&server.metrics().await?, "gpt_heap_trims_total"), 1.0);
    Ok(())
}
