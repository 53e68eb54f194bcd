//! Beam search against `transformers`' `generate(num_beams=k, do_sample=False, length_penalty=a)`
//! on the tiny-gpt2 fixture (`tests/fixtures/make_beam_fixture.py`): the same beams, token for
//! token, with the same scores.

use std::path::Path;

use candle_core::{DType, Device};
use gpt::beam::{beam_search, BeamParams};

#[test]
fn beams_match_transformers_token_for_token() -> anyhow::Result<()> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let (model, _) = gpt::load_dir(&fixtures.join("tiny-gpt2"), DType::F32, &Device::Cpu)?;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures.join("beam_search.json"))?)?;
    let cases = json["cases"].as_array().cloned().unwrap_or_default();
    assert!(cases.len() >= 10);
    let (mut by_eos, mut by_length) = (0, 0);
    for (i, case) in cases.iter().enumerate() {
        let prompt: Vec<u32> = serde_json::from_value(case["prompt"].clone())?;
        let params = BeamParams {
            beams: case["num_beams"].as_u64().unwrap_or(1) as usize,
            max_new_tokens: case["max_new_tokens"].as_u64().unwrap_or(1) as usize,
            length_penalty: case["length_penalty"].as_f64().unwrap_or(1.0) as f32,
            eos: case["eos_token_id"].as_u64().map(|e| e as u32),
        };
        let ours = beam_search(&model, &prompt, &params)?;
        let theirs = case["beams"].as_array().cloned().unwrap_or_default();
        assert_eq!(ours.len(), theirs.len(), "case {i}");
        for (rank, (a, b)) in ours.iter().zip(&theirs).enumerate() {
            let tokens: Vec<u32> = serde_json::from_value(b["tokens"].clone())?;
            let score = b["score"].as_f64().unwrap_or(f64::NAN) as f32;
            assert_eq!(a.tokens, tokens, "case {i} ({params:?}), beam {rank}");
            assert!(
                (a.score - score).abs() < 1e-4,
                "case {i}, beam {rank}: score {} vs {score}",
                a.score
            );
            if a.ended_by_eos {
                by_eos += 1;
            } else {
                by_length += 1;
            }
        }
    }
    assert!(
        by_eos > 5 && by_length > 5,
        "both endings covered: {by_eos} by eos, {by_length} by length"
    );
    Ok(())
}
