// AdamW, the CUDA side of the optimizer (optim/cuda.rs).

#include "common.cuh"

// One AdamW step of a flattened parameter; out is (3, n): theta, m, v.
extern "C" __global__ void adamw(const float* theta, const float* g, const float* mv, float* out, size_t n,
                                 float lr, float beta1, float beta2, float eps, float decay, float bias1,
                                 float bias2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float m = beta1 * mv[i] + (1.0f - beta1) * g[i];
        float v = beta2 * mv[n + i] + (1.0f - beta2) * g[i] * g[i];
        float update = (m / bias1) / (sqrtf(v / bias2) + eps);
        out[i] = theta[i] * (1.0f - lr * decay) - lr * update;
        out[n + i] = m;
        out[2 * n + i] = v;
    }
}


// Gradient clipping and AdamW over every parameter at once (training). The host lists the
// parameters in chunks of at most CLIP_CHUNK elements, a table row per chunk: the addresses of
// its gradient, weights, first and second moments, its length, and whether weight decay applies.
// grad_sumsq writes each chunk's sum of squares, sum_partials their total (in a fixed order: the
// same on every run), and adamw_clipped scales the gradients to a global norm of at most
// max_norm and updates weights and moments in place: three launches, nothing read back.
#define TABLE_COLS 6

extern "C" __global__ void grad_sumsq(const unsigned long long* table, float* partial) {
    __shared__ float red[32];
    const unsigned long long* row = table + TABLE_COLS * (size_t)blockIdx.x;
    const float* g = (const float*)row[0];
    size_t n = (size_t)row[4];
    float s = 0.0f;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += g[i] * g[i];
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void sum_partials(const float* partial, int n, float* total) {
    __shared__ float red[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += partial[i];
    s = block_reduce<false>(s, red);
    if (threadIdx.x == 0) total[0] = s;
}

extern "C" __global__ void adamw_clipped(const unsigned long long* table, const float* total, float max_norm,
                                         float lr, float beta1, float beta2, float eps, float weight_decay,
                                         float bias1, float bias2) {
    float norm = sqrtf(total[0]);
    float scale = (max_norm > 0.0f && norm > max_norm) ? max_norm / (norm + 1e-6f) : 1.0f;
    const unsigned long long* row = table + TABLE_COLS * (size_t)blockIdx.x;
    const float* g = (const float*)row[0];
    float* theta = (float*)row[1];
    float* m = (float*)row[2];
    float* v = (float*)row[3];
    size_t n = (size_t)row[4];
    float decay = row[5] ? weight_decay : 0.0f;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
        float gi = g[i] * scale;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        float update = (mi / bias1) / (sqrtf(vi / bias2) + eps);
        theta[i] = theta[i] * (1.0f - lr * decay) - lr * update;
        m[i] = mi;
        v[i] = vi;
    }
}
