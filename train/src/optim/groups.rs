//! The parameter groups of a run: which rule updates each variable (AdamW, or Muon for the
//! hidden matrices under `--optimizer muon`) and at what share of the schedule's learning rate
//! (`--embedding-lr`, `--head-lr`, `--muon-lr`), behind the one interface the trainer steps,
//! checkpoints and shares between ranks.

use std::collections::HashMap;

use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};

use super::muon::{Blocks, Muon, MuonConfig};
use super::{clip_factor, AdamW, AdamWConfig};

/// `--optimizer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// AdamW for every parameter.
    #[default]
    Adamw,
    /// Muon for the hidden matrices (attention and MLP projections), AdamW for the embeddings,
    /// the head, gains and biases.
    Muon,
}

/// Where the trainer's i-th variable is updated.
#[derive(Debug, Clone, Copy)]
enum Slot {
    AdamW(usize),
    Muon(usize),
}

pub struct Optimizer {
    adamw: AdamW,
    /// Muon and its learning rate's share of the schedule's.
    muon: Option<(Muon, f64)>,
    slots: Vec<Slot>,
    vars: Vec<Var>,
}

/// Muon's part of a run: its settings, its learning rate's share of the schedule's, and which
/// variables it takes (with the matrices each holds).
pub struct MuonGroup<'a> {
    pub cfg: MuonConfig,
    pub lr_scale: f64,
    pub blocks: &'a dyn Fn(&str, &Var) -> Option<Blocks>,
}

impl Optimizer {
    /// `named` in the trainer's order (the gradients' order); `lr_scale(name)` each AdamW
    /// parameter's share of the schedule's learning rate.
    pub fn new(
        named: Vec<(String, Var)>,
        adamw: AdamWConfig,
        lr_scale: impl Fn(&str) -> f64,
        muon: Option<MuonGroup>,
    ) -> Result<Self> {
        let vars = named.iter().map(|(_, v)| v.clone()).collect();
        let (mut on_adamw, mut on_muon, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (name, var) in named {
            match muon.as_ref().and_then(|m| (m.blocks)(&name, &var)) {
                Some(blocks) => {
                    slots.push(Slot::Muon(on_muon.len()));
                    on_muon.push((name, var, blocks));
                }
                None => {
                    slots.push(Slot::AdamW(on_adamw.len()));
                    on_adamw.push((name, var));
                }
            }
        }
        let muon = match muon {
            Some(group) => Some((Muon::new(on_muon, group.cfg)?, group.lr_scale)),
            None => None,
        };
        Ok(Self {
            adamw: AdamW::new(on_adamw, adamw)?.with_lr_scales(lr_scale),
            muon,
            slots,
            vars,
        })
    }

    pub fn vars(&self) -> Vec<Var> {
        self.vars.clone()
    }

    /// One update at the schedule's learning rate `lr` from the gradients clipped to a global
    /// norm of at most `max_norm` (0: no clipping).
    pub fn step_clipped(&mut self, grads: &[Tensor], lr: f64, max_norm: f64) -> Result<()> {
        if self.muon.is_none() {
            return self.adamw.step_clipped(grads, lr, max_norm);
        }
        let (_, scale) = clip_factor(grads, max_norm)?;
        self.step_scaled_where(grads, lr, scale, |_| true)
    }

    /// The update of the parameters `update` picks (by index), from the gradients times
    /// `grad_scale`; the others stay as they are.
    pub fn step_scaled_where(
        &mut self,
        grads: &[Tensor],
        lr: f64,
        grad_scale: f64,
        update: impl Fn(usize) -> bool,
    ) -> Result<()> {
        if grads.len() != self.slots.len() {
            candle_core::bail!("{} gradients for {} parameters", grads.len(), self.slots.len());
        }
        let Some((muon, muon_scale)) = &mut self.muon else {
            return self.adamw.step_scaled_where(grads, lr, grad_scale, update);
        };
        let (mut adamw_grads, mut adamw_index, mut muon_grads, mut muon_index) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (i, (slot, g)) in self.slots.iter().zip(grads).enumerate() {
            match slot {
                Slot::AdamW(_) => {
                    adamw_grads.push(g.clone());
                    adamw_index.push(i);
                }
                Slot::Muon(_) => {
                    muon_grads.push(g.clone());
                    muon_index.push(i);
                }
            }
        }
        self.adamw
            .step_scaled_where(&adamw_grads, lr, grad_scale, |j| update(adamw_index[j]))?;
        muon.step(&muon_grads, lr * *muon_scale, grad_scale, |j| update(muon_index[j]))
    }

    /// Each parameter's optimizer state in the parameters' order (AdamW's moments `(2, n)`,
    /// Muon's momentum), their storage: changing them in place changes the optimizer's.
    pub fn moments(&self) -> Vec<Tensor> {
        let adamw = self.adamw.moments();
        let muon = self.muon.as_ref().map(|(m, _)| m.states()).unwrap_or_default();
        self.slots
            .iter()
            .map(|slot| match *slot {
                Slot::AdamW(j) => adamw[j].clone(),
                Slot::Muon(j) => muon[j].clone(),
            })
            .collect()
    }

    /// The state by name: AdamW's `NAME.exp_avg` and `NAME.exp_avg_sq`, Muon's
    /// `NAME.momentum_buffer` (PyTorch's names).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = self.adamw.state_tensors();
        if let Some((muon, _)) = &self.muon {
            out.extend(muon.state_tensors());
        }
        out
    }

    /// Restores the state saved by [`Optimizer::state_tensors`] after `steps` updates.
    pub fn load_state(&mut self, mut tensors: HashMap<String, Tensor>, steps: u64) -> Result<()> {
        if let Some((muon, _)) = &mut self.muon {
            muon.load_state(&mut tensors)?;
        }
        self.adamw.load_state(tensors, steps)
    }
}
