//! AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), gradient accumulation and
//! clipping by global norm.
//!
//! candle-nn has an `AdamW`, but it keeps its moment estimates private, so they cannot be saved
//! for an exact resume, and it decays every parameter; this one exposes its state and decays only
//! 2-D weight matrices (not biases or LayerNorm parameters), as nanoGPT does.

use std::collections::HashMap;

use candle_core::{DType, Result, Tensor, Var};

#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

struct Param {
    name: String,
    var: Var,
    decay: bool,
    m: Tensor, // first moment
    v: Tensor, // second moment
}

pub struct AdamW {
    params: Vec<Param>,
    steps: u64,
    cfg: AdamWConfig,
}

impl AdamW {
    /// `named_vars` in a fixed order (it is also the order of the gradients given to `step`).
    pub fn new(named_vars: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        let params = named_vars
            .into_iter()
            .map(|(name, var)| {
                let zeros = var.as_tensor().zeros_like()?;
                Ok(Param {
                    decay: var.rank() >= 2,
                    name,
                    var,
                    m: zeros.clone(),
                    v: zeros,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { params, steps: 0, cfg })
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// One update with learning rate `lr`; `grads[i]` belongs to the i-th variable.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!("{} gradients for {} parameters", grads.len(), self.params.len());
        }
        self.steps += 1;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        let bias1 = 1.0 - beta1.powi(self.steps as i32);
        let bias2 = 1.0 - beta2.powi(self.steps as i32);
        for (p, g) in self.params.iter_mut().zip(grads) {
            let g = g.detach(); // the moments must not hold on to any autograd graph
            p.m = ((&p.m * beta1)? + (&g * (1.0 - beta1))?)?;
            p.v = ((&p.v * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&p.m / bias1)?;
            let v_hat = (&p.v / bias2)?;
            let theta = p.var.as_tensor();
            let theta = if p.decay {
                (theta * (1.0 - lr * weight_decay))?
            } else {
                theta.clone()
            };
            let update = (m_hat / (v_hat.sqrt()? + eps)?)?;
            p.var.set(&(theta - (update * lr)?)?)?;
        }
        Ok(())
    }

    /// Moment estimates by name (`NAME.exp_avg`, `NAME.exp_avg_sq`, as PyTorch calls them).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .flat_map(|p| {
                [
                    (format!("{}.exp_avg", p.name), p.m.clone()),
                    (format!("{}.exp_avg_sq", p.name), p.v.clone()),
                ]
            })
            .collect()
    }

    /// Restores the moments saved by [`AdamW::state_tensors`] after `steps` updates.
    pub fn load_state(&mut self, mut tensors: HashMap<String, Tensor>, steps: u64) -> Result<()> {
        for p in &mut self.params {
            for (suffix, slot) in [("exp_avg", &mut p.m), ("exp_avg_sq", &mut p.v)] {
                let name = format!("{}.{suffix}", p.name);
                let t = tensors
                    .remove(&name)
                    .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.clone() })?;
                if t.shape() != p.var.shape() {
                    candle_core::bail!(
                        "optimizer state {name}: shape {:?}, expected {:?}",
                        t.shape(),
                        p.var.shape()
                    );
                }
                *slot = t.to_dtype(DType::F32)?.to_device(p.var.device())?;
            }
        }
        self.steps = steps;
        Ok(())
    }
}

/// Global L2 norm of all gradients together.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    let mut sum = 0f64;
    for g in grads {
        sum += g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    }
    Ok(sum.sqrt())
}

/// Scales the gradients so that their global norm is at most `max_norm` (as PyTorch's
/// `clip_grad_norm_`); returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let norm = global_norm(grads)?;
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for g in grads.iter_mut() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}
