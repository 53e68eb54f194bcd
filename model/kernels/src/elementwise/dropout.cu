// Dropout, the CUDA side of dropout.rs: the masks of crate::rng, as on the CPU.

#include "common.cuh"

extern "C" __global__ void dropout_fwd(const float* x, float* y, size_t n, unsigned long long key,
                                       unsigned long long first, float p, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        y[i] = counter_uniform(key, first + i) >= p ? x[i] * scale : 0.0f;
    }
}

