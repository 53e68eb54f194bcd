//! `/v1/embeddings` on the tiny fixture: each input's final hidden state at its last token,
//! L2-normalised, equal to `transformers`' (`last_hidden_state`) within 1e-4; the forms of
//! `input`, base64, and bad input as 400s naming the field.

mod common;

use base64::Engine as _;
use common::{config, fixture, start};
use serde_json::{json, Value};

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(f64::NAN) as f32).collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn embeddings_are_normalised_last_hidden_states_in_every_form() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let texts = ["First Citizen:", "Before we proceed any further, hear me speak."];
    let many = server.call("/v1/embeddings", json!({"input": texts})).await?;
    assert_eq!(many["object"], "list");
    let width = server.state.attention_model.config().n_embd;
    let mut tokens = 0;
    for (i, text) in texts.iter().enumerate() {
        let one = server.call("/v1/embeddings", json!({"input": text})).await?;
        let v = floats(&one["data"][0]["embedding"]);
        assert_eq!(v.len(), width);
        assert_eq!(v, floats(&many["data"][i]["embedding"]), "batched as alone");
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        let ids = server.tokenize(text).await?;
        tokens += ids.len();
        let by_ids = server.call("/v1/embeddings", json!({"input": ids})).await?;
        assert_eq!(floats(&by_ids["data"][0]["embedding"]), v, "token ids as the text");
        let encoded = server
            .call("/v1/embeddings", json!({"input": text, "encoding_format": "base64"}))
            .await?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded["data"][0]["embedding"].as_str().unwrap_or_default())?;
        let decoded: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(decoded, v);
    }
    assert_eq!(many["usage"]["prompt_tokens"], tokens);
    assert_ne!(
        floats(&many["data"][0]["embedding"]),
        floats(&many["data"][1]["embedding"])
    );
    Ok(())
}

#[tokio::test]
#[cfg_attr(
    not(gpt_test_transformers),
    ignore = "needs GPT_TEST_PYTHON, a Python with transformers and torch"
)]
async fn embeddings_equal_transformers_last_hidden_state() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let text = "Before we proceed any further, hear me speak.";
    let ours = floats(&server.call("/v1/embeddings", json!({"input": text})).await?["data"][0]["embedding"]);
    let ids = server.tokenize(text).await?;
    let script = format!(
        "import json, torch, transformers\n\
         m = transformers.AutoModel.from_pretrained({dir:?}).eval()\n\
         h = m(torch.tensor([{ids:?}])).last_hidden_state[0, -1]\n\
         print(json.dumps((h / h.norm()).tolist()))",
        dir = fixture().display().to_string(),
        ids = ids
    );
    let out = std::process::Command::new(gpt_test_support::python())
        .args(["-c", &script])
        .output()?;
    anyhow::ensure!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let theirs: Vec<f32> = serde_json::from_slice(&out.stdout)?;
    let worst = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert_eq!(ours.len(), theirs.len());
    assert!(worst < 1e-4, "{worst}");
    Ok(())
}

/// Embeddings requested while generations stream share the engine's steps with them: each
/// vector and each text as it is alone, and the inputs' tokens counted among the engine's
/// prompt tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_run_in_the_engine_beside_generations() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let texts = [
        "First Citizen:",
        "Before we proceed any further, hear me speak.",
        "All:",
    ];
    let body =
        |seed: u64| json!({"prompt": "ROMEO:", "max_tokens": 48, "temperature": 0.8, "seed": seed, "stream": true});
    let mut alone_texts = Vec::new();
    for seed in 0..3 {
        alone_texts.push(common::streamed_text(&server.stream(body(seed)).await?, 0).0);
    }
    let alone = server.call("/v1/embeddings", json!({"input": texts})).await?;
    let counted = |metrics: &str| -> f64 {
        (metrics.lines())
            .find_map(|l| l.strip_prefix("gpt_prompt_tokens_total "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    let before = counted(&server.metrics().await?);
    let streams = (0..3).map(|seed| server.stream(body(seed)));
    let embeddings = (0..4).map(|_| server.call("/v1/embeddings", json!({"input": texts})));
    let (streams, embeddings) = tokio::join!(
        futures_util::future::join_all(streams),
        futures_util::future::join_all(embeddings)
    );
    for (chunks, want) in streams.into_iter().zip(&alone_texts) {
        assert_eq!(&common::streamed_text(&chunks?, 0).0, want);
    }
    for e in embeddings {
        let e = e?;
        for i in 0..texts.len() {
            assert_eq!(
                floats(&e["data"][i]["embedding"]),
                floats(&alone["data"][i]["embedding"])
            );
        }
    }
    let prompt = server.tokenize("ROMEO:").await?.len();
    let embedded = alone["usage"]["prompt_tokens"].as_u64().unwrap_or(0) as usize;
    assert_eq!(
        counted(&server.metrics().await?) - before,
        (3 * prompt + 4 * embedded) as f64
    );
    Ok(())
}

#[tokio::test]
async fn bad_embedding_requests_name_the_field() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let context = server.state.limits.context;
    let long: Vec<u32> = vec![5; context + 1];
    let cases = [
        (json!({"input": []}), 400, "input"),
        (json!({"input": ""}), 400, "input[0]"),
        (json!({"input": [[1, 2], [1, 99999]]}), 400, "input[1][1]"),
        (json!({"input": long}), 400, "context"),
        (json!({"input": "hi", "dimensions": 3}), 400, "dimensions"),
        (json!({"input": "hi", "encoding_format": "hex"}), 400, "encoding_format"),
        (json!({"input": "hi", "pooling": "mean"}), 400, "pooling"),
        (
            json!({"input": "hi", "model": "text-embedding-3-small"}),
            404,
            "text-embedding-3-small",
        ),
    ];
    for (body, status, mentions) in cases {
        let (got, resp) = server.post_to("/v1/embeddings", body.clone()).await?;
        assert_eq!(got, status, "{body}: {resp}");
        let message = resp["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(mentions), "{body}: {mentions:?} not in {message:?}");
    }
    Ok(())
}
