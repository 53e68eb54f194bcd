//! Batched decode's product with the weights coming from memory: `rows x in`
//! activations times weights stored `(out, in)`, each shape repeated over enough distinct copies
//! (>= 1 GB) that they stream from memory as in a decode step over all layers. Prints, per row
//! count, the weights' read rate (GB/s) and the arithmetic rate (GFLOPS): `gemv` is this at one
//! row, `gemm` the same arithmetic with the weights in cache.
//!
//!     [ROWS=1,8,12,16,24,32] [WEIGHTS=f32] [PRECISION=highest|high] cargo bench -p gpt --bench rows_stream

mod common;

use candle_core::{Device, Tensor};
use gpt::WeightFormat;
use gpt_kernels::PackedMatrix;

fn main() -> anyhow::Result<()> {
    gpt::device::fix_cpu_thread_count();
    let rows = common::sizes("ROWS", "1,8,12,16,24,32")?;
    let format: WeightFormat = std::env::var("WEIGHTS").unwrap_or_else(|_| "f32".into()).parse()?;
    let bytes_per_weight = common::bytes_per_weight(format);
    // `PRECISION=high`: f32 weights as bf16 halves on AMX tiles (the same bytes per weight).
    let precision: gpt::MatmulPrecision = std::env::var("PRECISION")
        .unwrap_or_else(|_| "highest".into())
        .parse()?;
    let shapes = [(768, 2304), (768, 3072), (3072, 768)];
    let mut matrices = Vec::new();
    for (d_in, d_out) in shapes {
        let size = d_in * d_out;
        let copies = (1_000_000_000 / (size * 4)).max(1);
        let ws = (0..copies)
            .map(|c| {
                let w: Vec<f32> = (0..size)
                    .map(|i| (((i + c) * 7919 % 1000) as f32 - 500.0) * 1e-4)
                    .collect();
                PackedMatrix::from_dense(&Tensor::from_vec(w, (d_out, d_in), &Device::Cpu)?, format)?
                    .with_precision(precision)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        matrices.push((d_in, d_out, ws));
    }
    for &m in &rows {
        let (mut secs, mut bytes, mut flops) = (0.0, 0.0, 0.0);
        for (d_in, d_out, ws) in &matrices {
            let x: Vec<f32> = (0..m * d_in).map(|i| ((i * 31 % 100) as f32 - 50.0) * 1e-2).collect();
            let x = Tensor::from_vec(x, (m, *d_in), &Device::Cpu)?;
            let best = common::best_secs(5, || {
                for w in ws {
                    w.matmul(&x)?;
                }
                Ok(())
            })?;
            secs += best;
            bytes += (d_in * d_out * ws.len()) as f64 * bytes_per_weight;
            flops += 2.0 * (m * d_in * d_out * ws.len()) as f64;
        }
        println!(
            "{}",
            serde_json::json!({"rows": m, "weights": format.to_string(), "precision": precision.to_string(), "gb_per_s": bytes / secs / 1e9,
                               "gflops": flops / secs / 1e9, "ms_per_gb": secs / (bytes / 1e9) * 1e3})
        );
    }
    Ok(())
}
