//! LoRA adapters in a batched generation step: a step that mixes sequences with different
//! adapters and without any gives each sequence what it gets in a step of its own, and what the
//! model with that adapter set gives.

mod common;

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use common::{max_abs_diff, random_model, tokens};
use gpt::lora::{LoraConfig, LoraLayer};
use gpt::{Adapter, Config, Gpt, LogitsFor, SeqStep, WeightFormat};

/// An adapter of rank `r` on `targets`, its matrices random (B too, so that it changes the
/// logits).
fn random_adapter(cfg: &Config, targets: &[&str], r: usize, alpha: f64) -> anyhow::Result<Adapter> {
    let config = LoraConfig {
        r,
        lora_alpha: alpha,
        lora_dropout: 0.0,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        layers_to_transform: None,
        use_rslora: false,
        base_model_name_or_path: None,
    };
    let mut layers = BTreeMap::new();
    for (name, d_in, d_out) in config.layers(cfg)? {
        let a = Tensor::randn(0f32, 0.3, (r, d_in), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 0.3, (d_out, r), &Device::Cpu)?;
        layers.insert(name, LoraLayer::new(a, b, config.scale()));
    }
    Ok(Adapter::new(config, layers, cfg)?)
}

/// Every step's logits of each sequence: its prompt's (all positions), then those of `decode`
/// more steps, each feeding a fixed token; all sequences in one step with their adapters.
fn run(
    model: &Gpt,
    prompts: &[Vec<u32>],
    adapters: &[Option<&Adapter>],
    decode: usize,
) -> anyhow::Result<Vec<Vec<Tensor>>> {
    let mut caches: Vec<_> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut out: Vec<Vec<Tensor>> = prompts.iter().map(|_| Vec::new()).collect();
    for step in 0..=decode {
        let fed: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                if step == 0 {
                    p.clone()
                } else {
                    vec![((p[0] as usize + step * 3) % 90) as u32]
                }
            })
            .collect();
        let mut steps: Vec<SeqStep> = caches
            .iter_mut()
            .zip(&fed)
            .map(|(cache, tokens)| SeqStep { tokens, cache })
            .collect();
        let which = vec![LogitsFor::All; prompts.len()];
        let logits = model.logits(&model.forward_step_adapted(&mut steps, &which, adapters)?)?;
        let mut start = 0;
        for (i, tokens) in fed.iter().enumerate() {
            out[i].push(logits.narrow(0, start, tokens.len())?);
            start += tokens.len();
        }
    }
    Ok(out)
}

#[test]
fn a_step_mixing_adapters_and_the_base_gives_each_sequence_its_own_logits() -> anyhow::Result<()> {
    let cfg = Config::tiny(97);
    let (_vars, trained) = random_model(&cfg)?;
    let qkv = random_adapter(&cfg, &["c_attn", "c_fc"], 2, 4.0)?;
    // `c_proj` adapts both projections, the attention's and the MLP's.
    let proj = random_adapter(&cfg, &["c_proj"], 4, 8.0)?;
    let prompts: Vec<Vec<u32>> = [9, 5, 12, 7, 3]
        .iter()
        .zip(1..)
        .map(|(&n, seed)| tokens(n, 97, seed))
        .collect();
    let adapters = [Some(&qkv), None, Some(&proj), Some(&qkv), None];
    for (what, model) in [
        ("as trained", trained.clone()),
        ("packed for inference", trained.clone().into_inference_layout()?),
        ("in bf16", trained.clone().with_weight_format(WeightFormat::Bf16)?),
    ] {
        let batched = run(&model, &prompts, &adapters, 3)?;
        for (i, (prompt, adapter)) in prompts.iter().zip(adapters).enumerate() {
            let alone = run(&model, std::slice::from_ref(prompt), &[adapter], 3)?.remove(0);
            let mut with_set = model.clone();
            with_set.set_adapter(adapter)?;
            let set = run(&with_set, std::slice::from_ref(prompt), &[], 3)?.remove(0);
            let base = run(&model, std::slice::from_ref(prompt), &[], 3)?.remove(0);
            for step in 0..alone.len() {
                let d = max_abs_diff(&batched[i][step], &alone[step])?;
                assert!(
                    d <= 1e-6,
                    "{what}: sequence {i}, step {step}: batched vs alone differ by {d}"
                );
                let d = max_abs_diff(&set[step], &alone[step])?;
                assert!(
                    d <= 1e-4,
                    "{what}: sequence {i}, step {step}: set_adapter vs per-row differ by {d}"
                );
                let moved = max_abs_diff(&base[step], &alone[step])?;
                match adapter {
                    Some(_) => assert!(moved > 1e-2, "{what}: sequence {i}'s adapter changed nothing ({moved})"),
                    None => assert_eq!(moved, 0.0, "{what}: sequence {i} has no adapter"),
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_step_refuses_a_count_of_adapters_that_is_not_the_sequences() -> anyhow::Result<()> {
    let cfg = Config::tiny(97);
    let (_vars, model) = random_model(&cfg)?;
    let adapter = random_adapter(&cfg, &["c_attn"], 2, 4.0)?;
    let mut cache = model.new_cache();
    let ids = tokens(4, 97, 1);
    let err = model
        .forward_step_adapted(
            &mut [SeqStep {
                tokens: &ids,
                cache: &mut cache,
            }],
            &[LogitsFor::Last],
            &[Some(&adapter), None],
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("2 adapters for 1 sequences"), "{err}");
    assert_eq!(cache.len(), 0, "nothing was written to the cache");
    Ok(())
}
