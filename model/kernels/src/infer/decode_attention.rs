//! Attention of one new token per sequence against its KV cache on the GPU, the whole batch in
//! one launch (the kernels in `decode_attention.cu`, beside this file).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, LaunchConfig};
use candle_core::{CudaStorage, Layout, Result, Shape};

use crate::cuda::address;

const MODULE: crate::cuda::Module = crate::ptx_module!("decode_attention");

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
        // SAFETY: the kernel writes every element of y (each block its head's `hs` values of its
        // row) before anything reads it.
        let y = unsafe { dev.alloc::<T>(rows * c)? };
        let cfg = LaunchConfig {
            grid_dim: (self.n_head as u32, rows as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: (self.shared_floats * 4) as u32,
        };
        let (nh, hs) = (self.n_head as i32, self.head_dim as i32);
        crate::launch!(dev, MODULE, kernel, cfg; &qkv, &self.table, &y, &nh, &hs, &self.scale);
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
