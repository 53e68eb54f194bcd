//! bf16 mixed precision (`gpt-train --dtype bf16`): the same loss and gradients as f32 to bf16's
//! precision, and training still learns. Its own test binary: the setting is process-wide.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use gpt::{Config, Gpt};
use gpt_train::init::seeded_var_builder;
use gpt_train::optim::{AdamW, AdamWConfig};
use gpt_train::step::accumulate_grads;

fn cosine(a: &Tensor, b: &Tensor) -> anyhow::Result<f64> {
    let (a, b) = (
        a.flatten_all()?.to_dtype(DType::F64)?,
        b.flatten_all()?.to_dtype(DType::F64)?,
    );
    let dot = (&a * &b)?.sum_all()?.to_scalar::<f64>()?;
    let norms = a.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt() * b.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
    Ok(dot / norms)
}

#[test]
fn bf16_matmuls_match_f32_and_still_learn() -> anyhow::Result<()> {
    let varmap = VarMap::new();
    let cfg = Config {
        n_positions: 32,
        ..Config::tiny(50)
    };
    let model = Gpt::new(seeded_var_builder(&varmap, 3, &Device::Cpu), &cfg)?;
    let named = gpt_train::init::named_vars(&varmap)?;
    let vars: Vec<Var> = named.iter().map(|(_, v)| v.clone()).collect();
    let ids: Vec<u32> = (0..4 * 33).map(|i| (i as u32 * 7 + i as u32 / 5) % 50).collect();
    let t = Tensor::from_vec(ids, (4, 33), &Device::Cpu)?;
    let batch = [(t.narrow(1, 0, 32)?, t.narrow(1, 1, 32)?).into()];

    let (loss_f32, grads_f32) = accumulate_grads(&model, &vars, &batch, 1, Default::default())?;
    // The same variables, multiplied in bf16.
    let model = model.with_autocast(gpt::Autocast::Bf16);
    let (loss_bf16, grads_bf16) = accumulate_grads(&model, &vars, &batch, 1, Default::default())?;
    assert!(loss_f32 != loss_bf16, "autocast changed nothing: {loss_f32}");
    assert!(
        (loss_f32 - loss_bf16).abs() < 1e-2 * loss_f32,
        "f32 {loss_f32}, bf16 {loss_bf16}"
    );
    for ((name, _), (a, b)) in named.iter().zip(grads_f32.iter().zip(&grads_bf16)) {
        assert_eq!(b.dtype(), DType::F32, "gradient {name}");
        let c = cosine(a, b)?;
        assert!(c > 0.99, "gradient {name}: cosine similarity {c}");
    }

    let adamw = AdamWConfig {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    let mut opt = AdamW::new(named, adamw)?;
    let mut loss = loss_bf16;
    for _ in 0..20 {
        let (l, grads) = accumulate_grads(&model, &vars, &batch, 1, Default::default())?;
        opt.step(&grads, 1e-2)?;
        loss = l;
    }
    assert!(
        loss < 0.7 * loss_bf16,
        "20 bf16 steps on one batch: {loss_bf16} -> {loss}"
    );
    Ok(())
}
