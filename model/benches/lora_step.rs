//! A batched decode step with LoRA adapters against the same step on the base: BATCH sequences
//! (16) after a 16-token prompt each, stepped together for NEW_TOKENS (64) tokens, with none of
//! them adapted, then spread over ADAPTERS (4) random adapters of rank R (8) on TARGETS (c_attn),
//! interleaved REPEATS (5) times. The checkpoint is CHECKPOINT (default: the repository's
//! weights/), packed for inference as gpt-server holds it. Prints one JSON object: the median
//! tokens/s of each and their ratio.
//!
//!     [CHECKPOINT=DIR] [BATCH=16] [ADAPTERS=4] [R=8] [TARGETS=c_attn,c_fc] cargo bench -p gpt --bench lora_step

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{Device, Tensor};
use gpt::lora::{LoraConfig, LoraLayer};
use gpt::{Adapter, Gpt, LogitsFor, SeqStep};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn adapter(cfg: &gpt::Config, r: usize, targets: &[String]) -> anyhow::Result<Adapter> {
    let config = LoraConfig {
        r,
        lora_alpha: 2.0 * r as f64,
        lora_dropout: 0.0,
        target_modules: targets.to_vec(),
        layers_to_transform: None,
        use_rslora: false,
        base_model_name_or_path: None,
    };
    let mut layers = BTreeMap::new();
    for (name, d_in, d_out) in config.layers(cfg)? {
        let a = Tensor::randn(0f32, 0.02, (r, d_in), &Device::Cpu)?;
        let b = Tensor::randn(0f32, 0.02, (d_out, r), &Device::Cpu)?;
        layers.insert(name, LoraLayer::new(a, b, config.scale()));
    }
    Ok(Adapter::new(config, layers, cfg)?)
}

/// Tokens/s of `new_tokens` decode steps of every sequence together, each with `adapters[s]`.
fn decode(model: &Gpt, batch: usize, new_tokens: usize, adapters: &[Option<&Adapter>]) -> anyhow::Result<f64> {
    let vocab = model.config().vocab_size;
    let mut caches: Vec<_> = (0..batch).map(|_| model.new_cache()).collect();
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|s| (0..16).map(|i| ((s * 31 + i * 7) % vocab) as u32).collect())
        .collect();
    let which = vec![LogitsFor::Last; batch];
    let mut steps: Vec<SeqStep> = caches
        .iter_mut()
        .zip(&prompts)
        .map(|(cache, tokens)| SeqStep { tokens, cache })
        .collect();
    model.forward_step_adapted(&mut steps, &which, adapters)?;
    let next: Vec<[u32; 1]> = (0..batch).map(|s| [(s % vocab) as u32]).collect();
    let start = Instant::now();
    for _ in 0..new_tokens {
        let mut steps: Vec<SeqStep> = caches
            .iter_mut()
            .zip(&next)
            .map(|(cache, t)| SeqStep { tokens: t, cache })
            .collect();
        let hidden = model.forward_step_adapted(&mut steps, &which, adapters)?;
        model.logits(&hidden)?;
    }
    Ok((batch * new_tokens) as f64 / start.elapsed().as_secs_f64())
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator();
    gpt::device::fix_cpu_thread_count();
    let checkpoint =
        std::env::var("CHECKPOINT").unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../weights").into());
    let (batch, new_tokens, n_adapters, r) = (
        env_or("BATCH", 16usize),
        env_or("NEW_TOKENS", 64usize),
        env_or("ADAPTERS", 4usize),
        env_or("R", 8usize),
    );
    let targets: Vec<String> = env_or("TARGETS", "c_attn".to_string())
        .split(',')
        .map(str::to_string)
        .collect();
    let (model, _) = gpt::load_dir_as(std::path::Path::new(&checkpoint), None, &Device::Cpu)?;
    let adapters: Vec<Adapter> = (0..n_adapters.max(1))
        .map(|_| adapter(model.config(), r, &targets))
        .collect::<anyhow::Result<_>>()?;
    let spread: Vec<Option<&Adapter>> = (0..batch).map(|s| Some(&adapters[s % adapters.len()])).collect();
    let (mut base, mut adapted) = (Vec::new(), Vec::new());
    for _ in 0..env_or("REPEATS", 5usize) {
        base.push(decode(&model, batch, new_tokens, &[])?);
        adapted.push(decode(&model, batch, new_tokens, &spread)?);
    }
    let ratios: Vec<f64> = adapted.iter().zip(&base).map(|(a, b)| a / b).collect();
    println!(
        "{}",
        serde_json::json!({
            "checkpoint": checkpoint, "batch": batch, "adapters": n_adapters, "r": r, "targets": targets,
            "base_tokens_per_s": median(base), "adapted_tokens_per_s": median(adapted),
            "ratio_median": median(ratios.clone()), "ratios": ratios,
        })
    );
    Ok(())
}
