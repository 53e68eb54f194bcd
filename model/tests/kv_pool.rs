//! The pool of freed KV-cache buffers (`gpt::set_kv_pool_limit`): dropped caches' buffers are
//! kept up to the limit and taken again, holding another sequence's keys and values, without
//! changing any result; caches in f16. One test in its own binary, as the pool is process-wide.

mod common;

use candle_core::Tensor;
use common::{random_model, tokens};
use gpt::{Config, Gpt, KvCache, LogitsFor, SeqStep};

/// Prefills `prompt` then decodes `steps` given tokens one at a time; every step's logits.
fn run(model: &Gpt, cache: &mut KvCache, prompt: &[u32], steps: &[u32]) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut out = Vec::new();
    let step = |ids: &[u32], cache: &mut KvCache| -> anyhow::Result<Tensor> {
        Ok(model.forward_step(&mut [SeqStep { tokens: ids, cache }], LogitsFor::Last)?)
    };
    out.push(step(prompt, cache)?.flatten_all()?.to_vec1::<f32>()?);
    for id in steps {
        out.push(step(std::slice::from_ref(id), cache)?.flatten_all()?.to_vec1::<f32>()?);
    }
    Ok(out)
}

#[test]
fn freed_buffers_are_kept_to_the_limit_and_reused_without_changing_results() -> anyhow::Result<()> {
    let cfg = Config {
        n_positions: 256,
        ..Config::tiny(97)
    };
    let (_vm, model) = random_model(&cfg)?;
    let (prompt, steps) = (tokens(40, cfg.vocab_size, 1), tokens(30, cfg.vocab_size, 2));

    // Without a pool: the reference, and nothing kept.
    gpt::set_kv_pool_limit(0);
    let mut fresh = model.new_cache();
    fresh.reserve(prompt.len() + steps.len())?;
    let reference = run(&model, &mut fresh, &prompt, &steps)?;
    drop(fresh);
    assert_eq!(gpt::kv_pool_bytes(), 0);

    gpt::set_kv_pool_limit(64 << 20);
    // A cache filled with other tokens, dropped: its buffers (holding its keys and values) are
    // kept, 2 x layers x heads x room x head_dim f32 in all.
    let mut other = model.new_cache();
    other.reserve(prompt.len() + steps.len())?;
    run(
        &model,
        &mut other,
        &tokens(60, cfg.vocab_size, 9),
        &tokens(10, cfg.vocab_size, 8),
    )?;
    drop(other);
    let kept = gpt::kv_pool_bytes();
    let room = 128; // 70 positions in chunks of 64
    assert_eq!(kept, 2 * cfg.n_layer * cfg.n_embd * room * 4);

    // The next cache takes them (the pool empties) and computes the same bits over them.
    let mut reused = model.new_cache();
    reused.reserve(prompt.len() + steps.len())?;
    let again = run(&model, &mut reused, &prompt, &steps)?;
    assert_eq!(gpt::kv_pool_bytes(), 0, "the buffers were taken from the pool");
    assert_eq!(again, reference);

    // Forks, truncation and compact copies take from and give back to the pool, and keep their
    // results: a fork of the prompt continued with the same steps gives the same logits.
    let mut base = model.new_cache();
    run(&model, &mut base, &prompt, &[])?;
    let mut fork = base.fork()?;
    let forked = run(&model, &mut fork, &steps[..1], &steps[1..])?;
    assert_eq!(forked, reference[1..]);
    fork.truncate(prompt.len())?;
    let mut compacted = fork.compact()?.prefix(prompt.len())?;
    assert_eq!(run(&model, &mut compacted, &steps[..1], &steps[1..])?, forked);

    // At most the limit is kept; lowering it lets the rest go.
    drop((reused, base, fork, compacted));
    assert!(gpt::kv_pool_bytes() > 0);
    gpt::set_kv_pool_limit(kept);
    assert!(gpt::kv_pool_bytes() <= kept);
    gpt::set_kv_pool_limit(0);
    assert_eq!(gpt::kv_pool_bytes(), 0);
    let mut last = model.new_cache();
    run(&model, &mut last, &prompt, &[])?;
    drop(last);
    assert_eq!(gpt::kv_pool_bytes(), 0);

    // On the CPU in f32 a cache is blocks of one size: a longer cache takes a shorter one's
    // blocks and adds its own, and freed, the pool keeps them all (what the caches held at their
    // peak), whatever the lengths.
    gpt::set_kv_pool_limit(64 << 20);
    let mut small = model.new_cache();
    small.reserve(prompt.len() + steps.len())?; // 2 blocks a layer
    run(&model, &mut small, &prompt, &steps)?;
    drop(small);
    assert_eq!(gpt::kv_pool_bytes(), kept);
    let mut large = model.new_cache();
    large.reserve(200)?; // 4 blocks a layer: the 2 kept and 2 new
    assert_eq!(run(&model, &mut large, &prompt, &steps)?, reference);
    assert_eq!(gpt::kv_pool_bytes(), 0, "the kept blocks were taken");
    drop(large);
    assert_eq!(gpt::kv_pool_bytes(), 2 * kept, "every block is kept");
    gpt::set_kv_pool_limit(0);

    // Whole buffers (half precision, other devices) come in sizes: one the pool does not hold
    // lets kept buffers of other sizes go, so that afterwards the pool keeps the new size alone,
    // not both (the pool and the caches in use stay within what they held at their peak).
    let varmap = candle_nn::VarMap::new();
    let half = Gpt::new(
        candle_nn::VarBuilder::from_varmap(&varmap, candle_core::DType::BF16, &candle_core::Device::Cpu),
        &cfg,
    )?;
    gpt::set_kv_pool_limit(64 << 20);
    let mut small = half.new_cache();
    small.reserve(prompt.len() + steps.len())?; // room 128
    let expected = run(&half, &mut small, &prompt, &steps)?;
    drop(small);
    let kept = 2 * cfg.n_layer * cfg.n_embd * 128 * 2;
    assert_eq!(gpt::kv_pool_bytes(), kept);
    let mut large = half.new_cache();
    large.reserve(200)?; // room 256, which the 128s do not serve
    assert_eq!(run(&half, &mut large, &prompt, &steps)?, expected);
    assert_eq!(gpt::kv_pool_bytes(), 0, "the other size was let go");
    drop(large);
    assert_eq!(gpt::kv_pool_bytes(), 2 * kept, "only the new size is kept");
    gpt::set_kv_pool_limit(0);
    caches_in_f16_hold_half_the_bytes_within_rounding_of_f32()
}

/// Caches that store f16 on the CPU (`Gpt::with_kv_cache_dtype`): half the pool's bytes a
/// position, logits within f16's rounding of the f32 cache's (not equal to them), the prompt in
/// one step equal to it token by token (head sizes 8: the portable kernel; 64: the vector
/// kernels), and dtypes the cache cannot hold refused by name.
fn caches_in_f16_hold_half_the_bytes_within_rounding_of_f32() -> anyhow::Result<()> {
    for (n_embd, n_head) in [(32, 4), (128, 2)] {
        let cfg = Config {
            n_positions: 256,
            n_embd,
            n_head,
            ..Config::tiny(97)
        };
        let (_vm, model) = random_model(&cfg)?;
        let half = model.clone().with_kv_cache_dtype(candle_core::DType::F16)?;
        assert_eq!(half.kv_cache_dtype(), candle_core::DType::F16);
        let (prompt, steps) = (tokens(40, cfg.vocab_size, 1), tokens(30, cfg.vocab_size, 2));
        let reference = run(&model, &mut model.new_cache(), &prompt, &steps)?;
        gpt::set_kv_pool_limit(64 << 20);
        let mut cache = half.new_cache();
        cache.reserve(prompt.len() + steps.len())?;
        let got = run(&half, &mut cache, &prompt, &steps)?;
        drop(cache);
        assert_eq!(
            gpt::kv_pool_bytes(),
            2 * cfg.n_layer * cfg.n_embd * 128 * 2,
            "f16 blocks"
        );
        gpt::set_kv_pool_limit(0);
        let diff = (reference.iter().flatten())
            .zip(got.iter().flatten())
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let scale = reference.iter().flatten().fold(0f32, |m, x| m.max(x.abs()));
        assert!(
            diff > 0.0 && diff < 1e-2 * scale,
            "hs {}: f16 cache's logits {diff} from f32's (largest {scale})",
            n_embd / n_head
        );
        // The prompt token by token: its last logits equal the prompt's in one step.
        let mut one = half.new_cache();
        let by_token = run(&half, &mut one, &prompt[..1], &prompt[1..])?;
        assert_eq!(by_token.last(), got.first());
        let refused = model.clone().with_kv_cache_dtype(candle_core::DType::BF16);
        assert!(refused.is_err_and(|e| e.to_string().contains("BF16")));
        // `auto`: f32 beside f32 weights, f16 beside quantized ones.
        let quantized = model.clone().with_weight_format(gpt::WeightFormat::Q8_0)?;
        assert_eq!(gpt::KvCacheDtype::Auto.resolve(&model), candle_core::DType::F32);
        assert_eq!(gpt::KvCacheDtype::Auto.resolve(&quantized), candle_core::DType::F16);
        assert!("bf16"
            .parse::<gpt::KvCacheDtype>()
            .is_err_and(|e| e.to_string().contains("bf16")));
    }
    Ok(())
}
