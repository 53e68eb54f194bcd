//! `/v1/chat/completions`: the chat template (the checkpoint's, a file's, or the fallback) turns
//! messages into the prompt that completions would get, the response and the stream have chat's
//! shapes, errors name chat's parameters; and around every route, CORS and request ids.

mod common;

use common::{config, fixture, start, ServerConfig};
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

fn content(r: &Value, i: usize) -> String {
    r["choices"][i]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The fixture checkpoint copied with `tokenizer_config` merged into its tokenizer_config.json.
fn fixture_with(tokenizer_config: Value) -> anyhow::Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    for entry in std::fs::read_dir(fixture())? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.path().join(entry.file_name()))?;
    }
    let path = dir.path().join("tokenizer_config.json");
    let mut config: Value = match std::fs::read_to_string(&path) {
        Ok(text) => serde_json::from_str(&text)?,
        Err(_) => json!({}),
    };
    for (k, v) in tokenizer_config.as_object().into_iter().flatten() {
        config[k] = v.clone();
    }
    std::fs::write(&path, serde_json::to_string(&config)?)?;
    Ok(dir)
}

#[tokio::test]
async fn a_chat_turn_is_the_completion_of_the_rendered_prompt_whole_and_streamed() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    // (The fixture's context is 64 tokens.)
    let messages = json!([
        {"role": "system", "content": "Rome."},
        {"role": "user", "content": "Speak"},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": [{"type": "text", "text": "You"}, {"type": "text", "text": "all"}]},
    ]);
    let rendered = "Rome.\n\nUSER:\nSpeak\n\nASSISTANT:\nYes.\n\nUSER:\nYou\nall\n\nASSISTANT:\n";
    let chat = server
        .call(
            CHAT,
            json!({"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 3}),
        )
        .await?;
    let plain = server
        .call(
            "/v1/completions",
            json!({"prompt": rendered, "max_tokens": 12, "temperature": 0, "stop": ["\n\n"], "logprobs": 3}),
        )
        .await?;
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        content(&chat, 0),
        plain["choices"][0]["text"].as_str().unwrap_or_default()
    );
    assert!(!content(&chat, 0).contains("\n\n"), "the turn ends at the blank line");
    assert_eq!(
        chat["choices"][0]["finish_reason"],
        plain["choices"][0]["finish_reason"]
    );
    assert_eq!(chat["usage"], plain["usage"]);
    // Logprobs in chat's shape, the same numbers as completions'.
    let lp = &chat["choices"][0]["logprobs"]["content"];
    let plain_lp = &plain["choices"][0]["logprobs"];
    let n = lp.as_array().map_or(0, Vec::len);
    assert!(n > 0 && Some(n) == plain_lp["tokens"].as_array().map(Vec::len));
    for i in 0..n {
        assert_eq!(lp[i]["token"], plain_lp["tokens"][i]);
        // Within float rounding: the second request reuses the first's prompt from the prefix
        // cache, whose attention ran over a different number of rows.
        let close = |a: &Value, b: &Value| (a.as_f64().unwrap_or(f64::NAN) - b.as_f64().unwrap_or(0.0)).abs() < 1e-5;
        assert!(close(&lp[i]["logprob"], &plain_lp["token_logprobs"][i]), "{i}");
        let bytes: Vec<u8> = serde_json::from_value(lp[i]["bytes"].clone())?;
        assert_eq!(Some(String::from_utf8(bytes)?.as_str()), lp[i]["token"].as_str());
        let top = lp[i]["top_logprobs"].as_array().cloned().unwrap_or_default();
        let plain_top = plain_lp["top_logprobs"][i].as_object().cloned().unwrap_or_default();
        assert_eq!(top.len(), plain_top.len());
        for (t, (token, p)) in top.iter().zip(plain_top) {
            assert_eq!(t["token"].as_str(), Some(token.as_str()));
            assert!(close(&t["logprob"], &p));
        }
    }

    // Streamed: each choice's role first, then content, then its finish reason alone, usage last.
    let body = json!({"messages": messages, "max_tokens": 12, "temperature": 0, "n": 2,
                      "stream": true, "stream_options": {"include_usage": true}});
    let chunks = server.stream_at(CHAT, body).await?;
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    for index in [0, 1] {
        let mine: Vec<&Value> = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().into_iter().flatten())
            .filter(|c| c["index"] == index)
            .collect();
        assert_eq!(mine[0]["delta"], json!({"role": "assistant", "content": ""}));
        let text: String = mine.iter().filter_map(|c| c["delta"]["content"].as_str()).collect();
        assert_eq!(text, content(&chat, 0), "choice {index}");
        let last = mine.last().copied().cloned().unwrap_or_default();
        assert_eq!(last["delta"], json!({}));
        assert_eq!(last["finish_reason"], chat["choices"][0]["finish_reason"]);
        assert_eq!(mine.iter().filter(|c| !c["finish_reason"].is_null()).count(), 1);
    }
    let usage = &chunks.last().cloned().unwrap_or_default();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], chat["usage"]["prompt_tokens"]);
    Ok(())
}

#[tokio::test]
async fn the_checkpoints_template_is_used_and_a_file_overrides_it() -> anyhow::Result<()> {
    // A Hub-style template: Python string methods, the eos token, raise_exception.
    let template =
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system messages') }}{% endif %}\
                    [{{ m.role }}] {{ m.content.strip() }}{{ eos_token }}{% endfor %}[assistant]";
    let dir = fixture_with(json!({"chat_template": template, "eos_token": {"content": "<|endoftext|>"}}))?;
    let server = start(dir.path(), config()).await?;
    let info = server.get("/tokenizer_info").await?;
    assert_eq!(info["chat_template"], template);
    let chat = server
        .call(
            CHAT,
            json!({"messages": [{"role": "user", "content": "  Speak  "}], "max_tokens": 8, "temperature": 0}),
        )
        .await?;
    let plain = server
        .call(
            "/v1/completions",
            json!({"prompt": "[user] Speak<|endoftext|>[assistant]", "max_tokens": 8, "temperature": 0}),
        )
        .await?;
    assert_eq!(
        content(&chat, 0),
        plain["choices"][0]["text"].as_str().unwrap_or_default()
    );
    assert_eq!(chat["usage"], plain["usage"]);
    let (status, err) = server
        .post_to(CHAT, json!({"messages": [{"role": "system", "content": "x"}]}))
        .await?;
    assert_eq!(status, 400);
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no system messages")),
        "{err}"
    );
    assert_eq!(err["error"]["param"], "messages");

    // --chat-template FILE wins over the checkpoint's.
    let file = dir.path().join("other.jinja");
    std::fs::write(&file, "{% for m in messages %}{{ m.content }}|{% endfor %}")?;
    let server = start(
        dir.path(),
        ServerConfig {
            chat_template: Some(file.clone()),
            ..config()
        },
    )
    .await?;
    let chat = server
        .call(
            CHAT,
            json!({"messages": [{"role": "user", "content": "Speak"}], "max_tokens": 8, "temperature": 0}),
        )
        .await?;
    let plain = server
        .call(
            "/v1/completions",
            json!({"prompt": "Speak|", "max_tokens": 8, "temperature": 0}),
        )
        .await?;
    assert_eq!(
        content(&chat, 0),
        plain["choices"][0]["text"].as_str().unwrap_or_default()
    );

    // A template that does not compile stops the start, naming the file.
    std::fs::write(&file, "{% for m in %}")?;
    let cfg = ServerConfig {
        chat_template: Some(file.clone()),
        ..config()
    };
    let err = start(dir.path(), cfg)
        .await
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(err.contains("other.jinja") && err.contains("does not compile"), "{err}");
    Ok(())
}

#[tokio::test]
async fn chat_errors_name_chat_parameters() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let user = json!([{"role": "user", "content": "Speak"}]);
    let cases = [
        (
            json!({"messages": user, "max_completion_tokens": 5000}),
            "max_completion_tokens",
            "between 0 and",
        ),
        (
            json!({"messages": user, "max_tokens": 5000, "max_completion_tokens": 5}),
            "max_tokens",
            "between 0 and",
        ),
        (
            json!({"messages": user, "top_logprobs": 2}),
            "top_logprobs",
            "requires logprobs",
        ),
        (
            json!({"messages": user, "logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "between 0 and 20",
        ),
        (
            json!({"messages": user, "tools": [{"type": "retrieval"}]}),
            "tools[0].type",
            "must be \"function\"",
        ),
        (json!({"messages": user, "functions": []}), "functions", "not supported"),
        (json!({"messages": user, "temperature": -1}), "temperature", ">= 0"),
        (json!({"messages": []}), "messages", "at least one message"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages",
            "unknown variant",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages",
            "not supported",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x".repeat(400)}]}),
            "messages",
            "rendered from messages",
        ),
    ];
    for (body, param, says) in cases {
        let (status, err) = server.post_to(CHAT, body.clone()).await?;
        assert_eq!(status, 400, "{body}: {err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{body}: {message}");
        assert_eq!(err["error"]["param"], param, "{body}: {err}");
    }
    let (status, _) = server.post_to(CHAT, json!({"model": "nope", "messages": user})).await?;
    assert_eq!(status, 404);
    Ok(())
}

#[tokio::test]
async fn cors_only_for_the_given_origins_and_every_response_has_a_request_id() -> anyhow::Result<()> {
    let preflight = |url: String, origin: &'static str| {
        reqwest::Client::new()
            .request(reqwest::Method::OPTIONS, url)
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization,content-type")
            .send()
    };
    let allow = |r: &reqwest::Response| {
        r.headers()
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let closed = start(&fixture(), config()).await?;
    let r = preflight(format!("{}{CHAT}", closed.url), "http://example.com").await?;
    assert_eq!(allow(&r), None, "no CORS by default");

    let cfg = ServerConfig {
        cors_origins: vec!["http://example.com".into()],
        ..config()
    };
    let open = start(&fixture(), cfg).await?;
    let r = preflight(format!("{}{CHAT}", open.url), "http://example.com").await?;
    assert!(r.status().is_success());
    assert_eq!(allow(&r).as_deref(), Some("http://example.com"));
    let r = preflight(format!("{}{CHAT}", open.url), "http://elsewhere.org").await?;
    assert_eq!(allow(&r), None, "an origin not on the list");
    let any = start(
        &fixture(),
        ServerConfig {
            cors_origins: vec!["*".into()],
            ..config()
        },
    )
    .await?;
    let r = preflight(format!("{}/v1/completions", any.url), "http://elsewhere.org").await?;
    assert_eq!(allow(&r).as_deref(), Some("*"));

    // A request id on every response: a new one, or the client's own.
    let r = reqwest::get(format!("{}/health", open.url)).await?;
    let id = r
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    assert_eq!(id.len(), 36, "a UUID: {id:?}");
    let r = reqwest::Client::new()
        .get(format!("{}/v1/models", open.url))
        .header("x-request-id", "mine-42")
        .send()
        .await?;
    assert_eq!(
        r.headers().get("x-request-id").and_then(|v| v.to_str().ok()),
        Some("mine-42")
    );
    Ok(())
}

#[tokio::test]
async fn the_playground_is_served_at_the_root_with_the_models_settings() -> anyhow::Result<()> {
    let cfg = ServerConfig {
        api_key: Some("k".into()),
        model_name: "</script><b>".into(),
        ..config()
    };
    let server = start(&fixture(), cfg).await?;
    let resp = reqwest::get(format!("{}/", server.url)).await?;
    assert_eq!(resp.status().as_u16(), 200, "the page needs no key");
    let kind = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    assert_eq!(kind.as_deref(), Some("text/html; charset=utf-8"));
    let page = resp.text().await?;
    let start = page
        .find("const CONFIG = ")
        .ok_or_else(|| anyhow::anyhow!("no CONFIG"))?
        + "const CONFIG = ".len();
    let end = start + page[start..].find(";\n").unwrap_or(0);
    let config: Value = serde_json::from_str(&page[start..end])?;
    assert_eq!(
        config,
        json!({"model": "</script><b>", "context": 64, "n_layer": 2, "n_head": 4, "max_tokens_cap": 64,
               "max_attention_tokens": 64, "api_key_required": true})
    );
    assert!(
        !page[start..end].contains('<'),
        "a model name cannot close the script element"
    );
    for id in [
        "prompt",
        "generate",
        "conversation",
        "send",
        "show-attention",
        "heatmap",
        "apikey",
    ] {
        assert!(page.contains(&format!("id=\"{id}\"")), "{id}");
    }
    Ok(())
}
