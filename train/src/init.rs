//! Reproducible weight initialisation. candle's CPU random generator cannot be seeded
//! (`Device::set_seed` fails on the CPU), so a training run's initial weights would differ from
//! run to run; this `VarBuilder` backend draws them from a seeded generator instead, in the order
//! the model asks for them, and keeps them as trainable `Var`s in a `VarMap`.

use std::sync::Mutex;

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::{Init, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

struct SeededVarMap {
    varmap: VarMap,
    rng: Mutex<rand_chacha::ChaCha12Rng>,
}

impl SeededVarMap {
    fn sample(&self, shape: &Shape, init: Init) -> Result<Vec<f32>> {
        let n = shape.elem_count();
        let mut rng = self
            .rng
            .lock()
            .map_err(|_| candle_core::Error::Msg("init rng poisoned".into()))?;
        Ok(match init {
            Init::Const(v) => vec![v as f32; n],
            Init::Randn { mean, stdev } => {
                let normal = Normal::new(mean, stdev).map_err(candle_core::Error::wrap)?;
                (0..n).map(|_| normal.sample(&mut *rng) as f32).collect()
            }
            Init::Uniform { lo, up } => (0..n).map(|_| rng.random_range(lo..up) as f32).collect(),
            other => candle_core::bail!("seeded init does not support {other:?}"),
        })
    }
}

impl candle_nn::var_builder::SimpleBackend for SeededVarMap {
    fn get(&self, s: Shape, name: &str, init: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let mut vars = self
            .varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("varmap poisoned".into()))?;
        if let Some(var) = vars.get(name) {
            return Ok(var.as_tensor().clone());
        }
        let values = self.sample(&s, init)?;
        let var = Var::from_tensor(&Tensor::from_vec(values, s, dev)?.to_dtype(dtype)?)?;
        let tensor = var.as_tensor().clone();
        vars.insert(name.to_string(), var);
        Ok(tensor)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        let vars = self
            .varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("varmap poisoned".into()))?;
        vars.get(name)
            .map(|v| v.as_tensor().clone())
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() })
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap.data().lock().map(|v| v.contains_key(name)).unwrap_or(false)
    }
}

/// A `VarBuilder` whose new variables are drawn from `seed` and stored in `varmap` (in f32).
pub fn seeded_var_builder(varmap: &VarMap, seed: u64, device: &Device) -> VarBuilder<'static> {
    let backend = SeededVarMap {
        varmap: varmap.clone(),
        rng: Mutex::new(rand_chacha::ChaCha12Rng::seed_from_u64(seed)),
    };
    VarBuilder::from_backend(Box::new(backend), DType::F32, device.clone())
}

/// The variables of `varmap` with their names, sorted by name: the order in which the optimizer
/// holds them and checkpoints store their state.
pub fn named_vars(varmap: &VarMap) -> Result<Vec<(String, Var)>> {
    let mut named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("varmap poisoned".into()))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(named)
}

/// The blocks' output projections (GPT-2's `attn.c_proj` and `mlp.c_proj`, the families'
/// `o_proj` and `down_proj`; their biases stay) set to zero, as modded-nanogpt starts them: each
/// block then adds nothing to the residual stream until it has learnt to.
pub fn zero_output_projections(named: &[(String, Var)]) -> Result<usize> {
    let mut zeroed = 0;
    for (name, var) in named {
        if ["c_proj.weight", "o_proj.weight", "down_proj.weight"]
            .iter()
            .any(|end| name.ends_with(end))
        {
            var.set(&var.as_tensor().zeros_like()?)?;
            zeroed += 1;
        }
    }
    Ok(zeroed)
}
