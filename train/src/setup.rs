//! What a run starts from, read or made before its first step: the checkpoint it resumes, its
//! tokenizer, its data, the weights it fine-tunes from, and, in a job of several ranks, this
//! rank's device and scratch directory. [`crate::train::Trainer::new`] calls these in order.

use std::path::{Path, PathBuf};

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use gpt::checkpoint;
use gpt::{Adapter, Gpt, Tokenizer};

use crate::checkpoints::{self, Saved};
use crate::config::{LoraRun, RunConfig, TrainArgs};
use crate::data::token_files::DataFormat;
use crate::data::{self, Corpus};
use crate::distributed::World;
use crate::optim::muon::{Blocks, MuonConfig};
use crate::optim::{AdamWConfig, MuonGroup, Optimizer, OptimizerKind};

/// With `--resume`, the newest complete checkpoint in `--out` (an error if there is none);
/// without, `None`, after checking that `--out` holds no run that this one would overwrite. Only
/// rank 0 (`root`) cleans up what a crashed save left there; the other ranks only read.
pub fn saved_run(args: &TrainArgs, root: bool) -> Result<Option<Saved>> {
    let out = &args.out;
    if root {
        checkpoints::clean_up(out)?;
    }
    if args.resume {
        let saved = checkpoints::latest(out)?;
        return Ok(Some(saved.with_context(|| {
            format!("--resume: no complete checkpoint to resume in {}", out.display())
        })?));
    }
    if !checkpoints::list(out)?.is_empty() {
        bail!(
            "{} already holds a training checkpoint; pass --resume to continue it, or choose another --out",
            out.display()
        );
    }
    Ok(None)
}

/// The run's corpus tokenised (cached under `OUT/tokens`) and split, each split long enough for
/// one window; with `--data-format chat`, its conversations rendered with the chat template of
/// `template_dir` (the checkpoint fine-tuned or resumed; none: the fallback play script).
pub fn prepare_data(run: &RunConfig, tokenizer: &Tokenizer, out: &Path, template_dir: Option<&Path>) -> Result<Corpus> {
    if run.data_format == DataFormat::Chat {
        let template = data::chat::template(template_dir)?;
        let read = |paths: &[PathBuf]| -> Result<Vec<data::chat::Example>> {
            data::chat::read(&data::sources::sources(paths, DataFormat::Chat)?, &template, tokenizer)
        };
        let val = run
            .val_data
            .as_ref()
            .map(|v| read(std::slice::from_ref(v)))
            .transpose()?;
        return Ok(Corpus::Chat(data::chat::split(
            read(&run.data)?,
            val,
            run.val_fraction,
        )?));
    }
    let data = data::prepare(
        &run.data,
        run.val_data.as_deref(),
        run.val_fraction,
        tokenizer,
        &out.join("tokens"),
        &run.reading(),
    )?;
    for (name, split) in [("training", &data.train), ("validation", &data.val)] {
        if split.len() < run.block_size() + 1 {
            bail!(
                "the {name} split has {} tokens, fewer than block size + 1 = {}; use more text, a smaller \
                 --block-size, or a different --val-fraction / --val-data",
                split.len(),
                run.block_size() + 1
            );
        }
    }
    Ok(Corpus::Text(data))
}

/// The tokenizer of a resumed run is its checkpoint's, of a fine-tuning run the `--init-from`
/// checkpoint's (a `--tokenizer` given too must be the same); a new run builds its own.
pub fn run_tokenizer(
    args: &TrainArgs,
    saved: Option<&Saved>,
    init_from: Option<&Path>,
    scratch: &Path,
) -> Result<Tokenizer> {
    let (dir, what) = match (saved, init_from) {
        (Some(saved), _) => (saved.dir.clone(), "the checkpoint being resumed".to_string()),
        (None, Some(dir)) => (
            dir.to_path_buf(),
            format!("the --init-from checkpoint {}", dir.display()),
        ),
        (None, None) => {
            let spec = args.tokenizer.as_deref().unwrap_or("char");
            return crate::tokenizer::build_tokenizer(spec, &args.data, &args_reading(args, None), scratch);
        }
    };
    let tok = checkpoint::load_tokenizer(&dir, usize::MAX)?;
    if let Some(spec) = &args.tokenizer {
        let given = crate::tokenizer::build_tokenizer(spec, &args.data, &args_reading(args, saved), scratch)?;
        if given.inner().to_string(false).ok() != tok.inner().to_string(false).ok() {
            bail!("--tokenizer {spec} differs from the tokenizer of {what}");
        }
    }
    Ok(tok)
}

/// Sets the model's variables to the weights of the checkpoint in `dir` (of any family, in any
/// format [`gpt::load_model`] reads: GPT-2's `transformer.` prefixes, a stored LM head and the old
/// attention buffers are handled there), as the trainable model holds them
/// ([`gpt::arch::trainable_tensors`]). A position table longer than the model's (a shorter
/// `--block-size`) gives its first rows.
pub fn load_weights(dir: &Path, vars: &[(String, Var)], device: &Device) -> Result<()> {
    let tensors = base_tensors(dir, device)?;
    for (name, var) in vars {
        let mut t = tensors
            .get(name)
            .with_context(|| format!("--init-from {}: tensor `{name}` is missing", dir.display()))?
            .clone();
        if name == "wpe.weight" && t.dim(0)? > var.dim(0)? {
            t = t.narrow(0, 0, var.dim(0)?)?;
        }
        var.set(&t.contiguous()?)
            .with_context(|| format!("--init-from {}: tensor `{name}`", dir.display()))?;
    }
    Ok(())
}

/// The weights of the checkpoint `dir` by the names of a trainable model's variables, in f32.
fn base_tensors(dir: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let base = gpt::load_model(dir, DType::F32, device).with_context(|| format!("--init-from {}", dir.display()))?;
    let named = base.named_tensors()?.into_iter().collect();
    gpt::arch::trainable_tensors(base.config(), named).with_context(|| format!("--init-from {}", dir.display()))
}

/// A LoRA run's model: its base (`run.init_from`) frozen, plain tensors that no gradient
/// reaches, with a fresh adapter whose matrices are the variables of `varmap` (drawn from the
/// run's seed; a resumed run then restores them).
pub fn lora_model(run: &RunConfig, lora: &LoraRun, varmap: &VarMap, device: &Device) -> Result<(Gpt, Adapter)> {
    let named = run
        .init_from
        .as_deref()
        .context("--lora-r trains an adapter on a base model: pass it with --init-from CHECKPOINT")?;
    let dir = checkpoint::resolve(&named.to_string_lossy())
        .context("--init-from")?
        .dir;
    if let Some(base) = &lora.base {
        return quantized_base_model(run, lora, base, &dir, varmap, device);
    }
    // GPT-2's straight from the file where there is one (a packed copy for inference, then an
    // f32 copy of it, would double the base's memory while loading); the other families' as
    // their trainable model holds them (q, k, v stacked...: `gpt::arch::trainable_tensors`).
    let gpt2 = run.model.is_gpt2_shaped();
    let frozen = if gpt2 && dir.join(checkpoint::WEIGHTS_FILE).is_file() {
        crate::average::parameters(&dir, device)?
    } else {
        base_tensors(&dir, device)?
    };
    let mut model = Gpt::new_trainable(VarBuilder::from_tensors(frozen, DType::F32, device), &run.model)
        .with_context(|| format!("--init-from {}", dir.display()))?;
    let vb = crate::init::seeded_var_builder(varmap, run.seed, device);
    let adapter = Adapter::init(lora.peft_config(Some(named)), &run.model, &vb)?;
    model.set_adapter(Some(&adapter))?;
    Ok((model, adapter))
}

/// [`lora_model`] with the base held as inference holds it, in `base` (`--lora-base`: `stored`
/// or a weight format), on the CPU: QLoRA's frozen quantized base.
fn quantized_base_model(
    run: &RunConfig,
    lora: &LoraRun,
    base: &str,
    dir: &Path,
    varmap: &VarMap,
    device: &Device,
) -> Result<(Gpt, Adapter)> {
    if !device.is_cpu() {
        bail!("--lora-base {base}: a base held packed or quantized trains on the CPU only; on a GPU leave it out");
    }
    let format = match base {
        "stored" => None,
        f => Some(
            f.parse::<gpt::WeightFormat>()
                .map_err(|e| anyhow::anyhow!("--lora-base: {e}"))?,
        ),
    };
    // The embedding and the head dense, as QLoRA leaves them (and the loss then fused).
    let (model, _) = gpt::load_dir_as(dir, format, device).with_context(|| format!("--init-from {}", dir.display()))?;
    let mut model = model.with_dense_embeddings()?;
    let (have, want) = (model.config(), &run.model);
    if (have.resid_pdrop, have.embd_pdrop, have.attn_pdrop) != (want.resid_pdrop, want.embd_pdrop, want.attn_pdrop) {
        bail!(
            "--lora-base {base} keeps the base's dropout (residual, embedding, attention: {}, {}, {}); \
             --dropout {} would change it",
            have.resid_pdrop,
            have.embd_pdrop,
            have.attn_pdrop,
            want.resid_pdrop
        );
    }
    let vb = crate::init::seeded_var_builder(varmap, run.seed, device);
    let adapter = Adapter::init(lora.peft_config(run.init_from.as_deref()), &run.model, &vb)?;
    model.set_adapter(Some(&adapter))?;
    Ok((model, adapter))
}

/// How `--data` is read, from the flags, else the run being resumed, else the defaults.
pub fn args_reading(args: &TrainArgs, saved: Option<&Saved>) -> data::Reading {
    let saved = saved.map(|s| s.state.run.reading()).unwrap_or_default();
    data::Reading {
        text_field: args.text_field.clone().unwrap_or(saved.text_field),
        format: args.data_format.unwrap_or(saved.format),
    }
}

/// Where this rank may write what it builds a tokenizer from: `--out` for rank 0, a directory of
/// its own under the system's temporary directory for the others (which never write `--out`).
pub fn scratch_dir(args: &TrainArgs, world: &World) -> PathBuf {
    if world.is_root() {
        return args.out.clone();
    }
    std::env::temp_dir().join(format!("gpt-train-rank{}-{}", world.rank(), std::process::id()))
}

/// The device this rank trains on: `--device` as given, except that in a job of several ranks
/// `cuda` (or `auto` finding CUDA) means the GPU of this rank's place on its host, among those
/// visible (one per rank, as `CUDA_VISIBLE_DEVICES` or the local rank gives them).
pub fn rank_device(spec: &str, world: &World) -> Result<Device> {
    let device = gpt::parse_device(spec)?;
    if world.size() == 1 || !device.is_cuda() || spec.starts_with("cuda:") {
        return Ok(device);
    }
    Ok(gpt::parse_device(&format!(
        "cuda:{}",
        world.local_rank() % gpu_count().max(1)
    ))?)
}

#[cfg(feature = "cuda")]
fn gpu_count() -> usize {
    candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().map_or(1, |n| n.max(0) as usize)
}

#[cfg(not(feature = "cuda"))]
fn gpu_count() -> usize {
    1
}

/// Fails unless `out` can be created and written, before any work is done.
pub fn check_writable(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("--out {}: cannot create the directory", out.display()))?;
    let probe = out.join(".write-test");
    std::fs::write(&probe, b"").with_context(|| format!("--out {}: directory is not writable", out.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

/// The run's optimizer over `named` (the trainer's variables, in order): AdamW for every one, or
/// under `--optimizer muon` Muon for the hidden matrices, its products at the training products'
/// precision `autocast`; each group at its learning rate.
pub fn optimizer(run: &RunConfig, named: Vec<(String, Var)>, autocast: gpt::Autocast) -> Result<Optimizer> {
    let share = |lr: Option<f64>| match run.learning_rate > 0.0 {
        true => lr.map_or(1.0, |lr| lr / run.learning_rate),
        false => 0.0,
    };
    let (embedding, head) = (share(run.embedding_lr), share(run.head_lr));
    let lr_scale = move |name: &str| {
        if EMBEDDINGS.iter().any(|e| name.ends_with(e)) {
            embedding
        } else if name.ends_with(HEAD) {
            head
        } else {
            1.0
        }
    };
    let cfg = &run.model;
    let blocks = |name: &str, var: &Var| muon_blocks(cfg, name, var);
    let muon = (run.optimizer == OptimizerKind::Muon).then(|| MuonGroup {
        cfg: MuonConfig {
            momentum: run.muon_momentum,
            nesterov: true,
            ns_steps: 5,
            scale: run.muon_scale,
            weight_decay: run.weight_decay,
            autocast,
        },
        lr_scale: share(Some(run.muon_lr())),
        blocks: &blocks,
    });
    Ok(Optimizer::new(named, opt_config(run), lr_scale, muon)?)
}

/// The embeddings' and the head's names' ends (GPT-2's and the families').
const EMBEDDINGS: [&str; 3] = ["wte.weight", "wpe.weight", "embed_tokens.weight"];
const HEAD: &str = "lm_head.weight";

/// The matrices Muon takes in the variable `name` of a model of `cfg`: a hidden 2-D matrix
/// (not an embedding or the head), split into q, k and v, or gate and up, where the model
/// holds them fused. `None` for the variables AdamW keeps.
pub fn muon_blocks(cfg: &gpt::Config, name: &str, var: &Var) -> Option<Blocks> {
    let (rows, cols) = var.as_tensor().dims2().ok()?;
    if EMBEDDINGS.iter().any(|e| name.ends_with(e)) || name.ends_with(HEAD) {
        return None;
    }
    if cfg.is_gpt2_shaped() {
        // GPT-2's Conv1D holds (in, out); c_attn is q, k and v side by side.
        let outputs = match name.ends_with("attn.c_attn.weight") {
            true => vec![cfg.n_embd; 3],
            false => vec![cols],
        };
        return Some(Blocks { in_out: true, outputs });
    }
    use gpt::arch::names::{GATE_UP, QKV};
    let outputs = if name.ends_with(&format!("{QKV}.weight")) {
        vec![cfg.q_width(), cfg.kv_width(), cfg.kv_width()]
    } else if name.ends_with(&format!("{GATE_UP}.weight")) {
        vec![cfg.mlp_width(); if cfg.variant.gated_mlp { 2 } else { 1 }]
    } else {
        vec![rows]
    };
    Some(Blocks { in_out: false, outputs })
}

pub fn opt_config(run: &RunConfig) -> AdamWConfig {
    AdamWConfig {
        beta1: run.beta1,
        beta2: run.beta2,
        eps: 1e-8,
        weight_decay: run.weight_decay,
    }
}
