//! The backward pass of the fused CPU training path, on a tape: while [`record`] runs a forward
//! pass, each differentiable op of this module's wrappers (the fused ops, the residual add, the
//! token embedding's rows, the position table's narrow) is written down with its inputs and
//! output, and [`Tape::backward`] runs the ops' own backward rules over the entries in reverse.
//!
//! candle's `Tensor::backward` walks the same graph, but gives every gradient edge a zeroed
//! buffer and an add (`GradStore::or_insert`, then `add`) even where a tensor has one consumer,
//! as all but the residual stream do here: on nanoGPT's CPU recipe that zeroing and copying was
//! ~7% of a step (profile in BENCHMARKS.md; candle#3578 and candle#3822 would change it
//! upstream, both open). Here the first gradient to reach a tensor is kept as it is and a second
//! one is added, in the order candle adds them, so the gradients are candle's, bit for bit.
//!
//! The ops still build candle's graph while recording (it costs the references it holds), so
//! that an op outside the tape is caught rather than its gradient lost: a tensor that tracks
//! gradients, reaches the backward pass and is neither an entry's output nor one of the leaves
//! asked for is an error. Tensors that track nothing (targets, a bias-free layer's zeros) are
//! constants and get no gradient.
//!
//! Activation checkpointing ([`checkpoint`], Chen et al., 2016, "Training Deep Nets with
//! Sublinear Memory Cost"; PyTorch's `torch.utils.checkpoint`): a segment of the pass (a
//! transformer block) runs without recording, so that only its input and output are kept, and the
//! backward pass runs it again, on a tape of its own, when its output's gradient arrives. Every op
//! here computes the same bits again (dropout masks come from keys, not from a generator's state),
//! so the gradients are those of the recorded pass, bit for bit.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{CustomOp1, CustomOp2, CustomOp3, Tensor, TensorId};

type Result<T, E = candle_core::Error> = std::result::Result<T, E>;

type Op1 = Arc<Box<dyn CustomOp1 + Send + Sync>>;
type Op2 = Arc<Box<dyn CustomOp2 + Send + Sync>>;
type Op3 = Arc<Box<dyn CustomOp3 + Send + Sync>>;

/// Called with an entry's index and the gradients so far once its backward rule has run.
type AfterRule<'a> = dyn FnMut(usize, &mut HashMap<TensorId, Tensor>) -> Result<()> + 'a;

/// A segment of the forward pass that [`checkpoint`] runs again in the backward pass.
pub type Segment = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

thread_local! {
    /// The tape [`record`] is writing on this thread, if any.
    static TAPE: RefCell<Option<Tape>> = const { RefCell::new(None) };
}

/// One differentiable step of a recorded forward pass: what it read and what it made.
enum Entry {
    Op1(Op1, Tensor, Tensor),
    Op2(Op2, [Tensor; 2], Tensor),
    Op3(Op3, [Tensor; 3], Tensor),
    /// `out = a + b`, same shapes.
    Add([Tensor; 2], Tensor),
    /// `out = arg.narrow(0, 0, len)`: the first rows of a table (the positions used).
    FirstRows(Tensor, Tensor),
    /// `out = table.embedding(ids)`: rows of a table by index.
    Embedding {
        table: Tensor,
        ids: Tensor,
        out: Tensor,
    },
    /// `out = segment(x)`, run without recording (see [`checkpoint`]).
    Checkpoint(Segment, Tensor, Tensor),
    /// `out`, made by candle's ops from `vars`, leaves of their own that share `args`' storage
    /// (see [`candle_ops`]).
    Candle {
        args: Vec<Tensor>,
        vars: Vec<Tensor>,
        out: Tensor,
    },
}

impl Entry {
    fn out(&self) -> &Tensor {
        match self {
            Self::Op1(_, _, out)
            | Self::Op2(_, _, out)
            | Self::Op3(_, _, out)
            | Self::Add(_, out)
            | Self::FirstRows(_, out)
            | Self::Embedding { out, .. }
            | Self::Checkpoint(_, _, out)
            | Self::Candle { out, .. } => out,
        }
    }

    /// The tensors the step read (a checkpointed segment's own reads are not listed).
    fn args(&self) -> Vec<&Tensor> {
        match self {
            Self::Op1(_, x, _) | Self::FirstRows(x, _) | Self::Checkpoint(_, x, _) => vec![x],
            Self::Op2(_, args, _) | Self::Add(args, _) => args.iter().collect(),
            Self::Op3(_, args, _) => args.iter().collect(),
            Self::Embedding { table, ids, .. } => vec![table, ids],
            Self::Candle { args, .. } => args.iter().collect(),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Self::Op1(op, ..) => op.name(),
            Self::Op2(op, ..) => op.name(),
            Self::Op3(op, ..) => op.name(),
            Self::Add(..) => "add",
            Self::FirstRows(..) => "narrow",
            Self::Embedding { .. } => "embedding",
            Self::Checkpoint(..) => "checkpoint",
            Self::Candle { .. } => "candle-ops",
        }
    }
}

/// Whether the environment leaves the tape on (`GPT_CPU_TAPE` is not `0`).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::switch_on(&ON, "GPT_CPU_TAPE")
}

/// A recorded forward pass (see the module's documentation).
#[derive(Default)]
pub struct Tape {
    entries: Vec<Entry>,
}

/// Runs `forward` with this thread's differentiable ops written on a new tape, and returns its
/// result with the tape.
///
/// # Errors
/// `forward`'s, or a tape already recording on this thread.
pub fn record<R, E: From<candle_core::Error>>(forward: impl FnOnce() -> Result<R, E>) -> Result<(R, Tape), E> {
    let started = TAPE.with_borrow_mut(|tape| match tape {
        Some(_) => false,
        None => {
            *tape = Some(Tape::default());
            true
        }
    });
    if !started {
        return Err(candle_core::Error::Msg("tape: a tape is already recording on this thread".into()).into());
    }
    /// Ends the recording however `forward` ends (a panic included).
    struct Stop;
    impl Drop for Stop {
        fn drop(&mut self) {
            TAPE.with_borrow_mut(|tape| *tape = None);
        }
    }
    let _stop = Stop;
    let result = forward();
    let tape = TAPE.with_borrow_mut(Option::take).unwrap_or_default();
    Ok((result?, tape))
}

/// `segment(x)`; while a tape records, with activation checkpointing (see the module's
/// documentation): the segment's ops are not recorded and its intermediate tensors are dropped
/// as it returns (its output is detached from candle's graph, which would hold them), and the
/// backward pass runs `segment` on `x` again. `segment` must compute the same values every time
/// and run on the tape's ops alone (no op outside the tape that the gradient must cross).
pub fn checkpoint(x: &Tensor, segment: Segment) -> Result<Tensor> {
    let Some(suspended) = Suspended::take() else {
        return segment(x);
    };
    let out = segment(x)?.detach();
    drop(suspended);
    push(|| Entry::Checkpoint(segment, x.clone(), out.clone()));
    Ok(out)
}

/// This thread's tape, taken off it while a piece of the pass runs unrecorded, and put back when
/// this is dropped (however the piece ends).
struct Suspended(Option<Tape>);

impl Suspended {
    /// `None` when no tape records.
    fn take() -> Option<Self> {
        TAPE.with_borrow_mut(Option::take).map(|tape| Self(Some(tape)))
    }
}

impl Drop for Suspended {
    fn drop(&mut self) {
        let tape = self.0.take();
        TAPE.with_borrow_mut(|t| *t = tape);
    }
}

/// Whether a tape records on this thread (its ops' backward rules will run).
pub(crate) fn recording() -> bool {
    TAPE.with_borrow(Option::is_some)
}

fn push(entry: impl FnOnce() -> Entry) {
    TAPE.with_borrow_mut(|tape| {
        if let Some(tape) = tape {
            tape.entries.push(entry());
        }
    });
}

/// [`Tensor::apply_op1`], on the tape while one records.
pub(crate) fn op1(x: &Tensor, op: impl CustomOp1 + Send + Sync + 'static) -> Result<Tensor> {
    let op: Op1 = Arc::new(Box::new(op));
    let out = x.apply_op1_arc(op.clone())?;
    push(|| Entry::Op1(op, x.clone(), out.clone()));
    Ok(out)
}

/// [`Tensor::apply_op2`], on the tape while one records.
pub(crate) fn op2(a: &Tensor, b: &Tensor, op: impl CustomOp2 + Send + Sync + 'static) -> Result<Tensor> {
    let op: Op2 = Arc::new(Box::new(op));
    let out = a.apply_op2_arc(b, op.clone())?;
    push(|| Entry::Op2(op, [a.clone(), b.clone()], out.clone()));
    Ok(out)
}

/// [`Tensor::apply_op3`], on the tape while one records.
pub(crate) fn op3(a: &Tensor, b: &Tensor, c: &Tensor, op: impl CustomOp3 + Send + Sync + 'static) -> Result<Tensor> {
    let op: Op3 = Arc::new(Box::new(op));
    let out = a.apply_op3_arc(b, c, op.clone())?;
    push(|| Entry::Op3(op, [a.clone(), b.clone(), c.clone()], out.clone()));
    Ok(out)
}

/// `a + b`, on the tape while one records.
pub(crate) fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let out = (a + b)?;
    push(|| Entry::Add([a.clone(), b.clone()], out.clone()));
    Ok(out)
}

/// The first `len` rows of `table`, on the tape while one records.
pub fn first_rows(table: &Tensor, len: usize) -> Result<Tensor> {
    let out = table.narrow(0, 0, len)?;
    push(|| Entry::FirstRows(table.clone(), out.clone()));
    Ok(out)
}

/// `f(args)` computed by candle's ops, on the tape while one records: as one entry whose
/// backward rule is candle's `backward` over those ops alone (they read copies of `args` made
/// leaves: views of the same storage, so nothing is copied). For the pieces of a pass that have
/// no op of the tape's own, such as the LM head and its loss on a GPU; candle's backward then
/// gives the zeroed buffers and adds of its graph to those ops only.
pub fn candle_ops(args: &[&Tensor], f: impl FnOnce(&[Tensor]) -> Result<Tensor>) -> Result<Tensor> {
    // `f`'s own ops are not recorded (a tape op among them is one of candle's graph here).
    let Some(suspended) = Suspended::take() else {
        return f(&args.iter().map(|&a| a.clone()).collect::<Vec<_>>());
    };
    let vars = (args.iter())
        .map(|a| match a.track_op() {
            true => Ok(candle_core::Var::from_tensor(&a.detach())?.as_tensor().clone()),
            false => Ok((*a).clone()), // a constant stays one
        })
        .collect::<Result<Vec<_>>>()?;
    let out = f(&vars)?;
    drop(suspended);
    push(|| Entry::Candle {
        args: args.iter().map(|&a| a.clone()).collect(),
        vars,
        out: out.clone(),
    });
    Ok(out)
}

/// Rows `ids` (1-D) of `table`, on the tape while one records.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if OneHotGradEmbedding::applies(table, ids)? {
        return op2(table, ids, OneHotGradEmbedding);
    }
    let out = table.embedding(ids)?;
    push(|| Entry::Embedding {
        table: table.clone(),
        ids: ids.clone(),
        out: out.clone(),
    });
    Ok(out)
}

/// `table.embedding(ids)` on a CUDA GPU in f32 (training), with its gradient taken as the
/// product of the ids' one-hot matrix `(N, V)`, transposed, with the rows' gradient: candle's
/// gradient (`index_add`) gives one thread to each column and walks every id in it, 7.8 ms of a
/// 50 ms step at nanoGPT's shakespeare-char shape on an H200 (ncu), where the product takes
/// microseconds and is as deterministic. Only while the one-hot matrix is small (`V · N` up to
/// 2^26 values: a character-level vocabulary); GPT-2's 50257 tokens keep candle's.
struct OneHotGradEmbedding;

impl OneHotGradEmbedding {
    fn applies(table: &Tensor, ids: &Tensor) -> Result<bool> {
        Ok(table.device().is_cuda()
            && table.dtype() == candle_core::DType::F32
            && ids.dtype() == candle_core::DType::U32
            && table.rank() == 2
            && ids.rank() == 1
            && table.dim(0)? * ids.elem_count() <= 1 << 26)
    }
}

impl CustomOp2 for OneHotGradEmbedding {
    fn name(&self) -> &'static str {
        "embedding-one-hot-grad"
    }

    fn cpu_fwd(
        &self,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
        _: &candle_core::CpuStorage,
        _: &candle_core::Layout,
    ) -> Result<(candle_core::CpuStorage, candle_core::Shape)> {
        candle_core::bail!("embedding-one-hot-grad runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        table: &candle_core::CudaStorage,
        table_l: &candle_core::Layout,
        ids: &candle_core::CudaStorage,
        ids_l: &candle_core::Layout,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        use candle_core::backend::BackendStorage;
        let (_, c) = table_l.shape().dims2()?;
        let rows = table.index_select(ids, table_l, ids_l, 0)?;
        Ok((rows, candle_core::Shape::from((ids_l.shape().elem_count(), c))))
    }

    fn bwd(&self, table: &Tensor, ids: &Tensor, _: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (v, c) = table.dims2()?;
        let n = ids.elem_count();
        let vocab = Tensor::arange(0u32, v as u32, ids.device())?.reshape((1, v))?;
        let one_hot = ids.reshape((n, 1))?.broadcast_eq(&vocab)?.to_dtype(table.dtype())?; // (N, V)
        let d_table = one_hot.t()?.matmul(&grad.reshape((n, c))?.contiguous()?)?; // (V, C)
        Ok((Some(d_table), None))
    }
}

impl Tape {
    /// The gradients of `seed · out` (`out` a scalar the tape made, a loss) for each of `leaves`
    /// (`None` for one that `out` does not depend on). Two leaves' gradients may be views of one
    /// buffer (an affine layer's weight and bias), never overlapping ones unless the forward pass
    /// added two leaves to each other.
    ///
    /// # Errors
    /// An op's backward rule's, or a tensor that tracks gradients and reaches this pass without
    /// being a leaf or an entry's output (an op the forward pass ran outside the tape).
    pub fn backward(self, out: &Tensor, seed: f32, leaves: &[&Tensor]) -> Result<Vec<Option<Tensor>>> {
        let wanted: HashSet<TensorId> = leaves.iter().map(|t| t.id()).collect();
        let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
        grads.insert(out.id(), Tensor::new(seed, out.device())?.broadcast_as(out.shape())?);
        self.propagate(&mut grads, &wanted, &mut |_, _| Ok(()))?;
        Ok(leaves.iter().map(|t| grads.remove(&t.id())).collect())
    }

    /// [`Tape::backward`], handing each leaf's gradient (by its index in `leaves`) to `ready` as
    /// soon as it is final, while the pass goes on: after the backward rule of the first entry
    /// that read it, the last to run. What PyTorch's DDP hooks on for starting the gradient sum
    /// during the backward pass. Every leaf is handed over once, in an order that depends only on
    /// the recorded pass; with checkpointed segments (whose reads the tape does not list), all at
    /// the end.
    ///
    /// # Errors
    /// [`Tape::backward`]'s, and `ready`'s (which stops the pass).
    pub fn backward_each(
        self,
        out: &Tensor,
        seed: f32,
        leaves: &[&Tensor],
        mut ready: impl FnMut(usize, Option<Tensor>) -> Result<()>,
    ) -> Result<()> {
        let wanted: HashSet<TensorId> = leaves.iter().map(|t| t.id()).collect();
        // The leaves whose gradients are final once entry k's rule has run; the rest at the end.
        let mut final_after: Vec<Vec<usize>> = vec![Vec::new(); self.entries.len()];
        let mut at_end = Vec::new();
        if self.entries.iter().any(|e| matches!(e, Entry::Checkpoint(..))) {
            at_end.extend(0..leaves.len());
        } else {
            let mut first_read: HashMap<TensorId, usize> = HashMap::new();
            for (k, entry) in self.entries.iter().enumerate() {
                for arg in entry.args() {
                    first_read.entry(arg.id()).or_insert(k);
                }
            }
            for (i, leaf) in leaves.iter().enumerate() {
                match first_read.get(&leaf.id()) {
                    Some(&k) => final_after[k].push(i),
                    None => at_end.push(i),
                }
            }
        }
        let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
        grads.insert(out.id(), Tensor::new(seed, out.device())?.broadcast_as(out.shape())?);
        self.propagate(&mut grads, &wanted, &mut |k, grads| {
            for &i in &final_after[k] {
                ready(i, grads.remove(&leaves[i].id()))?;
            }
            Ok(())
        })?;
        for i in at_end {
            ready(i, grads.remove(&leaves[i].id()))?;
        }
        Ok(())
    }

    /// Runs the entries' backward rules in reverse from the gradients in `grads` (keyed by the
    /// tensors they are of), leaving there the gradients of the `wanted` leaves (and of tensors
    /// made before the tape); `after(k, grads)` once entry k's rule has run.
    fn propagate(
        self,
        grads: &mut HashMap<TensorId, Tensor>,
        wanted: &HashSet<TensorId>,
        after: &mut AfterRule<'_>,
    ) -> Result<()> {
        let made: HashSet<TensorId> = self.entries.iter().map(|e| e.out().id()).collect();
        // Whether `arg`'s gradient is kept: an entry's output or a leaf; a constant's is dropped.
        let keep = |arg: &Tensor, op: &'static str| -> Result<bool> {
            if made.contains(&arg.id()) || wanted.contains(&arg.id()) {
                Ok(true)
            } else if arg.track_op() {
                candle_core::bail!(
                    "tape: a gradient from {op} reached a {:?} tensor made outside the tape",
                    arg.dims()
                )
            } else {
                Ok(false)
            }
        };
        for (k, entry) in self.entries.into_iter().enumerate().rev() {
            Self::run_rule(entry, grads, wanted, &keep)?;
            after(k, grads)?;
        }
        Ok(())
    }

    /// One entry's backward rule: its output's gradient (if the loss depends on it) to its
    /// arguments' (those `keep` keeps), added to what they hold in `grads`.
    fn run_rule(
        entry: Entry,
        grads: &mut HashMap<TensorId, Tensor>,
        wanted: &HashSet<TensorId>,
        keep: &dyn Fn(&Tensor, &'static str) -> Result<bool>,
    ) -> Result<()> {
        {
            let Some(grad) = grads.remove(&entry.out().id()) else {
                return Ok(()); // nothing the loss depends on
            };
            let name = entry.name();
            let (args, arg_grads): (Vec<Tensor>, Vec<Option<Tensor>>) = match entry {
                Entry::Op1(op, x, out) => {
                    let gx = op.bwd(&x, &out, &grad)?;
                    (vec![x], vec![gx])
                }
                Entry::Op2(op, [a, b], out) => {
                    let (ga, gb) = op.bwd(&a, &b, &out, &grad)?;
                    (vec![a, b], vec![ga, gb])
                }
                Entry::Op3(op, [a, b, c], out) => {
                    let (ga, gb, gc) = op.bwd(&a, &b, &c, &out, &grad)?;
                    (vec![a, b, c], vec![ga, gb, gc])
                }
                Entry::Add([a, b], _) => (vec![a, b], vec![Some(grad.clone()), Some(grad)]),
                Entry::FirstRows(table, _) => {
                    let (rows, len) = (table.dim(0)?, grad.dim(0)?);
                    let grad = if rows > len {
                        let mut pad = table.dims().to_vec();
                        pad[0] = rows - len;
                        Tensor::cat(&[&grad, &Tensor::zeros(pad, grad.dtype(), grad.device())?], 0)?
                    } else {
                        grad
                    };
                    (vec![table], vec![Some(grad)])
                }
                Entry::Checkpoint(segment, x, _) => {
                    // The segment again, on a tape of its own, from its output's gradient; its
                    // input's gradient and the leaves' come back here.
                    let (again, tape) = record(|| segment(&x))?;
                    let mut inner = HashMap::from([(again.id(), grad)]);
                    let mut inner_wanted = wanted.clone();
                    inner_wanted.insert(x.id());
                    tape.propagate(&mut inner, &inner_wanted, &mut |_, _| Ok(()))?;
                    let keep_x = keep(&x, name)?;
                    for (id, g) in inner {
                        if (id == x.id() && !keep_x) || !inner_wanted.contains(&id) {
                            continue;
                        }
                        let sum = match grads.remove(&id) {
                            Some(sum) => (sum + g)?,
                            None => g,
                        };
                        grads.insert(id, sum);
                    }
                    return Ok(());
                }
                Entry::Candle { args, vars, out } => {
                    // candle's backward from `out` weighted by its gradient, down to `vars`.
                    let mut store = (out * grad.detach())?.sum_all()?.backward()?;
                    let gs = vars.iter().map(|v| store.remove(v)).collect();
                    (args, gs)
                }
                Entry::Embedding { table, ids, .. } => {
                    // Added into the table's gradient so far, row by row, as candle does.
                    if keep(&table, name)? {
                        let sum = match grads.remove(&table.id()) {
                            Some(sum) => sum,
                            None => table.zeros_like()?,
                        };
                        grads.insert(table.id(), sum.index_add(&ids, &grad, 0)?);
                    }
                    return Ok(());
                }
            };
            for (arg, g) in args.iter().zip(arg_grads) {
                let Some(g) = g else { continue };
                if !keep(arg, name)? {
                    continue;
                }
                // The first gradient as it is; a later one added after it, as candle orders them.
                let sum = match grads.remove(&arg.id()) {
                    Some(sum) => (sum + g)?,
                    None => g,
                };
                grads.insert(arg.id(), sum);
            }
        }
        Ok(())
    }
}
