//! `MatmulPrecision::High` (bf16x3 products on AMX tiles for f32 weights, two products for bf16
//! ones) against exact products, and the model with it against the model at `Highest`. The
//! kernel runs only where the CPU and kernel have AMX-BF16 (`cfg(gpt_test_amx)`, from the build
//! script): elsewhere its tests are reported as ignored, with the reason, and one checks instead
//! that `high` is refused with an error naming AMX. The tile products' arithmetic is checked on
//! every host through their emulation in plain Rust (`PackedMatrix::matmul_high_emulated`), and
//! against the hardware where it runs.

mod common;

use candle_core::{Device, Tensor, D};
use common::{random_model, tokens};
use gpt::{Config, LogitsFor, MatmulPrecision, SeqStep, WeightFormat};
use gpt_kernels::PackedMatrix;

/// The reason the AMX kernel's tests give where it cannot run.
const NO_AMX: &str = "needs AMX-BF16 in the CPU and kernel (the `high` precision's tiles)";

fn amx() -> bool {
    MatmulPrecision::High.available()
}

fn values(t: &Tensor) -> anyhow::Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

/// Every output within bf16x3's bound of the exact (f64) product of the weights as held: the
/// dropped `lo·lo` term and the two halves' residuals are each under 2^-18 of `|x||w|`, so with
/// f32 accumulation 2^-15 (3e-5) of `Σ|x||w|` holds; bf16 alone (2^-9) would be far outside it.
/// bf16 weights are exact in the tiles and only the activations split, within the same bound.
/// Shapes take partial tiles in rows (16), columns (16, tasks of 32) and `k` (blocks of 32);
/// each row of a batch is bit-identical to that row alone.
#[test]
#[cfg_attr(
    not(gpt_test_amx),
    ignore = "needs AMX-BF16 in the CPU and kernel (the `high` precision's tiles)"
)]
fn high_precision_products_are_within_bf16x3_bounds_and_batch_invariant() -> anyhow::Result<()> {
    assert!(amx(), "{NO_AMX}");
    for format in [WeightFormat::F32, WeightFormat::Bf16] {
        for (k, n) in [(768, 70), (33, 17), (96, 200), (32, 3), (20, 33), (1, 5)] {
            products_within_bound(format, k, n)?;
        }
    }
    Ok(())
}

fn products_within_bound(format: WeightFormat, k: usize, n: usize) -> anyhow::Result<()> {
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
    let packed = PackedMatrix::from_dense(&w, format)?.with_precision(MatmulPrecision::High)?;
    assert_eq!(packed.precision(), MatmulPrecision::High);
    // The weights as the matrix holds them (bf16-rounded for bf16).
    let wv = values(&packed.dense()?)?;
    for m in [1, 5, 16, 17, 32, 40, 70] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
        let xv = values(&x)?;
        let got = values(&packed.matmul(&x)?)?;
        assert_eq!(got.len(), m * n);
        let mut worst = 0f64;
        for i in 0..m {
            for j in 0..n {
                let (xs, ws) = (&xv[i * k..(i + 1) * k], &wv[j * k..(j + 1) * k]);
                let exact: f64 = xs.iter().zip(ws).map(|(&a, &b)| a as f64 * b as f64).sum();
                let size: f64 = xs.iter().zip(ws).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                worst = worst.max((got[i * n + j] as f64 - exact).abs() / size.max(1e-30));
            }
        }
        assert!(worst < 3e-5, "{format} k {k} n {n} m {m}: error {worst:e} of Σ|x||w|");
        // Under bf16 alone the same products err by ~1e-3: the split is doing its work.
        if k >= 32 {
            assert!(
                worst > 0.0 || m * n < 8,
                "{format} k {k} n {n} m {m}: exact to the bit, suspicious"
            );
        }
        for i in [0, m / 2, m - 1] {
            let alone = values(&packed.matmul(&x.narrow(0, i, 1)?)?)?;
            assert_eq!(
                alone,
                got[i * n..(i + 1) * n],
                "{format} k {k} n {n}: row {i} of {m} differs alone"
            );
        }
    }
    Ok(())
}

/// The tile products emulated in plain Rust, on any host: within bf16x3's bound of the exact
/// product, each row the same alone as in a batch, and where the CPU has AMX within 2e-6 of
/// `Σ|x||w|` of the hardware's (which rounds its sums internally otherwise than the definition's
/// sequential f32 adds; a wrong layout, half or order of products errs by 2^-9 or more).
#[test]
fn emulated_tile_products_are_within_bounds_and_match_the_hardware() -> anyhow::Result<()> {
    let hardware = amx();
    let mut worst_hw = 0f32;
    for format in [WeightFormat::F32, WeightFormat::Bf16] {
        for (k, n) in [(96, 70), (33, 17), (20, 33)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
            let packed = PackedMatrix::from_dense(&w, format)?;
            let wv = values(&packed.dense()?)?;
            for m in [1, 17, 40] {
                let xv = values(&Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?)?;
                let got = packed.matmul_high_emulated(&xv, m)?;
                for i in 0..m {
                    for j in 0..n {
                        let (xs, ws) = (&xv[i * k..(i + 1) * k], &wv[j * k..(j + 1) * k]);
                        let exact: f64 = xs.iter().zip(ws).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let size: f64 = xs.iter().zip(ws).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                        let err = (got[i * n + j] as f64 - exact).abs() / size.max(1e-30);
                        assert!(err < 3e-5, "{format} k {k} n {n} m {m} ({i}, {j}): error {err:e}");
                    }
                }
                let last = packed.matmul_high_emulated(&xv[(m - 1) * k..], 1)?;
                assert_eq!(last, got[(m - 1) * n..], "{format} k {k} n {n}: the last row alone");
                if hardware {
                    let tiles = packed.clone().with_precision(MatmulPrecision::High)?;
                    let real = values(&tiles.matmul(&Tensor::from_vec(xv.clone(), (m, k), &Device::Cpu)?)?)?;
                    for i in 0..m {
                        for j in 0..n {
                            let (xs, ws) = (&xv[i * k..(i + 1) * k], &wv[j * k..(j + 1) * k]);
                            let size: f32 = xs.iter().zip(ws).map(|(&a, &b)| (a * b).abs()).sum();
                            let d = (real[i * n + j] - got[i * n + j]).abs() / size.max(1e-30);
                            worst_hw = worst_hw.max(d);
                        }
                    }
                }
            }
        }
    }
    eprintln!("hardware against emulation: {worst_hw:e} of Σ|x||w|");
    assert!(
        worst_hw < 2e-6,
        "hardware and emulation differ by {worst_hw:e} of Σ|x||w|"
    );
    Ok(())
}

/// The fused linear layer (bias, GELU) takes the same path: within the bound of `Highest`'s.
#[test]
#[cfg_attr(
    not(gpt_test_amx),
    ignore = "needs AMX-BF16 in the CPU and kernel (the `high` precision's tiles)"
)]
fn high_precision_linear_layer_matches_highest() -> anyhow::Result<()> {
    assert!(amx(), "{NO_AMX}");
    let (k, n, m) = (96, 50, 21);
    let w = Tensor::randn(0f32, 0.2, (n, k), &Device::Cpu)?;
    let bias = Tensor::randn(0f32, 1.0, n, &Device::Cpu)?;
    let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
    let highest = PackedMatrix::from_dense(&w, WeightFormat::F32)?;
    let high = highest.clone().with_precision(MatmulPrecision::High)?;
    for gelu in [false, true] {
        let a = values(&highest.matmul_bias(&x, &bias, gelu)?)?;
        let b = values(&high.matmul_bias(&x, &bias, gelu)?)?;
        let worst = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "gelu {gelu}: {worst}");
    }
    // And back: `Highest` drops the tiles and gives f32's bits again.
    let back = high.with_precision(MatmulPrecision::Highest)?;
    assert_eq!(back.precision(), MatmulPrecision::Highest);
    assert_eq!(values(&back.matmul(&x)?)?, values(&highest.matmul(&x)?)?);
    Ok(())
}

/// A whole model, with f32 and with bf16 weights: prompt logits at every position within 1e-4 of
/// `Highest`'s, the same greedy token at each, through the KV cache (prefill, then one-token
/// steps).
#[test]
#[cfg_attr(
    not(gpt_test_amx),
    ignore = "needs AMX-BF16 in the CPU and kernel (the `high` precision's tiles)"
)]
fn high_precision_model_matches_highest() -> anyhow::Result<()> {
    assert!(amx(), "{NO_AMX}");
    for format in [WeightFormat::F32, WeightFormat::Bf16] {
        model_matches_highest(format)?;
    }
    Ok(())
}

/// Where the CPU or kernel has no AMX-BF16, asking for `high` is an error that names AMX.
#[test]
#[cfg_attr(gpt_test_amx, ignore = "this CPU and kernel run AMX-BF16, so `high` is not refused")]
fn without_amx_high_precision_is_refused_naming_it() -> anyhow::Result<()> {
    assert!(!amx(), "AMX-BF16 runs here");
    let cfg = Config {
        n_layer: 1,
        n_head: 2,
        n_embd: 32,
        n_positions: 16,
        vocab_size: 17,
        ..Config::gpt2_small()
    };
    let (_vars, model) = random_model(&cfg)?;
    for format in [WeightFormat::F32, WeightFormat::Bf16] {
        let err = model
            .clone()
            .into_inference_layout()?
            .with_weight_format(format)?
            .with_matmul_precision(MatmulPrecision::High)
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref().is_some_and(|e| e.contains("AMX")),
            "without AMX `high` must be refused, naming it: {err:?}"
        );
    }
    Ok(())
}

fn model_matches_highest(format: WeightFormat) -> anyhow::Result<()> {
    let cfg = Config {
        n_layer: 2,
        n_head: 4,
        n_embd: 64,
        n_positions: 64,
        vocab_size: 97,
        ..Config::gpt2_small()
    };
    let (_vars, model) = random_model(&cfg)?;
    let highest = model.into_inference_layout()?.with_weight_format(format)?;
    let high = highest.clone().with_matmul_precision(MatmulPrecision::High)?;
    let ids = tokens(40, cfg.vocab_size, 7);
    let run = |model: &gpt::Gpt| -> anyhow::Result<Tensor> {
        let mut cache = model.new_cache();
        let prefill = model.forward_step(
            &mut [SeqStep {
                tokens: &ids[..30],
                cache: &mut cache,
            }],
            LogitsFor::All,
        )?;
        let mut rows = vec![prefill.squeeze(0)?];
        for t in &ids[30..] {
            let step = model.forward_step(
                &mut [SeqStep {
                    tokens: std::slice::from_ref(t),
                    cache: &mut cache,
                }],
                LogitsFor::Last,
            )?;
            rows.push(step.reshape((1, cfg.vocab_size))?);
        }
        Ok(Tensor::cat(&rows, 0)?)
    };
    let (a, b) = (run(&highest)?, run(&high)?);
    let diff = common::max_abs_diff(&a, &b)?;
    let scale = a.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(
        diff < 1e-4 * scale.max(1.0),
        "{format}: logits differ by {diff} (scale {scale})"
    );
    assert!(
        diff > 0.0,
        "{format}: `high` gave `highest`'s exact bits: the tiles did not run"
    );
    assert_eq!(
        a.argmax(D::Minus1)?.to_vec1::<u32>()?,
        b.argmax(D::Minus1)?.to_vec1::<u32>()?
    );
    Ok(())
}

/// `high` applies to packed f32 weights only: other formats and dense tensors are refused with
/// the weight's name and format.
#[test]
fn high_precision_refuses_other_weights() -> anyhow::Result<()> {
    let w = Tensor::randn(0f32, 1.0, (8, 32), &Device::Cpu)?;
    let err = PackedMatrix::from_dense(&w, WeightFormat::Q8_0)?
        .with_precision(MatmulPrecision::High)
        .err()
        .map(|e| e.to_string());
    assert!(err.as_deref().is_some_and(|e| e.contains("q8_0")), "{err:?}");
    let cfg = Config {
        n_layer: 1,
        n_head: 2,
        n_embd: 32,
        n_positions: 16,
        vocab_size: 40,
        ..Config::gpt2_small()
    };
    let (_vars, model) = random_model(&cfg)?;
    let err = model
        .with_matmul_precision(MatmulPrecision::High)
        .err()
        .map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.contains("transformer.wte.weight")),
        "a dense (training-layout) model must be refused, naming the weight: {err:?}"
    );
    assert_eq!("high".parse::<MatmulPrecision>()?, MatmulPrecision::High);
    assert!("medium".parse::<MatmulPrecision>().is_err());
    Ok(())
}
