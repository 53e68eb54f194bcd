//! Causal self-attention over whole `(B, T)` windows (training and evaluation) on the CPU in
//! f32, forward and backward, tiled as FlashAttention does (Dao et al., 2022): per (sequence,
//! head), a block of [`BLOCK`] queries at a time against the keys it sees, its scores, causal
//! softmax and dropout in one `(BLOCK, T)` scratch that stays in cache. The `(B, nh, T, T)`
//! scores are never stored, and the probabilities only where they stay in the CPU's caches
//! ([`keeps_probs`]: short windows, as nanoGPT's CPU recipe trains): otherwise the backward pass
//! recomputes them block by block (the whole row of a block's scores fits, so the softmax is
//! taken directly, with no running maximum to carry).
//!
//! Why not candle's ops: they transpose q, k and v into copies, write the `(B, nh, T, T)` scores,
//! their softmax and its dropout as tensors of their own (three passes over memory, kept alive for
//! the backward pass with their gradients), and multiply with the `gemm` crate's AVX2 path. At
//! nanoGPT's baby-GPT shape (6 heads, T = 256, 32 sequences a core) those tensors are 50 MB each
//! per layer. Here the products are a small register-tiled kernel on [`Vec16`] lanes
//! ([`gemm`]) over the heads' rows where they are (heads of whole vectors, [`in_place`]) and
//! per-head transposed copies laid out for it; each (sequence, head) is one task on
//! candle's thread pool and computes in a fixed order, so results do not depend on the threads.
//!
//! Packed windows (several sequences one after another in a window, as chat fine-tuning packs
//! short conversations) give each row the first key it may see, its sequence's start: the
//! scores before it are masked like those after the row, so no sequence attends to another.
//!
//! Dropout of the attention weights uses the masks of [`crate::elementwise::dropout`], indexed as the
//! `(B, nh, T, T)` probabilities' elements: the same masks as dropout applied to those
//! probabilities, so this op and candle's composite agree under dropout too (tested).

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};

use crate::elementwise::dropout::Dropout;
use crate::simd::{Kernel, Simd, Vec16, LANES};
use tiles::{gemm, AsMat, Causal, Mat};

/// Queries per block: a block's `(64, T)` scores are 64 KiB at T = 256, in L2 beside the
/// head's keys and values.
const BLOCK: usize = 64;

/// The most bytes of probabilities a forward pass keeps for its backward pass (2 MiB: with a
/// few layers and threads, what the L3 cache holds beside the rest). Reading them back costs
/// a copy of each block's `(BLOCK, T)` rows; recomputing them, a product of the block's queries
/// and keys and a softmax per row, a third of the backward pass of nanoGPT's CPU recipe (4
/// heads of 64 positions, 6 windows a thread: 384 KiB a layer). Larger probabilities (GPT-2
/// small's 4 x 12 x 256 x 256 are 12 MiB a layer) would come back from memory, as slow as
/// recomputing them.
const KEEP_PROBS_MAX: usize = 2 << 20;

/// Whether a forward pass over `rows` rows of windows of `t` with `n_head` heads keeps its
/// probabilities for the backward pass ([`KEEP_PROBS_MAX`]).
pub(crate) fn keeps_probs(rows: usize, t: usize, n_head: usize) -> bool {
    let bytes = [n_head, t, t.next_multiple_of(LANES), 4]
        .into_iter()
        .fold(rows.checked_div(t).unwrap_or(0), usize::saturating_mul);
    t > 0 && bytes <= KEEP_PROBS_MAX
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod tiles;

/// `softmax(q kᵀ · scale + causal mask) v` per head, with dropout of the attention weights,
/// for `qkv` `(B * T, 3C)` (windows of `t` rows; queries, keys, values, head after head, as
/// GPT-2's `c_attn` writes them); returns `(B * T, C)`.
#[derive(Debug, Clone)]
pub(crate) struct WindowAttention {
    /// Positions per window (T).
    pub(crate) t: usize,
    pub(crate) n_head: usize,
    pub(crate) scale: f32,
    /// Dropout of the attention weights; its `first` counts elements of the `(B, nh, T, T)`
    /// probabilities.
    pub(crate) dropout: Option<Dropout>,
    pub(crate) simd: Simd,
    /// Packed windows: `starts[b * T + i]` is the first key row `i` of window `b` sees (its
    /// sequence's first position, at most `i`); `None`: every row sees the window from 0.
    pub(crate) starts: Option<Arc<[u32]>>,
    /// Where the forward pass keeps the probabilities (softmax, before dropout), `(B, nh, T,
    /// tp)`, for the backward pass to read instead of recomputing them: the same values, so the
    /// same bits. `None`: not kept ([`keeps_probs`], or no backward pass will run).
    pub(crate) probs: Option<Arc<OnceLock<Vec<f32>>>>,
}

/// The shape of one call: `b` windows of `t` positions, `c = nh * hs` channels; `tp` and `hsp`
/// are `t` and `hs` rounded up to whole vectors (the kernel's columns come in 16s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dims {
    b: usize,
    t: usize,
    c: usize,
    nh: usize,
    hs: usize,
    tp: usize,
    hsp: usize,
}

impl Dims {
    fn of(layout: &Layout, t: usize, n_head: usize) -> Result<Self> {
        let &[rows, width] = layout.dims() else {
            candle_core::bail!("window-attention: qkv is {:?}, not (B * T, 3C)", layout.dims())
        };
        if t == 0 || !rows.is_multiple_of(t) {
            candle_core::bail!("window-attention: {rows} rows are not whole windows of {t}")
        }
        let b = rows / t;
        let c = width / 3;
        if n_head == 0 || width != 3 * c || !c.is_multiple_of(n_head) {
            candle_core::bail!("window-attention: qkv has {width} columns, not 3 x {n_head} heads of equal size")
        }
        let hs = c / n_head;
        Ok(Self {
            b,
            t,
            c,
            nh: n_head,
            hs,
            tp: t.next_multiple_of(LANES),
            hsp: hs.next_multiple_of(LANES),
        })
    }
}

impl WindowAttention {
    /// The first key row `i` of window `b` sees.
    #[inline(always)]
    fn start(&self, d: Dims, b: usize, i: usize) -> usize {
        self.starts.as_ref().map_or(0, |s| s[b * d.t + i] as usize)
    }

    /// Index, in the kept `(B, nh, T, tp)` probabilities, of row `i`'s first weight.
    fn kept_index(d: Dims, b: usize, h: usize, i: usize) -> usize {
        ((b * d.nh + h) * d.t + i) * d.tp
    }

    /// The probabilities the forward pass kept for this shape, if it kept them.
    fn kept(&self, d: Dims) -> Option<&[f32]> {
        let kept = self.probs.as_ref()?.get()?;
        (kept.len() == d.b * d.nh * d.t * d.tp).then_some(kept.as_slice())
    }

    /// Element index, in the `(B, nh, T, T)` probabilities, of row `i`'s first weight.
    fn row_index(&self, d: Dims, b: usize, h: usize, i: usize) -> u64 {
        (((b * d.nh + h) * d.t + i) * d.t) as u64
    }

    /// Runs `task(b, h, workspace)` for every (sequence, head) on candle's thread pool, each
    /// chunk of tasks with its thread's workspace for this shape. The workspaces are kept from
    /// call to call (a thread's last one): made anew, zeroed, for every chunk, they were ~15 MB
    /// of allocation and zeroing per step of nanoGPT's CPU recipe.
    fn for_each_head(&self, d: Dims, task: impl Fn(usize, usize, &mut Workspace) + Sync) {
        thread_local! {
            static WORKSPACE: std::cell::RefCell<Option<(Dims, Workspace)>> = const { std::cell::RefCell::new(None) };
        }
        candle_core::utils::barrier_pool().execute_chunked(d.b * d.nh, |range| {
            let kept = WORKSPACE.with(|w| w.borrow_mut().take());
            let mut ws = match kept {
                Some((dims, ws)) if dims == d => ws,
                _ => Workspace::new(d),
            };
            for i in range {
                task(i / d.nh, i % d.nh, &mut ws);
            }
            WORKSPACE.with(|w| *w.borrow_mut() = Some((d, ws)));
        });
    }
}

/// One task's buffers: per-head copies of its operands in the layouts the products read, and
/// the block's scratch. `…t` buffers are transposed, `(hs, tp)`; row buffers are `(tp, hsp)`
/// (or `(t, hs)` where only read as the left operand). Padding stays zero: no pass writes it,
/// so a workspace serves any number of heads and passes of its shape.
struct Workspace {
    q: Vec<f32>,
    qt: Vec<f32>,
    k: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    vt: Vec<f32>,
    dy: Vec<f32>,
    dyt: Vec<f32>,
    dkt: Vec<f32>,
    dvt: Vec<f32>,
    /// `(BLOCK, tp)`: scores, then probabilities.
    p: Vec<f32>,
    /// `(BLOCK, tp)`: their gradient.
    dp: Vec<f32>,
    /// `(BLOCK, hsp)`: a block's output rows (or the queries' gradient).
    out: Vec<f32>,
    /// `(tp)`: one row's dropout mask.
    mask: Vec<f32>,
}

impl Workspace {
    fn new(d: Dims) -> Self {
        let rows = d.tp * d.hsp;
        let trans = d.hs * d.tp;
        Self {
            q: vec![0.0; d.t * d.hs],
            qt: vec![0.0; trans],
            k: vec![0.0; rows],
            kt: vec![0.0; trans],
            v: vec![0.0; rows],
            vt: vec![0.0; trans],
            dy: vec![0.0; d.t * d.hs],
            dyt: vec![0.0; trans],
            dkt: vec![0.0; trans],
            dvt: vec![0.0; trans],
            p: vec![0.0; BLOCK * d.tp],
            dp: vec![0.0; BLOCK * d.tp],
            out: vec![0.0; BLOCK * d.hsp],
            mask: vec![0.0; d.tp],
        }
    }
}

/// Copies the `hs` columns at `col0` of window `b`'s rows of a `(B * T, ld)` matrix (one head's
/// queries, keys, values or output gradient) into `rows`, `(t, ld_rows)`.
fn gather(src: &[f32], ld: usize, col0: usize, d: Dims, b: usize, rows: &mut [f32], ld_rows: usize) {
    for i in 0..d.t {
        let from = &src[(b * d.t + i) * ld + col0..][..d.hs];
        rows[i * ld_rows..][..d.hs].copy_from_slice(from);
    }
}

/// The same columns as [`gather`], transposed into `trans`, `(hs, tp)` ([`crate::simd::transpose`];
/// value by value this was about a sixth of the attention's time in nanoGPT's CPU recipe).
fn gather_transposed(simd: Simd, src: &[f32], ld: usize, col0: usize, d: Dims, b: usize, trans: &mut [f32]) {
    let first = b * d.t * ld + col0;
    let rows = &src[first..first + (d.t - 1) * ld + d.hs];
    assert!(
        trans.len() >= d.hs.saturating_sub(1) * d.tp + d.t,
        "window-attention: transposed buffer"
    );
    // SAFETY: `rows` holds the window's `t` rows of `hs` values `ld` apart, `trans` `hs` rows of
    // `t` values `tp` apart (checked above); distinct buffers.
    unsafe { crate::simd::transpose(simd, rows.as_ptr(), ld, trans.as_mut_ptr(), d.tp, d.t, d.hs) }
}

/// One pass (forward or backward) over every (sequence, head), each task on the lanes that
/// [`Simd::run`] picks.
trait HeadPass: Sync {
    /// Head `h` of window `b`.
    ///
    /// # Safety
    /// No other call writes the parts of the pass's output that this one writes (head `h`'s
    /// columns of window `b`'s rows), and that output outlives the pass.
    unsafe fn head<V: Vec16>(&self, b: usize, h: usize, ws: &mut Workspace);
}

/// A [`HeadPass`]'s task as a [`Kernel`].
struct OnLanes<'a, P>(&'a P, usize, usize, &'a mut Workspace);

impl<P: HeadPass> Kernel for OnLanes<'_, P> {
    type Output = ();
    #[inline(always)]
    fn run<V: Vec16>(self) {
        // SAFETY: `run_pass` gives every (window, head) to one task; each writes its own
        // columns of its window's rows.
        unsafe { self.0.head::<V>(self.1, self.2, self.3) }
    }
}

fn run_pass<P: HeadPass>(op: &WindowAttention, d: Dims, pass: &P) {
    op.for_each_head(d, |b, h, ws| op.simd.run(OnLanes(pass, b, h, ws)));
}

/// Forward: `qkv` `(B * T, 3C)` → `y` `(B * T, C)`.
fn forward(op: &WindowAttention, d: Dims, qkv: &[f32]) -> Vec<f32> {
    struct Forward<'a> {
        op: &'a WindowAttention,
        d: Dims,
        qkv: &'a [f32],
        y: usize,
        /// The kept probabilities' buffer, or 0.
        kept: usize,
    }
    impl HeadPass for Forward<'_> {
        #[inline(always)]
        unsafe fn head<V: Vec16>(&self, b: usize, h: usize, ws: &mut Workspace) {
            let kept = (self.kept != 0).then_some(self.kept as *mut f32);
            // SAFETY: the trait's contract; `y` is `(B * T, C)`, `kept` `(B, nh, T, tp)`.
            unsafe { forward_head::<V>(self.op, self.d, self.qkv, self.y as *mut f32, kept, b, h, ws) }
        }
    }
    // Neither zeroed first: the heads write every output, and every kept row whole.
    let len = d.b * d.t * d.c;
    let mut y = Vec::with_capacity(len);
    let kept_len = d.b * d.nh * d.t * d.tp;
    let mut kept: Option<Vec<f32>> = op.probs.as_ref().map(|_| Vec::with_capacity(kept_len));
    let pass = Forward {
        op,
        d,
        qkv,
        y: y.as_mut_ptr() as usize,
        kept: kept.as_mut().map_or(0, |k| k.as_mut_ptr() as usize),
    };
    run_pass(op, d, &pass);
    // SAFETY: every (window, head) wrote its columns of its rows: all `len` values.
    unsafe { y.set_len(len) };
    if let (Some(probs), Some(mut kept)) = (&op.probs, kept) {
        // SAFETY: every (window, head) wrote its `t` rows of `tp` probabilities.
        unsafe { kept.set_len(kept_len) };
        // Set once: an op runs its forward pass once.
        let _ = probs.set(kept);
    }
    y
}

/// # Safety
/// `y` is `(B * T, C)` and `kept` (if any) `(B, nh, T, tp)`; no other thread touches head `h`'s
/// columns of window `b`'s rows, or its rows of `kept`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn forward_head<V: Vec16>(
    op: &WindowAttention,
    d: Dims,
    qkv: &[f32],
    y: *mut f32,
    kept: Option<*mut f32>,
    b: usize,
    h: usize,
    ws: &mut Workspace,
) {
    let (c3, hs) = (3 * d.c, d.hs);
    let first = b * d.t * c3 + h * hs; // the window's first query of this head
    gather_transposed(op.simd, qkv, c3, d.c + h * hs, d, b, &mut ws.kt);
    let (q, v) = if in_place(d) {
        (qkv[first..].at(c3), qkv[first + 2 * d.c..].at(c3))
    } else {
        gather(qkv, c3, h * hs, d, b, &mut ws.q, hs);
        gather(qkv, c3, 2 * d.c + h * hs, d, b, &mut ws.v, d.hsp);
        (ws.q.at(hs), ws.v.at(d.hsp))
    };
    for i0 in (0..d.t).step_by(BLOCK) {
        let m = BLOCK.min(d.t - i0);
        let n = (i0 + m).next_multiple_of(LANES); // keys this block sees, in whole vectors
                                                  // The probabilities go straight into the kept rows, unless dropout is to change them.
        let p = match kept {
            // SAFETY: the caller's contract: this head's rows of `kept`, `tp` each.
            Some(kept) if op.dropout.is_none() => unsafe { kept.add(WindowAttention::kept_index(d, b, h, i0)) },
            _ => ws.p.as_mut_ptr(),
        };
        // SAFETY: `q`'s rows of the block, `kᵀ` `(hs, tp)` with `n <= tp` (zero past `t`), `p` `m`
        // rows of `tp`.
        unsafe { tiles::scores::<V>(d, i0, m, n, q.rows_from(i0), ws.kt.at(d.tp), Mat::new(p, d.tp)) };
        for r in 0..m {
            // SAFETY: row `r` of `p`, whole (`tp`), in `ws.p` or this head's rows of `kept`.
            let row = unsafe { std::slice::from_raw_parts_mut(p.add(r * d.tp), d.tp) };
            softmax_row(&mut row[..n], op.start(d, b, i0 + r), i0 + r + 1, op.scale);
            match kept {
                // Kept in place: what lies past `n` (never read) is written too.
                Some(_) if op.dropout.is_none() => row[n..].fill(0.0),
                Some(kept) => {
                    // SAFETY: as above: this head's row of `kept`, `tp` long; `row` is in `ws.p`.
                    unsafe {
                        let to = kept.add(WindowAttention::kept_index(d, b, h, i0 + r));
                        std::ptr::copy_nonoverlapping(row.as_ptr(), to, d.tp)
                    }
                }
                None => {}
            }
            if let Some(drop) = op.dropout {
                let mask = drop_mask(drop, op.row_index(d, b, h, i0 + r), &mut ws.mask[..=i0 + r]);
                row.iter_mut().zip(mask).for_each(|(p, &m)| *p *= m);
            }
        }
        // The block's output rows, in this head's columns of `y`, or through `ws.out`.
        let out = if in_place(d) {
            // SAFETY: the caller's contract: this head's columns of this window's rows.
            unsafe { Mat::new(y.add((b * d.t + i0) * d.c + h * hs), d.c) }
        } else {
            ws.out.at_mut(d.hsp)
        };
        // SAFETY: `p` holds the block's `(m, n)` weights, `v` the window's rows (the sums stop at
        // each row's last key, within the window), `out` `m` rows of `hsp`.
        unsafe { weights_times_rows::<V>(d, i0, m, n, Mat::new(p.cast_const(), d.tp), v, out) };
        if !in_place(d) {
            for r in 0..m {
                // SAFETY: the caller's contract: this head's columns of this window's rows.
                let out = unsafe { std::slice::from_raw_parts_mut(y.add((b * d.t + i0 + r) * d.c + h * hs), hs) };
                out.copy_from_slice(&ws.out[r * d.hsp..][..hs]);
            }
        }
    }
}

/// Whether a head's rows are read and written where they are (`qkv`, `y` and their gradients,
/// with their row strides) rather than through the workspace's copies: heads of whole vectors
/// (GPT-2's 64, nanoGPT's CPU recipe's 32), whose tiles' full-width loads and stores stay
/// within the head's columns. The copies (a call to `memcpy` per row, 128 bytes in the recipe)
/// and those the backward pass made without reading them were 13% of the recipe's attention
/// forward and 18% backward (one thread).
#[inline(always)]
fn in_place(d: Dims) -> bool {
    d.hs == d.hsp
}

/// Fills `mask` with the dropout's factors (0, or 1/(1-p) where kept) for the weights at
/// element indices `first..`, and returns it.
fn drop_mask(drop: Dropout, first: u64, mask: &mut [f32]) -> &[f32] {
    let keep = drop.scale();
    for (j, m) in mask.iter_mut().enumerate() {
        *m = if drop.keeps(first + j as u64) { keep } else { 0.0 };
    }
    mask
}

/// Scores → causal softmax, in place: the entries `start..len` scaled, exponentiated and
/// normalised, the rest of the row zeroed. The row holds whole vectors past `len`
/// (`len.next_multiple_of(LANES)` entries at least); `start < len`.
#[inline(always)]
fn softmax_row(row: &mut [f32], start: usize, len: usize, scale: f32) {
    let seen = &mut row[..len];
    seen.iter_mut().for_each(|s| *s *= scale);
    // Another sequence's keys (a packed window): -inf, whose exponential is 0 (`rows::exp`),
    // so they add nothing to the sum and come out 0.
    seen[..start].fill(f32::NEG_INFINITY);
    let max = crate::rows::max(seen);
    let whole = len / LANES * LANES;
    let mut sums = [0f32; LANES];
    for chunk in row[..whole].chunks_exact_mut(LANES) {
        for (s, v) in sums.iter_mut().zip(chunk) {
            *v = crate::rows::exp(*v - max);
            *s += *v;
        }
    }
    // The last partial vector's exponentials on a whole vector (one at a time, a row's ~8 of
    // them were most of the attention's `exp`), then summed in order; the entries past `len`
    // are zeroed below whatever they hold.
    let mut sum = 0f32;
    if whole < len {
        let tail = &mut row[whole..whole + LANES];
        tail.iter_mut().for_each(|v| *v = crate::rows::exp(*v - max));
        tail[..len - whole].iter().for_each(|v| sum += *v);
    }
    let inv = 1.0 / (sums.iter().sum::<f32>() + sum);
    for (j, v) in row.iter_mut().enumerate() {
        *v = masked(j, len, *v * inv);
    }
}

/// `v` for `j < len`, else 0: the masked entries of a row zeroed in the pass that writes the
/// others, by a select that vectorises. (A `fill` of each row's few masked entries was a call to
/// `memset`, ~24,000 a step of nanoGPT's CPU recipe.) The masked entries' old values are
/// defined (the workspace starts zeroed) and never used.
#[inline(always)]
fn masked(j: usize, len: usize, v: f32) -> f32 {
    if j < len {
        v
    } else {
        0.0
    }
}

/// Backward: the gradient of `qkv` from `qkv` and the output's gradient `dy` `(B * T, C)`.
fn backward(op: &WindowAttention, d: Dims, qkv: &[f32], dy: &[f32]) -> Vec<f32> {
    struct Backward<'a> {
        op: &'a WindowAttention,
        d: Dims,
        qkv: &'a [f32],
        dy: &'a [f32],
        dqkv: usize,
    }
    impl HeadPass for Backward<'_> {
        #[inline(always)]
        unsafe fn head<V: Vec16>(&self, b: usize, h: usize, ws: &mut Workspace) {
            let kept = self.op.kept(self.d);
            // SAFETY: the trait's contract; `dqkv` is `(B * T, 3C)`.
            unsafe {
                backward_head::<V>(
                    self.op,
                    self.d,
                    self.qkv,
                    self.dy,
                    kept,
                    self.dqkv as *mut f32,
                    b,
                    h,
                    ws,
                )
            }
        }
    }
    // Not zeroed first: the heads write every gradient.
    let len = d.b * d.t * 3 * d.c;
    let mut dqkv = Vec::with_capacity(len);
    let pass = Backward {
        op,
        d,
        qkv,
        dy,
        dqkv: dqkv.as_mut_ptr() as usize,
    };
    run_pass(op, d, &pass);
    // SAFETY: every (window, head) wrote its query, key and value columns of its rows: all
    // `len` values.
    unsafe { dqkv.set_len(len) };
    dqkv
}

/// With `P` the block's probabilities, `M` the dropout's mask scaled by 1/(1-p) and `S = P ⊙ M`
/// the weights applied to the values (`y = S v`): `dS = dy vᵀ`, `dP = dS ⊙ M`, the scores'
/// gradient `dZ = P ⊙ (dP − Σ_j P_j dP_j) · scale`, then `dq = dZ k`, `dk += dZᵀ q` and
/// `dv += Sᵀ dy` (the last two as their transposes, which the kernel's layout favours).
///
/// # Safety
/// `dqkv` is `(B * T, 3C)`; no other thread touches head `h`'s columns of window `b`'s rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn backward_head<V: Vec16>(
    op: &WindowAttention,
    d: Dims,
    qkv: &[f32],
    dy: &[f32],
    kept: Option<&[f32]>,
    dqkv: *mut f32,
    b: usize,
    h: usize,
    ws: &mut Workspace,
) {
    let (c3, hs) = (3 * d.c, d.hs);
    let (first, first_dy) = (b * d.t * c3 + h * hs, b * d.t * d.c + h * hs);
    for (src, ld, col0, trans) in [
        (qkv, c3, h * hs, &mut ws.qt),
        (qkv, c3, 2 * d.c + h * hs, &mut ws.vt),
        (dy, d.c, h * hs, &mut ws.dyt),
    ] {
        gather_transposed(op.simd, src, ld, col0, d, b, trans);
    }
    // Rows: the output gradient's and the keys' (and the queries' where the scores are computed
    // again), where they are or copied.
    let (q, k, dy_rows) = if in_place(d) {
        (qkv[first..].at(c3), qkv[first + d.c..].at(c3), dy[first_dy..].at(d.c))
    } else {
        if kept.is_none() {
            gather(qkv, c3, h * hs, d, b, &mut ws.q, hs);
        }
        gather(qkv, c3, d.c + h * hs, d, b, &mut ws.k, d.hsp);
        gather(dy, d.c, h * hs, d, b, &mut ws.dy, hs);
        (ws.q.at(hs), ws.k.at(d.hsp), ws.dy.at(hs))
    };
    if kept.is_none() {
        gather_transposed(op.simd, qkv, c3, d.c + h * hs, d, b, &mut ws.kt);
    }
    ws.dkt.fill(0.0);
    ws.dvt.fill(0.0);
    for i0 in (0..d.t).step_by(BLOCK) {
        let m = BLOCK.min(d.t - i0);
        let n = (i0 + m).next_multiple_of(LANES);
        // The block's probabilities: read where the forward pass kept them, unless dropout is to
        // change them (then in `ws.p`, as when computed again).
        let p: *const f32 = match kept {
            Some(kept) if op.dropout.is_none() => kept[WindowAttention::kept_index(d, b, h, i0)..].as_ptr(),
            Some(kept) => {
                for r in 0..m {
                    let from = &kept[WindowAttention::kept_index(d, b, h, i0 + r)..][..n];
                    ws.p[r * d.tp..][..n].copy_from_slice(from);
                }
                ws.p.as_ptr()
            }
            None => {
                // SAFETY: `q`'s rows of the block, `kᵀ` `(hs, tp)` (zero past `t`), `p` `(BLOCK,
                // tp)`.
                unsafe { tiles::scores::<V>(d, i0, m, n, q.rows_from(i0), ws.kt.at(d.tp), ws.p.at_mut(d.tp)) };
                for r in 0..m {
                    softmax_row(&mut ws.p[r * d.tp..][..n], op.start(d, b, i0 + r), i0 + r + 1, op.scale);
                }
                ws.p.as_ptr()
            }
        };
        // SAFETY: `dy`'s rows of the block and `vᵀ`'s first `n` columns (zero past `t`).
        unsafe {
            gemm::<V>(
                m,
                n,
                hs,
                dy_rows.rows_from(i0),
                ws.vt.at(d.tp),
                ws.dp.at_mut(d.tp),
                false,
                Causal::KeyColumns(i0),
            )
        };
        for r in 0..m {
            let len = i0 + r + 1;
            let dp = &mut ws.dp[r * d.tp..][..n];
            let mask = op
                .dropout
                .map(|drop| drop_mask(drop, op.row_index(d, b, h, i0 + r), &mut ws.mask[..len]));
            if let Some(mask) = mask {
                dp[..len].iter_mut().zip(mask).for_each(|(dp, &m)| *dp *= m);
            }
            {
                // SAFETY: row `r` of the block's probabilities, `n` of them; written below only
                // through `ws.p`, after this borrow ends.
                let p = unsafe { std::slice::from_raw_parts(p.add(r * d.tp), n) };
                let dot = dot(&p[..len], &dp[..len]);
                for (j, (dp, &p)) in dp.iter_mut().zip(p).enumerate() {
                    *dp = masked(j, len, p * (*dp - dot) * op.scale);
                }
            }
            if let Some(mask) = mask {
                // With dropout `p` is `ws.p` (above).
                ws.p[r * d.tp..][..len].iter_mut().zip(mask).for_each(|(p, &m)| *p *= m);
            }
        }
        // SAFETY: the transposed operands from column `i0` of `(hs, tp)`, the block's `(m, n)`
        // weights and scores' gradient, `k`'s rows (the sums stop at each row's last key, within
        // the window).
        unsafe {
            let sums = [
                (ws.dyt[i0..].at(d.tp), Mat::new(p, d.tp), ws.dvt.at_mut(d.tp)), // dvᵀ += dyᵀ S
                (ws.qt[i0..].at(d.tp), ws.dp.at(d.tp), ws.dkt.at_mut(d.tp)),     // dkᵀ += qᵀ dZ
            ];
            for (a, b, c) in sums {
                gemm::<V>(hs, n, m, a, b, c, true, Causal::QuerySums(i0));
            }
            // dq = dZ k, into this head's query columns of `dqkv` or through `ws.out`.
            let out = if in_place(d) {
                Mat::new(dqkv.add((b * d.t + i0) * c3 + h * hs), c3)
            } else {
                ws.out.at_mut(d.hsp)
            };
            weights_times_rows::<V>(d, i0, m, n, ws.dp.at(d.tp), k, out);
        }
        if !in_place(d) {
            for r in 0..m {
                // SAFETY: the caller's contract: this head's query columns of this window's rows.
                let out = unsafe { std::slice::from_raw_parts_mut(dqkv.add((b * d.t + i0 + r) * c3 + h * hs), hs) };
                out.copy_from_slice(&ws.out[r * d.hsp..][..hs]);
            }
        }
    }
    // The key and value gradients transposed back into this head's columns of the window's rows.
    for (col0, src) in [(d.c, &ws.dkt), (2 * d.c, &ws.dvt)] {
        // SAFETY: `src` holds `hs` rows of `tp >= t` values; the window's rows from this head's
        // first key (or value) column, `t` rows of `hs` values: the caller's contract.
        unsafe {
            let to = dqkv.add(b * d.t * c3 + col0 + h * hs);
            crate::simd::transpose(op.simd, src.as_ptr(), d.tp, to, c3, hs, d.t)
        };
    }
}

/// `out = w x` for a block's `(m, n)` weights `w` (`P` or `dZ`, rows of `tp`) and the rows of
/// `x` (`v` or `k`, `hsp` columns): a row of `out` (of `hsp`) per query of the block, each summed
/// over the keys its query sees.
///
/// # Safety
/// `w` holds `m` rows of `n`, `x` the rows of the keys the block's queries see (`i0 + m`), `out`
/// `m` rows of `hsp`; `out` overlaps neither.
#[inline(always)]
unsafe fn weights_times_rows<V: Vec16>(
    d: Dims,
    i0: usize,
    m: usize,
    n: usize,
    w: Mat<*const f32>,
    x: Mat<*const f32>,
    out: Mat<*mut f32>,
) {
    // SAFETY: the caller's contract.
    unsafe { gemm::<V>(m, d.hsp, n, w, x, out, false, Causal::KeySums(i0)) }
}

/// `a · b` in 16 partial sums (vectorisable), then added in a fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut sums = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in sums.iter_mut().zip(x).zip(y) {
            *s += x * y;
        }
    }
    sums.iter().sum::<f32>() + tail
}

impl CustomOp1 for WindowAttention {
    fn name(&self) -> &'static str {
        "window-attention"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = crate::f32_slice(storage, layout, "window-attention")?;
        let d = Dims::of(layout, self.t, self.n_head)?;
        Ok((CpuStorage::F32(forward(self, d, qkv)), Shape::from((d.b * d.t, d.c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, layout: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::window_attention(s, layout, &self.gpu_args(layout)?)
    }

    fn bwd(&self, qkv: &Tensor, y: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dy.contiguous()?;
        Ok(Some(if qkv.device().is_cuda() {
            // The GPU's kernels take D_i = dy_i · y_i from the output rather than summing
            // P_ij (dy_i · v_j) over the row (they never hold a whole row).
            qkv.apply_op3_no_bwd(&y.contiguous()?, &dy, &WindowAttentionGradGpu(self.clone()))?
        } else {
            qkv.apply_op2_no_bwd(&dy, &WindowAttentionGrad(self.clone()))?
        }))
    }
}

impl WindowAttention {
    #[cfg(feature = "cuda")]
    fn gpu_args(&self, layout: &Layout) -> Result<cuda::WindowAttentionArgs> {
        if self.starts.is_some() {
            candle_core::bail!("window-attention: packed windows run on the CPU only (candle's ops elsewhere)")
        }
        let d = Dims::of(layout, self.t, self.n_head)?;
        let (p, key, first) = self.dropout.map_or((0.0, 0, 0), |drop| (drop.p, drop.key, drop.first));
        Ok(cuda::WindowAttentionArgs {
            b: d.b,
            t: d.t,
            n_head: d.nh,
            head_dim: d.hs,
            scale: self.scale,
            p,
            key,
            first,
        })
    }
}

/// [`WindowAttentionGrad`] on the GPU, from the input, the output and the output's gradient.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct WindowAttentionGradGpu(WindowAttention);

impl candle_core::CustomOp3 for WindowAttentionGradGpu {
    fn name(&self) -> &'static str {
        "window-attention-grad-gpu"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("window-attention-grad-gpu runs on CUDA only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let args = self.0.gpu_args(l1)?;
        cuda::window_attention_grad((s1, l1), (s2, l2), (s3, l3), &args)
    }
}

/// The gradient of [`WindowAttention`]'s input from the input and the output's gradient.
struct WindowAttentionGrad(WindowAttention);

impl CustomOp2 for WindowAttentionGrad {
    fn name(&self) -> &'static str {
        "window-attention-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let qkv = crate::f32_slice(s1, l1, "window-attention-grad")?;
        let dy = crate::f32_slice(s2, l2, "window-attention-grad")?;
        let d = Dims::of(l1, self.0.t, self.0.n_head)?;
        if l2.dims() != [d.b * d.t, d.c] {
            candle_core::bail!(
                "window-attention-grad: the gradient is {:?}, not {:?}",
                l2.dims(),
                [d.b * d.t, d.c]
            )
        }
        Ok((CpuStorage::F32(backward(&self.0, d, qkv, dy)), l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests;
