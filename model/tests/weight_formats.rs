//! Inference weight formats: the packed CPU kernel for `x @ W^T` against candle's matmul,
//! half-precision and quantized weights against f32 on the default model's perplexity, and
//! quantized checkpoints (`model.gguf`) written and loaded back.

mod common;

use candle_core::{DType, Device, Tensor, D};
use common::{batch, max_abs_diff, random_model, repo, shakespeare, tokens};
use gpt::{Config, Gpt, WeightFormat};
use gpt_kernels::{PackedMatrix, Simd};

/// The packed kernel in every format, on shapes that take many register tiles (1 to 12 rows and
/// more, a partial last panel, one and several tasks), against candle's matmul on the same
/// (rounded or dequantized) weights; every instruction set this CPU has gives the same bits; and
/// each row of a batch equals that row alone (batch invariance).
#[test]
fn packed_matmul_matches_candle_and_is_batch_invariant() -> anyhow::Result<()> {
    let simds = Simd::available();
    // k = 320 and 768: several chunks of the many-row path, the last one partial in 320.
    for (k, n) in [(768, 70), (320, 33), (64, 49), (96, 200), (32, 3), (20, 17), (1, 5)] {
        for format in WeightFormat::ALL {
            if format.ggml().is_some() && k % 32 != 0 {
                continue;
            }
            let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
            let packed = PackedMatrix::from_dense(&w, format)?;
            assert_eq!(packed.dims(), (n, k));
            let dense = packed.dense()?;
            if format.ggml().is_none() {
                let rounded = w.to_dtype(format.dtype())?.to_dtype(DType::F32)?;
                assert_eq!(
                    max_abs_diff(&dense, &rounded)?,
                    0.0,
                    "{format}: packing changed a weight"
                );
            }
            for m in [1, 2, 3, 7, 9, 12, 13, 16, 25, 40] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
                // q8_0 and q4_0 weights take activations quantized to q8_0.
                let input = if format.ggml().is_some() {
                    q8_0_rows(&x)?
                } else {
                    x.clone()
                };
                let expected = input.matmul(&dense.t()?)?;
                let got = packed.matmul(&x)?;
                assert_eq!(got.dims(), &[m, n]);
                let diff = max_abs_diff(&got, &expected)?;
                let scale = expected.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
                assert!(
                    diff < 1e-5 * scale * (k as f32).sqrt(),
                    "m={m} k={k} n={n} {format}: {diff}"
                );
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let bits = got.flatten_all()?.to_vec1::<f32>()?;
                for &simd in simds {
                    assert_eq!(
                        packed.matmul_with(&xs, m, simd),
                        bits,
                        "{simd:?} m={m} k={k} n={n} {format}"
                    );
                }
                for i in 0..m {
                    let alone = packed.matmul_with(&xs[i * k..(i + 1) * k], 1, simds[0]);
                    assert_eq!(alone, bits[i * n..(i + 1) * n], "row {i} of {m}, k={k} n={n} {format}");
                }
                // The fused bias and GELU give the bits of the separate ops.
                let bias = Tensor::randn(0f32, 1.0, n, &Device::Cpu)?;
                let with_bias = gpt_kernels::add_tiled(&got, &bias)?;
                for (gelu, expected) in [(false, with_bias.clone()), (true, gpt_kernels::gelu(&with_bias)?)] {
                    assert_eq!(
                        packed.matmul_bias(&x, &bias, gelu)?.to_vec2::<f32>()?,
                        expected.to_vec2::<f32>()?,
                        "bias, gelu {gelu}: m={m} k={k} n={n} {format}"
                    );
                }
            }
            // The embedding lookup of a tied head reads the same weights.
            let ids = [0u32, (n - 1) as u32, (n / 2) as u32];
            let rows = packed.rows(&ids)?;
            let expected = dense.embedding(&Tensor::new(&ids, &Device::Cpu)?)?;
            assert_eq!(max_abs_diff(&rows, &expected)?, 0.0);
            let err = packed.rows(&[n as u32]).unwrap_err().to_string();
            assert!(err.contains(&format!("token id {n}")), "{err}");
            let short_bias = Tensor::zeros(n + 1, DType::F32, &Device::Cpu)?;
            let x = Tensor::zeros((1, k), DType::F32, &Device::Cpu)?;
            let err = packed.matmul_bias(&x, &short_bias, false).unwrap_err().to_string();
            assert!(err.contains("bias has shape"), "{err}");
        }
    }
    Ok(())
}

/// `x` `(m, k)` as q8_0 blocks hold it, as llama.cpp quantizes activations: per row and block of
/// 32, `d = max|x| / 127`, codes `round(x · (1/d))`, values `code · d`.
fn q8_0_rows(x: &Tensor) -> anyhow::Result<Tensor> {
    let mut values = x.flatten_all()?.to_vec1::<f32>()?;
    for block in values.chunks_mut(32) {
        let d = block.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        block.iter_mut().for_each(|v| *v = (*v * inv).round() * d);
    }
    Ok(Tensor::from_vec(values, x.dims(), &Device::Cpu)?)
}

/// q8_0's and q4_0's integer products: within the activations' rounding of the f32 product of
/// the same weights (each code within half a step, `d / 2`, so an output within
/// `Σ_blocks d_x/2 · Σ|w|`), and most of that allowance unused; a non-finite activation gives a
/// non-finite output in its row only, as f32 does; zero rows give zeros.
#[test]
fn quantized_products_quantize_activations_within_their_rounding() -> anyhow::Result<()> {
    for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
        products_within_the_activations_rounding(format)?;
    }
    Ok(())
}

fn products_within_the_activations_rounding(format: WeightFormat) -> anyhow::Result<()> {
    let (m, k, n) = (5, 256, 40);
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu)?;
    let packed = PackedMatrix::from_dense(&w, format)?;
    let wv = packed.dense()?.flatten_all()?.to_vec1::<f32>()?;
    let mut xv = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    xv[2 * k..3 * k].iter_mut().for_each(|v| *v = 0.0);
    let got = packed
        .matmul(&Tensor::from_vec(xv.clone(), (m, k), &Device::Cpu)?)?
        .to_vec2::<f32>()?;
    let mut used = 0f64;
    for i in 0..m {
        for j in 0..n {
            let (xs, ws) = (&xv[i * k..(i + 1) * k], &wv[j * k..(j + 1) * k]);
            let exact: f64 = xs.iter().zip(ws).map(|(&a, &b)| a as f64 * b as f64).sum();
            let bound: f64 = xs
                .chunks(32)
                .zip(ws.chunks(32))
                .map(|(xb, wb)| {
                    let d = xb.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                    d / 2.0 * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
                })
                .sum();
            let err = (got[i][j] as f64 - exact).abs();
            assert!(
                err <= bound * 1.001 + 1e-5,
                "{format} ({i}, {j}): {} against {exact}, bound {bound}",
                got[i][j]
            );
            if i == 2 {
                assert_eq!(got[i][j], 0.0);
            } else {
                used = used.max(err / bound);
            }
        }
    }
    assert!(used > 0.0 && used < 0.5, "{format}: worst error {used} of the bound");
    xv[k + 7] = f32::NAN;
    xv[3 * k] = f32::INFINITY;
    let got = packed
        .matmul(&Tensor::from_vec(xv, (m, k), &Device::Cpu)?)?
        .to_vec2::<f32>()?;
    for (i, row) in got.iter().enumerate() {
        assert_eq!(row.iter().all(|v| v.is_finite()), i != 1 && i != 3, "{format}: row {i}");
    }
    Ok(())
}

/// Quantized blocks are moved into the packed layout and back, never requantized: GGML's bytes
/// come back identical.
#[test]
fn packed_quantized_blocks_round_trip_to_ggml() -> anyhow::Result<()> {
    let w = Tensor::randn(0f32, 1.0, (50, 96), &Device::Cpu)?;
    for format in [WeightFormat::Q8_0, WeightFormat::Q4_0] {
        let Some(ggml) = format.ggml() else { continue };
        let q = candle_core::quantized::QTensor::quantize(&w, ggml)?;
        let packed = PackedMatrix::from_qtensor(&q)?;
        assert_eq!(packed.to_qtensor()?.data()?, q.data()?, "{format}");
        let dequantized = q.dequantize(&Device::Cpu)?;
        assert_eq!(max_abs_diff(&packed.dense()?, &dequantized)?, 0.0, "{format}");
    }
    Ok(())
}

/// Mean next-token NLL of `model` over consecutive windows of `ids`.
fn mean_nll(model: &Gpt, ids: &[u32], window: usize) -> anyhow::Result<f64> {
    let (mut total, mut count) = (0f64, 0usize);
    for chunk in ids.chunks(window + 1).filter(|c| c.len() > 1) {
        let input = Tensor::new(&chunk[..chunk.len() - 1], &Device::Cpu)?.unsqueeze(0)?;
        let targets = Tensor::new(&chunk[1..], &Device::Cpu)?;
        let log_p = candle_nn::ops::log_softmax(&model.forward(&input, None)?.squeeze(0)?, D::Minus1)?;
        let picked = log_p.gather(&targets.unsqueeze(1)?, 1)?;
        total -= picked.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
        count += chunk.len() - 1;
    }
    Ok(total / count as f64)
}

/// The default model on held-out text (from the last 10% of the corpus it was trained on, which
/// it never trained on): perplexity in each format against f32. Limits: q8_0
/// within 0.5%, q4_0 within 5%; f16 and bf16 held to q8_0's.
#[test]
fn weight_formats_keep_the_default_models_perplexity() -> anyhow::Result<()> {
    let corpus = shakespeare(usize::MAX)?;
    let held_out = &corpus[corpus.len() * 9 / 10..];
    let text: String = held_out.chars().take(20_000).collect();
    let (f32_model, tokenizer) = gpt::load_dir_as(&repo("weights"), None, &Device::Cpu)?;
    let ids = tokenizer.encode(&text)?;
    let window = f32_model.config().n_positions;
    let reference = mean_nll(&f32_model, &ids, window)?.exp();
    for (format, limit) in [
        (WeightFormat::F16, 0.005),
        (WeightFormat::Bf16, 0.005),
        (WeightFormat::Q8_0, 0.005),
        (WeightFormat::Q4_0, 0.05),
    ] {
        let (model, _) = gpt::load_dir_as(&repo("weights"), Some(format), &Device::Cpu)?;
        assert_eq!(model.weight_format(), Some(format));
        let ppl = mean_nll(&model, &ids, window)?.exp();
        let change = (ppl - reference).abs() / reference;
        assert!(
            change < limit,
            "{format}: perplexity {ppl} against f32's {reference} ({change})"
        );
        // The decoding path (KV cache, packed steps) computes the same logits.
        let mut cache = model.new_cache();
        let step = model.forward_step(
            &mut [gpt::SeqStep {
                tokens: &ids[..40],
                cache: &mut cache,
            }],
            gpt::LogitsFor::Last,
        )?;
        let whole = model.forward(&Tensor::new(&ids[..40], &Device::Cpu)?.unsqueeze(0)?, None)?;
        let diff = max_abs_diff(&step.squeeze(0)?, &whole.squeeze(0)?.get(39)?)?;
        // q8_0 and q4_0 quantize every product's activations, where the two paths' attentions
        // differ in their last bits: a code can move by a step (q8_0: 0.039 on logits up to 16.7).
        let limit = match format {
            WeightFormat::Q8_0 | WeightFormat::Q4_0 => 0.01 * whole.abs()?.max_all()?.to_scalar::<f32>()?,
            _ => 1e-3,
        };
        assert!(diff < limit, "{format}: cached step against whole window: {diff}");
    }
    Ok(())
}

/// `model.gguf` holds the quantized blocks themselves: loading it gives the logits of the model
/// quantized in memory, bit for bit, and the directory no longer has a safetensors file that
/// would be loaded instead.
#[test]
fn quantized_checkpoints_load_back_exactly() -> anyhow::Result<()> {
    let (model, tokenizer) = gpt::load_dir(&repo("weights"), DType::F32, &Device::Cpu)?;
    let idx = batch(&[tokens(50, model.config().vocab_size, 3)])?;
    for format in [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::F16] {
        let dir = tempfile::tempdir()?;
        gpt::save_dir(dir.path(), &model, &tokenizer, DType::F32)?;
        gpt::save_gguf_dir(dir.path(), &model, &tokenizer, format)?;
        assert!(!dir.path().join("model.safetensors").exists());
        let (loaded, _) = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu)?;
        assert_eq!(loaded.weight_format(), Some(format));
        let in_memory = model.clone().with_weight_format(format)?;
        assert_eq!(
            loaded.forward(&idx, None)?.flatten_all()?.to_vec1::<f32>()?,
            in_memory.forward(&idx, None)?.flatten_all()?.to_vec1::<f32>()?,
            "{format}"
        );
        // A damaged file is an error that names it.
        let path = dir.path().join("model.gguf");
        let bytes = std::fs::read(&path)?;
        std::fs::write(&path, &bytes[..bytes.len() / 2])?;
        let err = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu)
            .err()
            .map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("model.gguf")), "{err:?}");
    }
    Ok(())
}

/// A layer whose rows are not whole blocks cannot be quantized: the error names the tensor and
/// the block.
#[test]
fn quantizing_rows_that_are_not_whole_blocks_names_the_tensor() -> anyhow::Result<()> {
    let cfg = Config {
        n_embd: 48,
        n_head: 4,
        ..Config::tiny(50)
    };
    let (_vm, model) = random_model(&cfg)?;
    let err = model
        .with_weight_format(WeightFormat::Q8_0)
        .err()
        .map(|e| e.to_string());
    let err = err.unwrap_or_default();
    assert!(err.contains("transformer.wte.weight") && err.contains("32"), "{err}");
    Ok(())
}

/// Bad inputs to the packed kernel are errors that say what is wrong, not panics.
#[test]
fn packed_matrix_rejects_bad_inputs() -> anyhow::Result<()> {
    let w = Tensor::randn(0f32, 1.0, (8, 64), &Device::Cpu)?;
    let packed = PackedMatrix::from_dense(&w, WeightFormat::Q8_0)?;
    let err = packed
        .matmul(&Tensor::zeros((2, 32), DType::F32, &Device::Cpu)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("(.., 32)") && err.contains("(8, 64)"), "{err}");
    let err = PackedMatrix::from_dense(&Tensor::zeros((4, 40), DType::F32, &Device::Cpu)?, WeightFormat::Q4_0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("multiple of 32") && err.contains("40"), "{err}");
    let q41 = candle_core::quantized::QTensor::quantize(&w, candle_core::quantized::GgmlDType::Q4_1)?;
    let err = PackedMatrix::from_qtensor(&q41).unwrap_err().to_string();
    assert!(err.contains("Q4_1") && err.contains("q8_0"), "{err}");
    Ok(())
}
