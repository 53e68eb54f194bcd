//! CPU inference benchmark, batch 1, GPT-2-small shape with random f32 weights: prefill tokens/s
//! for a 128-token prompt, and greedy decode tokens/s with the KV cache (16-token prompt, then
//! 128 new tokens). `bench/torch_inference.py` measures the same with PyTorch `transformers`;
//! `bench/inference.sh` runs both. Prints one JSON object.
//!
//!     cargo bench -p gpt --bench inference

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{VarBuilder, VarMap};
use gpt::{Config, Gpt, LogitsFor, SeqStep};

const PREFILL: usize = 128;
const PROMPT: usize = 16;
const NEW_TOKENS: usize = 128;
const REPEATS: usize = 5;

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect()
}

fn argmax(logits: &Tensor) -> anyhow::Result<u32> {
    Ok(logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?[0])
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator();
    gpt::device::fix_cpu_thread_count();
    let cfg = Config::gpt2_small();
    let varmap = VarMap::new();
    let model = Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &cfg)?;

    let ids = prompt(PREFILL, cfg.vocab_size);
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
    prefill_s.remove(0); // warm-up

    let ids = prompt(PROMPT, cfg.vocab_size);
    let mut decode_s = Vec::new();
    for _ in 0..REPEATS.min(3) {
        let mut cache = model.new_cache();
        let logits = model.forward_step(
            &mut [SeqStep {
                tokens: &ids,
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )?;
        let mut next = argmax(&logits)?;
        let start = Instant::now();
        for _ in 0..NEW_TOKENS {
            let step = SeqStep {
                tokens: std::slice::from_ref(&next),
                cache: &mut cache,
            };
            next = argmax(&model.forward_step(&mut [step], LogitsFor::Last)?)?;
        }
        decode_s.push(start.elapsed().as_secs_f64());
    }

    let report = serde_json::json!({
        "impl": "candle",
        "threads": candle_core::utils::get_num_threads(),
        "prefill_tokens": PREFILL,
        "prefill_tok_per_s": PREFILL as f64 / median(prefill_s),
        "decode_prompt": PROMPT,
        "decode_new_tokens": NEW_TOKENS,
        "decode_tok_per_s": NEW_TOKENS as f64 / median(decode_s),
    });
    println!("{report}");
    Ok(())
}
