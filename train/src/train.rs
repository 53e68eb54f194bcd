//! The training loop: batches → forward → cross-entropy → backward → clip → AdamW, with
//! evaluation, checkpoints (latest in OUT, best in OUT/best) and exact resume.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;
use gpt::checkpoint::{self, write_atomic};
use gpt::{Gpt, Tokenizer};
use serde::{Deserialize, Serialize};

use crate::config::{RunConfig, TrainArgs};
use crate::data::{self, Dataset, Tokens};
use crate::metrics::{Event, Metrics, Progress};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig};

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// Random streams of `data::batch_rng`: training micro-batches use their index; evaluation
/// batches use these offsets, so evaluating never shifts the training batches.
const EVAL_TRAIN_STREAM: u64 = 1 << 32;
const EVAL_VAL_STREAM: u64 = 2 << 32;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// Updates done so far.
    pub step: usize,
    pub best_val_loss: Option<f64>,
    /// Batches are drawn from `data::batch_rng(seed, step, ..)`: this pair is the RNG state.
    pub rng_seed: u64,
    pub last_eval_step: Option<usize>,
    pub elapsed_s: f64,
    pub run: RunConfig,
}

/// The outcome of `train`.
#[derive(Debug)]
pub struct Summary {
    pub step: usize,
    pub best_val_loss: Option<f64>,
    pub interrupted: bool,
}

/// Mean cross-entropy of next-token prediction over all positions of `(B, T)` windows.
pub fn loss(model: &Gpt, x: &Tensor, y: &Tensor, train: bool) -> Result<Tensor> {
    let logits = model.forward_t(x, train)?; // (B, T, V)
    let (b_sz, seq_len, vocab) = logits.dims3()?;
    Ok(gpt::ops::cross_entropy(
        &logits.reshape((b_sz * seq_len, vocab))?,
        &y.flatten_all()?,
    )?)
}

/// Runs `work(0) .. work(n - 1)` on `n` scoped threads (inline when `n` is 1) and returns their
/// results in worker order, or the first error.
fn in_threads<T: Send>(n: usize, work: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
    if n <= 1 {
        return Ok(vec![work(0)?]);
    }
    let work = &work;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n).map(|w| scope.spawn(move || work(w))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a worker thread panicked")))
            })
            .collect()
    })
}

/// Adds `scale * g` into `slot`, detached: a gradient otherwise keeps its step's whole graph
/// alive, and the optimizer's running moments would chain every step's activations (a leak).
fn accumulate(slot: &mut Option<Tensor>, g: &Tensor, scale: f64) -> Result<()> {
    let g = (g.detach() * scale)?;
    *slot = Some(match slot.take() {
        Some(a) => (a + g)?,
        None => g,
    });
    Ok(())
}

/// Gradients of the mean loss over equally sized micro-batches, summed as gradient accumulation
/// does (each micro-batch's loss divided by their count). Returns the mean loss and one gradient
/// per variable (zeros for a variable the loss does not reach).
///
/// With `shards` > 1 each micro-batch is split by rows across that many threads, each running
/// forward and backward on its part (data parallelism: on a few CPU cores this beats spreading
/// every small matmul over them). Shard gradients are weighted by their share of the rows and
/// summed in a fixed order, so the result does not depend on thread timing.
pub fn accumulate_grads(
    model: &Gpt,
    vars: &[Var],
    batches: &[(Tensor, Tensor)],
    shards: usize,
) -> Result<(f64, Vec<Tensor>)> {
    // Every (micro-batch, shard) piece with its weight in the mean.
    let mut pieces = Vec::new();
    for (x, y) in batches {
        let rows = x.dim(0)?;
        let n_shards = shards.clamp(1, rows.max(1));
        let mut start = 0;
        for s in 0..n_shards {
            let len = rows / n_shards + usize::from(s < rows % n_shards);
            let weight = len as f64 / rows as f64 / batches.len() as f64;
            pieces.push((x.narrow(0, start, len)?, y.narrow(0, start, len)?, weight));
            start += len;
        }
    }
    let n_workers = shards.clamp(1, pieces.len().max(1));
    let run_worker = |worker: usize| -> Result<(f64, Vec<Option<Tensor>>)> {
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut total = 0.0;
        for (x, y, weight) in pieces.iter().skip(worker).step_by(n_workers) {
            let loss = loss(model, x, y, true)?;
            total += weight * loss.to_scalar::<f32>()? as f64;
            let grads = loss.backward()?;
            for (slot, var) in acc.iter_mut().zip(vars) {
                if let Some(g) = grads.get(var.as_tensor()) {
                    accumulate(slot, g, *weight)?;
                }
            }
        }
        Ok((total, acc))
    };
    let partials = in_threads(n_workers, run_worker)?;
    let mut total = 0.0;
    let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
    for (loss, grads) in partials {
        total += loss;
        for (slot, g) in acc.iter_mut().zip(grads) {
            if let Some(g) = g {
                accumulate(slot, &g, 1.0)?;
            }
        }
    }
    let grads = acc
        .into_iter()
        .zip(vars)
        .map(|(g, v)| g.map_or_else(|| v.as_tensor().zeros_like(), Ok))
        .collect::<candle_core::Result<_>>()?;
    Ok((total, grads))
}

/// Mean loss over `run.eval_iters` batches of each split, drawn for `step`, the batches spread
/// over `threads` threads (summed in batch order, so the result does not depend on them).
fn estimate_loss(
    model: &Gpt,
    data: &Dataset,
    run: &RunConfig,
    step: usize,
    device: &Device,
    threads: usize,
) -> Result<(f64, f64)> {
    let batch_loss = |tokens: &Tokens, stream: u64, i: usize| -> Result<f64> {
        let mut rng = data::batch_rng(run.seed, step, stream + i as u64);
        let (x, y) = data::get_batch(tokens, run.batch_size, run.block_size(), &mut rng, device)?;
        Ok(loss(model, &x, &y, false)?.to_scalar::<f32>()? as f64)
    };
    let mean = |tokens: &Tokens, stream: u64| -> Result<f64> {
        let threads = threads.clamp(1, run.eval_iters);
        let losses = in_threads(threads, |t| -> Result<Vec<f64>> {
            (t..run.eval_iters)
                .step_by(threads)
                .map(|i| batch_loss(tokens, stream, i))
                .collect()
        })?;
        // Thread t holds batches t, t + threads, ...: put them back in batch order.
        let mut ordered = vec![0.0; run.eval_iters];
        for (t, thread_losses) in losses.into_iter().enumerate() {
            for (k, l) in thread_losses.into_iter().enumerate() {
                ordered[t + k * threads] = l;
            }
        }
        Ok(ordered.iter().sum::<f64>() / run.eval_iters as f64)
    };
    Ok((mean(&data.train, EVAL_TRAIN_STREAM)?, mean(&data.val, EVAL_VAL_STREAM)?))
}

/// The tokenizer for a new run: `char`, `bpe:N`, or a path to a tokenizer.json (or to a
/// directory holding one).
fn build_tokenizer(spec: &str, data: &[PathBuf]) -> Result<Tokenizer> {
    if data.is_empty() {
        bail!("no training data: pass --data FILE");
    }
    for path in data {
        data::read_text(path)?; // empty and non-UTF-8 files are named before tokenizer training
    }
    if spec == "char" {
        return Ok(Tokenizer::train_char(data)?);
    }
    if let Some(n) = spec.strip_prefix("bpe:") {
        let n: usize = n
            .parse()
            .with_context(|| format!("--tokenizer {spec}: N must be a number"))?;
        return Ok(Tokenizer::train_bpe(data, n)?);
    }
    let path = PathBuf::from(spec);
    let path = if path.is_dir() {
        path.join(checkpoint::TOKENIZER_FILE)
    } else {
        path
    };
    if !path.exists() {
        bail!("--tokenizer {spec}: expected char, bpe:N, or the path of a tokenizer.json (not found)");
    }
    Ok(Tokenizer::from_file(&path)?)
}

/// Fails unless `out` can be created and written, before any work is done.
fn check_writable(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("--out {}: cannot create the directory", out.display()))?;
    let probe = out.join(".write-test");
    std::fs::write(&probe, b"").with_context(|| format!("--out {}: directory is not writable", out.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

fn step_metadata(step: usize) -> HashMap<String, String> {
    HashMap::from([("step".to_string(), step.to_string())])
}

fn metadata_step(path: &Path) -> Result<Option<usize>> {
    Ok(checkpoint::read_metadata(path)?
        .get("step")
        .and_then(|s| s.parse().ok()))
}

struct Trainer {
    model: Gpt,
    tokenizer: Tokenizer,
    opt: AdamW,
    out: PathBuf,
}

impl Trainer {
    /// Writes the model, then the optimizer, then the state, each atomically; the step recorded
    /// in all three lets a resume detect a checkpoint cut between two of the writes.
    fn save_latest(&self, state: &TrainerState) -> Result<()> {
        let meta = step_metadata(state.step);
        checkpoint::save_dir_with_metadata(&self.out, &self.model, &self.tokenizer, DType::F32, &meta)?;
        let opt = safetensors::serialize(self.opt.state_tensors(), Some(meta))?;
        write_atomic(&self.out.join(OPTIMIZER_FILE), &opt)?;
        write_atomic(
            &self.out.join(STATE_FILE),
            serde_json::to_string_pretty(state)?.as_bytes(),
        )?;
        Ok(())
    }

    fn save_best(&self, step: usize) -> Result<()> {
        let dir = self.out.join("best");
        checkpoint::save_dir_with_metadata(&dir, &self.model, &self.tokenizer, DType::F32, &step_metadata(step))?;
        Ok(())
    }
}

/// Loads `OUT`'s latest checkpoint into the model's variables and the optimizer.
fn restore(out: &Path, state: &TrainerState, varmap: &VarMap, opt: &mut AdamW, device: &Device) -> Result<()> {
    let weights = out.join(checkpoint::WEIGHTS_FILE);
    let optimizer = out.join(OPTIMIZER_FILE);
    for path in [&weights, &optimizer] {
        let step = metadata_step(path)?;
        if step != Some(state.step) {
            bail!(
                "{} is from step {step:?} but {STATE_FILE} says step {}: the checkpoint was cut while being written",
                path.display(),
                state.step
            );
        }
    }
    let tensors = candle_core::safetensors::load(&weights, device)?;
    let vars = varmap.data().lock().map_err(|_| anyhow::anyhow!("varmap poisoned"))?;
    for (name, var) in vars.iter() {
        let key = format!("transformer.{name}");
        let t = tensors
            .get(&key)
            .with_context(|| format!("{}: tensor {key} missing", weights.display()))?;
        var.set(&t.to_dtype(DType::F32)?)?;
    }
    let state_tensors = candle_core::safetensors::load(&optimizer, device)?;
    opt.load_state(state_tensors, state.step as u64)
        .with_context(|| format!("restoring {}", optimizer.display()))?;
    Ok(())
}

/// Runs `gpt-train train`. `stop` is set by Ctrl-C / SIGTERM: the current step finishes, a
/// checkpoint is saved, and the run returns with `interrupted`.
pub fn train(args: &TrainArgs, stop: &AtomicBool) -> Result<Summary> {
    let out = args.out.clone();
    let state_path = out.join(STATE_FILE);
    let saved: Option<TrainerState> = if args.resume {
        let text = std::fs::read_to_string(&state_path)
            .with_context(|| format!("--resume: no checkpoint to resume in {}", out.display()))?;
        Some(serde_json::from_str(&text).with_context(|| format!("reading {}", state_path.display()))?)
    } else {
        if state_path.exists() {
            bail!(
                "{} already holds a training checkpoint; pass --resume to continue it, or choose another --out",
                out.display()
            );
        }
        None
    };
    check_writable(&out)?;

    let tokenizer = match &saved {
        Some(_) => {
            let tok = Tokenizer::from_file(&out.join(checkpoint::TOKENIZER_FILE))?;
            if let Some(spec) = &args.tokenizer {
                let given = build_tokenizer(spec, &args.data)?;
                if given.inner().to_string(false).ok() != tok.inner().to_string(false).ok() {
                    bail!("--tokenizer {spec} differs from the tokenizer of the checkpoint being resumed");
                }
            }
            tok
        }
        None => build_tokenizer(args.tokenizer.as_deref().unwrap_or("char"), &args.data)?,
    };
    let run = args.resolve(tokenizer.vocab_size(), saved.as_ref().map(|s| &s.run))?;
    let device = gpt::parse_device(&run.device)?;
    let data = data::prepare(
        &run.data,
        run.val_data.as_deref(),
        run.val_fraction,
        &tokenizer,
        &out.join("tokens"),
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

    let shards = if device.is_cpu() { cpu_threads(args.threads) } else { 1 };
    if device.is_cuda() {
        candle_core::cuda::set_gemm_reduced_precision_f32(args.tf32.unwrap_or(true));
        // Dropout masks come from the GPU's generator: seeded by the run and the starting step.
        device.set_seed(run.seed.wrapping_add(saved.as_ref().map_or(0, |s| s.step as u64)))?;
    }
    gpt::ops::set_autocast_bf16(args.dtype.as_deref() == Some("bf16"));
    let varmap = VarMap::new();
    let model = Gpt::new(crate::init::seeded_var_builder(&varmap, run.seed, &device), &run.model)?;
    let mut named: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .map_err(|_| anyhow::anyhow!("varmap poisoned"))?
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut opt = AdamW::new(named, opt_config(&run))?;
    let mut state = match saved {
        Some(saved) => {
            restore(&out, &saved, &varmap, &mut opt, &device)?;
            TrainerState {
                run: run.clone(),
                ..saved
            }
        }
        None => TrainerState {
            step: 0,
            best_val_loss: None,
            rng_seed: run.seed,
            last_eval_step: None,
            elapsed_s: 0.0,
            run: run.clone(),
        },
    };
    let vars = opt.vars();
    let mut trainer = Trainer {
        model,
        tokenizer,
        opt,
        out: out.clone(),
    };
    tracing::info!(
        parameters = trainer.model.num_parameters(),
        device = gpt::device_name(&device),
        threads = shards,
        matmul = if gpt::ops::autocast_bf16() { "bf16" } else { "f32" },
        vocab = run.model.vocab_size,
        train_tokens = data.train.len(),
        val_tokens = data.val.len(),
        step = state.step,
        "training"
    );

    let mut metrics = Metrics::open(&out, args.resume.then_some(state.step))?;
    let progress = Progress::new(state.step, run.max_iters);
    let schedule = run.schedule();
    let started = Instant::now();
    let elapsed_before = state.elapsed_s;
    let elapsed = || elapsed_before + started.elapsed().as_secs_f64();
    let mut interval_start = (Instant::now(), state.step);
    let mut interrupted = false;

    loop {
        let step = state.step;
        let at_end = step >= run.max_iters;
        if (step % run.eval_interval == 0 || at_end) && state.last_eval_step != Some(step) {
            let (train_loss, val_loss) = estimate_loss(&trainer.model, &data, &run, step, &device, shards)?;
            state.last_eval_step = Some(step);
            state.elapsed_s = elapsed();
            metrics.log(Event {
                event: "eval".into(),
                step,
                train_loss: Some(train_loss),
                val_loss: Some(val_loss),
                val_ppl: Some(val_loss.exp()),
                lr: schedule.lr(step.min(run.max_iters.saturating_sub(1))),
                tokens_per_sec: None,
                elapsed_s: state.elapsed_s,
            })?;
            metrics.plot(&out.join("loss.svg"))?;
            progress.println(&format!(
                "step {step}: train loss {train_loss:.4}, val loss {val_loss:.4}, val ppl {:.2}",
                val_loss.exp()
            ));
            if state.best_val_loss.is_none_or(|best| val_loss < best) {
                state.best_val_loss = Some(val_loss);
                trainer.save_best(step)?;
            }
            trainer.save_latest(&state)?;
            interval_start = (Instant::now(), step); // tokens/s measures training alone
        }
        if at_end {
            break;
        }
        if stop.load(Ordering::SeqCst) {
            interrupted = true;
            state.elapsed_s = elapsed();
            trainer.save_latest(&state)?;
            progress.finish();
            eprintln!(
                "interrupted: checkpoint saved at step {step} in {}; continue with: gpt-train train --out {} --resume",
                out.display(),
                out.display()
            );
            return Ok(Summary {
                step,
                best_val_loss: state.best_val_loss,
                interrupted,
            });
        }

        let lr = schedule.lr(step);
        let batches = (0..run.gradient_accumulation_steps)
            .map(|micro| {
                let mut rng = data::batch_rng(run.seed, step, micro as u64);
                data::get_batch(&data.train, run.batch_size, run.block_size(), &mut rng, &device)
            })
            .collect::<Result<Vec<_>>>()?;
        let (train_loss, mut grads) = accumulate_grads(&trainer.model, &vars, &batches, shards)?;
        if !train_loss.is_finite() {
            bail!("the training loss became {train_loss} at step {step}; try a lower --learning-rate");
        }
        clip_grad_norm(&mut grads, run.grad_clip)?;
        trainer.opt.step(&grads, lr)?;
        state.step += 1;

        let log_now = state.step % run.log_interval == 0 || state.step == run.max_iters;
        let secs = interval_start.0.elapsed().as_secs_f64().max(1e-9);
        let tokens_per_sec = ((state.step - interval_start.1) * run.tokens_per_step()) as f64 / secs;
        progress.step(state.step, train_loss, lr, tokens_per_sec, log_now);
        if log_now {
            metrics.log(Event {
                event: "train".into(),
                step: state.step,
                train_loss: Some(train_loss),
                val_loss: None,
                val_ppl: None,
                lr,
                tokens_per_sec: Some(tokens_per_sec),
                elapsed_s: elapsed(),
            })?;
            interval_start = (Instant::now(), state.step);
        }
    }
    progress.finish();
    let best = state.best_val_loss;
    if let Some(best) = best {
        println!(
            "done: {} steps in {:.1}s; best val loss {best:.4} (perplexity {:.2}), saved in {}",
            state.step,
            state.elapsed_s,
            best.exp(),
            out.join("best").display()
        );
    }
    Ok(Summary {
        step: state.step,
        best_val_loss: best,
        interrupted,
    })
}

/// Threads for CPU training: `--threads`, else every core this process may use.
pub fn cpu_threads(requested: Option<usize>) -> usize {
    requested
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Makes candle's own CPU thread pools single-threaded: training parallelises over batch shards
/// instead (see [`accumulate_grads`]). Must run before candle's first operation.
pub fn use_shard_parallelism() {
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        std::env::set_var(var, "1");
    }
}

fn opt_config(run: &RunConfig) -> AdamWConfig {
    AdamWConfig {
        beta1: run.beta1,
        beta2: run.beta2,
        eps: 1e-8,
        weight_decay: run.weight_decay,
    }
}
