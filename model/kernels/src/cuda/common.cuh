// What the CUDA kernels share: warp and block reductions, the warp-per-row layout, conversions
// between f32 and the half types, and the counter-based generator of the dropout masks. Each op's
// kernels sit beside its launcher (`elementwise/gelu.cu` by `elementwise/gelu.rs`...); build.rs
// compiles each .cu to PTX of its own with this folder on the include path.
//
// Row-wise kernels (softmax, LayerNorm) give one warp to a row: rows are at most a few thousand
// elements (attention keys, the embedding width), so 32 lanes striding over a row and combining
// with shuffles keep every load coalesced without shared memory.

#pragma once

#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Warps per block of the row-wise kernels (`WARPS_PER_BLOCK` in cuda/mod.rs).
#define WARPS_PER_BLOCK 4

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

// The warp's row, or rows when past the end (the whole warp returns together).
__device__ __forceinline__ size_t warp_row() {
    return (size_t)blockIdx.x * WARPS_PER_BLOCK + threadIdx.x / 32;
}

// Dropout with masks from SplitMix64 run as a counter (crate::rng, the same on the CPU): element i
// is kept when the top 24 bits of mix(key + (first + i + 1) * GOLDEN), as a fraction, are >= p.
__device__ __forceinline__ unsigned long long splitmix_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The uniform in [0, 1) of element `index` of the masks keyed by `key`.
__device__ __forceinline__ float counter_uniform(unsigned long long key, unsigned long long index) {
    unsigned long long z = key + (index + 1ULL) * 0x9E3779B97F4A7C15ULL;
    return (float)(splitmix_mix(z) >> 40) * (1.0f / 16777216.0f);
}

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }

// The block's reduction of v (max or sum), returned to every thread; `red` holds a float per warp.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();  // red may still be read from the previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : (MAX ? -INFINITY : 0.0f);
    return MAX ? warp_max(v) : warp_sum(v);
}

