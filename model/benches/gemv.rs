//! Decode's bottleneck in isolation: one token times a weight matrix, the product that
//! takes ~80% of a batch-1 decode step (perf: `gemm_common`'s vectorised gemv). Compares candle's
//! matmul on the inference layout (`x @ W^T`, W stored (out, in)) with a plain row-parallel dot
//! product over std threads, in GB/s of weights read: decode's speed limit is the machine's read
//! bandwidth divided by the weight bytes. Each shape is repeated over enough distinct copies of its
//! weight (>= 1 GB in all: this VM reports a 260 MiB L3) that they come from memory, not cache, as in a decode step over all
//! layers. Prints one JSON line per shape.
//!
//!     [THREADS=2] [SHAPES=768x2304,...] [COPIES=N] cargo bench -p gpt --bench gemv
//!
//! `SHAPES` (in x out) measures another model's products; `COPIES=1` one copy of each weight,
//! from cache where it fits (the kernel's arithmetic rate rather than the memory's).

mod common;

use candle_core::{Device, Tensor};
use gpt::WeightFormat;
use gpt_kernels::PackedMatrix;

/// `out[r] = w[r, :] . x` for this thread's rows, 8 independent accumulators so LLVM vectorises.
fn dot_rows(w: &[f32], x: &[f32], out: &mut [f32]) {
    let d_in = x.len();
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * d_in..(r + 1) * d_in];
        let mut acc = [0f32; 16];
        for (wc, xc) in row.chunks_exact(16).zip(x.chunks_exact(16)) {
            for i in 0..16 {
                acc[i] += wc[i] * xc[i];
            }
        }
        let tail: f32 = row
            .chunks_exact(16)
            .remainder()
            .iter()
            .zip(x.chunks_exact(16).remainder())
            .map(|(a, b)| a * b)
            .sum();
        *o = acc.iter().sum::<f32>() + tail;
    }
}

fn gemv(w: &[f32], x: &[f32], out: &mut [f32], threads: usize) {
    let d_in = x.len();
    let rows_per = out.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(rows_per).enumerate() {
            let w = &w[t * rows_per * d_in..(t * rows_per + chunk.len()) * d_in];
            s.spawn(move || dot_rows(w, x, chunk));
        }
    });
}

/// The same on rayon's pool (started once, as candle's own is), chunks of 64 rows.
fn gemv_pool(w: &[f32], x: &[f32], out: &mut [f32]) {
    use rayon::prelude::*;
    let d_in = x.len();
    out.par_chunks_mut(64).enumerate().for_each(|(i, chunk)| {
        let start = i * 64 * d_in;
        dot_rows(&w[start..start + chunk.len() * d_in], x, chunk)
    });
}

fn main() -> anyhow::Result<()> {
    gpt::device::fix_cpu_thread_count();
    let threads: usize = std::env::var("THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    // `SHAPES=576x1728,1536x576` (in x out) for another model's products than GPT-2 small's.
    let shapes: Vec<(usize, usize)> = match std::env::var("SHAPES") {
        Ok(s) => s
            .split(',')
            .map(|p| {
                let (i, o) = p
                    .split_once('x')
                    .ok_or_else(|| anyhow::anyhow!("SHAPES: {p:?} is not INxOUT"))?;
                Ok((i.trim().parse()?, o.trim().parse()?))
            })
            .collect::<anyhow::Result<_>>()?,
        Err(_) => vec![(768, 2304), (768, 3072), (3072, 768), (768, 50257)],
    };
    for (d_in, d_out) in shapes {
        let size = d_in * d_out;
        let copies = std::env::var("COPIES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or((1_000_000_000 / (size * 4)).max(1));
        let w: Vec<f32> = (0..size * copies)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-4)
            .collect();
        let x: Vec<f32> = (0..d_in).map(|i| ((i * 31 % 100) as f32 - 50.0) * 1e-2).collect();
        let xt = Tensor::from_slice(&x, (1, d_in), &Device::Cpu)?;
        let tensors = (0..copies)
            .map(|c| Tensor::from_slice(&w[c * size..(c + 1) * size], (d_out, d_in), &Device::Cpu)?.t())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let reference = xt.matmul(&tensors[0])?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; d_out];
        gemv(&w[..size], &x, &mut out, threads);
        let max_diff = out
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let gb = (size * copies * 4) as f64 / 1e9;
        let candle = common::best_secs(5, || {
            for t in &tensors {
                xt.matmul(t)?;
            }
            Ok(())
        })?;
        let plain = common::best_secs(5, || {
            for c in 0..copies {
                gemv(&w[c * size..(c + 1) * size], &x, &mut out, threads);
            }
            Ok(())
        })?;
        let qt = |dt: candle_core::quantized::GgmlDType| -> candle_core::Result<Vec<candle_core::quantized::QTensor>> {
            (0..copies)
                .map(|c| {
                    let t = Tensor::from_slice(&w[c * size..(c + 1) * size], (d_out, d_in), &Device::Cpu)?;
                    candle_core::quantized::QTensor::quantize(&t, dt)
                })
                .collect()
        };
        let mut q = serde_json::Map::new();
        let wts = (0..copies)
            .map(|c| Tensor::from_slice(&w[c * size..(c + 1) * size], (d_out, d_in), &Device::Cpu))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // This project's packed kernel (gpt_kernels::PackedMatrix) on the same weights in each format.
        for format in WeightFormat::ALL {
            let ws = wts
                .iter()
                .map(|t| PackedMatrix::from_dense(t, format))
                .collect::<candle_core::Result<Vec<_>>>()?;
            let secs = common::best_secs(5, || {
                for p in &ws {
                    p.matmul(&xt)?;
                }
                Ok(())
            })?;
            let y = ws[0].matmul(&xt)?.flatten_all()?.to_vec1::<f32>()?;
            let diff = y
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let gb_read = (size * copies) as f64 * common::bytes_per_weight(format) / 1e9;
            q.insert(
                format!("packed_{format}"),
                serde_json::json!({"gb_per_s": gb_read / secs, "max_diff": diff}),
            );
        }
        for (name, dt, bytes) in [
            ("qtensor_f32", candle_core::quantized::GgmlDType::F32, 4.0),
            ("qtensor_f16", candle_core::quantized::GgmlDType::F16, 2.0),
            ("qtensor_q8_0", candle_core::quantized::GgmlDType::Q8_0, 34.0 / 32.0),
            ("qtensor_q4_0", candle_core::quantized::GgmlDType::Q4_0, 18.0 / 32.0),
            // The k-quants a GGUF file's Q5_K and Q6_K matrices run as (rows of whole 256-blocks).
            ("qtensor_q5_k", candle_core::quantized::GgmlDType::Q5K, 176.0 / 256.0),
            ("qtensor_q6_k", candle_core::quantized::GgmlDType::Q6K, 210.0 / 256.0),
        ] {
            if dt.block_size() == 256 && !d_in.is_multiple_of(256) {
                continue;
            }
            let qs = qt(dt)?;
            let y = xt.apply_op1_no_bwd(&qs[0])?.flatten_all()?.to_vec1::<f32>()?;
            let diff = y
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let secs = common::best_secs(5, || {
                for t in &qs {
                    xt.apply_op1_no_bwd(t)?;
                }
                Ok(())
            })?;
            let qgb = (size * copies) as f64 * bytes / 1e9;
            q.insert(name.into(), serde_json::json!({"gb_per_s": qgb / secs, "tok_equiv_ms": secs / copies as f64 * 1e3, "max_diff": diff}));
        }
        // Q4_K (rows of whole 256-blocks): candle's `QMatMul` against the Q4_0 codes with an
        // offset per sub-block of 32 that a GGUF file's Q4_K matrices run as
        // (`gpt::llamacpp::weight`). The copies are f32's count: 1/7 of the bytes.
        if d_in.is_multiple_of(256) {
            let qs = qt(candle_core::quantized::GgmlDType::Q4K)?;
            let candle_q4k = common::best_secs(5, || {
                for t in &qs {
                    xt.apply_op1_no_bwd(t)?;
                }
                Ok(())
            })?;
            let recoded = qt(candle_core::quantized::GgmlDType::Q4K)?
                .into_iter()
                .map(|t| gpt::llamacpp::weight(t, candle_core::DType::F32, &Device::Cpu))
                .collect::<gpt::Result<Vec<_>>>()?;
            anyhow::ensure!(
                matches!(recoded[0], gpt::layers::Weight::Recoded { .. }),
                "Q4_K is not recoded"
            );
            let ours = common::best_secs(5, || {
                for w in &recoded {
                    w.forward(&xt, gpt::layers::Autocast::Off)?;
                }
                Ok(())
            })?;
            let ms = |secs: f64| secs / copies as f64 * 1e3;
            q.insert(
                "qtensor_q4_k".into(),
                serde_json::json!({"tok_equiv_ms": ms(candle_q4k)}),
            );
            q.insert("recoded_q4_k".into(), serde_json::json!({"tok_equiv_ms": ms(ours)}));
        }
        let pool = common::best_secs(5, || {
            for c in 0..copies {
                gemv_pool(&w[c * size..(c + 1) * size], &x, &mut out);
            }
            Ok(())
        })?;
        println!(
            "{}",
            serde_json::json!({
                "shape": format!("1x{d_in} @ {d_in}x{d_out}"), "threads": threads,
                "candle_gb_per_s": gb / candle, "plain_gb_per_s": gb / plain, "pool_gb_per_s": gb / pool, "max_diff": max_diff, "quantized": q,
            })
        );
    }
    Ok(())
}
