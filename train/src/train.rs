//! The training loop: batches → forward → cross-entropy → backward → clip → AdamW, with
//! evaluation, crash-safe checkpoints ([`crate::checkpoints`]) and exact resume. A [`Trainer`]
//! holds the run; each concern is one of its methods: setting up or resuming ([`Trainer::new`]),
//! one optimisation step ([`Trainer::step`]), evaluation ([`Trainer::evaluate`]), saving
//! ([`Trainer::save`]) and logging ([`Trainer::log_step`]); [`Trainer::run`] is the loop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Var};
use candle_nn::VarMap;
use gpt::checkpoint;
use gpt::{Gpt, Tokenizer};

use crate::checkpoints::{self, Saved, TrainerState};
use crate::config::{RunConfig, TrainArgs};
use crate::data::{self, Dataset};
use crate::metrics::{Event, Metrics, Progress};
use crate::optim::{AdamW, AdamWConfig};
use crate::schedule::Schedule;
use crate::step::{accumulate_grads, cpu_threads, Objective};

/// The outcome of `train`.
#[derive(Debug)]
pub struct Summary {
    pub step: usize,
    pub best_val_loss: Option<f64>,
    pub interrupted: bool,
}

/// Runs `gpt-train train`. `stop` is set by Ctrl-C / SIGTERM: the current step finishes, a
/// checkpoint is saved, and the run returns with `interrupted`.
pub fn train(args: &TrainArgs, stop: &AtomicBool) -> Result<Summary> {
    Trainer::new(args)?.run(stop)
}

pub struct Trainer {
    run: RunConfig,
    out: PathBuf,
    keep_last: usize,
    device: Device,
    /// Training batches are split into this many shards, one thread each (1 on a GPU and with
    /// `--parallel ops`).
    shards: usize,
    data: Dataset,
    model: Gpt,
    tokenizer: Tokenizer,
    opt: AdamW,
    vars: Vec<Var>,
    state: TrainerState,
    schedule: Schedule,
    metrics: Metrics,
    progress: Progress,
    /// Wall time of this process's part of the run starts here; `state.elapsed_s` adds earlier parts.
    started: Instant,
    elapsed_before: f64,
    /// Where the current tokens/s measurement began: (time, step).
    interval_start: (Instant, usize),
}

impl Trainer {
    /// A new run, or with `--resume` the newest complete checkpoint in `--out`: the checkpoint to
    /// continue, the tokenizer and settings, the data, the model and optimizer, in that order.
    pub fn new(args: &TrainArgs) -> Result<Self> {
        let out = args.out.clone();
        let saved = saved_run(args)?;
        check_writable(&out)?;
        let init_from = match args.init_from.as_deref().filter(|_| saved.is_none()) {
            Some(named) => Some(
                checkpoint::resolve(&named.to_string_lossy())
                    .context("--init-from")?
                    .dir,
            ),
            None => None,
        };
        let tokenizer = run_tokenizer(args, saved.as_ref(), init_from.as_deref())?;
        let init_config = init_from
            .as_deref()
            .map(|dir| gpt::Config::from_file(&dir.join(checkpoint::CONFIG_FILE)))
            .transpose()?;
        let run = args.resolve(
            tokenizer.vocab_size(),
            saved.as_ref().map(|s| &s.state.run),
            init_config.as_ref(),
        )?;
        let device = gpt::parse_device(&run.device)?;
        let data = prepare_data(&run, &tokenizer, &out)?;
        let parallel = args.parallel.unwrap_or_default().resolve(&run.model);
        let shards = if device.is_cpu() {
            parallel.use_cpu_threads(cpu_threads(args.threads))
        } else {
            1
        };
        if device.is_cuda() {
            candle_core::cuda::set_gemm_reduced_precision_f32(args.tf32.unwrap_or(crate::config::defaults::TF32));
        }
        let varmap = VarMap::new();
        let model = Gpt::new(crate::init::seeded_var_builder(&varmap, run.seed, &device), &run.model)?
            .with_autocast(args.dtype.unwrap_or_default().autocast());
        let named = crate::init::named_vars(&varmap)?;
        if let Some(dir) = &init_from {
            load_weights(dir, &named, &device)?;
        }
        let mut opt = AdamW::new(named, opt_config(&run))?;
        let state = match saved {
            Some(saved) => {
                checkpoints::restore(&saved, &varmap, &mut opt, &device)?;
                TrainerState {
                    run: run.clone(),
                    ..saved.state
                }
            }
            None => TrainerState::start(&run),
        };
        tracing::info!(
            parameters = model.num_parameters(),
            device = gpt::device_name(&device),
            threads = cpu_threads(args.threads),
            parallel = ?parallel,
            matmul = ?model.autocast(),
            vocab = run.model.vocab_size,
            train_tokens = data.train.len(),
            val_tokens = data.val.len(),
            step = state.step,
            "training"
        );
        Ok(Self {
            metrics: Metrics::open(&out, args.resume.then_some(state.step))?,
            progress: Progress::new(state.step, run.max_iters),
            schedule: run.schedule(),
            vars: opt.vars(),
            started: Instant::now(),
            elapsed_before: state.elapsed_s,
            interval_start: (Instant::now(), state.step),
            keep_last: args.keep_last.unwrap_or(crate::config::defaults::KEEP_LAST),
            run,
            out,
            device,
            shards,
            data,
            model,
            tokenizer,
            opt,
            state,
        })
    }

    fn elapsed(&self) -> f64 {
        self.elapsed_before + self.started.elapsed().as_secs_f64()
    }

    /// The loop: evaluate (and save) every `eval_interval` steps and at the end, stop cleanly
    /// when `stop` is set, else one step.
    pub fn run(mut self, stop: &AtomicBool) -> Result<Summary> {
        loop {
            let step = self.state.step;
            let at_end = step >= self.run.max_iters;
            if (step.is_multiple_of(self.run.eval_interval) || at_end) && self.state.last_eval_step != Some(step) {
                self.evaluate()?;
                self.save()?;
                self.interval_start = (Instant::now(), step); // tokens/s measures training alone
            }
            if at_end {
                break;
            }
            if stop.load(Ordering::SeqCst) {
                self.save()?;
                self.progress.finish();
                eprintln!(
                    "interrupted: checkpoint saved at step {step} in {}; continue with: gpt-train train --out {} --resume",
                    self.out.display(),
                    self.out.display()
                );
                return Ok(self.summary(true));
            }
            let lr = self.schedule.lr(step);
            let train_loss = self.step(lr)?;
            self.log_step(train_loss, lr)?;
        }
        self.progress.finish();
        if let Some(best) = self.state.best_val_loss {
            println!(
                "done: {} steps in {:.1}s; best val loss {best:.4} (perplexity {:.2}), saved in {}",
                self.state.step,
                self.state.elapsed_s,
                best.exp(),
                self.out.join(checkpoints::BEST).display()
            );
        }
        Ok(self.summary(false))
    }

    fn summary(&self, interrupted: bool) -> Summary {
        Summary {
            step: self.state.step,
            best_val_loss: self.state.best_val_loss,
            interrupted,
        }
    }

    /// One optimisation step at learning rate `lr`: the micro-batches of this step, their
    /// gradients, clipping, AdamW. Returns the training loss.
    pub fn step(&mut self, lr: f64) -> Result<f64> {
        let (run, step) = (&self.run, self.state.step);
        let batches = (0..run.gradient_accumulation_steps)
            .map(|micro| {
                let mut rng = data::batch_rng(run.seed, step, micro as u64);
                data::get_batch(
                    &self.data.train,
                    run.batch_size,
                    run.block_size(),
                    &mut rng,
                    &self.device,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let objective = Objective {
            label_smoothing: run.label_smoothing as f32,
            dropout_key: gpt_kernels::rng::key(&[run.seed, step as u64]),
        };
        let (train_loss, grads) = accumulate_grads(&self.model, &self.vars, &batches, self.shards, objective)?;
        if !train_loss.is_finite() {
            bail!("the training loss became {train_loss} at step {step}; try a lower --learning-rate");
        }
        self.opt.step_clipped(&grads, lr, run.grad_clip)?;
        self.state.step += 1;
        Ok(train_loss)
    }

    /// The progress bar every step; `metrics.jsonl` every `log_interval` steps.
    fn log_step(&mut self, train_loss: f64, lr: f64) -> Result<()> {
        let step = self.state.step;
        let log_now = step.is_multiple_of(self.run.log_interval) || step == self.run.max_iters;
        let secs = self.interval_start.0.elapsed().as_secs_f64().max(1e-9);
        let tokens_per_sec = ((step - self.interval_start.1) * self.run.tokens_per_step()) as f64 / secs;
        self.progress.step(step, train_loss, lr, tokens_per_sec, log_now);
        if log_now {
            self.metrics.log(Event {
                event: "train".into(),
                step,
                train_loss: Some(train_loss),
                val_loss: None,
                val_ppl: None,
                lr,
                tokens_per_sec: Some(tokens_per_sec),
                elapsed_s: self.elapsed(),
            })?;
            self.interval_start = (Instant::now(), step);
        }
        Ok(())
    }

    /// Train and validation loss at this step: logged, plotted, and the best model kept.
    pub fn evaluate(&mut self) -> Result<()> {
        let step = self.state.step;
        let (train_loss, val_loss) =
            crate::eval::estimate_loss(&self.model, &self.data, &self.run, step, &self.device, self.shards)?;
        self.state.last_eval_step = Some(step);
        self.state.elapsed_s = self.elapsed();
        self.metrics.log(Event {
            event: "eval".into(),
            step,
            train_loss: Some(train_loss),
            val_loss: Some(val_loss),
            val_ppl: Some(val_loss.exp()),
            lr: self.schedule.lr(step.min(self.run.max_iters.saturating_sub(1))),
            tokens_per_sec: None,
            elapsed_s: self.state.elapsed_s,
        })?;
        self.metrics.plot(&self.out.join("loss.svg"))?;
        self.progress.println(&format!(
            "step {step}: train loss {train_loss:.4}, val loss {val_loss:.4}, val ppl {:.2}",
            val_loss.exp()
        ));
        if self.state.best_val_loss.is_none_or(|best| val_loss < best) {
            self.state.best_val_loss = Some(val_loss);
            checkpoints::save_best(&self.out, &self.model, &self.tokenizer, step)?;
        }
        Ok(())
    }

    /// A checkpoint of the run as it is now.
    pub fn save(&mut self) -> Result<PathBuf> {
        self.state.elapsed_s = self.elapsed();
        checkpoints::save(
            &self.out,
            &self.model,
            &self.tokenizer,
            &self.opt,
            &self.state,
            self.keep_last,
        )
    }
}

/// With `--resume`, the newest complete checkpoint in `--out` (an error if there is none);
/// without, `None`, after checking that `--out` holds no run that this one would overwrite.
fn saved_run(args: &TrainArgs) -> Result<Option<Saved>> {
    let out = &args.out;
    checkpoints::clean_up(out)?;
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
/// one window.
fn prepare_data(run: &RunConfig, tokenizer: &Tokenizer, out: &Path) -> Result<Dataset> {
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
    Ok(data)
}

/// The tokenizer of a resumed run is its checkpoint's, of a fine-tuning run the `--init-from`
/// checkpoint's (a `--tokenizer` given too must be the same); a new run builds its own.
fn run_tokenizer(args: &TrainArgs, saved: Option<&Saved>, init_from: Option<&Path>) -> Result<Tokenizer> {
    let (dir, what) = match (saved, init_from) {
        (Some(saved), _) => (saved.dir.clone(), "the checkpoint being resumed".to_string()),
        (None, Some(dir)) => (
            dir.to_path_buf(),
            format!("the --init-from checkpoint {}", dir.display()),
        ),
        (None, None) => {
            let spec = args.tokenizer.as_deref().unwrap_or("char");
            return crate::tokenizer::build_tokenizer(spec, &args.data, &args_reading(args, None), &args.out);
        }
    };
    let tok = checkpoint::load_tokenizer(&dir, usize::MAX)?;
    if let Some(spec) = &args.tokenizer {
        let given = crate::tokenizer::build_tokenizer(spec, &args.data, &args_reading(args, saved), &args.out)?;
        if given.inner().to_string(false).ok() != tok.inner().to_string(false).ok() {
            bail!("--tokenizer {spec} differs from the tokenizer of {what}");
        }
    }
    Ok(tok)
}

/// Sets the model's variables to the weights of the checkpoint in `dir` (any GPT-2-layout
/// checkpoint: `transformer.` prefixes, a stored LM head and the old attention buffers are
/// handled by [`gpt::load_model`]).
fn load_weights(dir: &Path, vars: &[(String, Var)], device: &Device) -> Result<()> {
    let base = gpt::load_model(dir, candle_core::DType::F32, device)
        .with_context(|| format!("--init-from {}", dir.display()))?;
    let tensors: std::collections::HashMap<String, candle_core::Tensor> = base
        .named_tensors()?
        .into_iter()
        .map(|(name, t)| (name.trim_start_matches("transformer.").to_string(), t))
        .collect();
    for (name, var) in vars {
        let t = tensors
            .get(name)
            .with_context(|| format!("--init-from {}: tensor `{name}` is missing", dir.display()))?;
        var.set(&t.contiguous()?)
            .with_context(|| format!("--init-from {}: tensor `{name}`", dir.display()))?;
    }
    Ok(())
}

/// How `--data` is read, from the flags, else the run being resumed, else the defaults.
fn args_reading(args: &TrainArgs, saved: Option<&Saved>) -> data::Reading {
    let saved = saved.map(|s| s.state.run.reading()).unwrap_or_default();
    data::Reading {
        text_field: args.text_field.clone().unwrap_or(saved.text_field),
        format: args.data_format.unwrap_or(saved.format),
    }
}

/// Fails unless `out` can be created and written, before any work is done.
fn check_writable(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("--out {}: cannot create the directory", out.display()))?;
    let probe = out.join(".write-test");
    std::fs::write(&probe, b"").with_context(|| format!("--out {}: directory is not writable", out.display()))?;
    let _ = std::fs::remove_file(probe);
    Ok(())
}

fn opt_config(run: &RunConfig) -> AdamWConfig {
    AdamWConfig {
        beta1: run.beta1,
        beta2: run.beta2,
        eps: 1e-8,
        weight_decay: run.weight_decay,
    }
}
