//! The tape's backward pass (`gpt_kernels::tape`, what `gpt-train` runs on the CPU) against candle's
//! `backward` over the same forward pass: every parameter's gradient equal, value for value, in
//! shapes and settings that take each kind of entry (dropout at every site, the residual add
//! without dropout, a position table longer than the windows, a fixed sinusoidal table,
//! bias-free layers, label smoothing, bf16 products); and an op run outside the tape refused.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use gpt::config::{Activation, PositionEmbedding};
use gpt::{Autocast, Config, Dropout, Gpt};

/// The gradients of `weight · loss` for every variable, by candle's backward and by the tape.
fn both_ways(
    model: &Gpt,
    vars: &[Var],
    x: &Tensor,
    y: &Tensor,
    train: Dropout,
    eps: f32,
) -> anyhow::Result<[Vec<Option<Tensor>>; 2]> {
    let weight = 0.375;
    let leaves: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let loss = model.loss(x, y, Some(train), eps)?;
    let mut grads = (loss * weight as f64)?.backward()?;
    let candle = leaves.iter().map(|t| grads.remove(t)).collect();
    let (loss, tape) = gpt_kernels::tape::record(|| model.loss(x, y, Some(train), eps))?;
    let on_tape = tape.backward(&loss, weight, &leaves)?;
    Ok([candle, on_tape])
}

fn check(cfg: &Config, autocast: Autocast, rows: usize, t: usize, eps: f32) -> anyhow::Result<()> {
    let (varmap, model) = trainable_model(cfg)?;
    let model = model.with_autocast(autocast);
    compare(cfg, &model, &varmap, rows, t, eps)
}

/// [`common::random_model`] as `gpt-train` builds it ([`Gpt::new_trainable`]: the families'
/// stacked q/k/v and gate/up as variables of their own).
fn trainable_model(cfg: &Config) -> anyhow::Result<(VarMap, Gpt)> {
    let varmap = VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let model = Gpt::new_trainable(vb, cfg)?;
    for var in varmap.all_vars() {
        let noise = Tensor::randn(0f32, 0.3, var.shape(), &Device::Cpu)?;
        var.set(&(var.as_tensor() + noise)?)?;
    }
    Ok((varmap, model))
}

/// The gradients of `varmap`'s variables in `model`, by candle's backward and by the tape: all
/// reached, value for value.
fn compare(cfg: &Config, model: &Gpt, varmap: &VarMap, rows: usize, t: usize, eps: f32) -> anyhow::Result<()> {
    assert!(model.trains_on_tape(), "{cfg:?}");
    let mut vars = varmap.all_vars();
    vars.sort_by_key(|v| v.elem_count()); // a fixed order; the names do not matter here
    let ids = common::tokens(rows * (t + 1), cfg.vocab_size, 7);
    let windows: Vec<Vec<u32>> = ids.chunks(t + 1).map(|w| w.to_vec()).collect();
    let batch = common::batch(&windows)?;
    let (x, y) = (batch.narrow(1, 0, t)?, batch.narrow(1, 1, t)?);
    // A shard that starts at row 3 of its batch: every mask is drawn from there.
    let train = Dropout { key: 11, first_row: 3 };
    let [candle, on_tape] = both_ways(model, &vars, &x, &y, train, eps)?;
    let mut reached = 0;
    for (i, (a, b)) in candle.iter().zip(&on_tape).enumerate() {
        let shape = vars[i].shape();
        match (a, b) {
            (Some(a), Some(b)) => {
                let (a, b) = (a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
                let differ = a.iter().zip(&b).filter(|(p, q)| p != q).count();
                assert_eq!(
                    differ,
                    0,
                    "{cfg:?}: {differ} of {} values differ in a {shape:?} gradient",
                    a.len()
                );
                reached += 1;
            }
            (None, None) => {}
            _ => panic!("{cfg:?}: a {shape:?} variable has a gradient one way only"),
        }
    }
    assert_eq!(reached, vars.len(), "{cfg:?}: every variable gets a gradient");
    Ok(())
}

#[test]
fn a_lora_adapters_gradients_on_the_tape_are_candles() -> anyhow::Result<()> {
    let cfg = Config {
        resid_pdrop: 0.1,
        ..Config::tiny(50)
    };
    let (base_vars, _) = common::random_model(&cfg)?;
    // The base frozen, as a LoRA run holds it: its weights as plain tensors.
    let frozen: std::collections::HashMap<String, Tensor> = base_vars
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap poisoned"))?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    let base = Gpt::new(
        candle_nn::VarBuilder::from_tensors(frozen, DType::F32, &Device::Cpu),
        &cfg,
    )?;
    let (x, y) = (
        common::batch(&[common::tokens(16, 50, 3)])?,
        common::batch(&[common::tokens(16, 50, 4)])?,
    );
    let train = Some(Dropout { key: 5, first_row: 0 });
    let mut losses = Vec::new();
    // PEFT's lora_dropout (of the update's input) too: its masks on the tape as well.
    for lora_dropout in [0.0, 0.25] {
        let adapter_vars = VarMap::new();
        let config = gpt::lora::LoraConfig {
            r: 2,
            lora_alpha: 5.0,
            lora_dropout,
            target_modules: vec!["c_attn".into(), "c_proj".into(), "c_fc".into()],
            layers_to_transform: None,
            use_rslora: false,
            base_model_name_or_path: None,
        };
        let vb = candle_nn::VarBuilder::from_varmap(&adapter_vars, DType::F32, &Device::Cpu);
        let adapter = gpt::Adapter::init(config, &cfg, &vb)?;
        // B starts at zero, which would leave A without a gradient: both random here, the same
        // in both runs.
        let mut vars = adapter_vars
            .data()
            .lock()
            .map_err(|_| anyhow::anyhow!("varmap poisoned"))?
            .clone();
        let mut names: Vec<_> = vars.keys().cloned().collect();
        names.sort();
        for (i, name) in names.iter().enumerate() {
            let var = vars.remove(name).ok_or_else(|| anyhow::anyhow!("{name}"))?;
            let n = var.elem_count();
            let values: Vec<f32> = common::tokens(n, 1000, i as u64)
                .iter()
                .map(|&v| v as f32 / 1000.0 - 0.5)
                .collect();
            var.set(&Tensor::from_vec(values, var.shape(), &Device::Cpu)?)?;
        }
        let mut model = base.clone();
        model.set_adapter(Some(&adapter))?;
        compare(&cfg, &model, &adapter_vars, 3, 16, 0.0)?;
        let trained = model.loss(&x, &y, train, 0.0)?.to_scalar::<f32>()?;
        let evaluated = model.loss(&x, &y, None, 0.0)?.to_scalar::<f32>()?;
        losses.push((trained, evaluated));
    }
    // Dropout moves the training loss, and only the training loss.
    assert_ne!(losses[0].0, losses[1].0, "lora_dropout changed nothing while training");
    assert_eq!(losses[0].1, losses[1].1, "lora_dropout changed an evaluation");
    Ok(())
}

#[test]
fn the_tapes_gradients_are_candles() -> anyhow::Result<()> {
    let dropped = Config {
        resid_pdrop: 0.1,
        embd_pdrop: 0.1,
        attn_pdrop: 0.1,
        ..Config::tiny(50)
    };
    check(&dropped, Autocast::Off, 4, 24, 0.1)?;
    // Without dropout the residual adds are plain adds; windows shorter than the table.
    check(&Config::tiny(50), Autocast::Off, 3, 64, 0.0)?;
    check(
        &Config {
            bias: false,
            ..Config::tiny(50)
        },
        Autocast::Off,
        2,
        16,
        0.0,
    )?;
    check(&dropped, Autocast::Bf16, 2, 16, 0.0)?;
    Ok(())
}

/// A fixed (sinusoidal) position table is a constant: no gradient, and no error.
/// The other families train on the tape too (RMSNorm, rotations, grouped heads, QK-norm, q/k/v
/// biases, Arcee's ungated squared-ReLU MLP, Gemma's norms after each branch and scaled embedding, an untied head, dropout at
/// every site, bf16 products): every gradient candle's, value for value. Soft-capped scores
/// (Gemma 2) and a sliding window shorter than the context keep candle's backward pass.
#[test]
fn the_families_gradients_on_the_tape_are_candles() -> anyhow::Result<()> {
    use gpt::arch::{from_scratch, Family};
    let shape = Config {
        n_embd: 48,
        n_head: 6,
        n_layer: 2,
        resid_pdrop: 0.1,
        attn_pdrop: 0.1,
        embd_pdrop: 0.1,
        ..Config::tiny(40)
    };
    for (family, kv) in [
        (Family::Llama, Some(2)),
        (Family::Qwen2, Some(3)),
        (Family::Qwen3, Some(1)),
        (Family::Gemma3, Some(2)),
        (Family::Arcee, Some(2)),
    ] {
        let mut cfg = from_scratch(family, &shape, kv)?;
        cfg.n_inner = Some(64);
        check(&cfg, Autocast::Off, 3, 16, 0.0)?;
        check(&cfg, Autocast::Bf16, 2, 8, 0.1)?;
        let untied = Config {
            tie_word_embeddings: false,
            ..cfg.clone()
        };
        check(&untied, Autocast::Off, 2, 8, 0.0)?;
    }
    for (family, window) in [(Family::Gemma2, None), (Family::Mistral, Some(8))] {
        let mut cfg = from_scratch(family, &shape, Some(2))?;
        cfg.variant.sliding_window = window;
        let (_, model) = trainable_model(&cfg)?;
        assert!(!model.trains_on_tape(), "{family:?}");
    }
    Ok(())
}

#[test]
fn a_fixed_position_table_gets_no_gradient() -> anyhow::Result<()> {
    let cfg = Config {
        position_embedding: PositionEmbedding::Sinusoidal,
        ..Config::tiny(40)
    };
    check(&cfg, Autocast::Off, 2, 16, 0.0)
}

/// An op that the forward pass runs outside the tape, between two that it records, is an error
/// of the backward pass, not a gradient lost.
#[test]
fn an_op_outside_the_tape_is_refused() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let w = varmap.get(
        (8, 8),
        "w",
        candle_nn::Init::Randn { mean: 0.0, stdev: 1.0 },
        DType::F32,
        &dev,
    )?;
    let b = varmap.get(8, "b", candle_nn::Init::Const(0.5), DType::F32, &dev)?;
    let x = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
    let (y, tape) = gpt_kernels::tape::record(|| -> candle_core::Result<Tensor> {
        let h = gpt_kernels::affine(&x, &w, &b, Autocast::Off)?.relu()?; // relu: not on the tape
        let targets = Tensor::new(&[1u32, 2, 3, 4], &dev)?;
        gpt_kernels::cross_entropy(&gpt_kernels::affine(&h, &w, &b, Autocast::Off)?, &targets, 0.0)
    })?;
    let err = tape
        .backward(&y, 1.0, &[&w, &b])
        .expect_err("relu is outside the tape")
        .to_string();
    assert!(err.contains("outside the tape") && err.contains("[4, 8]"), "{err}");
    Ok(())
}

/// A piece of the pass in candle's ops (`tape::candle_ops`: the LM head and its loss on a GPU),
/// between the tape's ops, reading a weight that a tape op reads too (a tied one) and running a
/// tape op of its own unrecorded: every gradient is candle's backward's over the same pass, and
/// nothing is refused.
#[test]
fn candle_ops_on_the_tape_give_candles_gradients() -> anyhow::Result<()> {
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let init = candle_nn::Init::Randn { mean: 0.0, stdev: 1.0 };
    let w = varmap.get((8, 8), "w", init, DType::F32, &dev)?;
    let b = varmap.get(8, "b", candle_nn::Init::Const(0.5), DType::F32, &dev)?;
    let x = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
    let targets = Tensor::new(&[1u32, 2, 3, 4], &dev)?;
    let forward = || -> candle_core::Result<Tensor> {
        let h = gpt_kernels::gelu(&gpt_kernels::affine(&x, &w, &b, Autocast::Off)?)?;
        gpt_kernels::tape::candle_ops(&[&h, &w], |a| {
            let logits = (a[0].matmul(&a[1].t()?)?.relu()? * 3.0)?; // relu: no tape op
            gpt_kernels::cross_entropy(&logits, &targets, 0.1) // a tape op, unrecorded here
        })
    };
    let leaves = [&w, &b];
    let mut grads = (forward()? * 0.25)?.backward()?;
    let (loss, tape) = gpt_kernels::tape::record(forward)?;
    let on_tape = tape.backward(&loss, 0.25, &leaves)?;
    for (leaf, got) in leaves.iter().zip(on_tape) {
        let got = got.ok_or_else(|| anyhow::anyhow!("no gradient on the tape"))?;
        let want = grads
            .remove(leaf)
            .ok_or_else(|| anyhow::anyhow!("no gradient from candle"))?;
        let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            scale > 0.0 && diff <= 1e-6 * scale,
            "{:?}: {diff} of {scale}",
            leaf.shape()
        );
    }
    Ok(())
}

/// The activations that the tape does not record keep candle's backward.
#[test]
fn other_activations_train_on_candles_backward() -> anyhow::Result<()> {
    for activation in [Activation::Gelu, Activation::Relu] {
        let cfg = Config {
            activation_function: activation,
            ..Config::tiny(30)
        };
        let (_, model) = common::random_model(&cfg)?;
        assert!(!model.trains_on_tape(), "{activation:?}");
    }
    Ok(())
}

/// The gradients of `vars` from `loss` recorded on the tape.
fn tape_grads(vars: &[Var], loss: impl FnOnce() -> gpt::Result<Tensor>) -> anyhow::Result<Vec<Vec<f32>>> {
    let leaves: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let (loss, tape) = gpt_kernels::tape::record(loss)?;
    let grads = tape.backward(&loss, 0.5, &leaves)?;
    grads
        .into_iter()
        .map(|g| {
            Ok(g.ok_or_else(|| anyhow::anyhow!("a variable without a gradient"))?
                .flatten_all()?
                .to_vec1::<f32>()?)
        })
        .collect()
}

/// Activation checkpointing (every block run again in the backward pass) gives the tape's
/// gradients bit for bit: with dropout at every site, under bf16 products, over packed windows,
/// and for a LoRA adapter (with its input dropout) over a frozen base.
#[test]
fn activation_checkpointing_gives_the_same_gradients_bit_for_bit() -> anyhow::Result<()> {
    let cfg = Config {
        resid_pdrop: 0.1,
        embd_pdrop: 0.1,
        attn_pdrop: 0.1,
        ..Config::tiny(50)
    };
    let (x, y) = (
        common::batch(&[common::tokens(16, 50, 3), common::tokens(16, 50, 5)])?,
        common::batch(&[common::tokens(16, 50, 4), common::tokens(16, 50, 6)])?,
    );
    let positions = Tensor::new(
        &[
            [0u32, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3],
        ],
        &Device::Cpu,
    )?;
    let train = Some(Dropout { key: 9, first_row: 1 });
    let (varmap, model) = common::random_model(&cfg)?;
    let mut vars = varmap.all_vars();
    vars.sort_by_key(|v| v.elem_count());
    for autocast in [Autocast::Off, Autocast::Bf16] {
        let plain = model.clone().with_autocast(autocast);
        let again = plain.clone().with_activation_checkpointing(true);
        assert!(again.trains_on_tape());
        let want = tape_grads(&vars, || plain.loss(&x, &y, train, 0.0))?;
        let got = tape_grads(&vars, || again.loss(&x, &y, train, 0.0))?;
        assert!(got == want, "{autocast:?}: checkpointing changed the gradients");
        let want = tape_grads(&vars, || plain.loss_at(&x, &positions, &y, train, 0.0))?;
        let got = tape_grads(&vars, || again.loss_at(&x, &positions, &y, train, 0.0))?;
        assert!(got == want, "{autocast:?}, packed: checkpointing changed the gradients");
    }
    // A LoRA adapter on the frozen base (the model's own weights, now plain tensors).
    let adapter_vars = VarMap::new();
    let config = gpt::lora::LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        lora_dropout: 0.2,
        target_modules: vec!["c_attn".into(), "c_fc".into()],
        layers_to_transform: None,
        use_rslora: false,
        base_model_name_or_path: None,
    };
    let vb = candle_nn::VarBuilder::from_varmap(&adapter_vars, DType::F32, &Device::Cpu);
    let adapter = gpt::Adapter::init(config, &cfg, &vb)?;
    for var in adapter_vars.all_vars() {
        var.set(&Tensor::randn(0f32, 0.5, var.shape(), &Device::Cpu)?)?;
    }
    let frozen: std::collections::HashMap<String, Tensor> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap poisoned"))?
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().detach()))
        .collect();
    let mut plain = Gpt::new(
        candle_nn::VarBuilder::from_tensors(frozen, DType::F32, &Device::Cpu),
        &cfg,
    )?;
    plain.set_adapter(Some(&adapter))?;
    let again = plain.clone().with_activation_checkpointing(true);
    let mut lora_vars = adapter_vars.all_vars();
    lora_vars.sort_by_key(|v| v.elem_count());
    let want = tape_grads(&lora_vars, || plain.loss(&x, &y, train, 0.0))?;
    let got = tape_grads(&lora_vars, || again.loss(&x, &y, train, 0.0))?;
    assert!(got == want, "LoRA: checkpointing changed the gradients");
    // Not training (evaluation), nothing is checkpointed and the loss is the same.
    assert_eq!(
        plain.loss(&x, &y, None, 0.0)?.to_scalar::<f32>()?,
        again.loss(&x, &y, None, 0.0)?.to_scalar::<f32>()?
    );
    Ok(())
}

/// `Gpt::detached` (evaluation while training) computes the same loss from the same weights,
/// and builds no graph: its result tracks nothing, for a model of variables and for a LoRA
/// adapter's.
#[test]
fn a_detached_model_computes_the_same_and_tracks_nothing() -> anyhow::Result<()> {
    let cfg = Config::tiny(50);
    let (_, model) = common::random_model(&cfg)?;
    let (x, y) = (
        common::batch(&[common::tokens(16, 50, 3)])?,
        common::batch(&[common::tokens(16, 50, 4)])?,
    );
    let vb_vars = VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&vb_vars, DType::F32, &Device::Cpu);
    let config = gpt::lora::LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        lora_dropout: 0.0,
        target_modules: vec!["c_attn".into(), "c_fc".into()],
        layers_to_transform: None,
        use_rslora: false,
        base_model_name_or_path: None,
    };
    let adapter = gpt::Adapter::init(config, &cfg, &vb)?;
    for var in vb_vars.all_vars() {
        var.set(&Tensor::randn(0f32, 0.5, var.shape(), &Device::Cpu)?)?;
    }
    let mut adapted = model.clone();
    adapted.set_adapter(Some(&adapter))?;
    for (what, m) in [("variables", &model), ("LoRA", &adapted)] {
        let tracked = m.forward(&x, None)?;
        assert!(tracked.track_op(), "{what}: the test needs a model that tracks");
        let detached = m.detached().forward(&x, None)?;
        assert!(!detached.track_op(), "{what}: the detached model built a graph");
        let (a, b) = (
            tracked.flatten_all()?.to_vec1::<f32>()?,
            detached.flatten_all()?.to_vec1::<f32>()?,
        );
        assert!(a == b, "{what}: other logits");
        let (a, b) = (m.loss(&x, &y, None, 0.0)?, m.detached().loss(&x, &y, None, 0.0)?);
        assert_eq!(a.to_scalar::<f32>()?, b.to_scalar::<f32>()?, "{what}");
    }
    Ok(())
}

/// `backward_each` (what a data-parallel rank sums during the backward pass) hands over every
/// parameter's gradient once, the tape's bit for bit, each as soon as it is final: the last
/// block's before the first block's, and the token embedding (read first, and again by the tied
/// LM head) after every block's.
#[test]
fn gradients_are_handed_over_once_as_soon_as_final_and_equal_the_tapes() -> anyhow::Result<()> {
    let cfg = Config {
        resid_pdrop: 0.1,
        ..Config::tiny(50)
    };
    assert!(cfg.n_layer >= 2);
    let (varmap, model) = common::random_model(&cfg)?;
    let named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .clone()
        .into_iter()
        .collect();
    let leaves: Vec<&Tensor> = named.iter().map(|(_, v)| v.as_tensor()).collect();
    let (x, y) = (
        common::batch(&[common::tokens(16, 50, 3), common::tokens(16, 50, 5)])?,
        common::batch(&[common::tokens(16, 50, 4), common::tokens(16, 50, 6)])?,
    );
    let train = Some(Dropout { key: 5, first_row: 0 });
    let (loss, tape) = gpt_kernels::tape::record(|| model.loss(&x, &y, train, 0.0))?;
    let whole = tape.backward(&loss, 0.5, &leaves)?;
    let (loss, tape) = gpt_kernels::tape::record(|| model.loss(&x, &y, train, 0.0))?;
    let mut order = Vec::new();
    let mut each: Vec<Option<Tensor>> = vec![None; leaves.len()];
    tape.backward_each(&loss, 0.5, &leaves, |i, g| {
        order.push(i);
        each[i] = g;
        Ok(())
    })?;
    let mut seen = order.clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..leaves.len()).collect::<Vec<_>>(), "each leaf once");
    for (i, (a, b)) in whole.iter().zip(&each).enumerate() {
        let (Some(a), Some(b)) = (a, b) else {
            panic!("{} reached by one pass only", named[i].0)
        };
        assert_eq!(
            a.flatten_all()?.to_vec1::<f32>()?,
            b.flatten_all()?.to_vec1::<f32>()?,
            "{}",
            named[i].0
        );
    }
    let at = |name: &str| -> anyhow::Result<usize> {
        let i = named
            .iter()
            .position(|(n, _)| n == name)
            .ok_or_else(|| anyhow::anyhow!("no {name}"))?;
        order
            .iter()
            .position(|&j| j == i)
            .ok_or_else(|| anyhow::anyhow!("{name} not handed over"))
    };
    let last = cfg.n_layer - 1;
    assert!(at(&format!("h.{last}.mlp.c_proj.weight"))? < at("h.0.mlp.c_proj.weight")?);
    assert!(at(&format!("h.{last}.attn.c_attn.weight"))? < at("h.0.attn.c_attn.weight")?);
    assert!(at("h.0.ln_1.weight")? < at("wte.weight")?);
    // And not all at the end: the last block's are handed over while most of the pass is left.
    assert!(at(&format!("h.{last}.mlp.c_proj.weight"))? < leaves.len() / 2);
    Ok(())
}
