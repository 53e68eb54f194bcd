//! AdamW with decoupled weight decay (Loshchilov & Hutter, 2019), gradient accumulation and
//! clipping by global norm. In f32 the update is one fused pass per parameter (on the CPU, and
//! on a CUDA GPU with the `cuda` feature).
//!
//! candle-nn has an `AdamW`, but it keeps its moment estimates private, so they cannot be saved
//! for an exact resume, and it decays every parameter; this one exposes its state and decays only
//! 2-D weight matrices (not biases or LayerNorm parameters), as nanoGPT does.

#[cfg(feature = "cuda")]
mod cuda;
mod groups;
pub mod muon;

pub use groups::{MuonGroup, Optimizer, OptimizerKind};

use std::collections::HashMap;

use candle_core::{CpuStorage, CustomOp3, DType, IndexOp, Layout, Result, Shape, Tensor, Var};

#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

struct Param {
    name: String,
    var: Var,
    decay: bool,
    /// Its learning rate's share of the schedule's (its group's rate over `--learning-rate`).
    lr_scale: f64,
    /// First and second moments, flattened and stacked: `(2, n)`.
    moments: Tensor,
}

pub struct AdamW {
    params: Vec<Param>,
    steps: u64,
    cfg: AdamWConfig,
}

/// One AdamW update of a flattened parameter: inputs theta `(n)`, grad `(n)`, moments `(2, n)`;
/// output `(3, n)`: the new theta, m and v (the GPU's form; on the CPU the same arithmetic runs in
/// place, [`MomentsUpdate`] then [`ParamUpdate`]). The gradient is multiplied by `grad_scale`
/// first (the clipping factor; 1 when the norm is within bounds).
struct FusedUpdate {
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    decay: f32,
    bias1: f32,
    bias2: f32,
    grad_scale: f32,
}

impl FusedUpdate {
    /// The new moments from the gradient.
    #[inline(always)]
    fn moments(&self, g: f32, m: f32, v: f32) -> (f32, f32) {
        let g = g * self.grad_scale;
        (
            self.beta1 * m + (1.0 - self.beta1) * g,
            self.beta2 * v + (1.0 - self.beta2) * g * g,
        )
    }

    /// The new parameter from the new moments.
    #[inline(always)]
    fn param(&self, t: f32, m: f32, v: f32) -> f32 {
        let update = (m / self.bias1) / ((v / self.bias2).sqrt() + self.eps);
        t * (1.0 - self.lr * self.decay) - self.lr * update
    }

    /// Runs `work` over `n` elements in parts, split over the cores for a large parameter (the
    /// update runs after the shards' threads, alone); each element on its own, so the result is
    /// the same however it is split. On candle's thread pool when it has workers (`--parallel
    /// ops`), else on threads of its own for a large one (a thread's start and end cost a TLB flush
    /// on every core) and on this thread for the rest; compiled for the CPU's widest vectors.
    fn split(n: usize, work: impl Fn(std::ops::Range<usize>) + Sync) {
        let work = |range: std::ops::Range<usize>| {
            gpt_kernels::simd::vectorised(
                #[inline(always)]
                || work(range),
            )
        };
        let pool = candle_core::utils::barrier_pool();
        if pool.n_workers() > 0 {
            const PART: usize = 1 << 16;
            pool.execute_chunked(n.div_ceil(PART), |parts| {
                work(parts.start * PART..(parts.end * PART).min(n));
            });
            return;
        }
        let threads = if n >= 1 << 20 {
            crate::step::cpu_threads(None)
        } else {
            1
        };
        if threads <= 1 {
            work(0..n);
            return;
        }
        let per = n.div_ceil(threads).max(1);
        std::thread::scope(|scope| {
            for start in (0..n).step_by(per) {
                let work = &work;
                scope.spawn(move || work(start..(start + per).min(n)));
            }
        });
    }
}

/// A contiguous f32 slice of CPU storage, mutable.
fn f32_slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, op: &str) -> Result<&'a mut [f32]> {
    let (start, end) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{op}: not contiguous")))?;
    match s {
        CpuStorage::F32(v) => Ok(&mut v[start..end]),
        _ => candle_core::bail!("{op}: not f32"),
    }
}

/// Raw parts of a slice that scoped threads write disjoint ranges of.
#[derive(Clone, Copy)]
struct Shared(*mut f32);
impl Shared {
    /// The pointer (a method, so that closures capture the `Sync` wrapper, not its field).
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

// SAFETY: each thread of `FusedUpdate::split` touches its own range only.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// AdamW's moments `(2, n)` (m then v) updated in place from the gradient `(n)`.
struct MomentsUpdate<'a>(&'a FusedUpdate);

impl candle_core::InplaceOp2 for MomentsUpdate<'_> {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let mv = f32_slice_mut(s1, l1, "adamw-moments")?;
        let g = gpt_kernels::f32_slice(s2, l2, "adamw-moments")?;
        let n = g.len();
        if mv.len() != 2 * n {
            candle_core::bail!("adamw-moments: {} moments for {n} gradients", mv.len())
        }
        let mv = Shared(mv.as_mut_ptr());
        FusedUpdate::split(
            n,
            #[inline(always)]
            |range| {
                // SAFETY: `mv` holds `2 n` values; this thread's range of m and of v is its own.
                let (m, v) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(mv.ptr().add(range.start), range.len()),
                        std::slice::from_raw_parts_mut(mv.ptr().add(n + range.start), range.len()),
                    )
                };
                for ((m, v), &g) in m.iter_mut().zip(v.iter_mut()).zip(&g[range]) {
                    (*m, *v) = self.0.moments(g, *m, *v);
                }
            },
        );
        Ok(())
    }
}

/// A parameter `(n)` updated in place from its new moments `(2, n)`.
struct ParamUpdate<'a>(&'a FusedUpdate);

impl candle_core::InplaceOp2 for ParamUpdate<'_> {
    fn name(&self) -> &'static str {
        "adamw-param"
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let theta = f32_slice_mut(s1, l1, "adamw-param")?;
        let mv = gpt_kernels::f32_slice(s2, l2, "adamw-param")?;
        let n = theta.len();
        if mv.len() != 2 * n {
            candle_core::bail!("adamw-param: {} moments for {n} parameters", mv.len())
        }
        let (m, v) = mv.split_at(n);
        let theta = Shared(theta.as_mut_ptr());
        FusedUpdate::split(
            n,
            #[inline(always)]
            |range| {
                // SAFETY: `theta` holds `n` values; this thread's range is its own.
                let t = unsafe { std::slice::from_raw_parts_mut(theta.ptr().add(range.start), range.len()) };
                for ((t, &m), &v) in t.iter_mut().zip(&m[range.clone()]).zip(&v[range]) {
                    *t = self.0.param(*t, m, v);
                }
            },
        );
        Ok(())
    }
}

impl CustomOp3 for FusedUpdate {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let slice = |s, l| gpt_kernels::f32_slice(s, l, "fused-adamw");
        let (theta, g, mv) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let n = theta.len();
        let (m, v) = mv.split_at(n);
        let mut out = Vec::with_capacity(3 * n);
        out.extend(g.iter().zip(m).zip(v).map(|((&g, &m), &v)| self.moments(g, m, v)));
        let (new_m, new_v): (Vec<f32>, Vec<f32>) = out.drain(..).unzip();
        let mut out: Vec<f32> = theta
            .iter()
            .zip(new_m.iter().zip(&new_v))
            .map(|(&t, (&m, &v))| self.param(t, m, v))
            .collect();
        out.extend(new_m);
        out.extend(new_v);
        Ok((CpuStorage::F32(out), Shape::from((3, n))))
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
        let step = cuda::AdamWStep {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            decay: self.decay,
            bias1: self.bias1,
            bias2: self.bias2,
        };
        if self.grad_scale != 1.0 {
            candle_core::bail!("fused-adamw on CUDA: scale the gradients first (clip_grad_norm)")
        }
        cuda::adamw((s1, l1), (s2, l2), (s3, l3), step)
    }
}

impl AdamW {
    /// `named_vars` in a fixed order (it is also the order of the gradients given to `step`).
    pub fn new(named_vars: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        let params = named_vars
            .into_iter()
            .map(|(name, var)| {
                let moments = Tensor::zeros((2, var.elem_count()), DType::F32, var.device())?;
                Ok(Param {
                    decay: var.rank() >= 2,
                    lr_scale: 1.0,
                    name,
                    var,
                    moments,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Self { params, steps: 0, cfg })
    }

    /// Gives each parameter the learning rate `scale(name)` times the schedule's.
    pub fn with_lr_scales(mut self, scale: impl Fn(&str) -> f64) -> Self {
        for p in &mut self.params {
            p.lr_scale = scale(&p.name);
        }
        self
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }

    /// One update with learning rate `lr`; `grads[i]` belongs to the i-th variable.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        self.step_scaled(grads, lr, 1.0)
    }

    /// One update with learning rate `lr` from the gradients clipped to a global L2 norm of at
    /// most `max_norm` (0: no clipping), as gpt-train steps. On a CUDA GPU (f32, fused kernels on)
    /// the norm, the clipping and the update of every parameter are three launches with nothing
    /// read back ([`cuda::clipped_adamw`]; `GPT_CUDA_ADAMW=0` turns that off, to
    /// compare); elsewhere [`clip_factor`], then [`AdamW::step_scaled`].
    pub fn step_clipped(&mut self, grads: &[Tensor], lr: f64, max_norm: f64) -> Result<()> {
        #[cfg(feature = "cuda")]
        if !self.params.is_empty()
            && self
                .params
                .iter()
                .all(|p| p.var.device().is_cuda() && gpt_kernels::fused(p.var.as_tensor()) && p.lr_scale == 1.0)
            && gpu_update_on()
        {
            return self.step_clipped_on_gpu(grads, lr, max_norm);
        }
        let (_, grad_scale) = clip_factor(grads, max_norm)?;
        self.step_scaled(grads, lr, grad_scale)
    }

    #[cfg(feature = "cuda")]
    fn step_clipped_on_gpu(&mut self, grads: &[Tensor], lr: f64, max_norm: f64) -> Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!("{} gradients for {} parameters", grads.len(), self.params.len());
        }
        let grads = grads
            .iter()
            .map(|g| g.detach().contiguous())
            .collect::<Result<Vec<_>>>()?;
        if let Some(p) = self.params.iter().find(|p| !p.var.as_tensor().is_contiguous()) {
            candle_core::bail!("parameter {}: not contiguous, so it cannot be updated in place", p.name);
        }
        let params: Vec<cuda::AdamWParam> = self
            .params
            .iter()
            .zip(&grads)
            .map(|(p, grad)| cuda::AdamWParam {
                theta: p.var.as_tensor(),
                moments: &p.moments,
                grad,
                decay: p.decay,
            })
            .collect();
        let c = self.cfg;
        let (bias1, bias2) = self.bias_corrections(self.steps + 1);
        let step = cuda::AdamWStep {
            lr: lr as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            eps: c.eps as f32,
            decay: c.weight_decay as f32,
            bias1: bias1 as f32,
            bias2: bias2 as f32,
        };
        cuda::clipped_adamw(&params, max_norm as f32, step)?;
        self.steps += 1; // only once the update is queued: a refused one leaves the count as it was
        Ok(())
    }

    /// The bias corrections `1 - β1^t`, `1 - β2^t` of update `t` (counted from 1).
    fn bias_corrections(&self, t: u64) -> (f64, f64) {
        let t = t as i32;
        (1.0 - self.cfg.beta1.powi(t), 1.0 - self.cfg.beta2.powi(t))
    }

    /// One update with learning rate `lr` from the gradients times `grad_scale` (the clipping
    /// factor of [`clip_factor`]): on the CPU the moments and then the parameters are updated in
    /// place, with no copy of either (a GPT-2-small step's update touched 2 GB of fresh memory).
    pub fn step_scaled(&mut self, grads: &[Tensor], lr: f64, grad_scale: f64) -> Result<()> {
        self.step_scaled_where(grads, lr, grad_scale, |_| true)
    }

    /// [`AdamW::step_scaled`] of the parameters `update` picks (by index) only: the others and
    /// their moments stay as they are, and the step count advances all the same. The ranks of a
    /// data-parallel job on CPUs each update their own share this way, then share the results.
    pub fn step_scaled_where(
        &mut self,
        grads: &[Tensor],
        lr: f64,
        grad_scale: f64,
        update: impl Fn(usize) -> bool,
    ) -> Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!("{} gradients for {} parameters", grads.len(), self.params.len());
        }
        self.steps += 1;
        let (bias1, bias2) = self.bias_corrections(self.steps);
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        for (i, (p, g)) in self.params.iter_mut().zip(grads).enumerate() {
            if !update(i) {
                continue;
            }
            let g = g.detach().flatten_all()?; // the moments must not hold on to any graph
            let theta = p.var.as_tensor().flatten_all()?;
            let decay = if p.decay { weight_decay } else { 0.0 };
            let lr = lr * p.lr_scale;
            let kernel = FusedUpdate {
                lr: lr as f32,
                beta1: beta1 as f32,
                beta2: beta2 as f32,
                eps: eps as f32,
                decay: decay as f32,
                bias1: bias1 as f32,
                bias2: bias2 as f32,
                grad_scale: grad_scale as f32,
            };
            if gpt_kernels::fused(&theta) && theta.device().is_cpu() {
                p.moments.inplace_op2(&g.contiguous()?, &MomentsUpdate(&kernel))?;
                theta.inplace_op2(&p.moments, &ParamUpdate(&kernel))?;
                continue;
            }
            let g = if grad_scale == 1.0 { g } else { (g * grad_scale)? };
            let (new_theta, moments) = if gpt_kernels::fused(&theta) {
                let kernel = FusedUpdate {
                    grad_scale: 1.0,
                    ..kernel
                };
                let out = theta.apply_op3_no_bwd(&g.contiguous()?, &p.moments, &kernel)?; // (3, n)
                (out.i(0)?, out.narrow(0, 1, 2)?)
            } else {
                let m = ((p.moments.i(0)? * beta1)? + (&g * (1.0 - beta1))?)?;
                let v = ((p.moments.i(1)? * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let update = ((&m / bias1)? / ((&v / bias2)?.sqrt()? + eps)?)?;
                let theta = ((theta * (1.0 - lr * decay))? - (update * lr)?)?;
                (theta, Tensor::stack(&[m, v], 0)?)
            };
            p.var.set(&new_theta.reshape(p.var.shape())?)?;
            p.moments = moments;
        }
        Ok(())
    }

    /// Each parameter's moments, `(2, n)`, in the parameters' order (their storage: changing
    /// them in place changes the optimizer's).
    pub fn moments(&self) -> Vec<Tensor> {
        self.params.iter().map(|p| p.moments.clone()).collect()
    }

    /// Moment estimates by name (`NAME.exp_avg`, `NAME.exp_avg_sq`, as PyTorch calls them).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.params.len());
        for p in &self.params {
            for (i, suffix) in ["exp_avg", "exp_avg_sq"].into_iter().enumerate() {
                if let Ok(t) = p.moments.i(i).and_then(|t| t.reshape(p.var.shape())) {
                    out.push((format!("{}.{suffix}", p.name), t));
                }
            }
        }
        out
    }

    /// Restores the moments saved by [`AdamW::state_tensors`] after `steps` updates.
    pub fn load_state(&mut self, mut tensors: HashMap<String, Tensor>, steps: u64) -> Result<()> {
        for p in &mut self.params {
            let mut pair = Vec::with_capacity(2);
            for suffix in ["exp_avg", "exp_avg_sq"] {
                let t = take_state(&mut tensors, &format!("{}.{suffix}", p.name), &p.var)?;
                pair.push(t.flatten_all()?);
            }
            p.moments = Tensor::stack(&pair, 0)?;
        }
        self.steps = steps;
        Ok(())
    }
}

/// The saved state `name` of the variable `var`, taken out of `tensors`: f32 on its device, its
/// shape checked.
fn take_state(tensors: &mut HashMap<String, Tensor>, name: &str, var: &Var) -> Result<Tensor> {
    let t = tensors
        .remove(name)
        .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() })?;
    if t.shape() != var.shape() {
        candle_core::bail!(
            "optimizer state {name}: shape {:?}, expected {:?}",
            t.shape(),
            var.shape()
        );
    }
    t.to_dtype(DType::F32)?.to_device(var.device())
}

/// `GPT_CUDA_ADAMW` is not `0`: [`AdamW::step_clipped`]'s kernels on a GPU (read once).
#[cfg(feature = "cuda")]
fn gpu_update_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    gpt_kernels::switch_on(&ON, "GPT_CUDA_ADAMW")
}

/// Global L2 norm of all gradients together.
pub fn global_norm(grads: &[Tensor]) -> Result<f64> {
    if grads.is_empty() {
        return Ok(0.0);
    }
    if norm_by_sums_of_squares(grads) {
        // On the CPU: each gradient's squares summed in one pass, in f64, without a tensor of
        // squares (GPT-2 small's would be 500 MB of fresh memory a step).
        let mut sum = 0f64;
        for g in grads {
            sum += sum_of_squares(g)?;
        }
        return Ok(sum.sqrt());
    }
    // Summed on the device, read back once (one synchronisation on a GPU, not one per tensor).
    let squares = grads
        .iter()
        .map(|g| g.sqr()?.sum_all()?.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let sum = Tensor::stack(&squares, 0)?.sum_all()?.to_scalar::<f64>()?;
    Ok(sum.sqrt())
}

/// Whether [`global_norm`] sums each gradient's squares with [`sum_of_squares`] (f32 CPU
/// tensors, fused ops on), so that a norm summed from them in order is the same, bit for bit.
pub fn norm_by_sums_of_squares(grads: &[Tensor]) -> bool {
    grads.iter().all(|g| gpt_kernels::fused(g) && g.device().is_cpu())
}

/// `Σ x²` of a gradient, in f64, as [`global_norm`] sums it on the CPU.
pub fn sum_of_squares(g: &Tensor) -> Result<f64> {
    g.contiguous()?.apply_op1_no_bwd(&SumOfSquares)?.to_scalar::<f64>()
}

/// `Σ x²` of an f32 tensor, as an f64 scalar.
struct SumOfSquares;

impl candle_core::CustomOp1 for SumOfSquares {
    fn name(&self) -> &'static str {
        "sum-of-squares"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = gpt_kernels::f32_slice(s, l, "sum-of-squares")?;
        // Eight partial sums, so that the loop vectorises; a fixed order, so it is repeatable.
        let mut parts = [0f64; 8];
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for (p, &v) in parts.iter_mut().zip(c) {
                *p += (v as f64) * (v as f64);
            }
        }
        let tail: f64 = chunks.remainder().iter().map(|&v| (v as f64) * (v as f64)).sum();
        Ok((CpuStorage::F64(vec![parts.iter().sum::<f64>() + tail]), Shape::from(())))
    }
}

/// The global norm of the gradients and the factor that clips it to at most `max_norm` (as
/// PyTorch's `clip_grad_norm_`; 1 when within bounds or `max_norm` is 0), to pass to
/// [`AdamW::step_scaled`] instead of scaling every gradient.
pub fn clip_factor(grads: &[Tensor], max_norm: f64) -> Result<(f64, f64)> {
    let norm = global_norm(grads)?;
    Ok((norm, clip_scale(norm, max_norm)))
}

/// The factor that clips gradients of global norm `norm` to at most `max_norm`.
pub fn clip_scale(norm: f64, max_norm: f64) -> f64 {
    if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}

/// Scales the gradients so that their global norm is at most `max_norm` (as PyTorch's
/// `clip_grad_norm_`); returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut [Tensor], max_norm: f64) -> Result<f64> {
    let (norm, scale) = clip_factor(grads, max_norm)?;
    if scale != 1.0 {
        for g in grads.iter_mut() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}
