//! Structured outputs through the HTTP API: every request form (`response_format`,
//! `structured_outputs`, `guided_*`, llama.cpp's `json_schema` and `grammar`), streamed and whole,
//! with `n`, `best_of`, beam search and logprobs; outputs that end with "stop" follow their
//! schema, regex, choice or grammar; bad constraints are 400s that name the field.

mod common;

use std::path::Path;

use common::*;
use serde_json::{json, Value};

/// A random model with the fixture's byte-level BPE (320 tokens) and room for long outputs.
fn byte_level_model() -> anyhow::Result<tempfile::TempDir> {
    random_checkpoint(gpt::Config {
        n_positions: 512,
        ..gpt::Config::tiny(320)
    })
}

fn default_model() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../weights"))
}

/// The nested schema of these tests: what validates it, checked field by field.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[A-Za-z]+$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["king", "queen", "fool"]},
            "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10}, "minItems": 1, "maxItems": 3},
            "home": {"$ref": "#/$defs/place"},
            "motto": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]}
        },
        "required": ["name", "age", "role", "scores", "home"],
        "additionalProperties": false,
        "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                            "required": ["city"], "additionalProperties": false}}
    })
}

fn check_person(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("{text:?} is not JSON: {e}"))?;
    let o = v.as_object().ok_or(format!("{text}: not an object"))?;
    let known = ["name", "age", "role", "scores", "home", "motto"];
    if let Some(k) = o.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(format!("{text}: unknown key {k}"));
    }
    let name = o["name"].as_str().ok_or(format!("{text}: name"))?;
    let ok = !name.is_empty() && name.chars().count() <= 8 && name.chars().all(|c| c.is_ascii_alphabetic());
    let age = o["age"].as_u64().filter(|&a| a <= 120);
    let role = o["role"].as_str().filter(|r| ["king", "queen", "fool"].contains(r));
    let scores = o["scores"].as_array().filter(|s| {
        (1..=3).contains(&s.len()) && s.iter().all(|x| x.as_f64().is_some_and(|x| (0.0..=10.0).contains(&x)))
    });
    let city = o["home"]["city"].as_str().filter(|c| c.chars().count() <= 6);
    let home_keys = o["home"].as_object().map_or(0, |h| h.len());
    let motto = match o.get("motto") {
        None | Some(Value::Null) => true,
        Some(Value::String(m)) => m.chars().count() <= 6,
        _ => false,
    };
    if ok && age.is_some() && role.is_some() && scores.is_some() && city.is_some() && home_keys == 1 && motto {
        Ok(())
    } else {
        Err(format!("{text}: does not follow the schema"))
    }
}

/// `extra`'s fields added to the request `body`.
fn merge(body: &mut Value, extra: &Value) {
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
}

fn choices(body: &Value) -> Vec<(String, String)> {
    body["choices"]
        .as_array()
        .map(|cs| {
            cs.iter()
                .map(|c| {
                    (
                        c["text"].as_str().unwrap_or_default().to_string(),
                        c["finish_reason"].as_str().unwrap_or_default().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_outputs_follow_the_schema_in_every_form() -> anyhow::Result<()> {
    let dir = byte_level_model()?;
    let server = start(dir.path(), config()).await?;
    let forms = [
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}}}),
        json!({"structured_outputs": {"json": schema()}}),
        json!({"guided_json": schema().to_string()}),
        json!({"json_schema": schema()}),
    ];
    let mut stopped = 0;
    for (f, form) in forms.iter().enumerate() {
        for seed in 0..3 {
            let mut body = json!({"prompt": "Hello", "max_tokens": 300, "temperature": 1.0, "seed": seed, "n": 2});
            merge(&mut body, form);
            let (status, resp) = server.post(body).await?;
            assert_eq!(status, 200, "form {f}: {resp}");
            for (text, finish) in choices(&resp) {
                if finish == "stop" {
                    check_person(&text).map_err(anyhow::Error::msg)?;
                    stopped += 1;
                }
            }
        }
    }
    assert!(stopped >= 16, "{stopped} of 24 outputs ended with \"stop\"");
    // A second request with the same schema came from the cache.
    let metrics = server.metrics().await?;
    let hits = metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpt_grammar_cache_hits_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(hits.is_some_and(|h| h >= 8.0), "{hits:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_best_of_and_beam_outputs_are_constrained_too() -> anyhow::Result<()> {
    let dir = byte_level_model()?;
    let server = start(dir.path(), config()).await?;
    let so = json!({"json": schema()});
    // Greedy: the stream's text is the whole response's.
    let body = json!({"prompt": "Hi", "max_tokens": 300, "temperature": 0, "structured_outputs": so});
    let (_, whole) = server.post(body.clone()).await?;
    let mut streamed_body = body.clone();
    streamed_body["stream"] = json!(true);
    let chunks = server.stream(streamed_body).await?;
    let (text, finish) = streamed_text(&chunks, 0);
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap_or_default());
    assert_eq!(finish.as_deref(), whole["choices"][0]["finish_reason"].as_str());
    if finish.as_deref() == Some("stop") {
        check_person(&text).map_err(anyhow::Error::msg)?;
    }
    // best_of: every candidate sampled under its own grammar state.
    let body = json!({"prompt": "Hi", "max_tokens": 300, "temperature": 1.0, "seed": 3, "n": 2, "best_of": 4,
                      "structured_outputs": so});
    let (status, resp) = server.post(body).await?;
    assert_eq!(status, 200, "{resp}");
    for (text, finish) in choices(&resp) {
        if finish == "stop" {
            check_person(&text).map_err(anyhow::Error::msg)?;
        }
    }
    // Beam search: each beam masked by its own state.
    let body = json!({"prompt": "Hi", "max_tokens": 300, "use_beam_search": true, "best_of": 3, "n": 3,
                      "structured_outputs": {"regex": "(ab|cd)[0-9]{2}"}});
    let (status, resp) = server.post(body).await?;
    assert_eq!(status, 200, "{resp}");
    let outs = choices(&resp);
    assert_eq!(outs.len(), 3);
    for (text, finish) in outs {
        assert_eq!(finish, "stop", "{text}");
        assert!(matches_ab_cd(&text), "{text:?}");
    }
    Ok(())
}

fn matches_ab_cd(text: &str) -> bool {
    text.len() == 4
        && (text.starts_with("ab") || text.starts_with("cd"))
        && text[2..].bytes().all(|b| b.is_ascii_digit())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regex_choice_and_grammar_outputs_match_and_logprobs_are_the_constrained_ones() -> anyhow::Result<()> {
    let dir = byte_level_model()?;
    let server = start(dir.path(), config()).await?;
    for seed in 0..6 {
        let (_, resp) = server
            .post(
                json!({"prompt": "x", "max_tokens": 50, "temperature": 1.0, "seed": seed,
                         "guided_regex": "(ab|cd)[0-9]{2}"}),
            )
            .await?;
        let (text, finish) = &choices(&resp)[0];
        assert!(finish == "stop" && matches_ab_cd(text), "{text:?} {finish}");

        let (_, resp) = server
            .post(
                json!({"prompt": "x", "max_tokens": 50, "temperature": 1.5, "seed": seed,
                         "structured_outputs": {"choice": ["Romeo", "Juliet", "Mercutio"]}}),
            )
            .await?;
        let (text, finish) = &choices(&resp)[0];
        assert!(
            finish == "stop" && ["Romeo", "Juliet", "Mercutio"].contains(&text.as_str()),
            "{text:?}"
        );

        // llama.cpp's GBNF: a list of one to three words of a or b, comma separated.
        let gbnf = "root ::= word (\", \" word){0,2} \".\"\nword ::= (\"a\" | \"b\")+";
        let (_, resp) = server
            .post(json!({"prompt": "x", "max_tokens": 60, "temperature": 1.0, "seed": seed, "grammar": gbnf}))
            .await?;
        let (text, finish) = &choices(&resp)[0];
        if finish == "stop" {
            let body = text.strip_suffix('.').unwrap_or_default();
            let words: Vec<&str> = body.split(", ").collect();
            assert!(
                (1..=3).contains(&words.len())
                    && words
                        .iter()
                        .all(|w| !w.is_empty() && w.chars().all(|c| c == 'a' || c == 'b')),
                "{text:?}"
            );
        }
    }
    // Logprobs under a constraint are those of the masked distribution: only the tokens that
    // can start a choice appear, and the returned ones carry all the probability when the top
    // list is long enough.
    let (_, resp) = server
        .post(json!({"prompt": "x", "max_tokens": 1, "temperature": 0, "logprobs": 5,
                     "structured_outputs": {"choice": ["ab", "cd"]}}))
        .await?;
    let top = resp["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert!(!top.is_empty() && top.len() <= 4, "{top:?}");
    for token in top.keys() {
        assert!(
            "ab".starts_with(token.as_str()) || "cd".starts_with(token.as_str()),
            "{token:?}"
        );
    }
    let mass: f64 = top.values().filter_map(Value::as_f64).map(f64::exp).sum();
    assert!((mass - 1.0).abs() < 1e-3, "{mass}: {top:?}");
    // A constrained output cut by max_tokens ends with "length".
    let (_, resp) = server
        .post(json!({"prompt": "x", "max_tokens": 2, "temperature": 0, "json_schema": schema()}))
        .await?;
    assert_eq!(choices(&resp)[0].1, "length");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_constraints_are_400s_that_name_the_field() -> anyhow::Result<()> {
    let dir = byte_level_model()?;
    let server = start(dir.path(), config()).await?;
    let cases = [
        (json!({"guided_regex": "(unclosed"}), "guided_regex"),
        (
            json!({"json_schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}),
            "json_schema",
        ),
        (json!({"grammar": "root ::= undefined-rule"}), "grammar"),
        // A keyword llguidance does not implement is named, not ignored.
        (
            json!({"json_schema": {"if": {"type": "string"}, "then": {"maxLength": 3}}}),
            "json_schema",
        ),
        (
            json!({"guided_regex": "a", "json_schema": {"type": "object"}}),
            "json_schema",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": "no"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"structured_outputs": {"regex": "a"}, "allowed_token_ids": [1, 2]}),
            "allowed_token_ids",
        ),
    ];
    for (extra, field) in cases {
        let mut body = json!({"prompt": "x", "max_tokens": 4});
        merge(&mut body, &extra);
        let (status, resp) = server.post(body).await?;
        assert_eq!(status, 400, "{extra}: {resp}");
        assert_eq!(resp["error"]["param"], field, "{extra}: {resp}");
        assert!(
            resp["error"]["message"]
                .as_str()
                .is_some_and(|m| m.len() > field.len() + 4),
            "{extra}: {resp}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_character_model_takes_regexes_and_choices_and_refuses_json_it_cannot_write() -> anyhow::Result<()>
{
    let server = start(default_model(), config()).await?;
    for seed in 0..4 {
        let (status, resp) = server
            .post(
                json!({"prompt": "ROMEO:\n", "max_tokens": 40, "temperature": 0.8, "seed": seed,
                         "guided_regex": "(I|Thou) (will|shalt) [a-z]{2,8}\\."}),
            )
            .await?;
        assert_eq!(status, 200, "{resp}");
        let (text, finish) = &choices(&resp)[0];
        assert_eq!(finish, "stop", "{text:?}");
        let words: Vec<&str> = text.strip_suffix('.').unwrap_or_default().split(' ').collect();
        assert!(
            words.len() == 3
                && ["I", "Thou"].contains(&words[0])
                && ["will", "shalt"].contains(&words[1])
                && (2..=8).contains(&words[2].len())
                && words[2].chars().all(|c| c.is_ascii_lowercase()),
            "{text:?}"
        );
        let (_, resp) = server
            .post(
                json!({"prompt": "Who art thou?\n", "max_tokens": 20, "temperature": 1.0, "seed": seed,
                         "guided_choice": ["ROMEO", "JULIET"]}),
            )
            .await?;
        assert!(["ROMEO", "JULIET"].contains(&choices(&resp)[0].0.as_str()), "{resp}");
    }
    // The 65 characters of tinyshakespeare have no `{`: a JSON object cannot be written.
    let (status, resp) = server
        .post(json!({"prompt": "x", "response_format": {"type": "json_object"}}))
        .await?;
    assert_eq!(status, 400, "{resp}");
    assert_eq!(resp["error"]["param"], "response_format");
    assert!(
        resp["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("vocabulary")),
        "{resp}"
    );
    Ok(())
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"$ref": "#/$defs/Unit"}},
                "required": ["city", "unit"], "additionalProperties": false,
                "$defs": {"Unit": {"enum": ["C", "F"]}}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": false}}}
    ])
}

/// A call's arguments checked against its function's schema (the two of [`weather_tools`]).
fn check_call(call: &Value) -> Result<(), String> {
    let name = call["function"]["name"].as_str().unwrap_or_default();
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap_or_default())
        .map_err(|e| format!("{call}: arguments are not JSON: {e}"))?;
    let o = args.as_object().ok_or(format!("{call}: arguments not an object"))?;
    let ok = match name {
        "get_weather" => {
            o.len() == 2
                && o["city"].as_str().is_some_and(|c| c.chars().count() <= 8)
                && ["C", "F"].contains(&o["unit"].as_str().unwrap_or_default())
        }
        "get_time" => o.len() == 1 && ["UTC", "CET"].contains(&o["zone"].as_str().unwrap_or_default()),
        _ => false,
    };
    let id_ok = call["id"].as_str().is_some_and(|id| id.starts_with("call_")) && call["type"] == "function";
    if ok && id_ok {
        Ok(())
    } else {
        Err(format!("{call}: does not follow its function"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_follow_the_functions_schemas_whole_and_streamed() -> anyhow::Result<()> {
    let dir = byte_level_model()?;
    let server = start(dir.path(), config()).await?;
    let messages = json!([{"role": "user", "content": "Weather in Paris?"}]);
    // A named function: its arguments.
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for seed in 0..3 {
        let body = json!({"messages": messages, "tools": weather_tools(), "tool_choice": named, "max_tokens": 200,
                          "temperature": 1.0, "seed": seed});
        let r = server.call("/v1/chat/completions", body).await?;
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
        assert_eq!(choice["message"]["content"], Value::Null);
        let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        check_call(&calls[0]).map_err(anyhow::Error::msg)?;
    }
    // "required": one call or more, each of an offered function.
    for seed in 0..3 {
        let body = json!({"messages": messages, "tools": weather_tools(), "tool_choice": "required", "max_tokens": 300,
                          "temperature": 1.0, "seed": seed, "parallel_tool_calls": false});
        let r = server.call("/v1/chat/completions", body).await?;
        let choice = &r["choices"][0];
        if choice["finish_reason"] == "tool_calls" {
            let calls = choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default();
            assert_eq!(calls.len(), 1, "parallel_tool_calls: false: {r}");
            check_call(&calls[0]).map_err(anyhow::Error::msg)?;
        } else {
            assert_eq!(choice["finish_reason"], "length", "{r}");
        }
    }
    // "auto": text, or calls in the documented format.
    for seed in 0..4 {
        let body = json!({"messages": messages, "tools": weather_tools(), "max_tokens": 300,
                          "temperature": 1.0, "seed": seed});
        let r = server.call("/v1/chat/completions", body).await?;
        let choice = &r["choices"][0];
        match choice["finish_reason"].as_str() {
            Some("tool_calls") => {
                for call in choice["message"]["tool_calls"].as_array().cloned().unwrap_or_default() {
                    check_call(&call).map_err(anyhow::Error::msg)?;
                }
            }
            _ => {
                let text = choice["message"]["content"].as_str().unwrap_or_default();
                assert!(!text.starts_with("<tool_call>"), "{r}");
            }
        }
    }
    // Streamed: the named call's arguments as deltas, the first with its id and name.
    let body = json!({"messages": messages, "tools": weather_tools(), "tool_choice": named, "max_tokens": 200,
                      "temperature": 0, "stream": true});
    let chunks = server.stream_at("/v1/chat/completions", body.clone()).await?;
    let mut arguments = String::new();
    let (mut id, mut name, mut finish) = (None, None, None);
    for c in &chunks {
        let choice = &c["choices"][0];
        for d in choice["delta"]["tool_calls"].as_array().cloned().unwrap_or_default() {
            assert_eq!(d["index"], 0);
            id = id.or(d["id"].as_str().map(str::to_string));
            name = name.or(d["function"]["name"].as_str().map(str::to_string));
            arguments.push_str(d["function"]["arguments"].as_str().unwrap_or_default());
        }
        finish = finish.or(choice["finish_reason"].as_str().map(str::to_string));
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    let call = json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}});
    check_call(&call).map_err(anyhow::Error::msg)?;
    let mut whole_body = body;
    whole_body["stream"] = json!(false);
    let whole = server.call("/v1/chat/completions", whole_body).await?;
    assert_eq!(
        whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        json!(arguments)
    );
    // The conversation goes on with the call and its result, as the SDKs send them back.
    let follow = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": id, "content": "21 C"}],
        "tools": weather_tools(), "tool_choice": "none", "max_tokens": 5});
    let (status, r) = server.post_to("/v1/chat/completions", follow).await?;
    assert_eq!(status, 200, "{r}");
    assert!(r["choices"][0]["message"]["content"].is_string());
    // Bad tools are 400s naming the field.
    let bad = json!({"messages": messages, "tools": [{"type": "function", "function": {"name": "no spaces"}}]});
    let (status, r) = server.post_to("/v1/chat/completions", bad).await?;
    assert_eq!(
        (status, r["error"]["param"].clone()),
        (400, json!("tools[0].function.name")),
        "{r}"
    );
    let both = json!({"messages": messages, "tools": weather_tools(), "tool_choice": "required",
                      "response_format": {"type": "json_object"}});
    let (status, r) = server.post_to("/v1/chat/completions", both).await?;
    assert_eq!(
        (status, r["error"]["param"].clone()),
        (400, json!("response_format")),
        "{r}"
    );
    Ok(())
}
