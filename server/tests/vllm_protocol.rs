//! vLLM's request protocol, field by field (docs/http-api.md's table): the fields that shape the output
//! or the accounting do what they do in vLLM, and the ones this server does not implement are
//! 400s that name them and say why.

mod common;

use common::{config, fixture, start, streamed_text};
use serde_json::{json, Value};

const PROMPT: &str = "First Citizen:\nBefore we proceed";

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap_or_default().to_string()
}

#[tokio::test]
async fn continuous_usage_stats_put_the_counts_so_far_in_every_chunk() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "n": 2, "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true}});
    let chunks = server.stream(body.clone()).await?;
    assert!(chunks.len() > 3);
    let counts: Vec<u64> = chunks
        .iter()
        .map(|c| c["usage"]["completion_tokens"].as_u64())
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow::anyhow!("a chunk without usage: {chunks:?}"))?;
    assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
    assert_eq!(counts.last(), Some(&24), "two choices of 12 tokens");
    let prompt_tokens = chunks[0]["usage"]["prompt_tokens"].as_u64();
    assert!(chunks
        .iter()
        .all(|c| c["usage"]["prompt_tokens"].as_u64() == prompt_tokens));
    // Without it, only the last chunk has usage; without include_usage, none (as in vLLM).
    let mut plain = body.clone();
    plain["stream_options"] = json!({"include_usage": true});
    let chunks = server.stream(plain).await?;
    assert_eq!(chunks.iter().filter(|c| c.get("usage").is_some()).count(), 1);
    let mut neither = body;
    neither["stream_options"] = json!({"continuous_usage_stats": true});
    let chunks = server.stream(neither).await?;
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    Ok(())
}

#[tokio::test]
async fn stop_strings_and_tokens_report_their_stop_reason_and_can_stay_in_the_text() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let greedy = json!({"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": true});
    let (status, whole) = server.post(greedy.clone()).await?;
    assert_eq!(status, 200, "{whole}");
    let reference = text(&whole);
    assert_eq!(whole["choices"][0]["finish_reason"], "length");
    assert_eq!(
        whole["choices"][0]["stop_reason"],
        Value::Null,
        "the length limit has none"
    );
    // A stop string from the middle of the greedy text.
    let chars: Vec<char> = reference.chars().collect();
    anyhow::ensure!(chars.len() > 10, "greedy text too short: {reference:?}");
    let stop: String = chars[6..9].iter().collect();
    let at = reference.find(&stop).unwrap_or_default();
    for include in [false, true] {
        let mut body = greedy.clone();
        body["stop"] = json!([stop]);
        body["include_stop_str_in_output"] = json!(include);
        let (_, r) = server.post(body.clone()).await?;
        let want = &reference[..if include { at + stop.len() } else { at }];
        assert_eq!(text(&r), want, "include {include}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
        assert_eq!(r["choices"][0]["stop_reason"], json!(stop));
        body["stream"] = json!(true);
        let chunks = server.stream(body).await?;
        assert_eq!(streamed_text(&chunks, 0).0, want, "streamed, include {include}");
        let last = chunks.last().map(|c| c["choices"][0]["stop_reason"].clone());
        assert_eq!(last, Some(json!(stop)));
    }
    // A stop token: its id is the reason.
    let ids: Vec<u64> = whole["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
        .collect();
    assert_eq!(ids.len(), 24, "every token as token_id:<id>");
    let mut body = greedy;
    body["stop_token_ids"] = json!([ids[4]]);
    let (_, r) = server.post(body).await?;
    let first = ids.iter().position(|&id| id == ids[4]).unwrap_or(4);
    assert_eq!(r["usage"]["completion_tokens"], first + 1);
    assert_eq!(r["choices"][0]["stop_reason"], json!(ids[4]));
    Ok(())
}

#[tokio::test]
async fn allowed_token_ids_and_special_tokens_in_the_text() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let eos = server.tokenize("<|endoftext|>").await?;
    anyhow::ensure!(eos.len() == 1, "the fixture has an end-of-text token: {eos:?}");
    let body = json!({"prompt": PROMPT, "max_tokens": 3, "ignore_eos": true, "allowed_token_ids": eos});
    let (_, r) = server.post(body.clone()).await?;
    assert_eq!(text(&r), "", "special tokens are skipped by default");
    assert_eq!(r["usage"]["completion_tokens"], 3);
    let mut keep = body;
    keep["skip_special_tokens"] = json!(false);
    let (_, r) = server.post(keep).await?;
    assert_eq!(text(&r), "<|endoftext|>".repeat(3));
    // Sampling among a few ids draws only those.
    let allowed = server.tokenize(" the a of").await?;
    let body = json!({"prompt": PROMPT, "max_tokens": 16, "temperature": 1.5, "seed": 3, "logprobs": 0,
        "return_tokens_as_token_ids": true, "allowed_token_ids": allowed});
    let (_, r) = server.post(body).await?;
    let drawn: Vec<u32> = r["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
        .collect();
    assert_eq!(drawn.len(), 16);
    assert!(
        drawn.iter().all(|id| allowed.contains(id)),
        "{drawn:?} not within {allowed:?}"
    );
    let (status, r) = server
        .post(json!({"prompt": "x", "allowed_token_ids": [999_999]}))
        .await?;
    assert_eq!((status, r["error"]["param"].clone()), (400, json!("allowed_token_ids")));
    Ok(())
}

#[tokio::test]
async fn truncate_prompt_tokens_keeps_the_last_tokens() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let ids = server.tokenize(PROMPT).await?;
    let body = json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "truncate_prompt_tokens": 3});
    let (status, r) = server.post(body).await?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 3);
    assert_eq!(text(&r), server.detokenize(&ids[ids.len() - 3..]).await?);
    // -1: as much as the context holds (all of this short prompt).
    let (_, r) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": -1}))
        .await?;
    assert_eq!(r["usage"]["prompt_tokens"], ids.len());
    // A prompt longer than the context fits once truncated.
    let context = server.get("/v1/models").await?["data"][0]["max_model_len"]
        .as_u64()
        .unwrap_or(0) as usize;
    let long: Vec<u32> = ids.iter().copied().cycle().take(context + 10).collect();
    let (status, r) = server
        .post(json!({"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 8}))
        .await?;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 8);
    for bad in [0, -2, context as i64] {
        let (status, r) = server
            .post(json!({"prompt": PROMPT, "truncate_prompt_tokens": bad}))
            .await?;
        assert_eq!(status, 400);
        assert_eq!(r["error"]["param"], "truncate_prompt_tokens", "{r}");
    }
    Ok(())
}

#[tokio::test]
async fn ids_fingerprints_priority_and_fields_that_are_refused() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let (_, r) = server
        .post(
            json!({"prompt": PROMPT, "max_tokens": 2, "request_id": "abc-1", "priority": 0,
        "add_special_tokens": true, "spaces_between_special_tokens": false}),
        )
        .await?;
    assert_eq!(r["id"], "cmpl-abc-1");
    assert!(
        r["system_fingerprint"].as_str().is_some_and(|f| f.starts_with("fp_")),
        "{r}"
    );
    assert!(
        r["usage"].get("prompt_tokens_details").is_some_and(Value::is_null),
        "{r}"
    );
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "abc-2"});
    let r = server.call("/v1/chat/completions", chat).await?;
    assert_eq!(r["id"], "chatcmpl-abc-2");
    assert_eq!(
        r["system_fingerprint"],
        server.post(json!({"prompt": "x", "max_tokens": 1})).await?.1["system_fingerprint"]
    );
    let (status, r) = server.post(json!({"prompt": PROMPT, "priority": 1})).await?;
    assert_eq!((status, r["error"]["param"].clone()), (400, json!("priority")));
    let refused = [
        ("suffix", json!("x")),
        ("guided_decoding_backend", json!("xgrammar")),
        ("structural_tag", json!({})),
        ("logits_processors", json!(["m.P"])),
        ("kv_transfer_params", json!({})),
        ("vllm_xargs", json!({})),
        ("bad_words", json!(["x"])),
        ("prompt_embeds", json!("AAAA")),
    ];
    for (field, value) in refused {
        let mut body = json!({"prompt": PROMPT});
        body[field] = value;
        let (status, r) = server.post(body).await?;
        assert_eq!(status, 400, "{field}");
        assert_eq!(r["error"]["param"], field);
        let message = r["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("not supported") && message.contains(": "),
            "{field}: {message}"
        );
    }
    let (status, r) = server.post(json!({"prompt": PROMPT, "no_such_field": 1})).await?;
    assert_eq!(status, 400, "unknown fields stay errors: {r}");
    Ok(())
}

#[tokio::test]
async fn cache_salt_keeps_prefix_cache_entries_apart() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let hits = |m: String| -> f64 {
        m.lines()
            .find_map(|l| l.strip_prefix("gpt_prefix_cache_hits_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let long = PROMPT.repeat(2);
    let ask = |salt: &str| json!({"prompt": long, "max_tokens": 1, "cache_salt": salt});
    server.post(ask("a")).await?;
    let before = hits(server.metrics().await?);
    server.post(ask("b")).await?;
    assert_eq!(hits(server.metrics().await?), before, "another salt shares nothing");
    server.post(ask("a")).await?;
    assert_eq!(hits(server.metrics().await?), before + 1.0, "the same salt shares");
    let (status, _) = server.post(ask("")).await?;
    assert_eq!(status, 400);
    Ok(())
}

#[tokio::test]
async fn chat_echo_templates_and_continuing_the_final_message() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let prompt_tokens = |r: &Value| r["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]);
    let base = json!({"messages": messages, "max_tokens": 4, "temperature": 0});
    // echo: the answer starts with the assistant's last message.
    let mut body = base.clone();
    body["echo"] = json!(true);
    let r = server.call("/v1/chat/completions", body.clone()).await?;
    let content = r["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(content.starts_with("Once upon"), "{content:?}");
    body["stream"] = json!(true);
    let chunks = server.stream_at("/v1/chat/completions", body).await?;
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content, "streamed echo");
    // continue_final_message: the prompt ends inside the last message (the fallback template
    // writes a turn as "ROLE:\ncontent\n\n").
    let mut body = base.clone();
    body["continue_final_message"] = json!(true);
    body["add_generation_prompt"] = json!(false);
    let r = server.call("/v1/chat/completions", body).await?;
    let want = server.tokenize("USER:\nhi\n\nASSISTANT:\nOnce upon").await?.len();
    assert_eq!(prompt_tokens(&r), want);
    let mut both = base.clone();
    both["continue_final_message"] = json!(true);
    both["add_generation_prompt"] = json!(true);
    let (status, _) = server.post_to("/v1/chat/completions", both).await?;
    assert_eq!(status, 400);
    // add_generation_prompt: false leaves out the assistant's "ASSISTANT:\n".
    let mut body = base.clone();
    body["add_generation_prompt"] = json!(false);
    let r = server.call("/v1/chat/completions", body).await?;
    let want = server.tokenize("USER:\nhi\n\nASSISTANT:\nOnce upon\n\n").await?.len();
    assert_eq!(prompt_tokens(&r), want);
    // A request's own template, its variables and documents.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template": "{{ greeting }} {{ messages[0].content }} {{ documents[0].title }}",
        "chat_template_kwargs": {"greeting": "Hello"}, "documents": [{"title": "Verona", "text": "x"}]});
    let r = server.call("/v1/chat/completions", body).await?;
    assert_eq!(prompt_tokens(&r), server.tokenize("Hello hi Verona").await?.len());
    let bad = json!({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for %}"});
    let (status, r) = server.post_to("/v1/chat/completions", bad).await?;
    assert_eq!((status, r["error"]["param"].clone()), (400, json!("chat_template")));
    Ok(())
}

/// `prompt_logprobs` of one prompt position as (id, logprob, rank) entries.
fn entries(position: &Value) -> Vec<(u32, f64, u64)> {
    (position.as_object().into_iter().flatten())
        .map(|(id, e)| {
            (
                id.parse().unwrap_or(u32::MAX),
                e["logprob"].as_f64().unwrap_or(f64::NAN),
                e["rank"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

#[tokio::test]
async fn prompt_logprobs_give_each_prompt_tokens_logprob_rank_and_the_top_as_transformers_computes(
) -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let cases = common::reference()?;
    let ids: Vec<Vec<u32>> = cases.iter().map(|(_, ids, _)| ids.clone()).collect();
    let k = 5;
    // Two prompts with two choices each: a choice carries its own prompt's.
    let body = json!({"prompt": ids, "max_tokens": 2, "n": 2, "temperature": 0, "prompt_logprobs": k});
    let (status, r) = server.post(body.clone()).await?;
    assert_eq!(status, 200, "{r}");
    for (c, choice) in r["choices"].as_array().into_iter().flatten().enumerate() {
        let (_, ids, log_probs) = &cases[c / 2];
        let positions = choice["prompt_logprobs"].as_array().cloned().unwrap_or_default();
        assert_eq!(positions.len(), ids.len(), "choice {c}: one per prompt token");
        assert_eq!(positions[0], Value::Null, "nothing predicts the first token");
        let rows = log_probs.to_vec2::<f32>()?;
        for t in 1..ids.len() {
            let row: Vec<f64> = rows[t - 1].iter().map(|&v| v as f64).collect();
            let got = entries(&positions[t]);
            // The prompt's token: its logprob and its rank among the whole vocabulary.
            let &(_, logprob, rank) = got
                .iter()
                .find(|e| e.0 == ids[t])
                .ok_or_else(|| anyhow::anyhow!("choice {c} position {t}: no entry for the prompt token"))?;
            let want = row[ids[t] as usize];
            assert!(
                (logprob - want).abs() < 1e-4,
                "position {t}: {logprob} vs transformers {want}"
            );
            let above = row.iter().filter(|&&v| v > want + 1e-4).count() as u64;
            let at_least = row.iter().filter(|&&v| v >= want - 1e-4).count() as u64;
            assert!(
                (above + 1..=at_least).contains(&rank),
                "position {t}: rank {rank}, transformers {above}+1..={at_least}"
            );
            // The top k: ranks 1..=k, in order of logprob, the most likely as transformers has them.
            let mut top: Vec<(u32, f64, u64)> = got.iter().copied().filter(|e| e.2 <= k).collect();
            top.sort_by_key(|e| e.2);
            assert_eq!(
                top.iter().map(|e| e.2).collect::<Vec<_>>(),
                (1..=k).collect::<Vec<_>>(),
                "position {t}: {got:?}"
            );
            assert!(got.len() == k as usize || got.len() == k as usize + 1);
            let mut sorted = row.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            for (e, want) in top.iter().zip(&sorted) {
                assert!(
                    (e.1 - want).abs() < 1e-4,
                    "position {t}: rank {} {} vs {want}",
                    e.2,
                    e.1
                );
                assert!(
                    (e.1 - row[e.0 as usize]).abs() < 1e-4,
                    "the entry's id is the token with that logprob"
                );
            }
        }
    }
    // The same request again comes from the prefix cache: the same numbers, ranks included.
    let (_, again) = server.post(body).await?;
    assert_eq!(
        again["choices"][0]["prompt_logprobs"],
        r["choices"][0]["prompt_logprobs"]
    );
    // With `echo` and `logprobs`, each keeps its own top-N; the logprobs agree.
    let body = json!({"prompt": [ids[0]], "max_tokens": 0, "echo": true, "logprobs": 1, "prompt_logprobs": 4});
    let (_, both) = server.post(body).await?;
    let echo = &both["choices"][0]["logprobs"];
    let positions = both["choices"][0]["prompt_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for t in 1..ids[0].len() {
        assert_eq!(echo["top_logprobs"][t].as_object().map(|m| m.len()), Some(1));
        let e = entries(&positions[t]);
        assert!(e.len() >= 4);
        let own = e.iter().find(|e| e.0 == ids[0][t]).map(|e| e.1);
        assert_eq!(own, echo["token_logprobs"][t].as_f64(), "position {t}");
    }
    // `prompt_logprobs: 0`: only the prompt's own tokens. Without it the field is null.
    let (_, zero) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}))
        .await?;
    let positions = zero["choices"][0]["prompt_logprobs"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(positions.len() > 2 && positions[1..].iter().all(|p| entries(p).len() == 1));
    let (_, none) = server.post(json!({"prompt": PROMPT, "max_tokens": 1})).await?;
    assert_eq!(none["choices"][0].get("prompt_logprobs"), Some(&Value::Null));
    // Token ids as names.
    let (_, named) = server
        .post(json!({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "return_tokens_as_token_ids": true}))
        .await?;
    let first = named["choices"][0]["prompt_logprobs"][1]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert!(
        first
            .iter()
            .all(|(id, e)| e["decoded_token"] == format!("token_id:{id}")),
        "{first:?}"
    );
    Ok(())
}

#[tokio::test]
async fn prompt_logprobs_in_chat_and_their_limits() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let chat = json!({"messages": [{"role": "user", "content": "Speak, speak."}], "max_tokens": 2,
        "prompt_logprobs": 2});
    let r = server.post_to("/v1/chat/completions", chat.clone()).await?;
    assert_eq!(r.0, 200, "{}", r.1);
    let usage = r.1["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
    let positions = r.1["prompt_logprobs"].as_array().cloned().unwrap_or_default();
    assert_eq!(positions.len(), usage, "one per token of the rendered prompt");
    assert!(positions[0].is_null() && positions[1..].iter().all(|p| (2..=3).contains(&entries(p).len())));
    assert!(
        r.1["choices"][0].get("prompt_logprobs").is_none(),
        "on the response, as in vLLM"
    );
    // Refused: with a stream, below 0 or -1 (the whole vocabulary), past the limit.
    for (body, says) in [
        (
            json!({"prompt": PROMPT, "prompt_logprobs": 1, "stream": true}),
            "stream",
        ),
        (json!({"prompt": PROMPT, "prompt_logprobs": -1}), "whole vocabulary"),
        (json!({"prompt": PROMPT, "prompt_logprobs": -2}), "between 0 and 20"),
        (json!({"prompt": PROMPT, "prompt_logprobs": 21}), "between 0 and 20"),
    ] {
        let (status, e) = server.post(body.clone()).await?;
        assert_eq!(status, 400, "{body}");
        assert_eq!(e["error"]["param"], "prompt_logprobs", "{e}");
        assert!(e["error"]["message"].as_str().unwrap_or_default().contains(says), "{e}");
    }
    let mut streamed = chat;
    streamed["stream"] = json!(true);
    streamed["prompt_logprobs"] = json!(0);
    // 0 is accepted with a stream, as in vLLM (stream_at asserts the 200).
    let chunks = server.stream_at("/v1/chat/completions", streamed).await?;
    assert!(chunks.iter().all(|c| c.get("prompt_logprobs").is_none()));
    Ok(())
}
