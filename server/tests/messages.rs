//! Anthropic's Messages API (`/v1/messages`) on the tiny fixture: the same greedy text as the
//! chat endpoint, whole and streamed (events in Anthropic's order), count_tokens equal to the
//! chat's prompt tokens, `x-api-key`, and every bad input a 4xx in Anthropic's error shape naming
//! the field. (The `anthropic` SDK itself, with tools, on a real model:
//! `tests/fixtures/anthropic_smollm2_check.py`, in `.ci/run`.)

mod common;

use common::{config, fixture, start};
use serde_json::{json, Value};

/// The `event:` names and their data of an SSE body.
fn events(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((name.clone(), serde_json::from_str(d).unwrap_or(Value::Null)));
        }
    }
    out
}

fn assert_anthropic_error(status: u16, body: &Value, want: u16, kind: &str, mentions: &str) {
    assert_eq!(status, want, "{body}");
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(mentions), "{mentions:?} not in {message:?}");
}

#[tokio::test]
async fn messages_give_the_chat_endpoints_text_whole_and_streamed() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let conversation = json!([{"role": "user", "content": [{"type": "text", "text": "Speak, speak."}]}]);
    let chat = server
        .call(
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak, speak."}],
                "max_tokens": 12, "temperature": 0}),
        )
        .await?;
    let body = json!({"model": "tiny", "max_tokens": 12, "temperature": 0, "system": "Be brief.",
        "messages": conversation});
    let whole = server.call("/v1/messages", body.clone()).await?;
    assert_eq!(whole["type"], "message");
    assert_eq!(whole["role"], "assistant");
    assert_eq!(whole["content"][0]["type"], "text");
    assert_eq!(whole["content"][0]["text"], chat["choices"][0]["message"]["content"]);
    assert_eq!(whole["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    assert_eq!(whole["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
    let reason = match chat["choices"][0]["finish_reason"].as_str() {
        Some("length") => "max_tokens",
        _ if chat["choices"][0]["stop_reason"].is_string() => "stop_sequence",
        _ => "end_turn",
    };
    assert_eq!(whole["stop_reason"], reason, "{whole}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = server
        .client
        .post(format!("{}/v1/messages", server.url))
        .json(&streamed)
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 200);
    let events = events(&resp.text().await?);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names[1], "content_block_start");
    assert_eq!(
        &names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(
        names[2..names.len() - 3].iter().all(|n| *n == "content_block_delta"),
        "{names:?}"
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "each event's data names it");
    }
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(text, whole["content"][0]["text"].as_str().unwrap_or_default());
    assert_eq!(
        events[0].1["message"]["usage"]["input_tokens"],
        whole["usage"]["input_tokens"]
    );
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], whole["stop_reason"]);
    assert_eq!(delta["usage"]["output_tokens"], whole["usage"]["output_tokens"]);

    // count_tokens: the prompt as the chat template renders it, without max_tokens.
    let counted = server
        .call(
            "/v1/messages/count_tokens",
            json!({"model": "tiny", "system": "Be brief.", "messages": conversation}),
        )
        .await?;
    assert_eq!(counted["input_tokens"], chat["usage"]["prompt_tokens"]);
    Ok(())
}

#[tokio::test]
async fn bad_messages_are_anthropic_errors_naming_the_field() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"model": "tiny", "messages": user}), 400, "max_tokens"),
        (json!({"model": "tiny", "max_tokens": 4}), 400, "messages"),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": []}),
            400,
            "at least one",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}),
            400,
            "messages[0].role",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            400,
            "messages[0].content[0]",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}),
            400,
            "tool_use_id",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": user, "tool_choice": {"type": "sometimes"}}),
            400,
            "tool_choice.type",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": user, "tools": [{"input_schema": {}}]}),
            400,
            "tools[0]",
        ),
        (
            json!({"model": "tiny", "max_tokens": -1, "messages": user}),
            400,
            "max_tokens",
        ),
        (
            json!({"model": "tiny", "max_tokens": 4, "messages": user, "temperature": "hot"}),
            400,
            "temperature",
        ),
        (
            json!({"model": "claude-9", "max_tokens": 4, "messages": user}),
            404,
            "claude-9",
        ),
    ];
    for (body, status, mentions) in cases {
        let (got, resp) = server.post_to("/v1/messages", body.clone()).await?;
        let kind = if status == 404 {
            "not_found_error"
        } else {
            "invalid_request_error"
        };
        assert_anthropic_error(got, &resp, status, kind, mentions);
    }
    let resp = server
        .client
        .post(format!("{}/v1/messages", server.url))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await?;
    let status = resp.status().as_u16();
    assert_anthropic_error(
        status,
        &resp.json().await?,
        400,
        "invalid_request_error",
        "invalid JSON",
    );
    Ok(())
}

#[tokio::test]
async fn messages_take_the_key_as_x_api_key_or_bearer() -> anyhow::Result<()> {
    let server = start(
        &fixture(),
        common::ServerConfig {
            api_key: Some("sekret".into()),
            ..config()
        },
    )
    .await?;
    let url = format!("{}/v1/messages", server.url);
    let body = json!({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
    for (header, value, want) in [
        (None, "", 401),
        (Some("x-api-key"), "wrong", 401),
        (Some("x-api-key"), "sekret", 200),
        (Some("authorization"), "Bearer sekret", 200),
    ] {
        let mut req = server.client.post(&url).json(&body);
        if let Some(h) = header {
            req = req.header(h, value);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let json: Value = resp.json().await?;
        match want {
            401 => assert_anthropic_error(status, &json, 401, "authentication_error", "API key"),
            _ => assert_eq!(status, 200, "{json}"),
        }
    }
    Ok(())
}
