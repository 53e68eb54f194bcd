//! The CUDA launchers of the optimizer's kernels (`adamw.cu`, beside this file): one AdamW update
//! of a parameter, and the clipped update of every parameter at once.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::LaunchConfig;
use candle_core::{CudaStorage, Layout, Result, Shape};
use gpt_kernels::cuda::{address, elementwise, f32_view, output, wrap};

const MODULE: gpt_kernels::cuda::Module = gpt_kernels::ptx_module!("adamw");

/// The AdamW hyper-parameters of one update, in the kernel's argument order.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub decay: f32,
    pub bias1: f32,
    pub bias2: f32,
}

/// One AdamW update: theta `(n)`, grad `(n)`, moments `(2, n)` → `(3, n)`: theta, m, v.
pub fn adamw(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    p: AdamWStep,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    let theta = f32_view(s1, l1, "adamw")?;
    let (g, mv) = (f32_view(s2, l2, "adamw")?, f32_view(s3, l3, "adamw")?);
    let n = theta.len();
    if g.len() != n || mv.len() != 2 * n {
        candle_core::bail!("adamw: {n} parameters, {} gradients, {} moments", g.len(), mv.len());
    }
    let out = output(dev, 3 * n)?; // adamw writes each of theta, m and v
    gpt_kernels::launch!(dev, MODULE, "adamw", elementwise(n); &theta, &g, &mv, &out, &n,
        &p.lr, &p.beta1, &p.beta2, &p.eps, &p.decay, &p.bias1, &p.bias2);
    Ok(wrap(out, dev, Shape::from((3, n))))
}

/// One parameter for [`clipped_adamw`]: its weights and moments `(2, n)` (contiguous f32 on the
/// GPU, updated in place), its gradient, and whether weight decay applies to it.
pub struct AdamWParam<'a> {
    pub theta: &'a candle_core::Tensor,
    pub moments: &'a candle_core::Tensor,
    pub grad: &'a candle_core::Tensor,
    pub decay: bool,
}

/// Elements per chunk of [`clipped_adamw`] (a block of each kernel).
const CLIP_CHUNK: usize = 1 << 16;
/// Columns of its table (`TABLE_COLS` in adamw.cu).
const TABLE_COLS: usize = 6;

/// Clips the gradients to a global L2 norm of at most `max_norm` (0: no clipping) and applies one
/// AdamW update (`step.decay` is the weight decay of the parameters that take it) to every
/// parameter, in place, in three launches over all of them and with nothing read back: the
/// host goes on queueing the next step while these run. One kernel per parameter and op (the
/// way through candle's ops) was ~5 launches and allocations per parameter, and the norm's
/// read-back stopped the host every step.
pub fn clipped_adamw(params: &[AdamWParam<'_>], max_norm: f32, step: AdamWStep) -> Result<()> {
    let Some(first) = params.first() else { return Ok(()) };
    let candle_core::Device::Cuda(dev) = first.theta.device() else {
        candle_core::bail!("clipped-adamw: the parameters are not on a CUDA device")
    };
    let mut table: Vec<u64> = Vec::new();
    for p in params {
        let n = p.theta.elem_count();
        for t in [p.theta, p.moments, p.grad] {
            if t.dtype() != candle_core::DType::F32 || !t.device().same_device(p.theta.device()) {
                candle_core::bail!("clipped-adamw: a parameter, gradient or moment is not f32 on the GPU")
            }
        }
        if p.grad.elem_count() != n || p.moments.elem_count() != 2 * n {
            candle_core::bail!(
                "clipped-adamw: {n} weights, {} gradients, {} moments",
                p.grad.elem_count(),
                p.moments.elem_count()
            )
        }
        let (g, theta, m) = (address(p.grad)?, address(p.theta)?, address(p.moments)?);
        let v = m + 4 * n as u64;
        for start in (0..n).step_by(CLIP_CHUNK) {
            let off = 4 * start as u64;
            let len = CLIP_CHUNK.min(n - start) as u64;
            table.extend([g + off, theta + off, m + off, v + off, len, u64::from(p.decay)]);
        }
    }
    let chunks = table.len() / TABLE_COLS;
    if chunks == 0 {
        return Ok(());
    }
    let table = dev.clone_htod(&table)?;
    let partial = output(dev, chunks)?; // grad_sumsq writes each chunk's sum
    let total = output(dev, 1)?; // sum_partials writes the total
    let per_chunk = LaunchConfig {
        grid_dim: (chunks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    gpt_kernels::launch!(dev, MODULE, "grad_sumsq", per_chunk; &table, &partial);
    let n_chunks = chunks as i32;
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    gpt_kernels::launch!(dev, MODULE, "sum_partials", one_block; &partial, &n_chunks, &total);
    gpt_kernels::launch!(dev, MODULE, "adamw_clipped", per_chunk; &table, &total, &max_norm,
        &step.lr, &step.beta1, &step.beta2, &step.eps, &step.decay, &step.bias1, &step.bias2);
    Ok(())
}
