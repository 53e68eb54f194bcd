//! The decoder families through the server: each checkpoint of `tests/fixtures/families`
//! (written by `transformers`, see `make_family_fixtures.py`) served as it is, its prompt
//! logprobs equal to `transformers`' log-softmax within 1e-4 and its greedy completion the
//! tokens `transformers` generates.

mod common;

use candle_core::Device;
use common::{config, start};
use gpt_test_support::{family_dir as dir, FAMILY_CASES};
use serde_json::{json, Value};

/// The server's greedy completion of `prompt` (token ids), `n` tokens past any end, as ids.
async fn greedy_ids(server: &common::Server, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let (status, r) = server
        .post(
            json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
            "logprobs": 0, "return_tokens_as_token_ids": true}),
        )
        .await?;
    anyhow::ensure!(status == 200, "{r}");
    Ok(r["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
        .collect())
}

#[tokio::test]
async fn every_family_serves_transformers_prompt_logprobs_and_greedy_tokens() -> anyhow::Result<()> {
    for case in FAMILY_CASES {
        let server = start(&dir(case), config()).await?;
        let e: Value = serde_json::from_str(&std::fs::read_to_string(dir(case).join("expected.json"))?)?;
        let logits = candle_core::safetensors::load(dir(case).join("expected.safetensors"), &Device::Cpu)?;
        let ids: Vec<u32> = serde_json::from_value(e["sequences"][0].clone())?;
        let want = candle_nn::ops::log_softmax(&logits["logits_0"], 1)?.to_vec2::<f32>()?;
        let (status, r) = server
            .post(json!({"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}))
            .await?;
        assert_eq!(status, 200, "{case}: {r}");
        let positions = r["choices"][0]["prompt_logprobs"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(positions.len(), ids.len(), "{case}");
        for t in 1..ids.len() {
            let got = positions[t][ids[t].to_string()]["logprob"].as_f64().unwrap_or(f64::NAN);
            let expected = want[t - 1][ids[t] as usize] as f64;
            assert!(
                (got - expected).abs() < 1e-4,
                "{case}, position {t}: {got} vs transformers {expected}"
            );
        }
        let prompt: Vec<u32> = serde_json::from_value(e["greedy_prompt"].clone())?;
        let greedy: Vec<u32> = serde_json::from_value(e["greedy"].clone())?;
        assert_eq!(
            greedy_ids(&server, &prompt, greedy.len()).await?,
            greedy,
            "{case}: greedy tokens"
        );
    }
    Ok(())
}

/// Speculative decoding on a family: Gemma 3 (sliding windows, QK-norm) checked by itself as its
/// draft and by a Llama of the same tokenizer as the draft: the greedy tokens `transformers`
/// generates, whichever proposes.
#[tokio::test]
async fn a_family_decodes_speculatively_with_the_same_greedy_tokens() -> anyhow::Result<()> {
    let case = "gemma3-local";
    let e: Value = serde_json::from_str(&std::fs::read_to_string(dir(case).join("expected.json"))?)?;
    let prompt: Vec<u32> = serde_json::from_value(e["greedy_prompt"].clone())?;
    let greedy: Vec<u32> = serde_json::from_value(e["greedy"].clone())?;
    for draft in [dir(case), dir("llama-gqa")] {
        let cfg = common::ServerConfig {
            speculative: Some(gpt_server::Speculative {
                draft: Some(draft.clone()),
                num_tokens: 4,
                max_batch: 8,
            }),
            ..config()
        };
        let server = start(&dir(case), cfg).await?;
        let tokens = greedy_ids(&server, &prompt, greedy.len()).await?;
        assert_eq!(tokens, greedy, "draft {}", draft.display());
        let metrics = server.metrics().await?;
        let proposed: f64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("gpt_spec_decode_draft_tokens_total "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0);
        assert!(proposed > 0.0, "the draft proposed tokens: {metrics}");
    }
    Ok(())
}
