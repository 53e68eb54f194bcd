//! Prefix caching: prompts that share a prefix with an earlier one reuse its KV cache,
//! `/metrics` counts it, and nothing a client sees changes: greedy text, sampled text for a seed,
//! and the prompt's own logprobs (`echo` with `logprobs`, lm-eval's loglikelihood requests) equal
//! those of a server without the cache.

mod common;

use common::{config, fixture, start, ServerConfig};
use serde_json::{json, Value};

/// The value of an unlabelled metric.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
        .unwrap_or(f64::NAN)
}

fn prompt_logprobs(response: &Value) -> Vec<f64> {
    response["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_f64().unwrap_or(f64::NAN)).collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefixes_are_reused_without_changing_any_answer() -> anyhow::Result<()> {
    let cached = start(&fixture(), config()).await?;
    let plain = start(
        &fixture(),
        ServerConfig {
            prefix_cache_mib: 0,
            ..config()
        },
    )
    .await?;
    let context: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 60).collect();
    let requests: Vec<Value> = (0..4u32)
        .flat_map(|answer| {
            let mut ids = context.clone();
            ids.extend([answer, answer + 1, answer + 2]);
            [
                json!({"prompt": ids.clone(), "max_tokens": 8, "temperature": 0}),
                json!({"prompt": ids.clone(), "max_tokens": 8, "temperature": 0.9, "seed": 5, "n": 2}),
                json!({"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": true, "logprobs": 2}),
            ]
        })
        .collect();
    for body in &requests {
        let ((s1, a), (s2, b)) = (cached.post(body.clone()).await?, plain.post(body.clone()).await?);
        assert_eq!((s1, s2), (200, 200), "{a} {b}");
        for (ca, cb) in a["choices"]
            .as_array()
            .into_iter()
            .flatten()
            .zip(b["choices"].as_array().into_iter().flatten())
        {
            assert_eq!(ca["text"], cb["text"], "{body}");
        }
        let (la, lb) = (prompt_logprobs(&a), prompt_logprobs(&b));
        assert_eq!(la.len(), lb.len());
        for (x, y) in la.iter().zip(&lb) {
            // The first token has none (null) on both. Equal, not close: on the CPU each result is
            // summed in one order whether its keys and values were cached or just computed.
            assert!((x.is_nan() && y.is_nan()) || x == y, "{body}: {la:?} against {lb:?}");
        }
        assert_eq!(
            a["choices"][0]["logprobs"]["top_logprobs"].as_array().map(Vec::len),
            b["choices"][0]["logprobs"]["top_logprobs"].as_array().map(Vec::len)
        );
        assert_eq!(a["usage"], b["usage"]);
    }
    let m = cached.metrics().await?;
    let (lookups, hits, reused) = (
        metric(&m, "gpt_prefix_cache_lookups_total"),
        metric(&m, "gpt_prefix_cache_hits_total"),
        metric(&m, "gpt_prefix_cache_reused_tokens_total"),
    );
    assert_eq!(lookups, requests.len() as f64, "{m}");
    // Every request but two shares at least the 40-token context with an earlier one that
    // stored what it needs: the very first misses, and so does the first `echo` + `logprobs`
    // request (no entry has the prompt's logprobs before it).
    assert_eq!(hits, (requests.len() - 2) as f64, "{m}");
    assert!(reused >= 39.0 * (requests.len() - 2) as f64, "{m}");
    assert!(metric(&m, "gpt_prefix_cache_bytes") > 0.0, "{m}");
    let off = plain.metrics().await?;
    assert_eq!(metric(&off, "gpt_prefix_cache_hits_total"), 0.0, "{off}");
    Ok(())
}
