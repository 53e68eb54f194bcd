//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use gpt::{Config, Gpt};

/// A model with random weights far from their init (LayerNorm gains included), so that any
/// mix-up of positions, tensors or masks moves the logits well past the test tolerances.
pub fn random_model(cfg: &Config) -> anyhow::Result<(VarMap, Gpt)> {
    let varmap = VarMap::new();
    let model = Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), cfg)?;
    for var in varmap.all_vars() {
        let noise = Tensor::randn(0f32, 0.3, var.shape(), &Device::Cpu)?;
        var.set(&(var.as_tensor() + noise)?)?;
    }
    Ok((varmap, model))
}

use gpt_test_support as support;
#[allow(unused_imports)]
pub use support::{max_abs_diff, repo, shakespeare};

/// Deterministic pseudo-random token ids.
pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

pub fn batch(rows: &[Vec<u32>]) -> anyhow::Result<Tensor> {
    Ok(Tensor::new(rows.to_vec(), &Device::Cpu)?)
}
