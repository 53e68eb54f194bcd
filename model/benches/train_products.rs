//! Training's matrix products at GPT-2 small's sizes (4 x 256 tokens), each product of a step:
//! every projection's forward `x W^T`, `dX = dY W` and `dW = dY^T x`, and the LM head's on a
//! chunk of 512 rows, with the operands where the step holds them (row-major or a transposed
//! view). In f32, the whole product (`f32_ms`); in bf16 (`gpt-train --dtype bf16`) taken apart:
//! the time to round the left operand to bf16 rows and the right one to panels, against the
//! time of the multiplication itself. On the threads candle uses; one JSON line per product,
//! then the step's totals (12 layers, two chunks of the LM head).
//!
//! `DTYPE=f32` times the f32 products alone (the bf16 ones are slow where they run emulated,
//! without AVX512-BF16).
//!
//! `GPT_BF16_DOT=Avx512Bf16` (or `Avx512Fma`, `Avx2Fma`, `Emulated`) runs the bf16 products on
//! that kernel rather than the one `Bf16Dot::detect` picks (it says which in the totals' line).
//!
//! `SHAPE=recipe` takes nanoGPT's CPU recipe's sizes instead (12 x 64 tokens, 4 layers of 128,
//! 65 characters).
//!
//!     [SHAPE=recipe] [DTYPE=f32] [GPT_BF16_DOT=..] cargo bench -p gpt --bench train_products

mod common;

use gpt_kernels::train::bf16::{Bf16Dot, Bf16Panels, Bf16Rows};
use gpt_kernels::Operand;

fn values(len: usize, seed: usize, scale: f32) -> Vec<f32> {
    (0..len).map(|i| ((i * seed % 1000) as f32 - 500.0) * scale).collect()
}

fn main() -> anyhow::Result<()> {
    gpt::device::tune_cpu_allocator();
    gpt::device::fix_cpu_thread_count();
    Bf16Dot::from_env().map_err(|e| anyhow::anyhow!(e))?;
    let dot = Bf16Dot::detect();
    let recipe = std::env::var("SHAPE").is_ok_and(|s| s == "recipe");
    let bf16 = !std::env::var("DTYPE").is_ok_and(|s| s == "f32");
    // (tokens, width, vocabulary rows per LM head chunk, vocabulary, layers, LM head chunks)
    let (tokens, c, head_rows, vocab, n_layer, chunks) = if recipe {
        (768, 128, 768, 65, 4.0, 1.0)
    } else {
        (1024, 768, 512, 50257, 12.0, 2.0)
    };
    // (name, rows of the input, in, out)
    let layers = [
        ("qkv", tokens, c, 3 * c),
        ("attn_proj", tokens, c, c),
        ("fc", tokens, c, 4 * c),
        ("mlp_proj", tokens, 4 * c, c),
        ("lm_head", head_rows, c, vocab),
    ];
    let mut total = [0f64; 4];
    for (name, m, k, n) in layers {
        let w = values(n * k, 7919, 1e-4); // (n, k)
        let x = values(m * k, 104_729, 1e-3); // (m, k)
        let dy = values(m * n, 15_485_863, 1e-3); // (m, n)
        let (w, x, dy) = (
            Operand::rows(&w, n, k),
            Operand::rows(&x, m, k),
            Operand::rows(&dy, m, n),
        );
        // a @ B^T for each of the layer's three products, operands as the step holds them.
        for (product, a, b) in [("forward", x, w), ("dx", dy, w.t()), ("dw", dy.t(), x.t())] {
            let repeats = 5;
            let (mut pack_a, mut pack_b, mut multiply) = (f64::NAN, f64::NAN, f64::NAN);
            if bf16 {
                pack_a = common::median_secs(repeats, || {
                    Bf16Rows::new(a, dot);
                    Ok(())
                })?;
                pack_b = common::median_secs(repeats, || {
                    Bf16Panels::new(b, dot);
                    Ok(())
                })?;
                let (rows, panels) = (Bf16Rows::new(a, dot), Bf16Panels::new(b, dot));
                multiply = common::median_secs(repeats, || {
                    panels.matmul(&rows)?;
                    Ok(())
                })?;
            }
            let f32_whole = common::median_secs(repeats, || {
                gpt_kernels::product(a, b, gpt_kernels::Autocast::Off)?;
                Ok(())
            })?;
            for (t, s) in total.iter_mut().zip([pack_a, pack_b, multiply, f32_whole]) {
                *t += s * if name == "lm_head" { chunks } else { n_layer };
            }
            println!(
                "{}",
                serde_json::json!({
                    "layer": name, "product": product,
                    "shape": format!("({}x{}) @ ({}x{})^T", a.rows, a.cols, b.rows, b.cols),
                    "multiply_ms": multiply * 1e3,
                    "gflops": 2.0 * (a.rows * a.cols * b.rows) as f64 / multiply / 1e9,
                    "pack_a_ms": pack_a * 1e3, "pack_b_ms": pack_b * 1e3,
                    "f32_ms": f32_whole * 1e3, "f32_gflops": 2.0 * (a.rows * a.cols * b.rows) as f64 / f32_whole / 1e9,
                })
            );
        }
    }
    println!(
        "{}",
        serde_json::json!({"bf16_dot": format!("{dot:?}"), "step_ms": {"pack_a": total[0] * 1e3, "pack_b": total[1] * 1e3, "multiply": total[2] * 1e3, "f32_whole": total[3] * 1e3}})
    );
    Ok(())
}
