//! Causal attention of a step's new tokens against their KV caches (`gpt_kernels::cached_attention`,
//! GPT-2 small's 12 heads of 64), against candle's ops on the same operands (`q k^T`, mask,
//! softmax, `· v`), side by side in one run: a prompt of `T` tokens prefilled at once, and a
//! decode step of 16 sequences with `T` cached positions each. Prints one JSON line per case:
//! milliseconds per call (median) and nanoseconds per (query, key) pair per head.
//!
//!     [T=250,1000] cargo bench -p gpt --bench attention

mod common;

use candle_core::{DType, Device, Tensor, D};
use gpt_kernels::{cached_attention, CachedKv};

const N_HEAD: usize = 12;
const HS: usize = 64;

/// candle's ops for sequence `s` (rows `row0..row0 + len` of `qkv`, its cache `(k, v)`).
fn reference(qkv: &Tensor, row0: usize, len: usize, k: &Tensor, v: &Tensor) -> anyhow::Result<Tensor> {
    let (c, t) = (N_HEAD * HS, k.dim(1)?);
    let q = qkv
        .narrow(0, row0, len)?
        .narrow(1, 0, c)?
        .reshape((len, N_HEAD, HS))?
        .transpose(0, 1)?;
    let att = (q.contiguous()?.matmul(&k.t()?)? / (HS as f64).sqrt())?;
    let offset = t - len;
    let mask: Vec<f32> = (0..len)
        .flat_map(|i| (0..t).map(move |j| if j <= offset + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let att = att.broadcast_add(&Tensor::from_vec(mask, (len, t), &Device::Cpu)?)?;
    let att = candle_nn::ops::softmax(&att, D::Minus1)?;
    Ok(att.matmul(v)?.transpose(0, 1)?.reshape((len, c))?)
}

/// Positions per block, as the server's cache holds them.
const BLOCK: usize = 64;
fn main() -> anyhow::Result<()> {
    gpt::device::fix_cpu_thread_count();
    let lengths = common::sizes("T", "250,1000")?;
    let dev = Device::Cpu;
    let c = N_HEAD * HS;
    for &t in &lengths {
        for (case, seqs, len) in [("prefill", 1usize, t), ("decode x16", 16, 1)] {
            let qkv = Tensor::randn(0f32, 1.0, (seqs * len, 3 * c), &dev)?;
            let kv: Vec<(Tensor, Tensor)> = (0..seqs)
                .map(|_| {
                    let k = Tensor::randn(0f32, 1.0, (N_HEAD, t, HS), &dev)?;
                    let v = Tensor::randn(0f32, 1.0, (N_HEAD, t, HS), &dev)?;
                    Ok((k, v))
                })
                .collect::<anyhow::Result<_>>()?;
            // As the server's cache holds them: in blocks.
            let blocks = |x: &Tensor| -> anyhow::Result<Vec<Tensor>> {
                (0..t.div_ceil(BLOCK))
                    .map(|b| {
                        let block = Tensor::zeros((N_HEAD, BLOCK, HS), DType::F32, &dev)?;
                        block.slice_set(&x.narrow(1, b * BLOCK, BLOCK.min(t - b * BLOCK))?.contiguous()?, 1, 0)?;
                        Ok(block)
                    })
                    .collect()
            };
            let cached: Vec<CachedKv> = (kv.iter())
                .map(|(k, v)| {
                    Ok(CachedKv {
                        keys: blocks(k)?,
                        values: blocks(v)?,
                        len: t,
                        dropped: 0,
                    })
                })
                .collect::<anyhow::Result<_>>()?;
            let lens = vec![len; seqs];
            let scale = 1.0 / (HS as f32).sqrt();
            let pairs = (seqs * N_HEAD) as f64 * (0..len).map(|i| (t - len + i + 1) as f64).sum::<f64>();
            let repeats = ((2e9 / (pairs * 100.0)) as usize).clamp(5, 200);
            let ours = common::median_secs(repeats, || {
                cached_attention(&qkv, &lens, &cached, N_HEAD, scale)?;
                Ok(())
            })?;
            let candle = common::median_secs(repeats, || {
                for (s, (k, v)) in kv.iter().enumerate() {
                    reference(&qkv, s * len, len, k, v)?;
                }
                Ok(())
            })?;
            println!(
                "{}",
                serde_json::json!({
                    "case": case, "T": t, "ours_ms": ours * 1e3, "candle_ms": candle * 1e3,
                    "ours_ns_per_pair": ours * 1e9 / pairs, "speedup": candle / ours,
                })
            );
        }
    }
    Ok(())
}
