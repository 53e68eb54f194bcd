//! Helpers shared by the model crate's integration tests.
#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use gpt::{Config, Gpt};

/// A model with random weights far from their init (LayerNorm gains included), so that any
/// mix-up of positions, tensors or masks moves the logits well past the test tolerances. The
/// noise (standard deviation 0.3) is keyed by each tensor's name, so that every run draws the
/// same model: a tolerance that one draw in a hundred breaks would fail CI by chance.
pub fn random_model(cfg: &Config) -> anyhow::Result<(VarMap, Gpt)> {
    let varmap = VarMap::new();
    let model = Gpt::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), cfg)?;
    for (name, var) in varmap.data().lock().expect("no test panicked holding the map").iter() {
        // FNV-1a of the name: a seed that does not depend on the map's order.
        let seed = (name.bytes()).fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
        });
        // Uniform on [-1, 1) has standard deviation 1/sqrt(3).
        let noise = support::uniform(var.elem_count(), seed);
        let noise = Tensor::from_vec(noise, var.shape(), &Device::Cpu)?;
        var.set(&(var.as_tensor() + (noise * (0.3 * 3f64.sqrt()))?)?)?;
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
