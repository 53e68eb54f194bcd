//! Speculative decoding in the server: the same greedy output as without it, token for token and
//! with the same logprobs, with each proposer and under every generation feature; sampling with
//! the same distribution; the counters in /metrics; what a request and the flags may ask.

mod common;

use std::collections::HashMap;

use common::{config, fixture, start, Server, ServerConfig};
use gpt_server::Speculative;
use serde_json::{json, Value};

fn speculative(draft: Option<std::path::PathBuf>, max_batch: usize) -> ServerConfig {
    ServerConfig {
        speculative: Some(Speculative {
            draft,
            num_tokens: 5,
            max_batch,
        }),
        ..config()
    }
}

/// A small draft of `vocab` tokens (seeded random weights, the fixture's tokenizer): with the
/// fixture's 320 it rarely agrees with the model.
fn small_draft(vocab: usize) -> anyhow::Result<tempfile::TempDir> {
    common::random_checkpoint(gpt::Config {
        n_positions: 64,
        n_embd: 16,
        n_layer: 1,
        n_head: 2,
        ..gpt::Config::tiny(vocab)
    })
}

/// The servers compared: plain, n-gram, a draft that is the model itself (always agrees), a
/// draft that mostly does not.
async fn servers(max_batch: usize) -> anyhow::Result<(Vec<(&'static str, Server)>, tempfile::TempDir)> {
    let other = small_draft(320)?;
    let list = vec![
        ("plain", start(&fixture(), config()).await?),
        ("ngram", start(&fixture(), speculative(None, max_batch)).await?),
        (
            "self",
            start(&fixture(), speculative(Some(fixture()), max_batch)).await?,
        ),
        (
            "other",
            start(&fixture(), speculative(Some(other.path().to_path_buf()), max_batch)).await?,
        ),
    ];
    Ok((list, other))
}

/// What must not change: each choice's text, finish reason, tokens and logprobs (to 1e-4).
fn assert_same(name: &str, body: &Value, plain: &Value, got: &Value) {
    let (a, b) = (&plain["choices"], &got["choices"]);
    assert_eq!(a.as_array().map(Vec::len), b.as_array().map(Vec::len), "{name}: {body}");
    for (x, y) in a
        .as_array()
        .into_iter()
        .flatten()
        .zip(b.as_array().into_iter().flatten())
    {
        assert_eq!(x["text"], y["text"], "{name}: {body}");
        assert_eq!(x["finish_reason"], y["finish_reason"], "{name}: {body}");
        assert_eq!(x["stop_reason"], y["stop_reason"], "{name}: {body}");
        assert_eq!(x["logprobs"]["tokens"], y["logprobs"]["tokens"], "{name}: {body}");
        let lp = |c: &Value| -> Vec<Option<f64>> {
            (c["logprobs"]["token_logprobs"].as_array().into_iter().flatten())
                .map(Value::as_f64)
                .collect()
        };
        for (p, q) in lp(x).into_iter().zip(lp(y)) {
            let same = match (p, q) {
                (Some(p), Some(q)) => (p - q).abs() < 1e-4,
                (p, q) => p == q, // the echoed prompt's first token has none
            };
            assert!(same, "{name}: logprob {p:?} against {q:?}: {body}");
        }
    }
    assert_eq!(plain["usage"], got["usage"], "{name}: {body}");
}

fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::test]
async fn greedy_output_is_the_same_with_every_proposer_and_feature() -> anyhow::Result<()> {
    let (servers, _draft) = servers(4).await?;
    let base = |prompt: &str, max_tokens: u32| json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2});
    let mut bodies: Vec<Value> = Vec::new();
    // Plain prompts, repetitive ones (n-grams recur), to the context's end.
    for (i, prompt) in ["hello", "abcabcabcabc", "the cat sat on the mat. the cat", "xyz", "a"]
        .into_iter()
        .enumerate()
    {
        bodies.push(base(prompt, [8, 30, 60][i % 3]));
    }
    bodies.push(base("to be or not to be", 60)); // cut by the 64-token context
                                                 // Each feature on a prompt where proposals are checked.
    let feature = |extra: Value| {
        let mut b = base("abcabcabcabc", 40);
        for (k, v) in extra.as_object().into_iter().flatten() {
            b[k] = v.clone();
        }
        b
    };
    for extra in [
        json!({"stop": ["ab"]}),
        json!({"stop": ["zz", "cab"], "include_stop_str_in_output": true}),
        json!({"stop_token_ids": [101]}),
        json!({"logit_bias": {"100": 5, "99": -100}}),
        json!({"repetition_penalty": 1.3}),
        json!({"frequency_penalty": 0.7, "presence_penalty": 0.3}),
        json!({"min_tokens": 20, "max_tokens": 25}),
        json!({"max_tokens": 1}),
        json!({"max_tokens": 3}),
        json!({"n": 2, "best_of": 3}),
        json!({"echo": true}),
        json!({"allowed_token_ids": [97, 98, 99, 100, 101]}),
        json!({"structured_outputs": {"regex": "(ab|cd)+c"}}),
        json!({"prompt": ["abcabc", "hello there"], "max_tokens": 20}),
        json!({"ignore_eos": true, "max_tokens": 50}),
    ] {
        bodies.push(feature(extra));
    }
    for body in &bodies {
        let (status, plain) = servers[0].1.post(body.clone()).await?;
        assert_eq!(status, 200, "{plain}");
        for (name, server) in &servers[1..] {
            let (status, got) = server.post(body.clone()).await?;
            assert_eq!(status, 200, "{name}: {got}");
            assert_same(name, body, &plain, &got);
        }
    }
    // A prompt seen before comes from the prefix cache: the same again.
    let again = base("abcabcabcabc", 40);
    let (_, plain) = servers[0].1.post(again.clone()).await?;
    for (name, server) in &servers[1..] {
        let (_, got) = server.post(again.clone()).await?;
        assert_same(name, &again, &plain, &got);
    }
    // Streamed: the same text, in chunks of several tokens at a time.
    let stream = json!({"prompt": "abcabcabcabc", "max_tokens": 40, "temperature": 0, "stream": true});
    let (text, _) = common::streamed_text(&servers[0].1.stream(stream.clone()).await?, 0);
    for (name, server) in &servers[1..] {
        let (got, _) = common::streamed_text(&server.stream(stream.clone()).await?, 0);
        assert_eq!(got, text, "{name}");
    }
    // Proposals were checked, kept and refused; the counters say so.
    for (name, server) in &servers[1..] {
        let m = server.metrics().await?;
        let (checks, proposed, accepted) = (
            counter(&m, "gpt_spec_decode_checks_total"),
            counter(&m, "gpt_spec_decode_draft_tokens_total"),
            counter(&m, "gpt_spec_decode_accepted_tokens_total"),
        );
        assert!(
            checks > 20.0 && proposed >= checks && accepted < proposed,
            "{name}: {m}"
        );
        let rate = counter(&m, "gpt_spec_decode_acceptance_rate");
        assert!((rate - accepted / proposed).abs() < 1e-9, "{name}: {rate}");
        let mean = counter(&m, "gpt_spec_decode_mean_accepted_length");
        assert!((mean - accepted / checks).abs() < 1e-9, "{name}: {mean}");
        match *name {
            // (Its proposals are the raw logits' argmax: the penalties, biases and grammars
            // above choose otherwise at times.)
            "self" => assert!(accepted / proposed > 0.6, "{name}: {accepted} of {proposed}"),
            "other" => assert!(accepted / proposed < 0.5, "{name}: {accepted} of {proposed}"),
            _ => assert!(accepted > 20.0, "{name}: {accepted} of {proposed}"),
        }
    }
    let m = servers[0].1.metrics().await?;
    assert_eq!(
        counter(&m, "gpt_spec_decode_checks_total"),
        0.0,
        "plain never speculates"
    );
    Ok(())
}

#[tokio::test]
async fn under_load_it_steps_aside_and_the_output_stays_the_same() -> anyhow::Result<()> {
    let (servers, _draft) = servers(2).await?;
    let body = |i: usize| json!({"prompt": format!("abc{i}abc{i}abc"), "max_tokens": 30, "temperature": 0});
    let plain: Vec<Value> = futures_util::future::try_join_all((0..8).map(|i| servers[0].1.post(body(i))))
        .await?
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    for (name, server) in &servers[1..] {
        let got = futures_util::future::try_join_all((0..8).map(|i| server.post(body(i)))).await?;
        for (i, ((status, got), plain)) in got.iter().zip(&plain).enumerate() {
            assert_eq!(*status, 200, "{name}: {got}");
            assert_same(name, &body(i), plain, got);
        }
    }
    Ok(())
}

/// Per output position (the first 4), how often each token comes over `runs` requests of 16
/// choices each (seeds apart). (8 tokens each: over 4 the draft's reading of the prompt would not
/// pay, and the speculator would step aside.)
async fn frequencies(server: &Server, prompt: &str, runs: u64) -> anyhow::Result<Vec<HashMap<String, f64>>> {
    let mut counts: Vec<HashMap<String, f64>> = vec![HashMap::new(); 4];
    for run in 0..runs {
        let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.6, "top_k": 4,
                          "n": 16, "seed": run * 16, "logprobs": 0});
        let (status, resp) = server.post(body).await?;
        assert_eq!(status, 200, "{resp}");
        for choice in resp["choices"].as_array().into_iter().flatten() {
            let tokens = choice["logprobs"]["tokens"].as_array().cloned().unwrap_or_default();
            for (pos, t) in tokens.iter().enumerate().take(4) {
                *counts[pos].entry(t.to_string()).or_default() += 1.0 / (16 * runs) as f64;
            }
        }
    }
    Ok(counts)
}

#[tokio::test]
async fn sampled_output_has_the_models_distribution() -> anyhow::Result<()> {
    // (16 choices a request: speculation on up to 16 sequences.)
    let (servers, _draft) = servers(16).await?;
    // A prompt of what the model says greedily, where it repeats itself: n-grams recur, and
    // the n-gram proposals are at times what it samples.
    let (_, said) = servers[0]
        .1
        .post(json!({"prompt": "abc", "max_tokens": 30, "temperature": 0}))
        .await?;
    let prompt = format!("abc{}", said["choices"][0]["text"].as_str().unwrap_or_default());
    // Many seeds; per position, how often each token comes.
    let runs = 40;
    let plain = frequencies(&servers[0].1, &prompt, runs).await?;
    let n = (16 * runs) as f64;
    for (name, server) in &servers[1..3] {
        let got = frequencies(server, &prompt, runs).await?;
        for (pos, (a, b)) in plain.iter().zip(&got).enumerate() {
            for token in a.keys().chain(b.keys()) {
                let (p, q) = (
                    a.get(token).copied().unwrap_or(0.0),
                    b.get(token).copied().unwrap_or(0.0),
                );
                let sd = (2.0 * p.max(q).max(1.0 / n) * (1.0 - p.min(q)) / n).sqrt();
                assert!(
                    (p - q).abs() < 5.0 * sd,
                    "{name}: position {pos}, token {token}: {p:.3} plain against {q:.3}"
                );
            }
        }
        let m = server.metrics().await?;
        let accepted = counter(&m, "gpt_spec_decode_accepted_tokens_total");
        let proposed = counter(&m, "gpt_spec_decode_draft_tokens_total");
        assert!(
            accepted > 10.0 && accepted < proposed,
            "{name}: {accepted} of {proposed} accepted"
        );
    }
    Ok(())
}

#[tokio::test]
async fn a_request_may_turn_it_off_and_bad_settings_are_refused() -> anyhow::Result<()> {
    let server = start(&fixture(), speculative(Some(fixture()), 4)).await?;
    let body = json!({"prompt": "abcabcabc", "max_tokens": 20, "temperature": 0, "num_speculative_tokens": 0});
    let (status, off) = server.post(body).await?;
    assert_eq!(status, 200, "{off}");
    let m = server.metrics().await?;
    assert_eq!(counter(&m, "gpt_spec_decode_checks_total"), 0.0, "{m}");
    let body = json!({"prompt": "abcabcabc", "max_tokens": 20, "temperature": 0, "num_speculative_tokens": 2});
    let (_, on) = server.post(body).await?;
    assert_eq!(on["choices"][0]["text"], off["choices"][0]["text"]);
    let m = server.metrics().await?;
    let (checks, proposed) = (
        counter(&m, "gpt_spec_decode_checks_total"),
        counter(&m, "gpt_spec_decode_draft_tokens_total"),
    );
    assert!(checks > 0.0 && proposed <= 2.0 * checks, "at most 2 a step: {m}");
    for k in [-1, 17] {
        let (status, err) = server
            .post(json!({"prompt": "abc", "num_speculative_tokens": k}))
            .await?;
        assert_eq!(status, 400, "{err}");
        assert_eq!(err["error"]["param"], "num_speculative_tokens");
    }
    // A draft with another vocabulary is refused at start, naming both sizes.
    let bigger = small_draft(400)?;
    let err = match start(&fixture(), speculative(Some(bigger.path().to_path_buf()), 4)).await {
        Ok(_) => panic!("a draft of another vocabulary was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("draft") && err.contains("400") && err.contains("320"),
        "{err}"
    );
    Ok(())
}
