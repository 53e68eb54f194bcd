//! Training-step benchmark on random tokens: median time of forward + backward (on THREADS
//! cores, default all, split as gpt-train's `--parallel auto` does, or PARALLEL=shards|ops) and
//! of clipping with the AdamW update, each phase timed alone; then of whole steps as gpt-train
//! runs them (`step`; on a GPU the host queues a phase while the previous one runs), and
//! training tokens/s. Prints one JSON object.
//!
//!     [DEVICE=cpu|cuda] cargo bench -p gpt-train --bench train_step -- [recipe|shakespeare-char|gpt2|smollm2] [BATCH] [BLOCK] [STEPS]
//!
//! On a CUDA GPU, f32 matrix products use TF32 unless TF32=0; AUTOCAST=bf16 multiplies in bf16.
//!
//! `recipe` is nanoGPT's CPU recipe (65 tokens, 4 layers, 4 heads, 128 wide; batch 12 x 64);
//! `shakespeare-char` nanoGPT's GPU default (65 tokens, 6 x 6 x 384; batch 64 x 256); `gpt2` the
//! GPT-2-small shape (50257 tokens, 12 x 12 x 768; batch 4 x 256 by default); `smollm2`
//! SmolLM2-135M's (Llama family: 49152 tokens, 30 layers, 9 query and 3 key/value heads, 576 wide,
//! gated SiLU MLP 1536 wide, RMSNorm, RoPE, tied head; batch 4 x 256 by default).
//! `bench/torch_train.py throughput [--arch smollm2]` measures the PyTorch side (`transformers`'
//! `LlamaForCausalLM` for SmolLM2).

use std::time::Instant;

use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use gpt::{Config, Gpt};
use gpt_train::init::seeded_var_builder;
use gpt_train::optim::{AdamW, AdamWConfig};
use gpt_train::step::{accumulate_grads, Parallelism};
use gpt_train::step::{cpu_threads, use_shard_parallelism};

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator();
    let threads = cpu_threads(std::env::var("THREADS").ok().and_then(|s| s.parse().ok()));
    use_shard_parallelism(); // as gpt-train does, until the model's shape is known
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let shape = args.first().map(String::as_str).unwrap_or("recipe");
    let (mut cfg, batch, block) = match shape {
        "gpt2" => (Config::gpt2_small(), 4, 256),
        "smollm2" => {
            let shape = Config {
                n_layer: 30,
                n_head: 9,
                n_embd: 576,
                ..Config::tiny(49152)
            };
            let mut cfg = gpt::arch::from_scratch(gpt::arch::Family::Llama, &shape, Some(3))?;
            cfg.n_inner = Some(1536); // SmolLM2-135M's intermediate_size
            (cfg, 4, 256)
        }
        "shakespeare-char" => (Config::preset("shakespeare-char", Some(65))?, 64, 256),
        _ => (
            Config {
                n_layer: 4,
                n_head: 4,
                n_embd: 128,
                ..Config::tiny(65)
            },
            12,
            64,
        ),
    };
    let batch = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(batch);
    let block = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(block);
    let steps: usize = args
        .get(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or(if matches!(shape, "gpt2" | "smollm2") { 5 } else { 30 });
    (cfg.n_positions, cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) = (block, 0.0, 0.0, 0.0);

    let device = gpt::parse_device(&std::env::var("DEVICE").unwrap_or_else(|_| "cpu".into()))?;
    if device.is_cuda() {
        candle_core::cuda::set_gemm_reduced_precision_f32(std::env::var("TF32").map_or(true, |v| v != "0"));
    }
    let autocast = match std::env::var("AUTOCAST").as_deref() {
        Ok("bf16") => gpt::Autocast::Bf16,
        _ => gpt::Autocast::Off,
    };
    // PARALLEL=shards|ops overrides gpt-train's automatic choice, to compare.
    let parallel = match std::env::var("PARALLEL").as_deref() {
        Ok("shards") => Parallelism::Shards,
        Ok("ops") => Parallelism::Ops,
        _ => Parallelism::Auto,
    }
    .resolve(&cfg);
    let shards = if device.is_cpu() {
        parallel.use_cpu_threads(threads)
    } else {
        1
    };
    let varmap = VarMap::new();
    let model = Gpt::new_trainable(seeded_var_builder(&varmap, 0, &device), &cfg)?.with_autocast(autocast);
    let named = gpt_train::init::named_vars(&varmap)?;
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let cfg_opt = AdamWConfig {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let mut opt = AdamW::new(named, cfg_opt)?;

    let batch_of = |step: usize| -> anyhow::Result<(Tensor, Tensor)> {
        let ids: Vec<u32> = (0..batch * (block + 1))
            .map(|i| ((i * 7919 + step * 31) % cfg.vocab_size) as u32)
            .collect();
        let t = Tensor::from_vec(ids, (batch, block + 1), &device)?;
        Ok((t.narrow(1, 0, block)?, t.narrow(1, 1, block)?))
    };
    // Each phase timed alone: a GPU runs behind the host, so wait after each phase (the
    // synchronisations cost the step the overlap of one phase's kernels with the next's queueing).
    let (mut grad, mut upd) = (vec![], vec![]);
    for step in 0..=steps {
        let (x, y) = batch_of(step)?;
        let t0 = Instant::now();
        let (_, g) = accumulate_grads(&model, &vars, &[(x, y).into()], shards, Default::default())?;
        device.synchronize()?;
        let t1 = Instant::now();
        opt.step_clipped(&g, 1e-4, 1.0)?; // clipping and AdamW, as gpt-train steps
        device.synchronize()?;
        if step > 0 {
            grad.push((t1 - t0).as_secs_f64());
            upd.push(t1.elapsed().as_secs_f64());
        }
    }
    // Then whole steps as gpt-train runs them, with no waits but the loss's read-back.
    let t0 = Instant::now();
    for step in 0..steps {
        let (x, y) = batch_of(step)?;
        let (_, g) = accumulate_grads(&model, &vars, &[(x, y).into()], shards, Default::default())?;
        opt.step_clipped(&g, 1e-4, 1.0)?;
    }
    device.synchronize()?;
    let step_s = t0.elapsed().as_secs_f64() / steps.max(1) as f64;
    println!(
        "{}",
        serde_json::json!({
            "impl": "candle",
            "shape": shape,
            "device": gpt::device_name(&device),
            "autocast_bf16": model.autocast() == gpt::Autocast::Bf16,
            "bf16_dot": (model.autocast() == gpt::Autocast::Bf16 && device.is_cpu())
                .then(|| format!("{:?}", gpt_kernels::Bf16Dot::detect())),
            "threads": if device.is_cpu() { threads } else { 0 },
            "parallel": format!("{parallel:?}").to_lowercase(),
            "batch_size": batch,
            "block_size": block,
            "parameters": model.num_parameters(),
            "ms": {"forward_backward": 1e3 * median(grad), "clip_adamw": 1e3 * median(upd), "step": 1e3 * step_s},
            "tokens_per_sec": (batch * block) as f64 / step_s,
        })
    );
    Ok(())
}
