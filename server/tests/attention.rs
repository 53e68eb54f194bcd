//! `POST /v1/attention` against `transformers`' `output_attentions` on the attention fixture
//! (tests/fixtures/make_attention_fixture.py), its selection of layers and heads, and its limits.

mod common;

use std::path::PathBuf;

use candle_core::{Device, IndexOp};
use common::{config, start};
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/attention-gpt2")
}

#[tokio::test]
async fn attention_maps_equal_transformers_and_select_layers_and_heads() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let expected: Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json"))?)?;
    let reference = candle_core::safetensors::load(fixture().join("expected.safetensors"), &Device::Cpu)?;
    let reference = reference
        .get("attentions")
        .ok_or_else(|| anyhow::anyhow!("no attentions"))?;
    let (n_layer, n_head, t) = (reference.dim(0)?, reference.dim(1)?, reference.dim(2)?);

    let r = server
        .call("/v1/attention", json!({"prompt": expected["text"]}))
        .await?;
    assert_eq!(r["token_ids"], expected["ids"]);
    assert_eq!(r["tokens"].as_array().map(Vec::len), Some(t));
    assert_eq!(r["layers"], json!((0..n_layer).collect::<Vec<_>>()));
    let got: Vec<Vec<Vec<Vec<f32>>>> = serde_json::from_value(r["attentions"].clone())?;
    assert_eq!((got.len(), got[0].len(), got[0][0].len()), (n_layer, n_head, t));
    let mut worst = 0f32;
    for (l, layer) in got.iter().enumerate() {
        for (h, head) in layer.iter().enumerate() {
            let want = reference.i((l, h))?.to_vec2::<f32>()?;
            for (q, (row, want_row)) in head.iter().zip(&want).enumerate() {
                assert!(
                    (row.iter().sum::<f32>() - 1.0).abs() < 1e-5,
                    "layer {l} head {h} row {q}"
                );
                assert!(
                    row[q + 1..].iter().all(|&p| p == 0.0),
                    "layer {l} head {h}: query {q} sees later keys"
                );
                for (a, b) in row.iter().zip(want_row) {
                    worst = worst.max((a - b).abs());
                }
            }
        }
    }
    assert!(worst < 1e-4, "largest difference from transformers: {worst}");

    // Token ids, and a selection in the order asked for.
    let ids = expected["ids"].clone();
    let some = server
        .call("/v1/attention", json!({"prompt": ids, "layers": [1], "heads": [3, 0]}))
        .await?;
    let picked: Vec<Vec<Vec<Vec<f32>>>> = serde_json::from_value(some["attentions"].clone())?;
    assert_eq!(
        (some["layers"].clone(), some["heads"].clone()),
        (json!([1]), json!([3, 0]))
    );
    assert_eq!(picked, vec![vec![got[1][3].clone(), got[1][0].clone()]]);
    Ok(())
}

#[tokio::test]
async fn attention_refuses_what_it_cannot_answer_naming_the_limit() -> anyhow::Result<()> {
    let server = start(&fixture(), config()).await?;
    let long: Vec<u32> = (0..70).map(|i| i % 300).collect();
    let cases = [
        (
            json!({"prompt": "Speak", "layers": [2]}),
            "layers",
            "layers[0] must be between 0 and 1",
        ),
        (json!({"prompt": "Speak", "heads": [-1]}), "heads", "between 0 and 3"),
        (json!({"prompt": "Speak", "heads": []}), "heads", "must not be empty"),
        (json!({"prompt": ""}), "prompt", "must not be empty"),
        (json!({"prompt": ["a", "b"]}), "prompt", "one prompt"),
        (json!({"prompt": [1, 400]}), "prompt", "outside the vocabulary"),
        (json!({"prompt": long}), "prompt", "at most 64"),
        (json!({"prompt": "x", "top_k": 3}), "top_k", "unknown field"),
    ];
    for (body, param, says) in cases {
        let (status, err) = server.post_to("/v1/attention", body.clone()).await?;
        assert_eq!(status, 400, "{body}: {err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{body}: {message}");
        if param != "top_k" {
            assert_eq!(err["error"]["param"], param, "{body}: {err}");
        }
    }
    Ok(())
}
