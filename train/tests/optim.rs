//! Gradient accumulation, clipping and the optimizer on a real (tiny) model.

use candle_core::{Device, Tensor, Var};
use candle_nn::VarMap;
use gpt::{Config, Gpt};
use gpt_train::init::{named_vars, seeded_var_builder};
use gpt_train::optim::{clip_grad_norm, global_norm, AdamW, AdamWConfig};
use gpt_train::step::accumulate_grads;

fn model(seed: u64) -> anyhow::Result<(Gpt, Vec<(String, Var)>)> {
    let varmap = VarMap::new();
    let cfg = Config::tiny(50);
    let model = Gpt::new(seeded_var_builder(&varmap, seed, &Device::Cpu), &cfg)?;
    Ok((model, named_vars(&varmap)?))
}

fn batch(rows: usize, seq: usize, offset: u32) -> anyhow::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..rows * (seq + 1)).map(|i| (i as u32 * 7 + offset) % 50).collect();
    let t = Tensor::from_vec(ids, (rows, seq + 1), &Device::Cpu)?;
    Ok((t.narrow(1, 0, seq)?, t.narrow(1, 1, seq)?))
}

use gpt_test_support as support;
use support::max_abs_diff;

const ADAMW: AdamWConfig = AdamWConfig {
    beta1: 0.9,
    beta2: 0.99,
    eps: 1e-8,
    weight_decay: 0.1,
};

#[test]
fn same_seed_same_weights_different_seed_different_weights() -> anyhow::Result<()> {
    let (_, a) = model(1)?;
    let (_, b) = model(1)?;
    let (_, c) = model(2)?;
    let wte = |v: &[(String, Var)]| {
        v.iter()
            .find(|(n, _)| n == "wte.weight")
            .map(|(_, v)| v.as_tensor().clone())
    };
    let (a, b, c) = (wte(&a).unwrap(), wte(&b).unwrap(), wte(&c).unwrap());
    assert_eq!(max_abs_diff(&a, &b)?, 0.0);
    assert!(max_abs_diff(&a, &c)? > 1e-3);
    Ok(())
}

#[test]
fn four_micro_batches_of_8_update_like_one_batch_of_32() -> anyhow::Result<()> {
    let (x, y) = batch(32, 16, 3)?;
    let micro: Vec<gpt_train::data::Batch> = (0..4)
        .map(|i| Ok((x.narrow(0, i * 8, 8)?, y.narrow(0, i * 8, 8)?).into()))
        .collect::<anyhow::Result<_>>()?;

    let (model_a, vars_a) = model(7)?;
    let (model_b, vars_b) = model(7)?;
    let plain_a: Vec<Var> = vars_a.iter().map(|(_, v)| v.clone()).collect();
    let plain_b: Vec<Var> = vars_b.iter().map(|(_, v)| v.clone()).collect();
    let (loss_a, grads_a) = accumulate_grads(
        &model_a,
        &plain_a,
        &[(x.clone(), y.clone()).into()],
        1,
        Default::default(),
    )?;
    let (loss_b, grads_b) = accumulate_grads(&model_b, &plain_b, &micro, 1, Default::default())?;
    assert!((loss_a - loss_b).abs() < 1e-5, "{loss_a} vs {loss_b}");
    for ((name, _), (ga, gb)) in vars_a.iter().zip(grads_a.iter().zip(&grads_b)) {
        assert!(max_abs_diff(ga, gb)? < 1e-5, "gradient of {name}");
    }
    assert!(global_norm(&grads_a)? > 1e-3, "the gradients are not trivially zero");
    // Sharding rows across threads (uneven shards included) gives the same gradients.
    for shards in [2, 3, 5] {
        let (loss_s, grads_s) = accumulate_grads(
            &model_a,
            &plain_a,
            &[(x.clone(), y.clone()).into()],
            shards,
            Default::default(),
        )?;
        assert!((loss_a - loss_s).abs() < 1e-5, "{shards} shards: {loss_a} vs {loss_s}");
        for ((name, _), (ga, gs)) in vars_a.iter().zip(grads_a.iter().zip(&grads_s)) {
            assert!(max_abs_diff(ga, gs)? < 1e-5, "{shards} shards: gradient of {name}");
        }
    }

    let mut opt_a = AdamW::new(vars_a.clone(), ADAMW)?;
    let mut opt_b = AdamW::new(vars_b.clone(), ADAMW)?;
    opt_a.step(&grads_a, 1e-3)?;
    opt_b.step(&grads_b, 1e-3)?;
    for ((name, a), (_, b)) in vars_a.iter().zip(&vars_b) {
        assert!(max_abs_diff(a.as_tensor(), b.as_tensor())? < 1e-5, "updated {name}");
    }
    Ok(())
}

#[test]
fn clipping_bounds_the_global_norm_and_keeps_the_direction() -> anyhow::Result<()> {
    let (model, vars) = model(3)?;
    let plain: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
    let (_, grads) = accumulate_grads(&model, &plain, &[batch(4, 16, 1)?.into()], 1, Default::default())?;
    let norm = global_norm(&grads)?;
    assert!(norm > 0.1, "{norm}");

    let mut clipped = grads.clone();
    let before = clip_grad_norm(&mut clipped, norm / 4.0)?;
    assert!((before - norm).abs() < 1e-9);
    let after = global_norm(&clipped)?;
    assert!(
        after <= norm / 4.0 + 1e-6 && after > norm / 4.0 * 0.999,
        "{after} vs {}",
        norm / 4.0
    );
    let ratio = (&clipped[0] / &grads[0])?.flatten_all()?.to_vec1::<f32>()?;
    assert!(
        ratio.iter().filter(|r| r.is_finite()).all(|r| (r - 0.25).abs() < 1e-3),
        "direction kept"
    );

    let mut untouched = grads.clone();
    clip_grad_norm(&mut untouched, norm * 2.0)?;
    assert_eq!(max_abs_diff(&untouched[0], &grads[0])?, 0.0);
    Ok(())
}

/// `step_clipped` (gpt-train's update) is clipping, then `step`, to the bit.
#[test]
fn a_clipped_step_is_clipping_then_a_step() -> anyhow::Result<()> {
    let mut weights = Vec::new();
    for fused in [true, false] {
        let (model, vars) = model(3)?;
        let plain: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
        let (_, grads) = accumulate_grads(&model, &plain, &[batch(4, 16, 1)?.into()], 1, Default::default())?;
        let norm = global_norm(&grads)?;
        let mut opt = AdamW::new(vars.clone(), ADAMW)?;
        for _ in 0..2 {
            if fused {
                opt.step_clipped(&grads, 1e-3, norm / 3.0)?;
            } else {
                let mut clipped = grads.clone();
                clip_grad_norm(&mut clipped, norm / 3.0)?;
                opt.step(&clipped, 1e-3)?;
            }
        }
        weights.push(plain.iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>());
    }
    for (a, b) in weights[0].iter().zip(&weights[1]) {
        assert_eq!(max_abs_diff(a, b)?, 0.0);
    }
    Ok(())
}

#[test]
fn weight_decay_spares_biases_and_layer_norms() -> anyhow::Result<()> {
    let (_, vars) = model(5)?;
    let before: Vec<Tensor> = vars
        .iter()
        .map(|(_, v)| v.as_tensor().copy())
        .collect::<candle_core::Result<_>>()?;
    let zeros: Vec<Tensor> = vars
        .iter()
        .map(|(_, v)| v.as_tensor().zeros_like())
        .collect::<candle_core::Result<_>>()?;
    let mut opt = AdamW::new(
        vars.clone(),
        AdamWConfig {
            weight_decay: 0.5,
            ..ADAMW
        },
    )?;
    opt.step(&zeros, 0.1)?; // zero gradients: only decay moves a parameter
    for ((name, var), old) in vars.iter().zip(&before) {
        let moved = max_abs_diff(var.as_tensor(), old)? > 0.0;
        assert_eq!(moved, var.rank() >= 2, "{name}");
    }
    Ok(())
}

/// Gradients and optimizer moments must not carry autograd graphs: a moment that remembers its
/// previous value's graph chains every step's activations (this leaked ~120 MB per step once).
#[test]
fn gradients_and_moments_hold_no_graph() -> anyhow::Result<()> {
    let (model, vars) = model(11)?;
    let plain: Vec<Var> = vars.iter().map(|(_, v)| v.clone()).collect();
    let mut opt = AdamW::new(vars, ADAMW)?;
    for step in 0..3 {
        let (_, grads) = accumulate_grads(&model, &plain, &[batch(4, 16, step)?.into()], 2, Default::default())?;
        assert!(grads.iter().all(|g| !g.track_op()), "a gradient keeps its graph");
        opt.step(&grads, 1e-3)?;
    }
    assert!(
        opt.state_tensors().iter().all(|(_, t)| !t.track_op()),
        "a moment keeps a graph"
    );
    Ok(())
}

/// Muon against PyTorch's own `torch.optim.Muon` over three steps on a wide, a tall and a square
/// matrix, with both of its scales: each step's change of every parameter within 5% of
/// PyTorch's largest (PyTorch runs the Newton-Schulz iteration in bf16, this one in f32), while
/// Muon without Nesterov's momentum, or with the other scale, is further off than that.
#[test]
#[cfg_attr(
    not(gpt_test_peft),
    ignore = "needs GPT_TEST_PYTHON, a Python with torch 2.9 or later (torch.optim.Muon)"
)]
fn muon_equals_pytorchs() -> anyhow::Result<()> {
    use gpt_train::optim::muon::{Blocks, Muon, MuonConfig, MuonScale};
    let shapes = [(24, 40), (40, 24), (16, 16)];
    let values = |len: usize, seed: usize| support::uniform(len, seed as u64);
    let start: Vec<Vec<f32>> = shapes
        .iter()
        .enumerate()
        .map(|(k, &(r, c))| values(r * c, k).iter().map(|v| v * 0.05).collect())
        .collect();
    let grads: Vec<Vec<Vec<f32>>> = (0..3)
        .map(|step| {
            shapes
                .iter()
                .enumerate()
                .map(|(k, &(r, c))| values(r * c, 10 + 3 * step + k))
                .collect()
        })
        .collect();
    let (lr, weight_decay, momentum) = (0.02, 0.1, 0.95);
    let ours = |scale: MuonScale, nesterov: bool| -> anyhow::Result<Vec<Vec<Vec<f32>>>> {
        let vars: Vec<(String, Var, Blocks)> = shapes
            .iter()
            .zip(&start)
            .enumerate()
            .map(|(k, (&(r, c), v))| {
                let var = Var::from_tensor(&Tensor::from_vec(v.clone(), (r, c), &Device::Cpu)?)?;
                Ok((
                    format!("w{k}"),
                    var,
                    Blocks {
                        in_out: false,
                        outputs: vec![r],
                    },
                ))
            })
            .collect::<anyhow::Result<_>>()?;
        let cfg = MuonConfig {
            momentum,
            nesterov,
            ns_steps: 5,
            scale,
            weight_decay,
            autocast: gpt::Autocast::Off,
        };
        let mut muon = Muon::new(vars, cfg)?;
        let mut steps = Vec::new();
        for step in &grads {
            let g = step
                .iter()
                .zip(&shapes)
                .map(|(g, &s)| Ok(Tensor::from_vec(g.clone(), s, &Device::Cpu)?))
                .collect::<anyhow::Result<Vec<_>>>()?;
            muon.step(&g, lr, 1.0, |_| true)?;
            steps.push(
                muon.vars()
                    .iter()
                    .map(|v| Ok(v.as_tensor().flatten_all()?.to_vec1::<f32>()?))
                    .collect::<anyhow::Result<_>>()?,
            );
        }
        Ok(steps)
    };
    let theirs = |adjust: &str| -> anyhow::Result<Vec<Vec<Vec<f32>>>> {
        let spec = serde_json::json!({
            "params": shapes.iter().zip(&start).map(|(&(r, c), v)| serde_json::json!({"shape": [r, c], "values": v})).collect::<Vec<_>>(),
            "grads": grads, "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
            "nesterov": true, "adjust_lr_fn": adjust,
        });
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/muon_reference.py");
        let mut child = std::process::Command::new(support::python())
            .arg(script)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        use std::io::Write;
        child
            .stdin
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdin"))?
            .write_all(spec.to_string().as_bytes())?;
        let out = child.wait_with_output()?;
        anyhow::ensure!(
            out.status.success(),
            "muon_reference.py: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    // The worst difference of each step's change of a parameter, over PyTorch's largest change.
    let off = |a: &[Vec<Vec<f32>>], b: &[Vec<Vec<f32>>]| -> f32 {
        let mut worst = 0f32;
        for step in 0..a.len() {
            for k in 0..shapes.len() {
                let before = |run: &[Vec<Vec<f32>>]| {
                    if step == 0 {
                        start[k].clone()
                    } else {
                        run[step - 1][k].clone()
                    }
                };
                let (a0, b0) = (before(a), before(b));
                let da: Vec<f32> = a[step][k].iter().zip(&a0).map(|(x, y)| x - y).collect();
                let db: Vec<f32> = b[step][k].iter().zip(&b0).map(|(x, y)| x - y).collect();
                let largest = db.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = da.iter().zip(&db).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                worst = worst.max(diff / largest);
            }
        }
        worst
    };
    for (scale, adjust, other) in [
        (MuonScale::Original, "original", MuonScale::MatchAdamw),
        (MuonScale::MatchAdamw, "match_rms_adamw", MuonScale::Original),
    ] {
        let reference = theirs(adjust)?;
        let worst = off(&ours(scale, true)?, &reference);
        assert!(worst < 0.05, "{adjust}: each step's change {worst} off PyTorch's");
        let plain = off(&ours(scale, false)?, &reference);
        assert!(
            plain > 0.1,
            "{adjust}: without Nesterov {plain} off, as close as with it"
        );
        let scaled = off(&ours(other, true)?, &reference);
        assert!(
            scaled > 0.1,
            "{adjust}: the other scale {scaled} off, as close as this one"
        );
    }
    Ok(())
}
