//! The completions API as lm-evaluation-harness and vLLM's users call it: every form of
//! `prompt`, prompt logprobs (checked against `transformers`), the end-of-text token's logprob,
//! `echo` with `max_tokens: 0`, the sampling controls, `best_of`, the tokenizer endpoints and the
//! limits stated in the OpenAPI document.

mod common;

use candle_core::Device;
use common::{config, fixture, reference, start, streamed_text, Server};
use serde_json::{json, Value};

const EOT: u32 = 0; // the fixture's <|endoftext|>

fn text(r: &Value, i: usize) -> String {
    r["choices"][i]["text"].as_str().unwrap_or_default().to_string()
}

async fn ok(server: &Server, body: Value) -> anyhow::Result<Value> {
    let (status, r) = server.post(body).await?;
    anyhow::ensure!(status == 200, "{status}: {r}");
    Ok(r)
}

#[tokio::test]
async fn every_prompt_form_numbers_choices_prompt_times_n_plus_i() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let prompts = ["First Citizen:", "All:\nSpeak", "You are all resolved"];
    let mut solo = Vec::new();
    let mut ids = Vec::new();
    for p in prompts {
        let r = ok(
            &server,
            json!({"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
        )
        .await?;
        solo.push(text(&r, 0));
        ids.push(server.tokenize(p).await?);
    }
    let forms = [json!(prompts), json!(ids)];
    for form in forms {
        let body = json!({"prompt": form, "max_tokens": 6, "temperature": 0, "n": 2, "ignore_eos": true});
        let r = ok(&server, body.clone()).await?;
        let choices = r["choices"].as_array().cloned().unwrap_or_default();
        assert_eq!(choices.len(), 6);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(c["text"], solo[i / 2].as_str(), "choice {i} is prompt {}'s", i / 2);
        }
        let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
        assert_eq!(r["usage"]["prompt_tokens"], prompt_tokens);
        assert_eq!(r["usage"]["completion_tokens"], 6 * 6);
        // Streamed, the same texts under the same indices.
        let mut streaming = body;
        streaming["stream"] = json!(true);
        let chunks = server.stream(streaming).await?;
        for i in 0..6 {
            assert_eq!(
                streamed_text(&chunks, i as u64),
                (solo[i / 2].clone(), Some("length".into()))
            );
        }
    }
    // A single list of ids is one prompt.
    let r = ok(
        &server,
        json!({"prompt": ids[1], "max_tokens": 6, "temperature": 0, "ignore_eos": true}),
    )
    .await?;
    assert_eq!(text(&r, 0), solo[1]);
    Ok(())
}

#[tokio::test]
async fn prompt_logprobs_match_transformers_and_top_n_is_sorted() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let cases = reference()?;
    let texts: Vec<&str> = cases.iter().map(|c| c.0.as_str()).collect();
    // All three prompts in one request: one batched prefill.
    let r = ok(
        &server,
        json!({"prompt": texts, "max_tokens": 0, "echo": true, "logprobs": 3}),
    )
    .await?;
    for (i, (text_i, ids, log_probs)) in cases.iter().enumerate() {
        let choice = &r["choices"][i];
        assert_eq!(
            choice["text"],
            text_i.as_str(),
            "echo with max_tokens 0 is the prompt alone"
        );
        assert_eq!(choice["finish_reason"], "length");
        let lp = &choice["logprobs"];
        let got: Vec<Option<f64>> = serde_json::from_value(lp["token_logprobs"].clone())?;
        assert_eq!(got.len(), ids.len());
        assert_eq!(got[0], None, "nothing predicts the first token");
        let rows = log_probs.to_vec2::<f32>()?;
        for t in 1..ids.len() {
            let want = rows[t - 1][ids[t] as usize] as f64;
            let have = got[t].unwrap_or(f64::NAN);
            assert!(
                (have - want).abs() < 1e-4,
                "prompt {i} token {t}: {have} vs transformers {want}"
            );
            let top: Vec<f64> = lp["top_logprobs"][t]
                .as_object()
                .map(|m| m.values().filter_map(Value::as_f64).collect())
                .unwrap_or_default();
            let mut sorted = rows[t - 1].clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            assert!(!top.is_empty() && top.len() <= 3);
            assert!(
                (top[0] - sorted[0] as f64).abs() < 1e-4,
                "the most likely token comes first"
            );
            assert!(top.windows(2).all(|w| w[0] >= w[1]));
        }
    }
    assert_eq!(r["usage"]["completion_tokens"], 0);
    Ok(())
}

#[tokio::test]
async fn the_end_of_text_token_has_its_logprob_and_counts() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    // lm-eval's loglikelihood request, with the generated token forced to be <|endoftext|>.
    let ids = server.tokenize("First Citizen:\nBefore").await?;
    let body = json!({"prompt": [ids], "max_tokens": 1, "echo": true, "logprobs": 1, "temperature": 0,
                      "seed": 1234, "logit_bias": {EOT.to_string(): 100}});
    let r = ok(&server, body).await?;
    let lp = &r["choices"][0]["logprobs"];
    let tokens: Vec<String> = serde_json::from_value(lp["tokens"].clone())?;
    assert_eq!(tokens.len(), ids.len() + 1, "every prompt token plus the generated one");
    assert_eq!(tokens.last().map(String::as_str), Some("<|endoftext|>"));
    let values: Vec<Option<f64>> = serde_json::from_value(lp["token_logprobs"].clone())?;
    assert!(values.last().copied().flatten().is_some_and(|v| v < 0.0));
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["usage"]["completion_tokens"], 1);
    assert_eq!(text(&r, 0), server.detokenize(&ids).await?, "no text for <|endoftext|>");
    Ok(())
}

#[tokio::test]
async fn logit_bias_min_tokens_ignore_eos_and_stop_token_ids() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let prompt = "First Citizen:";
    let eos = json!({EOT.to_string(): 100});
    // A +100 bias forces end-of-text at once.
    let r = ok(&server, json!({"prompt": prompt, "max_tokens": 10, "logit_bias": eos})).await?;
    assert_eq!(
        (text(&r, 0).as_str(), r["usage"]["completion_tokens"].as_u64()),
        ("", Some(1))
    );
    // min_tokens delays it: five other tokens first, then end-of-text.
    let body = json!({"prompt": prompt, "max_tokens": 10, "logit_bias": eos, "min_tokens": 5, "logprobs": 0});
    let r = ok(&server, body).await?;
    let tokens: Vec<String> = serde_json::from_value(r["choices"][0]["logprobs"]["tokens"].clone())?;
    assert_eq!(tokens.len(), 6);
    assert!(tokens[..5].iter().all(|t| t != "<|endoftext|>"));
    assert_eq!(tokens[5], "<|endoftext|>");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // ignore_eos: end-of-text does not end the text (and adds none).
    let body = json!({"prompt": prompt, "max_tokens": 4, "logit_bias": eos, "ignore_eos": true});
    let r = ok(&server, body).await?;
    assert_eq!(r["usage"]["completion_tokens"], 4);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(text(&r, 0), "");

    // stop_token_ids: greedy text up to the first occurrence of a token it generates.
    let greedy = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "logprobs": 0});
    let r = ok(&server, greedy.clone()).await?;
    let full: Vec<String> = serde_json::from_value(r["choices"][0]["logprobs"]["tokens"].clone())?;
    let ids = server.tokenize(&full[3]).await?;
    anyhow::ensure!(ids.len() == 1, "token text {:?} re-encodes to one token", full[3]);
    let first = full.iter().position(|t| *t == full[3]).unwrap_or(3);
    let mut body = greedy;
    body["stop_token_ids"] = json!([ids[0]]);
    let r = ok(&server, body).await?;
    assert_eq!(r["usage"]["completion_tokens"], first + 1, "the stop token counts");
    assert_eq!(text(&r, 0), full[..first].concat(), "but adds no text");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    Ok(())
}

#[tokio::test]
async fn best_of_returns_the_n_most_likely_of_its_candidates() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let body = |n: usize, best_of: usize| {
        json!({"prompt": "All:\nSpeak", "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": n,
               "best_of": best_of, "logprobs": 0, "ignore_eos": true})
    };
    // The four candidates best_of=4 draws (candidate i samples with seed + i), and their scores.
    let all = ok(&server, body(4, 4)).await?;
    let mut scored: Vec<(f64, String)> = (0..4)
        .map(|i| {
            let lp: Vec<f64> =
                serde_json::from_value(all["choices"][i]["logprobs"]["token_logprobs"].clone()).unwrap_or_default();
            (lp.iter().sum(), text(&all, i))
        })
        .collect();
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    assert!(scored[0].0 > scored[3].0, "candidates differ: {scored:?}");
    for stream in [false, true] {
        let mut b = body(2, 4);
        b["stream"] = json!(stream);
        let texts: Vec<String> = if stream {
            let chunks = server.stream(b).await?;
            (0..2).map(|i| streamed_text(&chunks, i).0).collect()
        } else {
            let r = ok(&server, b).await?;
            assert_eq!(r["usage"]["completion_tokens"], 16, "usage counts the choices returned");
            (0..2).map(|i| text(&r, i)).collect()
        };
        assert_eq!(texts, [scored[0].1.clone(), scored[1].1.clone()], "stream: {stream}");
    }
    Ok(())
}

#[tokio::test]
async fn tokenizer_endpoints_in_vllms_shapes() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let (model, tok) = gpt::load_dir(&fixture(), candle_core::DType::F32, &Device::Cpu)?;
    let text = "First Citizen: café <|endoftext|>";
    let r: Value = server
        .call(
            "/tokenize",
            json!({"prompt": text, "add_special_tokens": false, "return_token_strs": true}),
        )
        .await?;
    let want = tok.encode(text)?;
    assert_eq!(r["tokens"], json!(want));
    assert_eq!(r["count"], want.len());
    assert_eq!(r["max_model_len"], model.config().n_positions);
    assert_eq!(r["token_strs"].as_array().map(Vec::len), Some(want.len()));
    assert_eq!(want.last(), Some(&EOT), "the special token is one token");
    let r: Value = server.call("/detokenize", json!({"tokens": want})).await?;
    assert_eq!(r["prompt"], text);
    let info: Value = server.get("/tokenizer_info").await?;
    assert_eq!(info["eos_token"], "<|endoftext|>");
    assert_eq!(info["bos_token"], "<|endoftext|>");
    let (status, body) = server.post_to("/detokenize", json!({"tokens": [1, 999]})).await?;
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("tokens[1]"));
    Ok(())
}

#[tokio::test]
async fn the_openapi_document_states_the_models_limits() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let spec: Value = server.get("/openapi.json").await?;
    let props = &spec["components"]["schemas"]["CompletionRequest"]["properties"];
    assert_eq!(
        spec["components"]["schemas"]["CompletionRequest"]["additionalProperties"],
        false
    );
    assert_eq!(props["max_tokens"]["maximum"], 64);
    assert_eq!(props["max_tokens"]["minimum"], 0);
    assert_eq!(props["top_p"]["exclusiveMinimum"], 0.0);
    assert_eq!(props["n"]["maximum"], 16);
    let forms = props["prompt"]["oneOf"].as_array().cloned().unwrap_or_default();
    assert_eq!(forms.len(), 4);
    assert_eq!(forms[0]["minLength"], 1, "the empty string is not a prompt");
    assert_eq!(forms[2]["maxItems"], 63, "the context less one");
    assert_eq!(forms[2]["items"]["maximum"], 319, "the vocabulary");
    for path in ["/v1/completions", "/tokenize", "/detokenize"] {
        assert!(spec["paths"][path]["post"].is_object(), "{path}");
    }
    assert!(spec["paths"]["/tokenizer_info"]["get"].is_object());
    Ok(())
}

#[tokio::test]
async fn a_character_level_model_states_its_alphabet() -> anyhow::Result<()> {
    let weights = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights");
    let server = start(&weights, config()).await?;
    let spec: Value = server.get("/openapi.json").await?;
    let pattern = spec["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["oneOf"][0]["pattern"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        pattern.starts_with("^[") && pattern.contains("ABC") && pattern.contains("\\x0a"),
        "{pattern}"
    );
    let (status, r) = server.post(json!({"prompt": "ROMEO: 東京", "max_tokens": 2})).await?;
    assert_eq!(status, 400);
    assert!(r["error"]["message"].as_str().unwrap_or_default().contains('東'), "{r}");
    let info: Value = server.get("/tokenizer_info").await?;
    assert!(
        info["eos_token"].is_null(),
        "a character vocabulary has no end-of-text token"
    );
    Ok(())
}

#[tokio::test]
async fn beam_search_returns_transformers_beams_and_refuses_sampling_parameters() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let (_, tok) = gpt::load_dir(&fixture(), candle_core::DType::F32, &Device::Cpu)?;
    let json: Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("../beam_search.json"))?)?;
    // The cases that end at the real end-of-text token (the server's), as transformers ran them.
    let cases: Vec<Value> = json["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["eos_token_id"] == 0)
        .cloned()
        .collect();
    assert!(cases.len() >= 4);
    for case in &cases {
        let k = case["num_beams"].as_u64().unwrap_or(1);
        let body = json!({"prompt": case["prompt"], "use_beam_search": true, "best_of": k, "n": k,
                          "length_penalty": case["length_penalty"], "max_tokens": case["max_new_tokens"]});
        let r = ok(&server, body.clone()).await?;
        let beams = case["beams"].as_array().cloned().unwrap_or_default();
        for (i, beam) in beams.iter().enumerate() {
            let tokens: Vec<u32> = serde_json::from_value(beam["tokens"].clone())?;
            assert_eq!(text(&r, i), tok.decode_skip_special(&tokens)?, "{body}: beam {i}");
        }
        // n = 1 of the same beams is the best; streamed, the same.
        let mut one = body;
        one["n"] = json!(1);
        one["stream"] = json!(true);
        let chunks = server.stream(one).await?;
        assert_eq!(streamed_text(&chunks, 0).0, text(&r, 0));
    }
    // ignore_eos is accepted, as vLLM's beam search takes it: end-of-text ends no beam, so every
    // one runs to max_tokens.
    let body = json!({"prompt": cases[0]["prompt"], "use_beam_search": true, "best_of": 4, "n": 4,
                      "max_tokens": 20, "ignore_eos": true});
    let r = ok(&server, body).await?;
    assert_eq!(r["usage"]["completion_tokens"], json!(4 * 20), "{r}");
    for c in r["choices"].as_array().into_iter().flatten() {
        assert_eq!(c["finish_reason"], "length", "{r}");
    }
    // Deterministic: sampling parameters make no sense with it.
    for (param, value) in [("temperature", json!(0.7)), ("top_k", json!(5))] {
        let mut body = json!({"prompt": "First Citizen:", "use_beam_search": true, "best_of": 3});
        body[param] = value;
        let (status, r) = server.post(body).await?;
        assert_eq!(status, 400, "{r}");
        assert_eq!(r["error"]["param"], param);
    }
    Ok(())
}
