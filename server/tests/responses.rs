//! OpenAI's Responses API (`/v1/responses`) on the tiny fixture: the chat endpoint's greedy text
//! as a `response`, whole and streamed (typed events in order, numbered), and every bad input a
//! 400 naming the field, what the server does not keep among them. (The `openai` SDK's
//! `responses` itself, with a JSON schema and tools, on a real model:
//! `tests/fixtures/responses_smollm2_check.py`, in `.ci/run`.)

mod common;

use common::{config, fixture, start};
use serde_json::{json, Value};

#[tokio::test]
async fn a_response_holds_the_chat_endpoints_text_whole_and_streamed() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let chat = server
        .call(
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Speak."}],
                "max_tokens": 12, "temperature": 0}),
        )
        .await?;
    let body = json!({"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 12, "temperature": 0,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Speak."}]}]});
    let whole = server.call("/v1/responses", body.clone()).await?;
    assert_eq!(whole["object"], "response");
    let text = &chat["choices"][0]["message"]["content"];
    assert_eq!(whole["output"][0]["content"][0]["text"], *text);
    assert_eq!(whole["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    let length = chat["choices"][0]["finish_reason"] == "length";
    assert_eq!(whole["status"], if length { "incomplete" } else { "completed" });

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = server
        .client
        .post(format!("{}/v1/responses", server.url))
        .json(&streamed)
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 200);
    let events: Vec<Value> = resp
        .text()
        .await?
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap_or_default()).collect();
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    let last = if length {
        "response.incomplete"
    } else {
        "response.completed"
    };
    assert_eq!(
        kinds[kinds.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            last
        ]
    );
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i, "{e}");
    }
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(deltas, text.as_str().unwrap_or_default());
    let done = &events[events.len() - 1]["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], *text);
    assert_eq!(done["usage"], whole["usage"]);
    assert_eq!(done["status"], whole["status"]);
    Ok(())
}

/// `include: ["message.output_text.logprobs"]` with `top_logprobs`: each token's log-probability
/// and alternatives, the chat endpoint's own, whole and in the stream's deltas.
#[tokio::test]
async fn logprobs_are_the_chat_endpoints() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let chat = server
        .call(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Speak."}], "max_tokens": 8, "temperature": 0,
                "logprobs": true, "top_logprobs": 2}),
        )
        .await?;
    let expected = &chat["choices"][0]["logprobs"]["content"];
    assert_eq!(
        expected.as_array().map(Vec::len),
        chat["usage"]["completion_tokens"].as_u64().map(|n| n as usize)
    );
    let body = json!({"input": "Speak.", "max_output_tokens": 8, "temperature": 0, "top_logprobs": 2,
        "include": ["message.output_text.logprobs"]});
    let whole = server.call("/v1/responses", body.clone()).await?;
    assert_eq!(whole["output"][0]["content"][0]["logprobs"], *expected);
    assert_eq!(
        whole["output"][0]["content"][0]["logprobs"][0]["top_logprobs"]
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = server
        .client
        .post(format!("{}/v1/responses", server.url))
        .json(&streamed)
        .send()
        .await?
        .text()
        .await?;
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let deltas: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().cloned().unwrap_or_default())
        .collect();
    // Each delta carries the tokens its text completes; the done event, all of them.
    let all = expected.as_array().cloned().unwrap_or_default();
    assert!(!deltas.is_empty() && all.starts_with(&deltas), "{deltas:?}");
    let done = events.iter().find(|e| e["type"] == "response.output_text.done");
    assert_eq!(done.map(|e| &e["logprobs"]), Some(expected));
    let (status, resp) = server
        .post_to(
            "/v1/responses",
            json!({"input": "x", "include": ["reasoning.encrypted_content"]}),
        )
        .await?;
    assert_eq!(status, 400, "{resp}");
    Ok(())
}

#[tokio::test]
async fn bad_responses_requests_are_400s_naming_the_field() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let cases = [
        (json!({"model": "tiny"}), "input"),
        (json!({"model": "tiny", "input": []}), "input"),
        (
            json!({"model": "tiny", "input": [{"role": "robot", "content": "x"}]}),
            "input[0].role",
        ),
        (
            json!({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input[0].content[0]",
        ),
        (
            json!({"model": "tiny", "input": [{"type": "function_call", "name": "f"}]}),
            "call_id",
        ),
        (
            json!({"model": "tiny", "input": [{"type": "reasoning"}]}),
            "input[0].type",
        ),
        (
            json!({"model": "tiny", "input": "hi", "previous_response_id": "resp_1"}),
            "previous_response_id",
        ),
        (
            json!({"model": "tiny", "input": "hi", "background": true}),
            "background",
        ),
        (
            json!({"model": "tiny", "input": "hi", "text": {"format": {"type": "yaml"}}}),
            "text.format.type",
        ),
        (
            json!({"model": "tiny", "input": "hi", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"model": "tiny", "input": "hi", "max_output_tokens": -2}),
            "max_tokens",
        ),
        (
            json!({"model": "tiny", "input": "hi", "instructions": 5}),
            "instructions",
        ),
    ];
    for (body, mentions) in cases {
        let (status, resp) = server.post_to("/v1/responses", body.clone()).await?;
        assert_eq!(status, 400, "{body}: {resp}");
        let message = resp["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(mentions), "{body}: {mentions:?} not in {message:?}");
    }
    let (status, _) = server
        .post_to("/v1/responses", json!({"model": "gpt-9", "input": "hi"}))
        .await?;
    assert_eq!(status, 404);
    Ok(())
}
