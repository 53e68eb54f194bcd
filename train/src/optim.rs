//! AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), gradient accumulation and
//! clipping by global norm. In f32 the update is one fused pass per parameter (on the CPU, and
//! on a CUDA GPU with the `cuda` feature).
//!
//! candle-nn has an `AdamW`, but it keeps its moment estimates private, so they cannot be saved
//! for an exact resume, and it decays every parameter; this one exposes its state and decays only
//! 2-D weight matrices (not biases or LayerNorm parameters), as nanoGPT does.

use std::collections::HashMap;

use candle_core::{CpuStorage, CustomOp3, DType, IndexOp, Layout, Result, Shape, Tensor, Var};

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
    /// First and second moments, flattened and stacked: `(2, n)`.
    moments: Tensor,
}

pub struct AdamW {
    params: Vec<Param>,
    steps: u64,
    cfg: AdamWConfig,
}

/// One AdamW update of a flattened parameter: inputs theta `(n)`, grad `(n)`, moments `(2, n)`;
/// output `(3, n)`: the new theta, m and v.
struct FusedUpdate {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    decay: f32,
    bias1: f32,
    bias2: f32,
}

impl FusedUpdate {
    /// AdamW on one run of elements: parameters `t`, gradients `g`, moments `m` and `v` into the
    /// new ones.
    #[allow(clippy::too_many_arguments)]
    fn update(
        &self,
        t: &[f32],
        g: &[f32],
        m: &[f32],
        v: &[f32],
        t_out: &mut [f32],
        m_out: &mut [f32],
        v_out: &mut [f32],
    ) {
        for i in 0..t.len() {
            let mi = self.beta1 * m[i] + (1.0 - self.beta1) * g[i];
            let vi = self.beta2 * v[i] + (1.0 - self.beta2) * g[i] * g[i];
            let update = (mi / self.bias1) / ((vi / self.bias2).sqrt() + self.eps);
            t_out[i] = t[i] * (1.0 - self.lr * self.decay) - self.lr * update;
            m_out[i] = mi;
            v_out[i] = vi;
        }
    }
}

impl CustomOp3 for FusedUpdate {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let slice = |s, l| gpt::ops::f32_slice(s, l, "fused-adamw");
        let (theta, g, mv) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let n = theta.len();
        let (m, v) = mv.split_at(n);
        let mut out = vec![0f32; 3 * n];
        let (new_theta, rest) = out.split_at_mut(n);
        let (new_m, new_v) = rest.split_at_mut(n);
        // Each element on its own: a large parameter's elements are split over the cores (the
        // update runs after the shards' threads, alone), with the same result.
        let threads = if n >= 1 << 20 {
            crate::train::cpu_threads(None)
        } else {
            1
        };
        let per = n.div_ceil(threads.max(1)).max(1);
        std::thread::scope(|scope| {
            let parts = new_theta
                .chunks_mut(per)
                .zip(new_m.chunks_mut(per))
                .zip(new_v.chunks_mut(per))
                .zip(
                    theta
                        .chunks(per)
                        .zip(g.chunks(per))
                        .zip(m.chunks(per).zip(v.chunks(per))),
                );
            for (((t_out, m_out), v_out), ((t, g), (m, v))) in parts {
                scope.spawn(move || self.update(t, g, m, v, t_out, m_out, v_out));
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((3, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let step = gpt::cuda_ops::AdamWStep {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            decay: self.decay,
            bias1: self.bias1,
            bias2: self.bias2,
        };
        gpt::cuda_ops::adamw((s1, l1), (s2, l2), (s3, l3), step)
    }
}

impl AdamW {
    /// `named_vars` in a fixed order (it is also the order of the gradients given to `step`).
    pub fn new(named_vars: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        let params = named_vars
            .into_iter()
            .map(|(name, var)| {
                let moments = Tensor::zeros((2, var.elem_count()), DType::F32, var.device())?;
                Ok(Param {
                    decay: var.rank() >= 2,
                    name,
                    var,
                    moments,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { params, steps: 0, cfg })
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
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
            let g = g.detach().flatten_all()?; // the moments must not hold on to any graph
            let theta = p.var.as_tensor().flatten_all()?;
            let decay = if p.decay { weight_decay } else { 0.0 };
            let (new_theta, moments) = if gpt::ops::fused(&theta) {
                let kernel = FusedUpdate {
                    lr: lr as f32,
                    beta1: beta1 as f32,
                    beta2: beta2 as f32,
                    eps: eps as f32,
                    decay: decay as f32,
                    bias1: bias1 as f32,
                    bias2: bias2 as f32,
                };
                let out = theta.apply_op3_no_bwd(&g.contiguous()?, &p.moments, &kernel)?; // (3, n)
                (out.i(0)?, out.narrow(0, 1, 2)?)
            } else {
                let m = ((p.moments.i(0)? * beta1)? + (&g * (1.0 - beta1))?)?;
                let v = ((p.moments.i(1)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let update = ((&m / bias1)? / ((&v / bias2)?.sqrt()? + eps)?)?;
                let theta = ((theta * (1.0 - lr * decay))? - (update * lr)?)?;
                (theta, Tensor::stack(&[m, v], 0)?)
            };
            p.var.set(&new_theta.reshape(p.var.shape())?)?;
            p.moments = moments;
        }
        Ok(())
    }

    /// Moment estimates by name (`NAME.exp_avg`, `NAME.exp_avg_sq`, as PyTorch calls them).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for p in &self.params {
            for (i, suffix) in ["exp_avg", "exp_avg_sq"].into_iter().enumerate() {
                if let Ok(t) = p.moments.i(i).and_then(|t| t.reshape(p.var.shape())) {
                    out.push((format!("{}.{suffix}", p.name), t));
                }
            }
        }
        out
    }

    /// Restores the moments saved by [`AdamW::state_tensors`] after `steps` updates.
    pub fn load_state(&mut self, mut tensors: HashMap<String, Tensor>, steps: u64) -> Result<()> {
        for p in &mut self.params {
            let mut pair = Vec::with_capacity(2);
            for suffix in ["exp_avg", "exp_avg_sq"] {
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
                pair.push(t.to_dtype(DType::F32)?.to_device(p.var.device())?.flatten_all()?);
            }
            p.moments = Tensor::stack(&pair, 0)?;
        }
        self.steps = steps;
        Ok(())
    }
}

/// Global L2 norm of all gradients together.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    if grads.is_empty() {
        return Ok(0.0);
    }
    // Summed on the device, read back once (one synchronisation on a GPU, not one per tensor).
    let squares = grads
        .iter()
        .map(|g| g.sqr()?.sum_all()?.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let sum = Tensor::stack(&squares, 0)?.sum_all()?.to_scalar::<f64>()?;
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
