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
        candle_core::bail!("decode_attention: a cache buffer is not on the GPU")
    };
    if !layout.is_contiguous() {
        candle_core::bail!("decode_attention: a cache buffer is not contiguous")
    }
    let stream = cs.device().cuda_stream();
    let base = match t.dtype() {
        candle_core::DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        candle_core::DType::BF16 => cs.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
        candle_core::DType::F16 => cs.as_cuda_slice::<half::f16>()?.device_ptr(&stream).0,
        d => candle_core::bail!("decode_attention: cache buffers of {d:?}"),
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
