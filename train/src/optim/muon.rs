//! Muon (Keller Jordan, 2024, <https://kellerjordan.github.io/posts/muon/>): SGD with Nesterov
//! momentum whose update of each hidden matrix is orthogonalised by five quintic Newton-Schulz
//! iterations, as PyTorch's `torch.optim.Muon` and Keller Jordan's `muon.py` compute it, with
//! either scale of the update: the original `sqrt(max(1, out / in))`, or Moonshot's
//! `0.2 sqrt(max(out, in))` (Liu et al., 2025, "Muon is scalable"), whose updates have AdamW's
//! RMS, so that AdamW's learning rate and weight decay carry over.
//!
//! Only 2-D hidden matrices take it; embeddings, the head, gains and biases stay on AdamW
//! ([`crate::optim::Optimizer`]). A fused projection (GPT-2's `c_attn`, a family's
//! `qkv_proj` and `gate_up_proj`) is orthogonalised part by part, q, k and v (gate and up) each
//! on its own, as modded-nanogpt does: they are separate matrices of the model.
//!
//! candle has no Muon; PyTorch's runs the iteration in bf16. On the CPU the products here run on
//! the project's packed kernel (`gpt_kernels::train::product`), f32 or bf16 as the run's
//! `--dtype`, each matrix on a thread of its own; elsewhere through candle's `matmul`.

use candle_core::{DType, Result, Tensor, Var};
use gpt_kernels::train::{product, Autocast, Operand};
use serde::{Deserialize, Serialize};

/// The quintic iteration's coefficients (Keller Jordan's, PyTorch's defaults).
const NS: (f32, f32, f32) = (3.4445, -4.7750, 2.0315);
/// The smallest norm an update is divided by (PyTorch's `eps`).
const EPS: f32 = 1e-7;

/// How the orthogonalised update of an `(out, in)` matrix is scaled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum MuonScale {
    /// Moonshot's `0.2 sqrt(max(out, in))` (PyTorch's `match_rms_adamw`): an update of AdamW's
    /// RMS, so AdamW's learning rate and weight decay serve.
    #[default]
    MatchAdamw,
    /// Keller Jordan's `sqrt(max(1, out / in))` (PyTorch's `original`), with its own learning rate
    /// (0.02 in his examples).
    Original,
}

impl MuonScale {
    /// The factor for an `(out, in)` matrix.
    pub fn factor(self, out: usize, inputs: usize) -> f64 {
        let (a, b) = (out as f64, inputs as f64);
        match self {
            Self::MatchAdamw => 0.2 * a.max(b).sqrt(),
            Self::Original => (a / b).max(1.0).sqrt(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MuonConfig {
    pub momentum: f64,
    pub nesterov: bool,
    pub ns_steps: usize,
    pub scale: MuonScale,
    pub weight_decay: f64,
    /// The precision of the iteration's products on the CPU.
    pub autocast: Autocast,
}

/// How a variable splits into the matrices Muon orthogonalises one by one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocks {
    /// The variable holds `(in, out)` (GPT-2's `Conv1D`) rather than `(out, in)`.
    pub in_out: bool,
    /// The parts' sizes along the output dimension (one part: the whole matrix).
    pub outputs: Vec<usize>,
}

struct Param {
    name: String,
    var: Var,
    blocks: Blocks,
    /// The momentum buffer, the variable's shape.
    momentum: Tensor,
}

pub struct Muon {
    params: Vec<Param>,
    cfg: MuonConfig,
}

/// One matrix to orthogonalise: `(rows, cols)` row-major.
struct Job {
    values: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Muon {
    pub fn new(vars: Vec<(String, Var, Blocks)>, cfg: MuonConfig) -> Result<Self> {
        let params = vars
            .into_iter()
            .map(|(name, var, blocks)| {
                let (rows, cols) = var.as_tensor().dims2()?;
                let out = if blocks.in_out { cols } else { rows };
                if blocks.outputs.iter().sum::<usize>() != out {
                    candle_core::bail!(
                        "muon: {name}'s parts {:?} do not add up to its {out} outputs",
                        blocks.outputs
                    )
                }
                let momentum = Tensor::zeros(var.shape(), DType::F32, var.device())?;
                Ok(Param {
                    name,
                    var,
                    blocks,
                    momentum,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { params, cfg })
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    /// One update at learning rate `lr` of the parameters `update` picks, from the gradients
    /// (`grads[i]` the i-th parameter's) times `grad_scale`.
    pub fn step(&mut self, grads: &[Tensor], lr: f64, grad_scale: f64, update: impl Fn(usize) -> bool) -> Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!("muon: {} gradients for {} parameters", grads.len(), self.params.len());
        }
        let beta = self.cfg.momentum;
        // The Nesterov update of each picked parameter, and its parts as `(out, in)` matrices.
        let mut updates = Vec::new();
        for (i, (p, g)) in self.params.iter_mut().zip(grads).enumerate() {
            if !update(i) {
                continue;
            }
            let u = match p.var.device().is_cpu() {
                true => nesterov_on_cpu(p, g, beta, grad_scale, self.cfg.nesterov)?,
                false => {
                    let g = (g.detach().to_dtype(DType::F32)? * grad_scale)?;
                    p.momentum = ((&p.momentum * beta)? + (&g * (1.0 - beta))?)?;
                    match self.cfg.nesterov {
                        true => ((g * (1.0 - beta))? + (&p.momentum * beta)?)?,
                        false => p.momentum.clone(),
                    }
                }
            };
            let u = if p.blocks.in_out { u.t()? } else { u }; // (out, in)
            let mut start = 0;
            let mut parts = Vec::with_capacity(p.blocks.outputs.len());
            for &rows in &p.blocks.outputs {
                parts.push(u.narrow(0, start, rows)?.contiguous()?);
                start += rows;
            }
            updates.push((i, parts));
        }
        let parts: Vec<&Tensor> = updates.iter().flat_map(|(_, parts)| parts).collect();
        let orthogonal = orthogonalise_all(&parts, self.cfg.ns_steps, self.cfg.autocast)?;
        let mut orthogonal = orthogonal.into_iter();
        let keep = 1.0 - lr * self.cfg.weight_decay;
        for (i, parts) in updates {
            let p = &self.params[i];
            let mut scaled = Vec::with_capacity(parts.len());
            for part in &parts {
                let o = orthogonal
                    .next()
                    .ok_or_else(|| candle_core::Error::Msg("muon: a part lost".into()))?;
                let (out, inputs) = part.dims2()?;
                scaled.push((o * (lr * self.cfg.scale.factor(out, inputs)))?);
            }
            let delta = Tensor::cat(&scaled, 0)?; // (out, in), times the learning rate
            let delta = if p.blocks.in_out { delta.t()? } else { delta };
            let theta = p.var.as_tensor();
            p.var.set(&((theta * keep)? - delta)?.contiguous()?)?;
        }
        Ok(())
    }

    /// Each parameter's momentum buffer, in the parameters' order.
    pub fn states(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.momentum.clone()).collect()
    }

    /// The momentum buffers by name (`NAME.momentum_buffer`, as PyTorch's Muon calls them).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|p| (format!("{}.momentum_buffer", p.name), p.momentum.clone()))
            .collect()
    }

    /// Restores the buffers saved by [`Muon::state_tensors`], taking them out of `tensors`.
    pub fn load_state(&mut self, tensors: &mut std::collections::HashMap<String, Tensor>) -> Result<()> {
        for p in &mut self.params {
            p.momentum = super::take_state(tensors, &format!("{}.momentum_buffer", p.name), &p.var)?;
        }
        Ok(())
    }
}

/// On the CPU, in one pass over the values: the momentum `m = β m + (1 − β) g` (in place of
/// candle's four element-wise ops, a fifth of Muon's time outside its products at nanoGPT's
/// CPU recipe) and the update, Nesterov's `(1 − β) g + β m` or `m`; `g` times `grad_scale`.
fn nesterov_on_cpu(p: &mut Param, g: &Tensor, beta: f64, grad_scale: f64, nesterov: bool) -> Result<Tensor> {
    let shape = p.var.shape().clone();
    let g = g.detach().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut m = p.momentum.flatten_all()?.to_vec1::<f32>()?;
    if g.len() != m.len() {
        candle_core::bail!("muon: {}: {} gradients for {} values", p.name, g.len(), m.len());
    }
    let (beta, scale) = (beta as f32, grad_scale as f32);
    let mut u = Vec::with_capacity(g.len());
    for (m, &g) in m.iter_mut().zip(&g) {
        let g = g * scale;
        *m = beta * *m + (1.0 - beta) * g;
        u.push(if nesterov { (1.0 - beta) * g + beta * *m } else { *m });
    }
    p.momentum = Tensor::from_vec(m, &shape, &candle_core::Device::Cpu)?;
    Tensor::from_vec(u, &shape, &candle_core::Device::Cpu)
}

/// Each matrix orthogonalised ([`newton_schulz`]): on the CPU each on a thread of its own
/// (the products' kernel splits one product over candle's pool instead when that has workers,
/// as under `--parallel ops`); elsewhere with candle's products. The result is the same however
/// the matrices are shared out.
fn orthogonalise_all(parts: &[&Tensor], steps: usize, autocast: Autocast) -> Result<Vec<Tensor>> {
    if parts.iter().any(|p| !p.device().is_cpu()) {
        return parts.iter().map(|p| newton_schulz_tensor(p, steps)).collect();
    }
    let jobs = parts
        .iter()
        .map(|p| {
            let (rows, cols) = p.dims2()?;
            Ok(Job {
                values: p.flatten_all()?.to_vec1::<f32>()?,
                rows,
                cols,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let pool_has_workers = candle_core::utils::barrier_pool().n_workers() > 0;
    let threads = match pool_has_workers {
        true => 1,
        false => crate::step::cpu_threads(None).min(jobs.len()).max(1),
    };
    // Each thread takes every `threads`-th matrix from the largest down (work ~ rows² cols).
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].rows.min(jobs[i].cols).pow(2) * jobs[i].rows.max(jobs[i].cols)));
    let results = crate::step::in_threads(threads, |w| {
        order
            .iter()
            .skip(w)
            .step_by(threads)
            .map(|&i| {
                let job = &jobs[i];
                Ok((i, newton_schulz(&job.values, job.rows, job.cols, steps, autocast)?))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    })
    .map_err(|e| candle_core::Error::Msg(format!("muon: {e}")))?;
    let mut out: Vec<Option<Tensor>> = vec![None; jobs.len()];
    for (i, values) in results.into_iter().flatten() {
        out[i] = Some(Tensor::from_vec(
            values,
            (jobs[i].rows, jobs[i].cols),
            &candle_core::Device::Cpu,
        )?);
    }
    out.into_iter()
        .map(|t| t.ok_or_else(|| candle_core::Error::Msg("muon: a matrix was not orthogonalised".into())))
        .collect()
}

/// `steps` quintic Newton-Schulz iterations towards the orthogonal factor of `g` `(rows, cols)`
/// row-major, as PyTorch's `_zeropower_via_newtonschulz` (on the wide orientation, `X X^T` the
/// smaller Gram matrix): `X = G / max(|G|_F, eps)`, then `A = X X^T`,
/// `X = a X + (b A + c A A) X`. Returns `(rows, cols)` row-major.
pub fn newton_schulz(g: &[f32], rows: usize, cols: usize, steps: usize, autocast: Autocast) -> Result<Vec<f32>> {
    let tall = rows > cols;
    let (r, c) = if tall { (cols, rows) } else { (rows, cols) };
    let mut x: Vec<f32> = match tall {
        true => Operand::rows(g, rows, cols).t().row_major().into_owned(),
        false => g.to_vec(),
    };
    let norm = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt() as f32;
    let inv = 1.0 / norm.max(EPS);
    x.iter_mut().for_each(|v| *v *= inv);
    let (a, b, cc) = NS;
    for _ in 0..steps {
        let gram = product(Operand::rows(&x, r, c), Operand::rows(&x, r, c), autocast)?; // X X^T (r, r)
        let gram2 = product(Operand::rows(&gram, r, r), Operand::rows(&gram, r, r), autocast)?; // A A^T = A A
        let poly: Vec<f32> = gram.iter().zip(&gram2).map(|(&g1, &g2)| b * g1 + cc * g2).collect(); // (r, r)
                                                                                                   // (b A + c A A) X: the right operand X^T (c, r), whose transpose X is row-major.
        let px = product(Operand::rows(&poly, r, r), Operand::columns(&x, c, r), autocast)?; // (r, c)
        x.iter_mut().zip(&px).for_each(|(v, &p)| *v = a * *v + p);
    }
    Ok(match tall {
        true => Operand::rows(&x, r, c).t().row_major().into_owned(),
        false => x,
    })
}

/// [`newton_schulz`] with candle's ops (f32), for tensors off the CPU.
fn newton_schulz_tensor(g: &Tensor, steps: usize) -> Result<Tensor> {
    let (rows, cols) = g.dims2()?;
    let tall = rows > cols;
    let g = g.to_dtype(DType::F32)?;
    let x = if tall { g.t()?.contiguous()? } else { g };
    let norm = x.sqr()?.sum_all()?.sqrt()?.to_scalar::<f32>()?;
    let mut x = (x / f64::from(norm.max(EPS)))?;
    let (a, b, c) = NS;
    for _ in 0..steps {
        let gram = x.matmul(&x.t()?)?;
        let poly = ((&gram * f64::from(b))? + (gram.matmul(&gram)? * f64::from(c))?)?;
        x = ((&x * f64::from(a))? + poly.matmul(&x)?)?;
    }
    if tall {
        x = x.t()?.contiguous()?;
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: usize) -> Vec<f32> {
        gpt_test_support::uniform(len, seed as u64)
    }

    /// The iteration on the packed kernel equals candle's ops, wide and tall.
    #[test]
    fn newton_schulz_on_the_kernel_equals_candles_ops() -> Result<()> {
        for (rows, cols) in [(24, 40), (40, 24), (16, 16)] {
            let g = values(rows * cols, rows);
            let ours = newton_schulz(&g, rows, cols, 5, Autocast::Off)?;
            let theirs = newton_schulz_tensor(&Tensor::from_vec(g, (rows, cols), &candle_core::Device::Cpu)?, 5)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let worst = ours
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-4, "({rows}, {cols}): {worst}");
        }
        Ok(())
    }

    /// Five iterations bring every singular value into about (0.5, 1.5) (Keller Jordan's
    /// description of the quintic's fixed band): `X^T X` near the identity on the diagonal.
    #[test]
    fn newton_schulz_flattens_the_spectrum() -> Result<()> {
        let (rows, cols) = (32, 64);
        // Rows scaled from 1 to 8: singular values far apart.
        let mut g = values(rows * cols, 3);
        for (r, row) in g.chunks_mut(cols).enumerate() {
            row.iter_mut().for_each(|v| *v *= 1.0 + 7.0 * r as f32 / rows as f32);
        }
        let x = newton_schulz(&g, rows, cols, 5, Autocast::Off)?;
        let gram = product(
            Operand::rows(&x, rows, cols),
            Operand::rows(&x, rows, cols),
            Autocast::Off,
        )?;
        for r in 0..rows {
            let d = gram[r * rows + r];
            assert!((0.2..2.3).contains(&d), "row {r}: |x_r|² = {d}");
        }
        Ok(())
    }

    #[test]
    fn scales() {
        assert!((MuonScale::MatchAdamw.factor(512, 128) - 0.2 * 512f64.sqrt()).abs() < 1e-12);
        assert_eq!(MuonScale::Original.factor(128, 512), 1.0);
        assert_eq!(MuonScale::Original.factor(512, 128), 2.0);
    }
}
