//! Packed windows (`Gpt::forward_at`, `Gpt::loss_at`): several sequences one after another in a
//! window, positions restarting at each, give every sequence what it gets in a window of its
//! own: its logits, and for the loss its share of the gradients. On the CPU's fused path (the
//! attention op with segment starts, the tape) and on candle's composite (f64: the additive mask),
//! which is also what a GPU runs for packed windows.

mod common;

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use gpt::{Config, Dropout, Gpt};

/// Two windows of 32: four sequences (one of a single token), then two.
const LENS: [&[usize]; 2] = [&[5, 9, 1, 17], &[20, 12]];
const T: usize = 32;

fn cfg() -> Config {
    Config {
        n_positions: 40,
        ..Config::tiny(50)
    }
}

/// The windows' inputs, targets and positions, and each sequence's (inputs, targets) alone.
#[allow(clippy::type_complexity)]
fn windows(dtype_dev: &Device) -> anyhow::Result<(Tensor, Tensor, Tensor, Vec<(Vec<u32>, Vec<u32>)>)> {
    let (mut x, mut y, mut pos, mut alone) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (w, lens) in LENS.iter().enumerate() {
        for (s, &len) in lens.iter().enumerate() {
            let ids = common::tokens(len + 1, 50, (10 * w + s) as u64);
            x.extend_from_slice(&ids[..len]);
            y.extend_from_slice(&ids[1..]);
            pos.extend(0..len as u32);
            alone.push((ids[..len].to_vec(), ids[1..].to_vec()));
        }
    }
    let shape = (LENS.len(), T);
    Ok((
        Tensor::from_vec(x, shape, dtype_dev)?,
        Tensor::from_vec(y, shape, dtype_dev)?,
        Tensor::from_vec(pos, shape, dtype_dev)?,
        alone,
    ))
}

/// `varmap`'s model again in f64 (candle's composite ops: no fused kernel takes f64).
fn in_f64(varmap: &VarMap, cfg: &Config) -> anyhow::Result<(VarMap, Gpt)> {
    let wide = VarMap::new();
    let model = Gpt::new(VarBuilder::from_varmap(&wide, DType::F64, &Device::Cpu), cfg)?;
    let from = varmap.data().lock().map_err(|_| anyhow::anyhow!("varmap poisoned"))?;
    for (name, var) in wide
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap poisoned"))?
        .iter()
    {
        let src = from
            .get(name)
            .ok_or_else(|| anyhow::anyhow!("{name} in one model only"))?;
        var.set(&src.as_tensor().to_dtype(DType::F64)?)?;
    }
    drop(from);
    Ok((wide, model))
}

/// The largest difference between two tensors of one shape, in f64.
fn diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

fn sorted_vars(varmap: &VarMap) -> anyhow::Result<Vec<Var>> {
    let data = varmap.data().lock().map_err(|_| anyhow::anyhow!("varmap poisoned"))?;
    let mut named: Vec<_> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named.into_iter().map(|(_, v)| v).collect())
}

/// Every sequence's logits from the packed windows equal its logits alone, and the packed loss's
/// gradients equal the sum of the sequences' losses, each weighted by its share of the targets.
/// `eval` is the logits' dropout key: `None` for inference's path, or (the config has no
/// dropout) the differentiable path, the one candle's f64 ops run.
fn check(model: &Gpt, varmap: &VarMap, eval: Option<Dropout>, tol: f64, what: &str) -> anyhow::Result<()> {
    let dev = &Device::Cpu;
    let (x, y, pos, alone) = windows(dev)?;
    let packed = model.forward_at(&x, &pos, eval)?.to_dtype(DType::F64)?; // (2, T, V)
    let mut seq = 0;
    for (w, lens) in LENS.iter().enumerate() {
        let mut row = 0;
        for &len in lens.iter() {
            let (ids, _) = &alone[seq];
            let own = model
                .forward(&Tensor::new(&ids[..], dev)?.unsqueeze(0)?, eval)?
                .to_dtype(DType::F64)?;
            let ours = packed.get(w)?.narrow(0, row, len)?.unsqueeze(0)?;
            let d = diff(&ours, &own)?;
            assert!(
                d < tol,
                "{what}: sequence {seq} (window {w}, row {row}) differs from alone by {d}"
            );
            row += len;
            seq += 1;
        }
    }
    // Without positions the same windows are one sequence each: the later sequences' logits
    // change (this is what the test would miss if positions were ignored).
    let whole = model.forward(&x, eval)?.to_dtype(DType::F64)?;
    let d = diff(&whole.get(0)?.narrow(0, 5, 9)?, &packed.get(0)?.narrow(0, 5, 9)?)?;
    assert!(d > 1e-3, "{what}: packing changed nothing ({d})");

    // Trained (the differentiable paths), without dropout (the config has none).
    let train = Some(Dropout { key: 0, first_row: 0 });
    let vars = sorted_vars(varmap)?;
    let packed = model.loss_at(&x, &pos, &y, train, 0.0)?.backward()?;
    let mut sum: Option<Vec<Tensor>> = None;
    let total = (LENS.len() * T) as f64;
    for (ids, targets) in &alone {
        let (xi, yi) = (
            Tensor::new(&ids[..], dev)?.unsqueeze(0)?,
            Tensor::new(&targets[..], dev)?.unsqueeze(0)?,
        );
        let loss = (model.loss(&xi, &yi, train, 0.0)? * (ids.len() as f64 / total))?;
        let mut grads = loss.backward()?;
        let g: Vec<Tensor> = vars
            .iter()
            .map(|v| {
                grads
                    .remove(v.as_tensor())
                    .map_or_else(|| v.as_tensor().zeros_like(), Ok)
            })
            .collect::<candle_core::Result<_>>()?;
        sum = Some(match sum {
            None => g,
            Some(acc) => acc
                .iter()
                .zip(&g)
                .map(|(a, b)| a + b)
                .collect::<candle_core::Result<_>>()?,
        });
    }
    let sum = sum.ok_or_else(|| anyhow::anyhow!("no sequences"))?;
    for (v, want) in vars.iter().zip(&sum) {
        let Some(got) = packed.get(v.as_tensor()) else {
            panic!("{what}: no gradient for a {:?} variable", v.shape());
        };
        let d = diff(&got.to_dtype(DType::F64)?, &want.to_dtype(DType::F64)?)?;
        assert!(d < tol, "{what}: a {:?} gradient differs by {d}", v.shape());
    }
    Ok(())
}

#[test]
fn packed_sequences_get_what_they_get_alone() -> anyhow::Result<()> {
    let cfg = cfg();
    let (varmap, model) = common::random_model(&cfg)?;
    check(&model, &varmap, None, 1e-4, "f32, the CPU's fused path")?;
    let (wide, model) = in_f64(&varmap, &cfg)?;
    let train = Some(Dropout { key: 0, first_row: 0 });
    check(&model, &wide, train, 1e-9, "f64, candle's composite")
}

/// The packed loss's gradients on the tape (what gpt-train runs on the CPU), with dropout, are
/// candle's backward's, value for value.
#[test]
fn packed_windows_train_on_the_tape_as_candle() -> anyhow::Result<()> {
    let cfg = Config {
        attn_pdrop: 0.1,
        resid_pdrop: 0.1,
        embd_pdrop: 0.1,
        ..cfg()
    };
    let (varmap, model) = common::random_model(&cfg)?;
    assert!(model.trains_on_tape());
    let (x, y, pos, _) = windows(&Device::Cpu)?;
    let vars = sorted_vars(&varmap)?;
    let leaves: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let train = Some(Dropout { key: 3, first_row: 2 });
    let mut grads = model.loss_at(&x, &pos, &y, train, 0.0)?.backward()?;
    let (loss, tape) = gpt_kernels::tape::record(|| model.loss_at(&x, &pos, &y, train, 0.0))?;
    let on_tape = tape.backward(&loss, 1.0, &leaves)?;
    for (v, got) in vars.iter().zip(on_tape) {
        let got = got.ok_or_else(|| anyhow::anyhow!("no gradient on the tape"))?;
        let want = grads
            .remove(v.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient from candle"))?;
        assert_eq!(
            got.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
            "a {:?} gradient",
            v.shape()
        );
    }
    Ok(())
}

/// Positions that do not number sequences, or of another shape than the inputs, are refused
/// with the place named.
#[test]
fn bad_positions_are_named() -> anyhow::Result<()> {
    let (_, model) = common::random_model(&cfg())?;
    let dev = &Device::Cpu;
    let x = Tensor::new(&[[1u32, 2, 3, 4]], dev)?;
    let err = model
        .forward_at(&x, &Tensor::new(&[[0u32, 1, 3, 4]], dev)?, None)
        .expect_err("a skip");
    assert!(err.to_string().contains("window 0, row 2"), "{err}");
    let err = model
        .forward_at(&x, &Tensor::new(&[[0u32, 1, 2]], dev)?, None)
        .expect_err("a short row");
    assert!(err.to_string().contains("[1, 3]"), "{err}");
    Ok(())
}
