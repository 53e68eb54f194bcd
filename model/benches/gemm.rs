//! Prefill's and batched decode's product in isolation: `rows x in` activations times
//! a weight stored `(out, in)`, in GFLOPS, for this project's packed kernel (`gpt_kernels::PackedMatrix`, each
//! weight format) and candle's f32 matmul on the same operands, side by side in one run. Weights are small enough to stay
//! in cache: this measures arithmetic, where `gemv` measures memory. Prints one JSON line per
//! shape and weight dtype.
//!
//!     [ROWS=1,16,38,128] cargo bench -p gpt --bench gemm

mod common;

use candle_core::{Device, Tensor};
use gpt::WeightFormat;
use gpt_kernels::PackedMatrix;

fn main() -> anyhow::Result<()> {
    gpt::device::fix_cpu_thread_count();
    let rows = common::sizes("ROWS", "1,16,38,128")?;
    for (k, n) in [(768, 2304), (768, 3072), (3072, 768), (768, 50257)] {
        let w = Tensor::randn(0f32, 0.02, (n, k), &Device::Cpu)?;
        for &m in &rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu)?;
            let flop = 2.0 * (m * n * k) as f64;
            let repeats = ((2e10 / flop) as usize).clamp(3, 200);
            let wt = w.t()?;
            let candle = common::median_secs(repeats, || {
                x.matmul(&wt)?;
                Ok(())
            })?;
            for format in WeightFormat::ALL {
                let packed = PackedMatrix::from_dense(&w, format)?;
                let ours = common::median_secs(repeats, || {
                    packed.matmul(&x)?;
                    Ok(())
                })?;
                println!(
                    "{}",
                    serde_json::json!({
                        "shape": format!("{m}x{k} @ ({n}x{k})^T"), "weights": format.to_string(),
                        "packed_gflops": flop / ours / 1e9, "candle_f32_gflops": flop / candle / 1e9,
                    })
                );
            }
        }
    }
    Ok(())
}
