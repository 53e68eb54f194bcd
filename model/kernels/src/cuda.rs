//! Launchers for the CUDA kernels in `ops.cu`: the `cuda_fwd` of the fused ops in [`crate::ops`]
//! (and of the training crate's AdamW update). f32, contiguous inputs.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ops.ptx"));
const MODULE: &str = "gpt_ops";
/// Must match `WARPS_PER_BLOCK` in ops.cu.
const WARPS_PER_BLOCK: u32 = 4;

/// The f32 data of a contiguous CUDA tensor.
pub fn f32_view<'a>(storage: &'a CudaStorage, layout: &Layout, op: &str) -> Result<CudaView<'a, f32>> {
    let slice = storage.as_cuda_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(slice.slice(start..end)),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

fn wrap(slice: CudaSlice<f32>, dev: &CudaDevice, shape: Shape) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(slice, dev.clone()), shape)
}

/// A grid-stride launch over `n` elements.
fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(WARPS_PER_BLOCK).max(1), 1, 1),
        block_dim: (32 * WARPS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches kernel `$name` of ops.cu with `$cfg` and the arguments in order.
///
/// SAFETY (of every use): the arguments match the kernel's parameters in order and type, and
/// each buffer holds the elements that the kernel reads or writes under that configuration.
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let func = $dev.get_or_load_custom_func($name, MODULE, PTX)?;
        let mut builder = func.builder();
        $( builder.arg($arg); )*
        unsafe { builder.launch($cfg) }.w()?;
    }};
}

pub fn gelu(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let x = f32_view(s, l, "gelu")?;
    let n = x.len();
    let y = unsafe { dev.alloc::<f32>(n)? };
    launch!(dev, "gelu_fwd", elementwise(n); &x, &y, &n);
    Ok(wrap(y, dev, l.shape().clone()))
}

/// Dropout of a contiguous f32 tensor (see `ops/dropout.rs`): the mask from (key, first + i).
pub fn dropout(s: &CudaStorage, l: &Layout, key: u64, first: u64, p: f32) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let x = f32_view(s, l, "dropout")?;
    let n = x.len();
    let y = unsafe { dev.alloc::<f32>(n)? };
    let scale = 1.0 / (1.0 - p);
    launch!(dev, "dropout_fwd", elementwise(n); &x, &y, &n, &key, &first, &p, &scale);
    Ok(wrap(y, dev, l.shape().clone()))
}

pub fn gelu_grad(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    let (x, g) = (f32_view(s1, l1, "gelu-grad")?, f32_view(s2, l2, "gelu-grad")?);
    let n = x.len();
    let dx = unsafe { dev.alloc::<f32>(n)? };
    launch!(dev, "gelu_bwd", elementwise(n); &x, &g, &dx, &n);
    Ok(wrap(dx, dev, l1.shape().clone()))
}

pub fn causal_softmax(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let x = f32_view(s, l, "causal-softmax")?;
    let dims = l.dims();
    let (t_q, t_k) = (dims[dims.len() - 2] as i32, dims[dims.len() - 1] as i32);
    let rows = x.len() / t_k.max(1) as usize;
    let y = unsafe { dev.alloc::<f32>(x.len())? };
    launch!(dev, "causal_softmax_fwd", per_row(rows); &x, &y, &rows, &t_q, &t_k);
    Ok(wrap(y, dev, l.shape().clone()))
}

pub fn softmax_grad(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    let (y, g) = (f32_view(s1, l1, "softmax-grad")?, f32_view(s2, l2, "softmax-grad")?);
    let t_k = *l1.dims().last().unwrap_or(&1) as i32;
    let rows = y.len() / t_k.max(1) as usize;
    let dx = unsafe { dev.alloc::<f32>(y.len())? };
    launch!(dev, "softmax_bwd", per_row(rows); &y, &g, &dx, &rows, &t_k);
    Ok(wrap(dx, dev, l1.shape().clone()))
}

pub fn add_tiled(s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    let (x, bias) = (f32_view(s1, l1, "add-tiled")?, f32_view(s2, l2, "add-tiled")?);
    let (n, nb) = (x.len(), bias.len());
    if nb == 0 || n % nb != 0 {
        candle_core::bail!("add-tiled: {nb} values do not tile {n}");
    }
    let y = unsafe { dev.alloc::<f32>(n)? };
    launch!(dev, "add_tiled", elementwise(n); &x, &bias, &y, &n, &nb);
    Ok(wrap(y, dev, l1.shape().clone()))
}

/// Column sums of `a`, a `(rows, cols)` matrix, into `out[offset..offset + cols]`: partial sums
/// over chunks of rows, then their sum, in a fixed order (the same result every run).
fn column_sum(
    dev: &CudaDevice,
    a: &CudaView<'_, f32>,
    rows: usize,
    cols: usize,
    out: &mut CudaSlice<f32>,
    offset: usize,
) -> Result<()> {
    let col_blocks = (cols as u32).div_ceil(128);
    // Enough chunks to fill the GPU, each long enough to amortise its launch. Chunk c covers
    // rows [c * chunk, min(rows, (c + 1) * chunk)) and writes its own row of `partial`.
    let chunks = rows.div_ceil(64).clamp(1, 256);
    let chunk = rows.div_ceil(chunks);
    let partial = unsafe { dev.alloc::<f32>(chunks * cols)? };
    let cfg = LaunchConfig {
        grid_dim: (col_blocks, chunks as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "column_sum", cfg; a, &partial, &0usize, &rows, &cols, &chunk);
    // Then the partial rows as one chunk, into out[offset..offset + cols].
    let cfg = LaunchConfig {
        grid_dim: (col_blocks, 1, 1),
        ..cfg
    };
    launch!(dev, "column_sum", cfg; &partial, &mut *out, &offset, &chunks, &cols, &chunks);
    Ok(())
}

/// Sums the consecutive blocks of `shape`'s size (the gradient of a tiled operand).
pub fn tile_sum(s: &CudaStorage, l: &Layout, shape: &Shape) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let g = f32_view(s, l, "tile-sum")?;
    let cols = shape.elem_count();
    if cols == 0 || g.len() % cols != 0 {
        candle_core::bail!("tile-sum: blocks of {cols} do not tile {}", g.len());
    }
    let mut out = unsafe { dev.alloc::<f32>(cols)? };
    column_sum(dev, &g, g.len() / cols, cols, &mut out, 0)?;
    Ok(wrap(out, dev, shape.clone()))
}

pub fn layer_norm(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    let x = f32_view(s1, l1, "layer-norm")?;
    let (gamma, beta) = (f32_view(s2, l2, "layer-norm")?, f32_view(s3, l3, "layer-norm")?);
    let c = gamma.len() as i32;
    let rows = x.len() / gamma.len();
    let y = unsafe { dev.alloc::<f32>(x.len())? };
    launch!(dev, "layer_norm_fwd", per_row(rows); &x, &gamma, &beta, &y, &rows, &c, &eps);
    Ok(wrap(y, dev, l1.shape().clone()))
}

/// dx, d gamma and d beta packed as the rows of a `(rows + 2, C)` matrix, as the CPU op.
pub fn layer_norm_grad(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    eps: f32,
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device();
    let x = f32_view(s1, l1, "layer-norm-grad")?;
    let (gamma, g) = (
        f32_view(s2, l2, "layer-norm-grad")?,
        f32_view(s3, l3, "layer-norm-grad")?,
    );
    let c = gamma.len();
    let rows = x.len() / c;
    let mut out = unsafe { dev.alloc::<f32>((rows + 2) * c)? };
    let gx = unsafe { dev.alloc::<f32>(rows * c)? };
    // dx into the first rows * c values of out, g * x̂ into gx.
    let c_i32 = c as i32;
    launch!(dev, "layer_norm_bwd", per_row(rows); &x, &gamma, &g, &mut out, &gx, &rows, &c_i32, &eps);
    column_sum(dev, &gx.slice(..), rows, c, &mut out, rows * c)?;
    column_sum(dev, &g, rows, c, &mut out, (rows + 1) * c)?;
    Ok(wrap(out, dev, Shape::from((rows + 2, c))))
}

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
    let out = unsafe { dev.alloc::<f32>(3 * n)? };
    launch!(dev, "adamw", elementwise(n); &theta, &g, &mv, &out, &n,
        &p.lr, &p.beta1, &p.beta2, &p.eps, &p.decay, &p.bias1, &p.bias2);
    Ok(wrap(out, dev, Shape::from((3, n))))
}

/// Attention of one new token per sequence over its own cache, all sequences in one launch
/// (inference): each row of `qkv` `(B, 3C)` appends its key and value to its cache and attends
/// over everything the cache then holds. candle has no attention over caches of different
/// lengths in one call, and looping over the sequences costs a dozen launches each per layer,
/// which bounded decode at batch 64 to what batch 8 gave.
///
/// `caches[b]`: the whole key and value buffers `(nh, cap, hs)` of sequence `b` (contiguous, in
/// `qkv`'s dtype), the positions they hold and `cap` (room for one more checked by the caller).
/// Returns `(B, C)`. The buffers are written in place.
pub fn decode_attention(
    qkv: &candle_core::Tensor,
    caches: &[(candle_core::Tensor, candle_core::Tensor, usize, usize)],
    n_head: usize,
    head_dim: usize,
    scale: f32,
) -> Result<candle_core::Tensor> {
    let candle_core::Device::Cuda(dev) = qkv.device() else {
        candle_core::bail!("decode_attention: qkv is not on a CUDA device")
    };
    let mut table = Vec::with_capacity(4 * caches.len());
    for (k, v, len, cap) in caches {
        if len >= cap || k.dtype() != qkv.dtype() || v.dtype() != qkv.dtype() {
            candle_core::bail!(
                "decode_attention: a cache holds {len} of {cap} positions in {:?}",
                k.dtype()
            );
        }
        table.extend([address(k)?, address(v)?, *len as u64, *cap as u64]);
    }
    let max_len = caches.iter().map(|c| c.2 + 1).max().unwrap_or(1);
    let op = DecodeAttention {
        table: dev.clone_htod(&table)?,
        n_head,
        head_dim,
        shared_floats: head_dim + max_len,
        scale,
    };
    qkv.apply_op1_no_bwd(&op)
}

/// Shared memory a block of [`decode_attention`] may take without opting in to more (48 KiB).
pub const DECODE_SHARED_FLOATS: usize = 48 * 1024 / 4;

/// The device address of a contiguous CUDA tensor's first element.
fn address(t: &candle_core::Tensor) -> Result<u64> {
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cuda(cs) = &*storage else {
        candle_core::bail!("a tensor of {:?} is not on the GPU", layout.shape())
    };
    if !layout.is_contiguous() {
        candle_core::bail!("a tensor of {:?} is not contiguous", layout.shape())
    }
    let stream = cs.device().cuda_stream();
    let base = match t.dtype() {
        candle_core::DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        candle_core::DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        candle_core::DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        d => candle_core::bail!("a tensor of {d:?}: expected f32, bf16 or f16"),
    };
    Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
}

struct DecodeAttention {
    table: CudaSlice<u64>,
    n_head: usize,
    head_dim: usize,
    shared_floats: usize,
    scale: f32,
}

impl DecodeAttention {
    fn run<T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        s: &CudaStorage,
        l: &Layout,
        kernel: &'static str,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let (rows, three_c) = l.shape().dims2()?;
        let c = self.n_head * self.head_dim;
        if three_c != 3 * c || rows * 4 != self.table.len() {
            candle_core::bail!(
                "decode_attention: qkv {:?} for {} caches of {c}",
                l.shape(),
                self.table.len() / 4
            );
        }
        let Some((start, end)) = l.contiguous_offsets() else {
            candle_core::bail!("decode_attention: qkv must be contiguous")
        };
        let qkv = s.as_cuda_slice::<T>()?.slice(start..end);
        let y = unsafe { dev.alloc::<T>(rows * c)? };
        let cfg = LaunchConfig {
            grid_dim: (self.n_head as u32, rows as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (self.shared_floats * 4) as u32,
        };
        let (nh, hs) = (self.n_head as i32, self.head_dim as i32);
        launch!(dev, kernel, cfg; &qkv, &self.table, &y, &nh, &hs, &self.scale);
        Ok((CudaStorage::wrap_cuda_slice(y, dev.clone()), Shape::from((rows, c))))
    }
}

impl candle_core::CustomOp1 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(&self, _: &candle_core::CpuStorage, _: &Layout) -> Result<(candle_core::CpuStorage, Shape)> {
        candle_core::bail!("decode_attention runs on CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        match s.dtype() {
            candle_core::DType::F32 => self.run::<f32>(s, l, "decode_attention_f32"),
            candle_core::DType::BF16 => self.run::<half::bf16>(s, l, "decode_attention_bf16"),
            candle_core::DType::F16 => self.run::<half::f16>(s, l, "decode_attention_f16"),
            d => candle_core::bail!("decode_attention: {d:?}"),
        }
    }
}

/// [`crate::window_attention`]'s shape and dropout on the GPU.
#[derive(Debug, Clone, Copy)]
pub struct WindowAttentionArgs {
    /// Windows, positions per window, heads, head size.
    pub b: usize,
    pub t: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Dropout of the attention weights (0: none), keyed by `key`, `first` the index of this
    /// call's first weight in the batch's `(B, nh, T, T)` probabilities.
    pub p: f32,
    pub key: u64,
    pub first: u64,
}

/// Largest head the attention kernels take (a multiple of 4; see ops.cu's instances).
pub const WINDOW_ATTENTION_MAX_HEAD: usize = 128;
/// Warps per block of the attention kernels (`ATT_WARPS` in ops.cu).
const ATTENTION_WARPS: u32 = 8;

impl WindowAttentionArgs {
    /// The kernels' instance for this head (name suffix) and the rows each warp takes: 4 for
    /// heads of up to 64, else 1.
    fn instance(&self) -> (&'static str, u32) {
        if self.head_dim <= 64 {
            ("_h64", 4)
        } else {
            ("_h128", 1)
        }
    }

    fn config(&self) -> LaunchConfig {
        let rows = ATTENTION_WARPS * self.instance().1;
        LaunchConfig {
            grid_dim: ((self.t as u32).div_ceil(rows), self.n_head as u32, self.b as u32),
            block_dim: (32 * ATTENTION_WARPS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn kernel(&self, name: &str) -> String {
        format!("{name}{}", self.instance().0)
    }

    fn check(&self) -> Result<()> {
        if self.head_dim == 0
            || self.head_dim > WINDOW_ATTENTION_MAX_HEAD
            || !self.head_dim.is_multiple_of(4)
            || self.n_head > 65_535
            || self.b > 65_535
        {
            candle_core::bail!(
                "window-attention on CUDA: {} windows of {} heads of {} (at most {WINDOW_ATTENTION_MAX_HEAD} per head, a multiple of 4)",
                self.b,
                self.n_head,
                self.head_dim
            )
        }
        Ok(())
    }

    /// The kernels' shared arguments after the buffers: t, nh, hs, scale, p, 1 / (1 - p), key, first.
    fn scalars(&self) -> (i32, i32, i32, f32, f32, f32) {
        let keep_scale = if self.p > 0.0 { 1.0 / (1.0 - self.p) } else { 1.0 };
        (
            self.t as i32,
            self.n_head as i32,
            self.head_dim as i32,
            self.scale,
            self.p,
            keep_scale,
        )
    }
}

/// Causal attention over whole windows: `qkv` `(B * T, 3C)` → `(B * T, C)`.
pub fn window_attention(s: &CudaStorage, l: &Layout, a: &WindowAttentionArgs) -> Result<(CudaStorage, Shape)> {
    a.check()?;
    let dev = s.device();
    let qkv = f32_view(s, l, "window-attention")?;
    let c = a.n_head * a.head_dim;
    let y = unsafe { dev.alloc::<f32>(a.b * a.t * c)? };
    let (t, nh, hs, scale, p, keep_scale) = a.scalars();
    launch!(dev, &a.kernel("window_attention_fwd"), a.config();
        &qkv, &y, &t, &nh, &hs, &scale, &p, &keep_scale, &a.key, &a.first);
    Ok(wrap(y, dev, Shape::from((a.b * a.t, c))))
}

/// The gradient of [`window_attention`]'s input from the input `qkv`, its output `y` and the
/// output's gradient `dy`: `(B * T, 3C)`.
pub fn window_attention_grad(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    a: &WindowAttentionArgs,
) -> Result<(CudaStorage, Shape)> {
    a.check()?;
    let dev = s1.device();
    let qkv = f32_view(s1, l1, "window-attention-grad")?;
    let (y, dy) = (
        f32_view(s2, l2, "window-attention-grad")?,
        f32_view(s3, l3, "window-attention-grad")?,
    );
    let rows = a.b * a.t;
    let c = a.n_head * a.head_dim;
    if qkv.len() != rows * 3 * c || y.len() != rows * c || dy.len() != rows * c {
        candle_core::bail!(
            "window-attention-grad: {} inputs, {} outputs and {} gradients for ({rows}, {c})",
            qkv.len(),
            y.len(),
            dy.len()
        )
    }
    // Every element of dqkv is written: q's columns by the first kernel, k's and v's by the second.
    let dqkv = unsafe { dev.alloc::<f32>(rows * 3 * c)? };
    let lse_d = unsafe { dev.alloc::<f32>(2 * a.b * a.n_head * a.t)? };
    let (t, nh, hs, scale, p, keep_scale) = a.scalars();
    launch!(dev, &a.kernel("window_attention_bwd_q"), a.config();
        &qkv, &y, &dy, &dqkv, &lse_d, &t, &nh, &hs, &scale, &p, &keep_scale, &a.key, &a.first);
    launch!(dev, &a.kernel("window_attention_bwd_kv"), a.config();
        &qkv, &dy, &lse_d, &dqkv, &t, &nh, &hs, &scale, &p, &keep_scale, &a.key, &a.first);
    Ok(wrap(dqkv, dev, Shape::from((rows, 3 * c))))
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
/// Columns of its table (`TABLE_COLS` in ops.cu).
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
    let partial = unsafe { dev.alloc::<f32>(chunks)? };
    let total = unsafe { dev.alloc::<f32>(1)? };
    let per_chunk = LaunchConfig {
        grid_dim: (chunks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "grad_sumsq", per_chunk; &table, &partial);
    let n_chunks = chunks as i32;
    let one_block = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, "sum_partials", one_block; &partial, &n_chunks, &total);
    launch!(dev, "adamw_clipped", per_chunk; &table, &total, &max_norm,
        &step.lr, &step.beta1, &step.beta2, &step.eps, &step.decay, &step.bias1, &step.bias2);
    Ok(())
}
