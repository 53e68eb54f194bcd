//! `gpt-kernels`: the CPU and CUDA kernels that the `gpt` model runs on, knowing nothing of the
//! GPT itself (as ggml under llama.cpp, or candle-core under candle-transformers). Each kernel is
//! tested bit for bit on every instruction set the host runs.
//!
//! - [`simd`]: the instruction-set layer (which vector instructions this CPU runs, sixteen f32
//!   lanes on each); [`parallel`]: passes spread over candle's thread pool; [`rows`]: reductions
//!   over a row (the softmax normaliser, the most likely token); [`rng`]: fixed-definition
//!   randomness.
//! - [`packed`]: the weight-matrix products, packed per format (f32, f16, bf16, q8_0, q4_0, AMX),
//!   for inference and for training's f32 products alike.
//! - [`tape`]: the backward pass of the fused ops, on a tape; [`elementwise`]: GELU, the causal
//!   softmax, broadcast adds, LayerNorm and dropout with their backward rules, used by both flows.
//! - [`train`]: kernels of training and evaluation over whole windows only: the products under
//!   any layout and bf16 autocast, the fused linear layers, window attention, the LM head fused
//!   with the cross-entropy.
//! - [`infer`]: kernels of generation only: attention of a step's new tokens against their KV
//!   caches.
//! - With the `cuda` feature, each op's CUDA kernel sits beside its launcher; [`cuda`] holds what
//!   the launchers share.
//!
//! The fused ops run for f32 tensors on the CPU (and with `cuda` on the GPU), where [`fused`]
//! says so; callers fall back to candle's ops elsewhere.

#![deny(clippy::undocumented_unsafe_blocks)]

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod elementwise;
mod error;
pub mod infer;
pub mod packed;
mod parallel;
pub mod rng;
pub mod rows;
pub mod simd;
pub mod tape;
#[cfg(test)]
mod tests;
pub mod train;

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};

pub use elementwise::gated::GateActivation;
pub use elementwise::{
    add_dropout, add_rms_norm, add_tiled, causal_mask, causal_softmax, dropout, gated, gelu, layer_norm, relu2,
    rms_norm, rope,
};
pub use error::ParseError;
pub use infer::{
    cached_attention, cached_attention_masked, cached_attention_on, grouped_attention, CachedKv, Masking, WriteRows,
};
pub use packed::{MatmulPrecision, PackedMatrix, WeightFormat};
pub use rows::{argmax, argmax_on, log_sum_exp, log_sum_exp_on};
pub use simd::Simd;
pub use train::{
    affine, affine_gelu, cross_entropy, frozen_affine, linear_product, lm_head_loss, product, repeat_kv_heads,
    scaled_linear_product, segment_mask, segment_starts, window_attention, window_attention_runs_on, Autocast, Bf16Dot,
    Operand, IGNORE,
};

/// The f32 data of a contiguous CPU tensor, for custom ops' `cpu_fwd`.
pub fn f32_slice<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> Result<&'a [f32]> {
    let data = storage.as_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

/// Whether a fused op (here, or the trainer's AdamW update) runs for `x`: f32 on the CPU unless
/// the environment sets `GPT_CPU_FUSED=0`, or on a CUDA GPU unless it sets `GPT_CUDA_FUSED=0`
/// (candle's own ops then, to compare).
pub fn fused(x: &Tensor) -> bool {
    x.dtype() == DType::F32 && ((x.device().is_cpu() && cpu_fused()) || (x.device().is_cuda() && cuda_fused()))
}

/// `GPT_CPU_FUSED` is not `0`.
pub fn cpu_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_on(&ON, "GPT_CPU_FUSED")
}

/// Whether the on/off switch `var` (the `GPT_CPU_*` and `GPT_CUDA_*` variables) is on: anything
/// but `0`, or unset. Read once into `cell`, a static of the caller's, as it is asked per op.
pub fn switch_on(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

/// `GPT_CUDA_FUSED` is not `0`.
pub fn cuda_fused() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch_on(&ON, "GPT_CUDA_FUSED")
}

/// `GPT_CUDA_TAPE` is `1`: training on a CUDA GPU takes the residual stream as rows and runs its
/// backward pass on the tape ([`tape`]). Off unless asked for until it has run on a GPU (its
/// checks are `tests/cuda.rs` and `bench/gpu.sh session`).
pub fn cuda_tape() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("GPT_CUDA_TAPE").is_ok_and(|v| v == "1"))
}
