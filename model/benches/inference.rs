//! Inference benchmark, GPT-2-small shape with random weights: prefill tokens/s for a PREFILL-token
//! prompt (batch 1, default 128), and greedy decode tokens/s (all sequences together) with the KV cache: a
//! 16-token prompt, then NEW_TOKENS new tokens for each of BATCH sequences stepped together.
//! `bench/torch_inference.py` measures the same with PyTorch `transformers`; `bench/inference.sh`
//! runs both on the CPU, `bench/gpu.sh` on a GPU. Prints one JSON object.
//!
//!     [DEVICE=cpu|cuda] [DTYPE=f32|bf16|f16] [WEIGHTS=f32|f16|bf16|q8_0|q4_0] [LAYOUT=inference|gpt2] [PRECISION=highest|high] [PREFILL=128] [BATCH=1] [NEW_TOKENS=128] \
//!         cargo bench -p gpt --bench inference
//!
//! `KV_CACHE=auto|f32|f16` picks what the KV cache holds, default `auto` as `gpt-server`'s
//! `--kv-cache-dtype` (f16 where the weights are lossy, as llama.cpp's cache, f32 where all are f32).
//!
//! `GGUF=FILE` benchmarks a llama.cpp GGUF file's model instead (its own formats, or `WEIGHTS`
//! where given): what `bench/smollm2_llamacpp.sh` runs beside `llama-bench`.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use gpt::{Config, Gpt, LogitsFor, SeqStep};

const PROMPT: usize = 16;
const REPEATS: usize = 5;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

fn argmax(logits: &Tensor) -> anyhow::Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?)
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator();
    gpt::device::fix_cpu_thread_count();
    let device = gpt::parse_device(&env_or("DEVICE", "cpu".to_string()))?;
    let dtype_name = env_or("DTYPE", "f32".to_string());
    let dtype = match dtype_name.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    };
    let (batch, new_tokens) = (env_or("BATCH", 1usize), env_or("NEW_TOKENS", 128usize));
    let prefill = env_or("PREFILL", 128usize);
    if let Some(path) = std::env::var_os("GGUF") {
        let weights = std::env::var("WEIGHTS").ok().map(|w| w.parse()).transpose()?;
        let (model, _) = gpt::load_dir_as(std::path::Path::new(&path), weights, &device)?;
        let name = weights.map_or("as stored".to_string(), |w: gpt::WeightFormat| w.to_string());
        return run(
            model,
            &device,
            &dtype_name,
            "gguf",
            &name,
            gpt::MatmulPrecision::Highest,
            prefill,
            batch,
            new_tokens,
        );
    }
    let cfg = Config::gpt2_small();
    // Random f32 weights made on the CPU, then moved and cast as a checkpoint is at load
    // (candle's CUDA backend draws no random bf16/f16 numbers).
    let varmap = VarMap::new();
    Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cfg)?;
    let weights = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap poisoned"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
        .collect();
    let model = Gpt::new(VarBuilder::from_tensors(weights, dtype, &device), &cfg)?;
    // What a loaded checkpoint is in (`LAYOUT=gpt2` for GPT-2's, as training has it).
    let layout = env_or("LAYOUT", "inference".to_string());
    let model = if layout == "gpt2" {
        model
    } else {
        model.into_inference_layout()?
    };
    // How inference holds the weight matrices (`WEIGHTS=f16|bf16|q8_0|q4_0`, activations f32).
    let weights: gpt::WeightFormat = env_or("WEIGHTS", "f32".to_string()).parse()?;
    let model = model.with_weight_format(weights)?;
    // `PRECISION=high`: f32 products as bf16x3 on AMX tiles (`gpt::MatmulPrecision`).
    let precision: gpt::MatmulPrecision = env_or("PRECISION", "highest".to_string()).parse()?;
    let model = model.with_matmul_precision(precision)?;
    run(
        model,
        &device,
        &dtype_name,
        &layout,
        &weights.to_string(),
        precision,
        prefill,
        batch,
        new_tokens,
    )
}

/// Prefill, then decode, timed; prints the report.
#[allow(clippy::too_many_arguments)]
fn run(
    model: Gpt,
    device: &Device,
    dtype_name: &str,
    layout: &str,
    weights: &str,
    precision: gpt::MatmulPrecision,
    prefill: usize,
    batch: usize,
    new_tokens: usize,
) -> anyhow::Result<()> {
    let kv: gpt::KvCacheDtype = env_or("KV_CACHE", "auto".to_string()).parse()?;
    let kv_dtype = kv.resolve(&model);
    let model = model.with_kv_cache_dtype(kv_dtype)?;
    let cfg = model.config().clone();
    let ids = prompt(prefill, cfg.vocab_size);
    let mut prefill_s = Vec::new();
    for _ in 0..=REPEATS {
        let mut cache = model.new_cache();
        let start = Instant::now();
        let logits = model.forward_step(
            &mut [SeqStep {
                tokens: &ids,
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )?;
        argmax(&logits)?;
        prefill_s.push(start.elapsed().as_secs_f64());
    }
    prefill_s.remove(0); // warm-up (and, on a GPU, kernel compilation)

    let ids = prompt(PROMPT, cfg.vocab_size);
    let mut decode_s = Vec::new();
    for _ in 0..REPEATS.min(3) {
        let mut caches: Vec<_> = (0..batch).map(|_| model.new_cache()).collect();
        let mut steps: Vec<SeqStep> = caches.iter_mut().map(|cache| SeqStep { tokens: &ids, cache }).collect();
        let mut next = argmax(&model.forward_step(&mut steps, LogitsFor::Last)?)?;
        let start = Instant::now();
        for _ in 0..new_tokens {
            let mut steps: Vec<SeqStep> = caches
                .iter_mut()
                .zip(&next)
                .map(|(cache, t)| SeqStep {
                    tokens: std::slice::from_ref(t),
                    cache,
                })
                .collect();
            next = argmax(&model.forward_step(&mut steps, LogitsFor::Last)?)?; // reads back: a sync
        }
        decode_s.push(start.elapsed().as_secs_f64());
    }

    let decode_median = median(decode_s);
    let report = serde_json::json!({
        "impl": "candle",
        "device": gpt::device_name(device),
        "dtype": dtype_name,
        "layout": layout,
        "weights": weights,
        "precision": precision.to_string(),
        "kv_cache": format!("{kv_dtype:?}").to_lowercase(),
        "threads": candle_core::utils::get_num_threads(),
        "prefill_tokens": prefill,
        "prefill_tok_per_s": prefill as f64 / median(prefill_s),
        "batch": batch,
        "decode_prompt": PROMPT,
        "decode_new_tokens": new_tokens,
        "decode_tok_per_s": (batch * new_tokens) as f64 / decode_median,
        // What each decode step reads of the weights, and at batch 1 the rate it reads them.
        "weight_bytes": model.weight_bytes(),
        "decode_weight_gb_per_s": (new_tokens * model.weight_bytes()) as f64 / decode_median / 1e9,
    });
    println!("{report}");
    Ok(())
}
