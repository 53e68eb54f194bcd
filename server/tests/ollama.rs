//! Ollama's API on the tiny fixture: `/api/chat` and `/api/generate` give the chat and
//! completions endpoints' greedy text, whole and as newline-delimited JSON; tool calls with their
//! arguments as objects; `/api/embed` the embeddings of `/v1/embeddings`; the model listings; and
//! bad input, other models and what a one-model server cannot do as `{"error": ...}`. (The
//! `ollama` client itself on a real model: `tests/fixtures/ollama_smollm2_check.py`, in CI.)

mod common;

use common::{config, fixture, start};
use serde_json::{json, Value};

/// A newline-delimited JSON body's objects.
async fn lines(server: &common::Server, path: &str, body: Value) -> anyhow::Result<Vec<Value>> {
    let resp = server
        .client
        .post(format!("{}{path}", server.url))
        .body(body.to_string()) // no Content-Type, as curl -d and Ollama's examples send it
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    Ok(resp
        .text()
        .await?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?)
}

#[tokio::test]
async fn chat_and_generate_give_the_openai_endpoints_text() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let messages = json!([{"role": "user", "content": "Speak, speak."}]);
    let reference = server
        .call(
            "/v1/chat/completions",
            json!({"messages": messages, "max_tokens": 12, "temperature": 0}),
        )
        .await?;
    let text = reference["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let options = json!({"temperature": 0, "num_predict": 12});
    let whole = server
        .call(
            "/api/chat",
            json!({"model": "tiny", "messages": messages, "options": options, "stream": false}),
        )
        .await?;
    assert_eq!(whole["message"]["content"], text.as_str());
    assert_eq!(whole["done"], true);
    assert_eq!(whole["eval_count"], reference["usage"]["completion_tokens"]);
    assert_eq!(whole["prompt_eval_count"], reference["usage"]["prompt_tokens"]);
    let length = reference["choices"][0]["finish_reason"] == "length";
    assert_eq!(whole["done_reason"], if length { "length" } else { "stop" });

    let streamed = lines(
        &server,
        "/api/chat",
        json!({"model": "tiny:latest", "messages": messages, "options": options}),
    )
    .await?;
    let joined: String = streamed
        .iter()
        .map(|l| l["message"]["content"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(joined, text);
    assert!(streamed[..streamed.len() - 1].iter().all(|l| l["done"] == false));
    assert_eq!(streamed[streamed.len() - 1]["done"], true);
    assert_eq!(streamed[streamed.len() - 1]["eval_count"], whole["eval_count"]);

    // generate: through the template as chat, or raw as a completion.
    let generated = server
        .call(
            "/api/generate",
            json!({"model": "tiny", "prompt": "Speak, speak.", "options": options, "stream": false}),
        )
        .await?;
    assert_eq!(generated["response"], text.as_str());
    let completion = server
        .call(
            "/v1/completions",
            json!({"prompt": "First Citizen:", "max_tokens": 12, "temperature": 0}),
        )
        .await?;
    let raw = lines(
        &server,
        "/api/generate",
        json!({"model": "tiny", "prompt": "First Citizen:", "raw": true, "options": options}),
    )
    .await?;
    let joined: String = raw.iter().map(|l| l["response"].as_str().unwrap_or_default()).collect();
    assert_eq!(joined, completion["choices"][0]["text"].as_str().unwrap_or_default());
    assert_eq!(raw[raw.len() - 1]["done"], true);
    let load = server.call("/api/generate", json!({"model": "tiny"})).await?;
    assert_eq!(load["done_reason"], "load");
    Ok(())
}

#[tokio::test]
async fn tool_calls_come_with_their_arguments_as_objects() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    // Short names: the call fits the fixture's context of 64 tokens.
    let tools = json!([{"type": "function", "function": {"name": "f", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"c": {"type": "string", "maxLength": 2}}, "required": ["c"],
            "additionalProperties": false}}}]);
    let body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "options": {"temperature": 0, "num_predict": 40}, "stream": false});
    let whole = server.call("/api/chat", body.clone()).await?;
    let call = &whole["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "f", "{whole}");
    assert!(call["arguments"]["c"].is_string(), "{whole}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let lines = lines(&server, "/api/chat", streamed).await?;
    let calls: Vec<&Value> = lines.iter().filter_map(|l| l["message"].get("tool_calls")).collect();
    assert_eq!(calls.len(), 1, "{lines:?}");
    assert_eq!(calls[0][0]["function"], *call);
    // The call and its result as the next turn's history.
    let next = json!({"model": "tiny", "stream": false, "options": {"temperature": 0, "num_predict": 4}, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
        {"role": "tool", "content": "Sunny", "tool_name": "f"}]});
    assert_eq!(server.call("/api/chat", next).await?["done"], true);
    Ok(())
}

#[tokio::test]
async fn listings_embeddings_and_errors() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let name = server.state.model_name.clone();
    assert_eq!(server.get("/api/tags").await?["models"][0]["name"], name.as_str());
    assert_eq!(server.get("/api/ps").await?["models"][0]["model"], name.as_str());
    assert!(server.get("/api/version").await?["version"].is_string());
    let show = server.call("/api/show", json!({"model": name})).await?;
    assert_eq!(show["model_info"]["general.architecture"], "gpt2");
    assert_eq!(show["model_info"]["gpt2.context_length"], server.state.limits.context);

    let embedded = server
        .call("/api/embed", json!({"model": name, "input": ["a", "b c"]}))
        .await?;
    let reference = server.call("/v1/embeddings", json!({"input": ["a", "b c"]})).await?;
    for i in 0..2 {
        assert_eq!(embedded["embeddings"][i], reference["data"][i]["embedding"]);
    }
    let long = "a ".repeat(4 * server.state.limits.context);
    let cut = server.call("/api/embed", json!({"input": long})).await?;
    assert_eq!(
        cut["prompt_eval_count"], server.state.limits.context,
        "truncated to the context"
    );
    let legacy = server.call("/api/embeddings", json!({"prompt": "a"})).await?;
    assert_eq!(legacy["embedding"], reference["data"][0]["embedding"]);

    let cases = [
        ("/api/chat", json!({"model": "tiny"}), 400, "messages"),
        (
            "/api/chat",
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            400,
            "messages[0].role",
        ),
        (
            "/api/chat",
            json!({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
            400,
            "images",
        ),
        ("/api/chat", json!({"messages": [], "format": 5}), 400, "format"),
        (
            "/api/chat",
            json!({"messages": [{"role": "user", "content": "x"}], "options": {"num_predict": -7}}),
            400,
            "num_predict",
        ),
        (
            "/api/chat",
            json!({"model": "llama3", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "llama3",
        ),
        ("/api/generate", json!({"prompt": "x", "suffix": "y"}), 400, "suffix"),
        ("/api/embed", json!({"input": long, "truncate": false}), 400, "context"),
        ("/api/embed", json!({"input": [1, 2]}), 400, "input[0]"),
        ("/api/pull", json!({"model": "llama3"}), 501, "cannot pull"),
        ("/api/create", json!({"model": "x"}), 501, "cannot pull"),
    ];
    for (path, body, status, mentions) in cases {
        let (got, resp) = server.post_to(path, body.clone()).await?;
        assert_eq!(got, status, "{path} {body}: {resp}");
        let message = resp["error"].as_str().unwrap_or_default();
        assert!(message.contains(mentions), "{path} {body}: {mentions:?} not in {resp}");
    }
    Ok(())
}
