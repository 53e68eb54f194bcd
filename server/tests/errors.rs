//! Every bad request gets OpenAI's error shape and the right status; the service endpoints.

mod common;

use common::{config, fixture, start};
use serde_json::{json, Value};

fn assert_error(status: u16, body: &Value, want_status: u16, param: Option<&str>, words: &[&str]) {
    assert_eq!(status, want_status, "{body}");
    let error = &body["error"];
    let message = error["message"].as_str().unwrap_or_default();
    assert!(!error["type"].as_str().unwrap_or_default().is_empty(), "{body}");
    for w in words {
        assert!(message.contains(w), "{message:?} lacks {w:?}");
    }
    if let Some(p) = param {
        assert_eq!(error["param"], p, "{body}");
    }
}

#[tokio::test]
async fn invalid_parameters_are_400_naming_the_parameter() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let cases = [
        (json!({"prompt": "hi", "temperature": -0.5}), "temperature", ">= 0"),
        (json!({"prompt": "hi", "top_p": 0}), "top_p", "(0, 1]"),
        (json!({"prompt": "hi", "top_p": 1.5}), "top_p", "(0, 1]"),
        (
            json!({"prompt": "hi", "max_tokens": 5000}),
            "max_tokens",
            "between 0 and 64",
        ),
        (json!({"prompt": "hi", "min_tokens": -1}), "min_tokens", "between 0 and"),
        (json!({"prompt": "hi", "min_p": 1.5}), "min_p", "[0, 1]"),
        (json!({"prompt": "hi", "best_of": 17}), "best_of", "between 1 and 16"),
        (
            json!({"prompt": "hi", "logit_bias": {"5": 101}}),
            "logit_bias",
            "[-100, 100]",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"320": 1}}),
            "logit_bias",
            "outside the vocabulary",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"05": 1}}),
            "logit_bias",
            "in decimal",
        ),
        (
            json!({"prompt": "hi", "stop_token_ids": [3, 320]}),
            "stop_token_ids",
            "stop_token_ids[1]",
        ),
        (json!({"prompt": ["hi", ""]}), "prompt", "prompt[1] must not be empty"),
        (
            json!({"prompt": [[1, 2], [3, 400]]}),
            "prompt",
            "prompt[1][1]: token id 400",
        ),
        (json!({"prompt": ["a", 1]}), "prompt", "prompt[1] must be a string"),
        (json!({"prompt": "hi", "suffix": "!"}), "suffix", "not supported"),
        (
            json!({"prompt": "hi", "early_stopping": true}),
            "early_stopping",
            "not supported",
        ),
        (
            json!({"prompt": "hi", "length_penalty": 11}),
            "length_penalty",
            "[-10, 10]",
        ),
        (json!({"prompt": "hi", "bogus": 1}), "bogus", "unknown field"),
        (json!({"prompt": ""}), "prompt", "empty"),
        (json!({"prompt": []}), "prompt", "empty"),
        (json!({"prompt": [1, 2, 320]}), "prompt", "outside the vocabulary"),
        (json!({"prompt": [-1]}), "prompt", "outside the vocabulary"),
        (json!({"prompt": "hi", "n": 0}), "n", "between 1 and"),
        (json!({"prompt": "hi", "logprobs": 99}), "logprobs", "between 0 and"),
        (json!({"prompt": "hi", "top_k": -5}), "top_k", "between -1 and 320"),
        (
            json!({"prompt": "hi", "presence_penalty": 3}),
            "presence_penalty",
            "[-2, 2]",
        ),
        (
            json!({"prompt": "hi", "repetition_penalty": 0}),
            "repetition_penalty",
            "> 0",
        ),
        (json!({"prompt": "hi", "stop": vec!["a"; 65]}), "stop", "up to 64"),
        (json!({"prompt": "hi", "stop": ["a", ""]}), "stop", "non-empty"),
    ];
    for (body, param, words) in cases {
        let (status, resp) = server.post(body.clone()).await?;
        assert_error(status, &resp, 400, Some(param), &[words]);
    }
    // A prompt that leaves no room in the 64-token context: OpenAI's code, and both numbers.
    let (status, resp) = server.post(json!({"prompt": vec![5; 64]})).await?;
    assert_error(status, &resp, 400, Some("prompt"), &["64 tokens", "at most 63"]);
    assert_eq!(resp["error"]["code"], "context_length_exceeded");
    let (status, resp) = server.post(json!({"prompt": [vec![5; 3], vec![5; 70]]})).await?;
    assert_error(status, &resp, 400, Some("prompt"), &["prompt[1] has 70 tokens"]);
    // A prompt that fits with max_tokens beyond the context: generation stops at the context.
    let (status, resp) = server
        .post(json!({"prompt": vec![5; 60], "max_tokens": 64, "temperature": 0, "ignore_eos": true}))
        .await?;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["usage"]["completion_tokens"], 4);
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    Ok(())
}

#[tokio::test]
async fn malformed_bodies_are_400_json_and_large_ones_413() -> anyhow::Result<()> {
    let server = start(
        &fixture(),
        common::ServerConfig {
            body_limit: 2000,
            ..config()
        },
    )
    .await?;
    let url = format!("{}/v1/completions", server.url);
    for (body, words) in [
        ("{not json", "invalid JSON"),
        (r#"{"prompt": "hi", "temperature": "hot"}"#, "temperature"),
        (r#"{"prompt": {"text": "hi"}}"#, "prompt"),
        (r#"{"max_tokens": 3}"#, "prompt"),
    ] {
        let resp = server
            .client
            .post(&url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await?;
        let status = resp.status().as_u16();
        assert_error(status, &resp.json().await?, 400, None, &[words]);
    }
    // An object's fields written as an array (which serde's derived structs would read in
    // order), here or in a nested object, is refused, naming where.
    let (status, resp) = server.post(json!(["hi"])).await?;
    assert_error(status, &resp, 400, None, &["must be a JSON object", "an array"]);
    let (status, resp) = server.post(json!({"prompt": "hi", "stream_options": []})).await?;
    assert_error(status, &resp, 400, Some("stream_options"), &["expected an object"]);
    let chat = |messages: Value| json!({"messages": messages, "max_tokens": 1});
    let cases = [
        (
            chat(json!([["user", "hi", null, null, null, null]])),
            "[0]: expected an object",
        ),
        (
            chat(json!([{"role": "user", "content": "hi"}, {"role": "cook"}])),
            "[1].role: unknown variant",
        ),
        (
            chat(json!([{"role": "user", "content": "hi", "colour": 1}])),
            "unknown field `colour`",
        ),
    ];
    for (body, words) in cases {
        let (status, resp) = server.post_to("/v1/chat/completions", body).await?;
        assert_error(status, &resp, 400, Some("messages"), &[words]);
    }
    let (status, resp) = server.post_to("/v1/chat/completions", json!({"max_tokens": 1})).await?;
    assert_error(status, &resp, 400, None, &["missing field `messages`"]);
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                    "stream_options": {"include_usage": true}, "stream": false});
    let (status, resp) = server.post_to("/v1/chat/completions", ok).await?;
    assert_eq!(status, 200, "{resp}");
    let big = json!({"prompt": "x".repeat(5000)});
    let (status, resp) = server.post(big).await?;
    assert_error(status, &resp, 413, None, &["limit"]);
    Ok(())
}

#[tokio::test]
async fn api_key_and_model_name() -> anyhow::Result<()> {
    let server = start(
        &fixture(),
        common::ServerConfig {
            api_key: Some("sekret".into()),
            ..config()
        },
    )
    .await?;
    let url = format!("{}/v1/completions", server.url);
    let body = json!({"model": "tiny", "prompt": "hi", "max_tokens": 2});
    for auth in [None, Some("Bearer wrong"), Some("sekret")] {
        let mut req = server.client.post(&url).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        assert_error(status, &resp.json().await?, 401, None, &["API key"]);
    }
    let ok = server
        .client
        .post(&url)
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await?;
    assert_eq!(ok.status().as_u16(), 200);
    let models = server.client.get(format!("{}/v1/models", server.url)).send().await?;
    assert_eq!(models.status().as_u16(), 401);
    let health = server.client.get(format!("{}/health", server.url)).send().await?;
    assert_eq!(health.status().as_u16(), 200, "health stays open for probes");

    let resp = server
        .client
        .post(&url)
        .bearer_auth("sekret")
        .json(&json!({"model": "gpt-5", "prompt": "hi"}))
        .send()
        .await?;
    let status = resp.status().as_u16();
    assert_error(status, &resp.json().await?, 404, Some("model"), &["gpt-5"]);

    // Without a key configured, no header is needed.
    let open = start(&fixture(), config()).await?;
    let (status, _) = open.post(body).await?;
    assert_eq!(status, 200);
    Ok(())
}

#[tokio::test]
async fn a_full_queue_answers_503_with_retry_after() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    let server = start(
        slow.path(),
        common::ServerConfig {
            max_batch_size: 1,
            max_queue: 1,
            ..config()
        },
    )
    .await?;
    let url = format!("{}/v1/completions", server.url);
    let long = json!({"prompt": "x", "max_tokens": 1000, "stream": true});
    // The first runs (the batch holds one), the second waits in the queue (room for one).
    let mut first = server.client.post(&url).json(&long).send().await?;
    assert!(first.chunk().await?.is_some());
    let second = {
        let (client, url, long) = (server.client.clone(), url.clone(), long.clone());
        tokio::spawn(async move { client.post(&url).json(&long).send().await })
    };
    // Probe only once the second is queued: a probe sent first would take the queue's place,
    // wait out the first's 1000 tokens and succeed.
    for _ in 0..1000 {
        if server.metrics().await?.lines().any(|l| l == "gpt_queue_depth 1") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let resp = server
        .client
        .post(&url)
        .json(&json!({"prompt": "y", "max_tokens": 1}))
        .send()
        .await?;
    let status = resp.status().as_u16();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap_or_default().to_string());
    let body: Value = resp.json().await?;
    assert_error(status, &body, 503, None, &["capacity"]);
    assert_eq!(retry_after.as_deref(), Some("1"));
    drop(first);
    drop(second);
    Ok(())
}

#[tokio::test]
async fn health_models_metrics_and_openapi() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let get = |path: &str| server.client.get(format!("{}{path}", server.url)).send();
    let health: Value = get("/health").await?.json().await?;
    assert_eq!(health["status"], "ok");
    let models: Value = get("/v1/models").await?.json().await?;
    assert_eq!(models["data"][0]["id"], "tiny");

    server
        .post(json!({"prompt": "hi", "max_tokens": 3, "temperature": 0}))
        .await?;
    server.post(json!({"prompt": "hi", "temperature": -1})).await?;
    server.call("/v1/embeddings", json!({"input": "hi"})).await?;
    server.post_to("/v1/messages", json!({"max_tokens": 2})).await?;
    let metrics = server.metrics().await?;
    for line in [
        "gpt_requests_total{route=\"/v1/embeddings\",status=\"200\"} 1",
        "gpt_requests_total{route=\"/v1/messages\",status=\"400\"} 1",
        "gpt_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
        "gpt_requests_total{route=\"/v1/completions\",status=\"400\"} 1",
        "gpt_generated_tokens_total",
        "gpt_prompt_tokens_total",
        "gpt_queue_depth 0",
        "gpt_batch_size",
        "gpt_time_to_first_token_seconds_bucket",
        "gpt_inter_token_latency_seconds_bucket",
    ] {
        assert!(metrics.contains(line), "metrics lack {line:?}:\n{metrics}");
    }
    // Three tokens of one request (a prefill step and two decode steps) and the embedding's step,
    // each timed.
    let value = |name: &str| -> f64 {
        (metrics.lines())
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(f64::NAN)
    };
    assert_eq!(value("gpt_step_duration_seconds_count"), 4.0, "{metrics}");
    assert!(value("gpt_step_duration_seconds_sum") > 0.0, "{metrics}");

    let spec: Value = get("/openapi.json").await?.json().await?;
    assert!(spec["paths"]["/v1/completions"]["post"].is_object());
    let request = &spec["components"]["schemas"]["CompletionRequest"]["properties"];
    for field in [
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "stop",
        "n",
        "logprobs",
        "echo",
        "stream",
        "seed",
    ] {
        assert!(
            request[field].is_object(),
            "CompletionRequest.{field} missing from the spec"
        );
    }
    assert!(spec["components"]["schemas"]["ErrorResponse"].is_object());
    Ok(())
}
