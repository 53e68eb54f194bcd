//! Attention maps from the model's own forward pass, against `transformers`' `output_attentions`
//! on a fixture whose attention is far from uniform (tests/fixtures/make_attention_fixture.py).

use std::path::PathBuf;

use candle_core::{DType, Device, IndexOp, Tensor, D};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/attention-gpt2")
}

#[test]
fn attentions_match_transformers_and_are_causal_distributions() -> anyhow::Result<()> {
    let (model, tokenizer) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json"))?)?;
    let ids = tokenizer.encode(expected["text"].as_str().unwrap_or_default())?;
    let want_ids: Vec<u32> = serde_json::from_value(expected["ids"].clone())?;
    assert_eq!(ids, want_ids);
    let reference = candle_core::safetensors::load(fixture().join("expected.safetensors"), &Device::Cpu)?;
    let reference = reference
        .get("attentions")
        .ok_or_else(|| anyhow::anyhow!("no attentions"))?;

    let input = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let (logits, attentions) = model.forward_with_attentions(&input)?;
    let t = ids.len();
    assert_eq!(attentions.len(), model.config().n_layer);
    // The same logits as the plain forward pass.
    let plain = model.forward(&input, None)?;
    assert_eq!((logits - plain)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);

    let ours = Tensor::stack(
        &attentions
            .iter()
            .map(|a| a.i(0))
            .collect::<candle_core::Result<Vec<_>>>()?,
        0,
    )?;
    assert_eq!(ours.dims(), reference.dims());
    let diff = (&ours - reference)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-4, "attentions differ from transformers' by {diff}");
    // Not uniform: the check above would be weak otherwise.
    assert!(reference.max_all()?.to_scalar::<f32>()? > 0.9);

    let rows = ours.sum(D::Minus1)?.flatten_all()?.to_vec1::<f32>()?;
    assert!(rows.iter().all(|s| (s - 1.0).abs() < 1e-5), "every row sums to 1");
    let all: Vec<Vec<Vec<Vec<f32>>>> = (0..ours.dim(0)?)
        .map(|l| ours.i(l)?.to_vec3::<f32>())
        .collect::<candle_core::Result<_>>()?;
    for layer in &all {
        for head in layer {
            for (q, row) in head.iter().enumerate() {
                assert!(row[q + 1..t].iter().all(|&p| p == 0.0), "query {q} sees a later key");
            }
        }
    }
    Ok(())
}
