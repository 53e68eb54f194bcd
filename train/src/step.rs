//! One optimisation step's loss and gradients: next-token cross-entropy over `(B, T)` windows,
//! backward, and gradient accumulation over micro-batches, data-parallel over CPU threads.

use anyhow::{bail, Result};
use candle_core::{Tensor, Var};
use gpt::{Dropout, Gpt};

use crate::data::Batch;

/// What a training step's loss depends on besides the batches.
#[derive(Debug, Clone, Copy, Default)]
pub struct Objective {
    /// Label smoothing ε of the cross-entropy (0: plain negative log-likelihood).
    pub label_smoothing: f32,
    /// The step's dropout key: micro-batch m's masks are keyed by `(dropout_key, m)` and the
    /// row's place in the whole micro-batch, so they do not depend on how rows are shared out.
    pub dropout_key: u64,
    /// The rows of each micro-batch this process trains.
    pub share: RowShare,
}

/// Which of the equal blocks of every micro-batch's rows a rank of a data-parallel job trains
/// (block `rank` of `ranks`); the gradients it returns are its block's part of the whole
/// batch's mean, so summing them over the ranks gives the whole batch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowShare {
    pub rank: usize,
    pub ranks: usize,
}

impl Default for RowShare {
    /// Every row: a process training alone.
    fn default() -> Self {
        Self { rank: 0, ranks: 1 }
    }
}

/// How the CPU's threads share a training step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Parallelism {
    /// [`Parallelism::Ops`] for models of width 512 and more, else [`Parallelism::Shards`].
    #[default]
    Auto,
    /// Each thread runs forward and backward on its own rows of the batch ([`accumulate_grads`]'
    /// shards), products and all, and the gradients are summed: no synchronisation within the
    /// pass, which small models' many small operations need, but a copy of every gradient per
    /// thread.
    Shards,
    /// One forward and backward pass, each product, attention and element-wise pass split over
    /// the threads (candle's thread pool, as inference runs): one copy of the gradients (GPT-2
    /// small: 2.9 GB peak against 5.2 GB in two shards) and no sum of shards.
    Ops,
}

impl Parallelism {
    /// What `Auto` means for a model of this shape.
    pub fn resolve(self, cfg: &gpt::Config) -> Self {
        match self {
            // Measured on 2 cores (BENCHMARKS.md): ops ahead at GPT-2 small (768), even with
            // shards at 384 (with 2/3 of the memory), well behind at 128.
            Self::Auto if cfg.n_embd >= 512 => Self::Ops,
            Self::Auto => Self::Shards,
            other => other,
        }
    }

    /// Sizes candle's thread pools for `threads` CPU threads under this (resolved) choice, and
    /// returns the number of shards a batch is split into. candle's rayon pool stays at one thread
    /// in both (the ops it runs are small beside the products, and its threads would compete with
    /// the pool's for the cores). Must run before the first product: the pool is sized once per
    /// process (with another size already there, results stay the same, only the speed differs).
    pub fn use_cpu_threads(self, threads: usize) -> usize {
        let (shards, pool) = match self {
            Self::Ops => (1, threads),
            Self::Shards | Self::Auto => (threads, 1),
        };
        std::env::set_var("RAYON_NUM_THREADS", "1");
        std::env::set_var("CANDLE_NUM_THREADS", pool.to_string());
        shards
    }
}

/// Mean cross-entropy of next-token prediction over the targets of a batch's `(B, T)` windows
/// (packed or not), with label smoothing `eps`; `train` while training (dropout on, with masks
/// from its key).
pub fn loss(model: &Gpt, batch: &Batch, train: Option<Dropout>, eps: f32) -> Result<Tensor> {
    Ok(match &batch.positions {
        Some(positions) => model.loss_at(&batch.x, positions, &batch.y, train, eps)?,
        None => model.loss(&batch.x, &batch.y, train, eps)?,
    })
}

/// Threads for CPU training: `--threads`, else every core this process may use.
pub fn cpu_threads(requested: Option<usize>) -> usize {
    requested
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Makes candle's own CPU thread pools single-threaded until a run sizes them
/// ([`Parallelism::use_cpu_threads`]). Must run before candle's first operation.
pub fn use_shard_parallelism() {
    for var in ["RAYON_NUM_THREADS", "CANDLE_NUM_THREADS"] {
        std::env::set_var(var, "1");
    }
}

/// Runs `work(0) .. work(n - 1)` on `n` scoped threads (inline when `n` is 1) and returns their
/// results in worker order, or the first error.
pub fn in_threads<T: Send>(n: usize, work: impl Fn(usize) -> Result<T> + Sync) -> Result<Vec<T>> {
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

/// Adds `g` into `slot`, detached: a gradient otherwise keeps its step's whole graph alive, and
/// the optimizer's running moments would chain every step's activations (a leak). On the CPU the
/// sum is taken in place (each gradient a backward pass returns has values of its own: a tensor,
/// or a view of a buffer that no other gradient overlaps), so summing micro-batches and shards
/// allocates nothing.
fn accumulate(slot: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    let g = g.detach();
    *slot = Some(match slot.take() {
        Some(a) if a.device().is_cpu() && gpt_kernels::fused(&a) && a.is_contiguous() => {
            a.inplace_op2(&g.contiguous()?, &AddAssign)?;
            a
        }
        Some(a) => (a + g)?,
        None => g,
    });
    Ok(())
}

/// `a += b` for f32 CPU tensors of one shape, `a` contiguous.
struct AddAssign;

impl candle_core::InplaceOp2 for AddAssign {
    fn name(&self) -> &'static str {
        "add-assign"
    }

    fn cpu_fwd(
        &self,
        s1: &mut candle_core::CpuStorage,
        l1: &candle_core::Layout,
        s2: &candle_core::CpuStorage,
        l2: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let (Some((a0, a1)), candle_core::CpuStorage::F32(a)) = (l1.contiguous_offsets(), s1) else {
            candle_core::bail!("add-assign: the sum must be contiguous f32")
        };
        let a = &mut a[a0..a1];
        let Some((b0, b1)) = l2.contiguous_offsets() else {
            candle_core::bail!("add-assign: the addend must be contiguous")
        };
        let b = &s2.as_slice::<f32>()?[b0..b1];
        if a.len() != b.len() {
            candle_core::bail!("add-assign: {} values and {}", a.len(), b.len())
        }
        gpt_kernels::simd::vectorised(
            #[inline(always)]
            || a.iter_mut().zip(b).for_each(|(x, &y)| *x += y),
        );
        Ok(())
    }
}

/// Gradients of the mean loss (see [`Objective`]) over equally sized micro-batches, summed as gradient accumulation
/// does (each micro-batch's loss divided by their count). Returns the mean loss and one gradient
/// per variable (zeros for a variable the loss does not reach).
///
/// In a data-parallel job (`objective.share`) only this rank's block of each micro-batch's rows
/// is trained, and its shards are that block's.
///
/// With `shards` > 1 each micro-batch is split by rows across that many threads, each running
/// forward and backward on its part (data parallelism: on a few CPU cores this beats spreading
/// every small matmul over them). Shard gradients are weighted by their share of the rows and
/// summed in a fixed order, so the result does not depend on thread timing. Where the model
/// allows ([`Gpt::trains_on_tape`]), each piece's backward pass runs on the tape its forward pass
/// recorded ([`gpt_kernels::tape`]) rather than candle's `backward`: the same gradients, without a
/// zeroed buffer and an add for every edge of the graph.
pub fn accumulate_grads(
    model: &Gpt,
    vars: &[Var],
    batches: &[Batch],
    shards: usize,
    objective: Objective,
) -> Result<(f64, Vec<Tensor>)> {
    accumulate_grads_handing_over(model, vars, batches, shards, objective, &|_, _| Ok(()))
}

/// [`accumulate_grads`], handing each variable's final gradient (by its index in `vars`) to
/// `ready` once, as soon as it is final where the pass allows: during the last micro-batch's
/// backward pass on the tape with one worker ([`gpt_kernels::tape::Tape::backward_each`]), else
/// once all are computed. The order depends only on the model and the settings, so every rank of
/// a job sees the same. The tensor handed over is the one returned, so that what `ready` writes
/// into it (a sum across ranks) is what the step gets.
pub fn accumulate_grads_handing_over(
    model: &Gpt,
    vars: &[Var],
    batches: &[Batch],
    shards: usize,
    objective: Objective,
    ready: &(dyn Fn(usize, &Tensor) -> Result<()> + Sync),
) -> Result<(f64, Vec<Tensor>)> {
    // Every (micro-batch, shard) piece with its weight in the mean.
    let mut pieces = Vec::new();
    let RowShare { rank, ranks } = objective.share;
    for (micro, batch) in batches.iter().enumerate() {
        let rows = batch.x.dim(0)?;
        if ranks == 0 || rank >= ranks || !rows.is_multiple_of(ranks) {
            bail!("a batch of {rows} rows does not divide among {ranks} ranks");
        }
        let block = rows / ranks;
        let n_shards = shards.clamp(1, block.max(1));
        let mut start = rank * block;
        for s in 0..n_shards {
            let len = block / n_shards + usize::from(s < block % n_shards);
            let weight = len as f64 / rows as f64 / batches.len() as f64;
            let dropout = Dropout {
                key: gpt_kernels::rng::key(&[objective.dropout_key, micro as u64]),
                first_row: start,
            };
            pieces.push((batch.rows(start, len)?, weight, dropout));
            start += len;
        }
    }
    let n_workers = shards.clamp(1, pieces.len().max(1));
    // Packed windows on a GPU take candle's ops (its attention kernel has no segments).
    let on_tape = model.trains_on_tape() && (model.device().is_cpu() || batches.iter().all(|b| b.positions.is_none()));
    let leaves: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    // With one worker on the tape, its last piece's backward pass hands the gradients over as
    // they are final; otherwise they are handed over once all are computed.
    let last_piece = pieces.len().saturating_sub(1);
    let handed_over = on_tape && n_workers == 1 && !pieces.is_empty();
    let run_worker = |worker: usize| -> Result<(f64, Vec<Option<Tensor>>)> {
        let mut acc: Vec<Option<Tensor>> = vec![None; vars.len()];
        let mut losses = Vec::new();
        for (p, (piece, weight, dropout)) in pieces.iter().enumerate().skip(worker).step_by(n_workers) {
            let piece_loss = || loss(model, piece, Some(*dropout), objective.label_smoothing);
            // The piece's weight as the loss's upstream gradient: every gradient comes out
            // weighted (the fused LM head scales its own in place), and pieces only add.
            let (loss, tape) = if on_tape {
                let (loss, tape) = gpt_kernels::tape::record(piece_loss)?;
                (loss, Some(tape))
            } else {
                (piece_loss()?, None)
            };
            losses.push((*weight, loss.detach()));
            let (tape, hand_over) = match tape {
                Some(tape) if handed_over && p == last_piece => (None, Some(tape)),
                tape => (tape, None),
            };
            if let Some(tape) = hand_over {
                tape.backward_each(&loss, *weight as f32, &leaves, |i, g| {
                    if let Some(g) = g {
                        accumulate(&mut acc[i], g).map_err(candle_core::Error::wrap)?;
                    }
                    let g = match &acc[i] {
                        Some(g) if g.is_contiguous() => g.clone(),
                        Some(g) => {
                            let g = g.contiguous()?;
                            acc[i] = Some(g.clone());
                            g
                        }
                        None => {
                            let zeros = leaves[i].zeros_like()?;
                            acc[i] = Some(zeros.clone());
                            zeros
                        }
                    };
                    ready(i, &g).map_err(candle_core::Error::wrap)
                })?;
                continue;
            }
            let grads: Vec<Option<Tensor>> = match tape {
                Some(tape) => tape.backward(&loss, *weight as f32, &leaves)?,
                None => {
                    let mut grads = (loss * *weight)?.backward()?;
                    leaves.iter().map(|t| grads.remove(t)).collect()
                }
            };
            for (slot, g) in acc.iter_mut().zip(grads) {
                if let Some(g) = g {
                    accumulate(slot, g)?;
                }
            }
        }
        // Read once the backward passes are queued: on a GPU, reading a loss before its backward
        // pass stops the host until the forward pass has run, and the GPU then waits for the
        // host to queue the backward pass.
        let mut total = 0.0;
        for (weight, loss) in losses {
            total += weight * loss.to_scalar::<f32>()? as f64;
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
                accumulate(slot, g)?;
            }
        }
    }
    let grads: Vec<Tensor> = acc
        .into_iter()
        .zip(vars)
        .map(|(g, v)| match g {
            Some(g) if !handed_over && !g.is_contiguous() => g.contiguous(),
            Some(g) => Ok(g),
            None => v.as_tensor().zeros_like(),
        })
        .collect::<candle_core::Result<_>>()?;
    if !handed_over {
        for (i, g) in grads.iter().enumerate() {
            ready(i, g)?;
        }
    }
    Ok((total, grads))
}
