// GELU (tanh approximation) and its gradient, the CUDA side of gelu.rs.

#include "common.cuh"

#define GELU_K0 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_K1 0.044715f

extern "C" __global__ void gelu_fwd(const float* x, float* y, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        y[i] = 0.5f * v * (1.0f + tanhf(GELU_K0 * (v + GELU_K1 * v * v * v)));
    }
}

extern "C" __global__ void gelu_bwd(const float* x, const float* g, float* dx, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i];
        float t = tanhf(GELU_K0 * (v + GELU_K1 * v * v * v));
        float du = GELU_K0 * (1.0f + 3.0f * GELU_K1 * v * v);
        dx[i] = g[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
}

