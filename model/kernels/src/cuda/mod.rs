//! What the CUDA launchers share: [`launch!`] over a [`Module`] of PTX (each op's kernels sit in
//! a `.cu` file beside its launcher, compiled by build.rs; `common.cuh` here holds their shared
//! device code), views of contiguous tensors, the launch shapes of the element-wise and row-wise
//! kernels, and device addresses for the kernels that take tables of them. f32, contiguous
//! inputs, unless a launcher says otherwise.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Shape};

pub use candle_core::cuda::cudarc::driver::PushKernelArg;
pub use candle_core::cuda::WrapErr;

/// Must match `WARPS_PER_BLOCK` in common.cuh.
const WARPS_PER_BLOCK: u32 = 4;

/// The PTX of one `.cu` file, loaded once per device under `name`.
pub struct Module {
    pub name: &'static str,
    pub ptx: &'static str,
}

/// The [`Module`] that build.rs compiled from `$stem.cu` (in the calling crate's `OUT_DIR`).
#[macro_export]
macro_rules! ptx_module {
    ($stem:literal) => {
        $crate::cuda::Module {
            name: concat!("gpt_", $stem),
            ptx: include_str!(concat!(env!("OUT_DIR"), "/", $stem, ".ptx")),
        }
    };
}

/// Launches kernel `$name` of `$module` on `$dev` with `$cfg` and the arguments in order.
#[macro_export]
macro_rules! launch {
    ($dev:expr, $module:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let module: &$crate::cuda::Module = &$module;
        let func = $dev.get_or_load_custom_func($name, module.name, module.ptx)?;
        let mut builder = func.builder();
        $( $crate::cuda::PushKernelArg::arg(&mut builder, $arg); )*
        let cfg = $cfg;
        // SAFETY: every caller passes the arguments the kernel takes, in its order and types,
        // and buffers that hold every element the kernel reads or writes under `cfg` (each
        // launcher checks the lengths it derives the configuration from).
        $crate::cuda::WrapErr::w(unsafe { builder.launch(cfg) })?;
    }};
}

/// The f32 data of a contiguous CUDA tensor.
pub fn f32_view<'a>(storage: &'a CudaStorage, layout: &Layout, op: &str) -> Result<CudaView<'a, f32>> {
    let slice = storage.as_cuda_slice::<f32>()?;
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(slice.slice(start..end)),
        None => candle_core::bail!("{op}: the input must be contiguous"),
    }
}

/// A device buffer of `n` f32 that the caller's next launch writes whole before anything reads
/// it.
pub fn output(dev: &CudaDevice, n: usize) -> Result<CudaSlice<f32>> {
    // SAFETY: uninitialised device memory is only unsafe to read; every caller launches a kernel
    // that writes all `n` elements before any read (each launcher says how).
    Ok(unsafe { dev.alloc::<f32>(n)? })
}

/// `slice` as the storage of a tensor of `shape`.
pub fn wrap(slice: CudaSlice<f32>, dev: &CudaDevice, shape: Shape) -> (CudaStorage, Shape) {
    (CudaStorage::wrap_cuda_slice(slice, dev.clone()), shape)
}

/// A grid-stride launch over `n` elements.
pub fn elementwise(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row.
pub fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((rows as u32).div_ceil(WARPS_PER_BLOCK).max(1), 1, 1),
        block_dim: (32 * WARPS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The device address of a contiguous CUDA tensor's first element.
pub fn address(t: &candle_core::Tensor) -> Result<u64> {
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
