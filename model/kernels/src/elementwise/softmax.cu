// The causal softmax and its gradient, the CUDA side of softmax.rs.

#include "common.cuh"

// Softmax over rows of t_k scores; query q = row % t_q sees keys 0..=offset + q, offset = t_k - t_q.
extern "C" __global__ void causal_softmax_fwd(const float* x, float* y, size_t rows, int t_q, int t_k) {
    size_t row = warp_row();
    if (row >= rows) return;
    int lane = threadIdx.x % 32;
    int offset = t_k > t_q ? t_k - t_q : 0;
    int n = min(offset + (int)(row % t_q) + 1, t_k);
    const float* xr = x + row * t_k;
    float* yr = y + row * t_k;
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, xr[j]);
    m = warp_max(m);
    float s = 0.0f;
    for (int j = lane; j < n; j += 32) s += expf(xr[j] - m);
    float inv = 1.0f / warp_sum(s);
    for (int j = lane; j < t_k; j += 32) yr[j] = j < n ? expf(xr[j] - m) * inv : 0.0f;
}

// dx = y * (g - sum(g * y)) per row.
extern "C" __global__ void softmax_bwd(const float* y, const float* g, float* dx, size_t rows, int t_k) {
    size_t row = warp_row();
    if (row >= rows) return;
    int lane = threadIdx.x % 32;
    const float* yr = y + row * t_k;
    const float* gr = g + row * t_k;
    float dot = 0.0f;
    for (int j = lane; j < t_k; j += 32) dot += yr[j] * gr[j];
    dot = warp_sum(dot);
    for (int j = lane; j < t_k; j += 32) dx[row * t_k + j] = yr[j] * (gr[j] - dot);
}
