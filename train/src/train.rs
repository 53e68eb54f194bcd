//! The training loop: batches → forward → cross-entropy → backward → clip → AdamW, with
//! evaluation, crash-safe checkpoints ([`crate::checkpoints`]) and exact resume. A [`Trainer`]
//! holds the run; each concern is one of its methods: setting up or resuming ([`Trainer::new`]),
//! one optimisation step ([`Trainer::step`]), evaluation ([`Trainer::evaluate`]), saving
//! ([`Trainer::save`]) and logging ([`Trainer::log_step`]); [`Trainer::run`] is the loop.
//!
//! In a data-parallel job ([`World`] of several ranks) every rank runs this loop on its share of
//! each batch's rows, the gradients summed across ranks before the update; rank 0 alone writes
//! (checkpoints, metrics, the progress line), and the others only read `--out`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Var};
use candle_nn::VarMap;
use gpt::checkpoint;
use gpt::{Gpt, Tokenizer};
use gpt_kernels::train::bf16::Bf16Dot;

use crate::checkpoints::{self, TrainerState};
use crate::config::{RunConfig, TrainArgs};
use crate::data::{self, Corpus};
use crate::distributed::{agree, World};
use crate::metrics::{Event, Metrics, Progress};
use crate::optim::Optimizer;
use crate::schedule::Schedule;
use crate::setup;
use crate::step::{accumulate_grads, cpu_threads, Objective, RowShare};

/// The outcome of `train`.
#[derive(Debug)]
pub struct Summary {
    pub step: usize,
    pub best_val_loss: Option<f64>,
    pub interrupted: bool,
}

/// Runs `gpt-train train` as this process's part of `world`. `stop` is set by Ctrl-C / SIGTERM
/// (on any rank): the current step finishes, a checkpoint is saved, and the run returns with
/// `interrupted`.
pub fn train(args: &TrainArgs, stop: &AtomicBool, world: &World) -> Result<Summary> {
    Trainer::new(args, world)?.run(stop)
}

pub struct Trainer<'w> {
    world: &'w World,
    /// Compare the ranks' parameters every this many steps (0: at evaluations only).
    check_replicas_every: usize,
    /// In a job of several ranks on CPUs (f32 gradients whose norm is summed from each owner's
    /// squares), the rank that updates each parameter ([`crate::distributed::owners`]); empty
    /// otherwise (every rank updates every parameter).
    owners: Vec<usize>,
    /// Sum the gradients onto their owners during the backward pass (`--overlap-allreduce`).
    overlap: bool,
    run: RunConfig,
    out: PathBuf,
    keep_last: usize,
    device: Device,
    /// Training batches are split into this many shards, one thread each (1 on a GPU and with
    /// `--parallel ops`).
    shards: usize,
    data: Corpus,
    model: Gpt,
    /// A LoRA run's adapter (set on `model`; its matrices are the variables).
    adapter: Option<gpt::Adapter>,
    tokenizer: Tokenizer,
    opt: Optimizer,
    vars: Vec<Var>,
    state: TrainerState,
    schedule: Schedule,
    /// Rank 0's; the other ranks write none.
    metrics: Option<Metrics>,
    progress: Progress,
    /// Wall time of this process's part of the run starts here; `state.elapsed_s` adds earlier parts.
    started: Instant,
    elapsed_before: f64,
    /// Where the current tokens/s measurement began: (time, step).
    interval_start: (Instant, usize),
}

impl<'w> Trainer<'w> {
    /// A new run, or with `--resume` the newest complete checkpoint in `--out`: the checkpoint to
    /// continue, the tokenizer and settings, the data, the model and optimizer, in that order;
    /// in a job of several ranks, then the checks that they all run the same job.
    pub fn new(args: &TrainArgs, world: &'w World) -> Result<Self> {
        let out = args.out.clone();
        let root = world.is_root();
        let saved = setup::saved_run(args, root)?;
        if root {
            setup::check_writable(&out)?;
        }
        let init_from = match args.init_from.as_deref().filter(|_| saved.is_none()) {
            Some(named) => Some(
                checkpoint::resolve(&named.to_string_lossy())
                    .context("--init-from")?
                    .dir,
            ),
            None => None,
        };
        let scratch = setup::scratch_dir(args, world);
        let tokenizer = setup::run_tokenizer(args, saved.as_ref(), init_from.as_deref(), &scratch);
        if !root {
            let _ = std::fs::remove_dir_all(&scratch); // its own, under the temporary directory
        }
        let tokenizer = tokenizer?;
        let init_config = init_from.as_deref().map(checkpoint::load_config).transpose()?;
        let run = args.resolve(
            tokenizer.vocab_size(),
            saved.as_ref().map(|s| &s.state.run),
            init_config.as_ref(),
        )?;
        if !run.batch_size.is_multiple_of(world.size()) {
            return Err(agree::JobError(format!(
                "--batch-size {} does not divide among {} ranks: each rank trains an equal share of every \
                 batch's rows; use a multiple of {}",
                run.batch_size,
                world.size(),
                world.size()
            ))
            .into());
        }
        let device = setup::rank_device(&run.device, world)?;
        if args.allreduce_bucket_mb.is_nan() || args.allreduce_bucket_mb <= 0.0 {
            bail!(
                "--allreduce-bucket-mb {}: must be more than 0",
                args.allreduce_bucket_mb
            );
        }
        world.set_bucket_mb(args.allreduce_bucket_mb);
        // Rank 0 tokenises the data into OUT/tokens first; the others then read its cache.
        if !root {
            world.barrier();
        }
        let template_dir = saved.as_ref().map(|s| s.dir.clone()).or_else(|| init_from.clone());
        let data = setup::prepare_data(&run, &tokenizer, &out, template_dir.as_deref())?;
        if root {
            world.barrier();
        }
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
        let autocast = args.dtype.unwrap_or_default().autocast();
        if autocast == gpt::Autocast::Bf16 && !device.is_cuda() {
            Bf16Dot::from_env().map_err(|e| anyhow::anyhow!(e))?;
            let dot = Bf16Dot::detect();
            tracing::info!("bf16 products on {dot:?}");
            if dot == Bf16Dot::Emulated {
                tracing::warn!(
                    "--dtype bf16: this CPU has neither AVX512-BF16 nor AVX2 with FMA, so the bf16 products run \
                     emulated in plain Rust (the same bits, far slower than f32's); --dtype f32 trains faster here"
                );
            }
        }
        let (model, adapter) = match &run.lora {
            None => {
                let model =
                    Gpt::new_trainable(crate::init::seeded_var_builder(&varmap, run.seed, &device), &run.model)?;
                if let Some(dir) = &init_from {
                    setup::load_weights(dir, &crate::init::named_vars(&varmap)?, &device)?;
                }
                (model, None)
            }
            Some(lora) => {
                let (model, adapter) = setup::lora_model(&run, lora, &varmap, &device)?;
                (model, Some(adapter))
            }
        };
        let model = model
            .with_autocast(autocast)
            .with_activation_checkpointing(args.activation_checkpointing);
        if args.activation_checkpointing && !model.trains_on_tape() {
            bail!(
                "--activation-checkpointing runs on the CPU's training path only (--device cpu, f32 weights, \
                 GPT-2's gelu_new activation); this run trains with candle's backward pass"
            );
        }
        let named = crate::init::named_vars(&varmap)?;
        if args.zero_init_proj {
            if saved.is_some() || init_from.is_some() || run.lora.is_some() {
                bail!(
                    "--zero-init-proj starts a new run's output projections at zero; this run starts from a checkpoint"
                );
            }
            crate::init::zero_output_projections(&named)?;
        }
        let mut opt = setup::optimizer(&run, named, autocast)?;
        let mut state = match saved {
            Some(saved) => {
                checkpoints::restore(&saved, &varmap, &mut opt, &device)?;
                if saved.state.world_size != world.size() && root {
                    tracing::info!(
                        saved = saved.state.world_size,
                        now = world.size(),
                        "resuming on another number of ranks: the same batches, rows and dropout masks; \
                         the gradients summed in another order"
                    );
                }
                TrainerState {
                    run: run.clone(),
                    ..saved.state
                }
            }
            None => TrainerState::start(&run),
        };
        state.world_size = world.size();
        let tokenizer_json = tokenizer
            .inner()
            .to_string(false)
            .map_err(|e| anyhow::anyhow!("the tokenizer as JSON: {e}"))?;
        let statement: agree::Statement = vec![
            ("code", agree::code_version()),
            ("flags", agree::flags()),
            ("tokenizer", agree::text_hash(&tokenizer_json)),
            ("training data", agree::corpus_fingerprint(&data, true)),
            ("validation data", agree::corpus_fingerprint(&data, false)),
            ("step", state.step.to_string()),
        ];
        agree::same_job(world, &statement)?;
        agree::same_parameters(world, &opt.vars(), state.step)?;
        let overlap = world.size() > 1
            && device.is_cpu()
            && match args.overlap_allreduce.unwrap_or_default() {
                crate::config::Overlap::Auto => world.hosts() > 1,
                crate::config::Overlap::On => true,
                crate::config::Overlap::Off => false,
            };
        tracing::info!(
            parameters = model.num_parameters(),
            device = gpt::device_name(&device),
            ranks = world.size(),
            hosts = world.hosts(),
            overlap_allreduce = overlap,
            threads = cpu_threads(args.threads),
            parallel = ?parallel,
            matmul = ?model.autocast(),
            checkpointing = model.activation_checkpointing(),
            vocab = run.model.vocab_size,
            train_tokens = data.tokens(true),
            val_tokens = data.tokens(false),
            step = state.step,
            "training"
        );
        if !root {
            // Only rank 0 reports; the others' errors still reach stderr.
            tracing::debug!(rank = world.rank(), "training as a rank of the job");
        }
        Ok(Self {
            metrics: root
                .then(|| Metrics::open(&out, args.resume.then_some(state.step)))
                .transpose()?,
            progress: if root {
                Progress::new(state.step, run.max_iters)
            } else {
                Progress::hidden()
            },
            owners: if world.size() > 1
                && crate::optim::norm_by_sums_of_squares(
                    &opt.vars().iter().map(|v| v.as_tensor().clone()).collect::<Vec<_>>(),
                ) {
                let sizes: Vec<usize> = opt.vars().iter().map(|v| v.elem_count()).collect();
                crate::distributed::owners(&sizes, world.size())
            } else {
                Vec::new()
            },
            overlap,
            world,
            check_replicas_every: args.check_replicas_every,
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
            adapter,
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
    /// A family's LoRA adapter: its stacked updates made again from the matrices the optimizer
    /// updated ([`gpt::Adapter::restack`]), before a pass reads them.
    fn restack_adapter(&mut self) -> Result<()> {
        if let Some(adapter) = self.adapter.as_mut().filter(|_| !self.run.model.is_gpt2_shaped()) {
            adapter.restack(&self.run.model)?;
            self.model.set_adapter(Some(adapter))?;
        }
        Ok(())
    }

    pub fn run(mut self, stop: &AtomicBool) -> Result<Summary> {
        loop {
            let step = self.state.step;
            let at_end = step >= self.run.max_iters;
            let check_now = self.check_replicas_every > 0 && step.is_multiple_of(self.check_replicas_every);
            let eval_now =
                (step.is_multiple_of(self.run.eval_interval) || at_end) && self.state.last_eval_step != Some(step);
            if check_now || eval_now {
                agree::same_parameters(self.world, &self.vars, step)?;
            }
            if eval_now {
                let val_loss = self.evaluate()?;
                self.save()?;
                self.interval_start = (Instant::now(), step); // tokens/s measures training alone
                self.world.take_comm_time(); // and so does the time in collectives
                if let Some(target) = self.run.stop_at_val_loss.filter(|&t| val_loss <= t && !at_end) {
                    self.progress.println(&format!(
                        "stopping: val loss {val_loss:.4} at step {step} is at or below --stop-at-val-loss {target} \
                         ({:.1}s)",
                        self.state.elapsed_s
                    ));
                    break;
                }
            }
            if at_end {
                break;
            }
            // Every rank stops at the same step, however the signal reached them.
            if self.world.any(stop.load(Ordering::SeqCst)) {
                self.save()?;
                self.progress.finish();
                if self.world.is_root() {
                    eprintln!(
                        "interrupted: checkpoint saved at step {step} in {}; continue with: gpt-train train --out {} --resume",
                        self.out.display(),
                        self.out.display()
                    );
                }
                return Ok(self.summary(true));
            }
            let lr = self.schedule.lr(step);
            let train_loss = self.step(lr)?;
            self.log_step(train_loss, lr)?;
        }
        self.progress.finish();
        if let Some(best) = self.state.best_val_loss.filter(|_| self.world.is_root()) {
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
        self.restack_adapter()?;
        let (run, step) = (&self.run, self.state.step);
        let batch_size = run.batch_at(step, self.world.size());
        let batches = (0..run.gradient_accumulation_steps)
            .map(|micro| {
                let mut rng = data::batch_rng(run.seed, step, micro as u64);
                self.data
                    .batch(true, batch_size, run.block_size(), &mut rng, &self.device)
            })
            .collect::<Result<Vec<_>>>()?;
        let objective = Objective {
            label_smoothing: run.label_smoothing as f32,
            dropout_key: gpt_kernels::rng::key(&[run.seed, step as u64]),
            share: RowShare {
                rank: self.world.rank(),
                ranks: self.world.size(),
            },
        };
        let started = Instant::now();
        // A job of several ranks on CPUs: each rank updates the parameters it owns.
        let owned_update = !self.owners.is_empty();
        let (train_loss, computed, mut grads) = if owned_update && self.overlap {
            self.overlapped_step(&batches, objective)?
        } else {
            let (loss, grads) = accumulate_grads(&self.model, &self.vars, &batches, self.shards, objective)?;
            (loss, Instant::now(), grads)
        };
        if owned_update && !self.overlap {
            self.world.reduce_to_owners(&mut grads, &self.owners)?;
        } else if !owned_update {
            self.world.sum_grads(&mut grads)?;
        }
        let summed = Instant::now();
        let mut train_loss = [train_loss];
        self.world.sum_f64(&mut train_loss);
        let [train_loss] = train_loss;
        if !train_loss.is_finite() {
            bail!("the training loss became {train_loss} at step {step}; try a lower --learning-rate");
        }
        if owned_update {
            self.update_owned(&grads, lr)?;
        } else {
            self.opt.step_clipped(&grads, lr, run.grad_clip)?;
        }
        tracing::debug!(
            step,
            forward_backward_s = (computed - started).as_secs_f64(),
            sum_across_ranks_s = (summed - computed).as_secs_f64(),
            update_s = summed.elapsed().as_secs_f64(),
            "step"
        );
        self.state.step += 1;
        Ok(train_loss)
    }

    /// The forward and backward passes on a thread of their own, handing each gradient over as
    /// it is final, while this thread (the one that calls MPI) sums them onto their owners
    /// ([`World::reduce_to_owners_as_ready`]). Returns the loss, when the passes ended, and the
    /// gradients (each summed on its owner). The sum's time past the end of the passes is this
    /// step's allreduce time (waiting for the other ranks included).
    fn overlapped_step(
        &self,
        batches: &[crate::data::Batch],
        objective: Objective,
    ) -> Result<(f64, Instant, Vec<candle_core::Tensor>)> {
        let (model, vars, shards) = (&self.model, &self.vars, self.shards);
        let (sent, ready) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            let passes = scope.spawn(move || {
                let hand_over = |i: usize, g: &candle_core::Tensor| -> Result<()> {
                    sent.send((i, g.clone()))
                        .map_err(|_| anyhow::anyhow!("the gradient sum stopped"))
                };
                let result =
                    crate::step::accumulate_grads_handing_over(model, vars, batches, shards, objective, &hand_over);
                (result, Instant::now())
            });
            let summed = self.world.reduce_to_owners_as_ready(&ready, vars.len(), &self.owners);
            let (result, computed) = passes
                .join()
                .map_err(|_| anyhow::anyhow!("the training step's thread panicked"))?;
            // The sum's own error first: a pass stopped by it only says that it stopped.
            summed?;
            let (loss, grads) = result?;
            let exposed = computed.elapsed();
            self.world.add_allreduce_time(exposed);
            Ok((loss, computed, grads))
        })
    }

    /// The update of a job of several ranks on CPUs, from the gradients summed onto their owners
    /// ([`World::reduce_to_owners`]), each rank updating the parameters it owns (its one or few
    /// cores would otherwise each run all of AdamW, as PyTorch's ZeRO-1 avoids): the global
    /// norm from every owner's sums of squares, added in the parameters' order as one process
    /// adds them (so the clipping is the same to the bit), AdamW on the owned parameters, then
    /// each parameter sent from its owner to the others.
    fn update_owned(&mut self, grads: &[candle_core::Tensor], lr: f64) -> Result<()> {
        let (world, owners) = (self.world, &self.owners);
        let mut squares = vec![0f64; grads.len()];
        for (i, g) in grads.iter().enumerate().filter(|(i, _)| owners[*i] == world.rank()) {
            squares[i] = crate::optim::sum_of_squares(g)?;
        }
        world.sum_f64(&mut squares); // each entry from its owner alone: x + 0 = x
        let norm = squares.iter().fold(0f64, |sum, &s| sum + s).sqrt();
        let scale = crate::optim::clip_scale(norm, self.run.grad_clip);
        self.opt
            .step_scaled_where(grads, lr, scale, |i| owners[i] == world.rank())?;
        let params: Vec<candle_core::Tensor> = self.vars.iter().map(|v| v.as_tensor().clone()).collect();
        world.broadcast_from_owners(&params, owners)
    }

    /// The progress bar every step; `metrics.jsonl` every `log_interval` steps.
    fn log_step(&mut self, train_loss: f64, lr: f64) -> Result<()> {
        let step = self.state.step;
        let log_now = step.is_multiple_of(self.run.log_interval) || step == self.run.max_iters;
        let secs = self.interval_start.0.elapsed().as_secs_f64().max(1e-9);
        let tokens: usize = (self.interval_start.1..step)
            .map(|s| self.run.tokens_at(s, self.world.size()))
            .sum();
        let tokens_per_sec = tokens as f64 / secs;
        if !log_now {
            self.progress.step(step, train_loss, lr, tokens_per_sec, "", false);
            return Ok(());
        }
        let mut event = Event {
            event: "train".into(),
            step,
            train_loss: Some(train_loss),
            lr,
            tokens_per_sec: Some(tokens_per_sec),
            elapsed_s: self.elapsed(),
            ..Event::default()
        };
        let mut more = String::new();
        if self.world.size() > 1 {
            // Every rank's time in collectives over the interval, gathered at each logged step.
            let time = self.world.take_comm_time();
            let all = self.world.all_gather_f64(&[time.allreduce_s, time.wait_s]);
            let (allreduce, wait): (Vec<f64>, Vec<f64>) = all.chunks(2).map(|c| (c[0], c[1])).unzip();
            let share = |v: &[f64]| 100.0 * v.iter().copied().fold(0.0, f64::max) / secs;
            more = format!(
                " ({} ranks; allreduce {:.1}%, wait {:.1}%)",
                self.world.size(),
                share(&allreduce),
                share(&wait)
            );
            event.ranks = Some(self.world.size());
            event.allreduce_s = Some(allreduce);
            event.wait_s = Some(wait);
        }
        self.progress.step(step, train_loss, lr, tokens_per_sec, &more, true);
        if let Some(metrics) = &mut self.metrics {
            metrics.log(event)?;
        }
        self.interval_start = (Instant::now(), step);
        Ok(())
    }

    /// Train and validation loss at this step: logged, plotted, and the best model kept.
    /// Returns the validation loss.
    pub fn evaluate(&mut self) -> Result<f64> {
        self.restack_adapter()?;
        let step = self.state.step;
        let (train_loss, val_loss) = crate::eval::estimate_loss(
            &self.model,
            &self.data,
            &self.run,
            step,
            &self.device,
            self.shards,
            self.world,
        )?;
        self.state.last_eval_step = Some(step);
        self.state.elapsed_s = self.elapsed();
        let is_best = self.state.best_val_loss.is_none_or(|best| val_loss < best);
        if is_best {
            self.state.best_val_loss = Some(val_loss);
        }
        let Some(metrics) = &mut self.metrics else {
            return Ok(val_loss); // a rank other than 0: it writes nothing
        };
        metrics.log(Event {
            event: "eval".into(),
            step,
            train_loss: Some(train_loss),
            val_loss: Some(val_loss),
            val_ppl: Some(val_loss.exp()),
            lr: self.schedule.lr(step.min(self.run.max_iters.saturating_sub(1))),
            elapsed_s: self.state.elapsed_s,
            ..Event::default()
        })?;
        metrics.plot(&self.out.join("loss.svg"))?;
        self.progress.println(&format!(
            "step {step}: train loss {train_loss:.4}, val loss {val_loss:.4}, val ppl {:.2}",
            val_loss.exp()
        ));
        if is_best {
            checkpoints::save_best(&self.out, &self.model, self.adapter.as_ref(), &self.tokenizer, step)?;
        }
        Ok(val_loss)
    }

    /// A checkpoint of the run as it is now, written by rank 0 once every rank has reached this
    /// step (`None` on the other ranks).
    pub fn save(&mut self) -> Result<Option<PathBuf>> {
        self.state.elapsed_s = self.elapsed();
        self.world.barrier();
        if !self.owners.is_empty() {
            // Each rank's moments are fresh for the parameters it owns: rank 0 saves them all.
            self.world.broadcast_from_owners(&self.opt.moments(), &self.owners)?;
        }
        if !self.world.is_root() {
            return Ok(None);
        }
        checkpoints::save(
            &self.out,
            &self.model,
            self.adapter.as_ref(),
            &self.tokenizer,
            &self.opt,
            &self.state,
            self.keep_last,
        )
        .map(Some)
    }
}
