//! Checkpoint averaging ("Attention Is All You Need", §6.1: the base models are the average of
//! the last 5 checkpoints, the big ones of the last 20): the element-wise mean of every parameter
//! over several checkpoints of the same model, saved as a normal checkpoint.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use gpt::checkpoint::{self, CONFIG_FILE, TOKENIZER_FILE, WEIGHTS_FILE};
use gpt::{Config, Gpt, Tokenizer};

/// The parameters of one checkpoint's `model.safetensors` on `device`, under their names without
/// the `transformer.` prefix.
pub(crate) fn parameters(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let path = dir.join(WEIGHTS_FILE);
    let tensors = gpt::files::read_safetensors(&path, device)?;
    Ok(tensors
        .into_iter()
        .filter(|(name, _)| {
            !name.ends_with(".attn.bias") && !name.ends_with(".attn.masked_bias") && name != "lm_head.weight"
        })
        .map(|(name, t)| (name.strip_prefix("transformer.").unwrap_or(&name).to_string(), t))
        .collect())
}

/// The mean of `dirs`' parameters, saved to `out` with the first one's config and tokenizer. The
/// checkpoints must share their config (but for dropout), tokenizer, and tensor names and shapes;
/// an error names what differs.
pub fn average(dirs: &[PathBuf], out: &Path) -> Result<()> {
    let Some(first) = dirs.first() else {
        bail!("no checkpoints to average");
    };
    let cfg = Config::from_file(&first.join(CONFIG_FILE))?;
    let tokenizer = Tokenizer::from_file(&first.join(TOKENIZER_FILE))?;
    let shape_of = |c: &Config| {
        (
            c.vocab_size,
            c.n_positions,
            c.n_embd,
            c.n_layer,
            c.n_head,
            c.bias,
            c.position_embedding,
        )
    };
    let mut sums: HashMap<String, Tensor> = HashMap::new();
    for dir in dirs {
        let other = Config::from_file(&dir.join(CONFIG_FILE))?;
        for (field, a, b) in [
            ("vocab_size", cfg.vocab_size, other.vocab_size),
            ("n_positions", cfg.n_positions, other.n_positions),
            ("n_embd", cfg.n_embd, other.n_embd),
            ("n_layer", cfg.n_layer, other.n_layer),
            ("n_head", cfg.n_head, other.n_head),
        ] {
            if a != b {
                bail!(
                    "{} has {field} {b} but {} has {a}: only checkpoints of one model can be averaged",
                    dir.display(),
                    first.display()
                );
            }
        }
        if shape_of(&other) != shape_of(&cfg) {
            bail!(
                "{} and {} are configured differently (bias or position embedding)",
                dir.display(),
                first.display()
            );
        }
        let tok = Tokenizer::from_file(&dir.join(TOKENIZER_FILE))?;
        if tok.inner().to_string(false).ok() != tokenizer.inner().to_string(false).ok() {
            bail!("{} has another tokenizer than {}", dir.display(), first.display());
        }
        let params = parameters(dir, &Device::Cpu)?;
        if !sums.is_empty() {
            if let Some(name) = params
                .keys()
                .find(|n| !sums.contains_key(*n))
                .or(sums.keys().find(|n| !params.contains_key(*n)))
            {
                bail!(
                    "tensor `{name}` is in one of {} and {} but not the other",
                    dir.display(),
                    first.display()
                );
            }
        }
        for (name, t) in params {
            let t = t.to_dtype(DType::F64)?; // the mean of many f32 checkpoints, without drift
            let sum = match sums.remove(&name) {
                None => t,
                Some(acc) => {
                    if acc.dims() != t.dims() {
                        bail!(
                            "tensor `{name}`: shape {:?} in {} but {:?} in {}",
                            t.dims(),
                            dir.display(),
                            acc.dims(),
                            first.display()
                        );
                    }
                    (acc + t)?
                }
            };
            sums.insert(name, sum);
        }
    }
    let n = dirs.len() as f64;
    let mean: HashMap<String, Tensor> = sums
        .into_iter()
        .map(|(name, sum)| Ok((name, (sum / n)?.to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    let model = Gpt::new(VarBuilder::from_tensors(mean, DType::F32, &Device::Cpu), &cfg)?;
    checkpoint::save_dir(out, &model, &tokenizer, DType::F32)?;
    Ok(())
}
