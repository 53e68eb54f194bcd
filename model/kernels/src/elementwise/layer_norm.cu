// LayerNorm and its gradient, the CUDA side of layer_norm.rs.

#include "common.cuh"

__device__ __forceinline__ void row_moments(const float* xr, int c, float eps, int lane, float* mean,
                                            float* rstd) {
    float s = 0.0f;
    for (int j = lane; j < c; j += 32) s += xr[j];
    float m = warp_sum(s) / c;
    float v = 0.0f;
    for (int j = lane; j < c; j += 32) v += (xr[j] - m) * (xr[j] - m);
    *mean = m;
    *rstd = rsqrtf(warp_sum(v) / c + eps);
}

extern "C" __global__ void layer_norm_fwd(const float* x, const float* gamma, const float* beta, float* y,
                                          size_t rows, int c, float eps) {
    size_t row = warp_row();
    if (row >= rows) return;
    int lane = threadIdx.x % 32;
    const float* xr = x + row * c;
    float mean, rstd;
    row_moments(xr, c, eps, lane, &mean, &rstd);
    for (int j = lane; j < c; j += 32) y[row * c + j] = (xr[j] - mean) * rstd * gamma[j] + beta[j];
}

// Per row, with x̂ the normalised row and ĝ = g * gamma: dx = rstd (ĝ - mean(ĝ) - x̂ mean(ĝ x̂)),
// and g * x̂ into gx (its column sums are d gamma).
extern "C" __global__ void layer_norm_bwd(const float* x, const float* gamma, const float* g, float* dx,
                                          float* gx, size_t rows, int c, float eps) {
    size_t row = warp_row();
    if (row >= rows) return;
    int lane = threadIdx.x % 32;
    const float* xr = x + row * c;
    const float* gr = g + row * c;
    float mean, rstd;
    row_moments(xr, c, eps, lane, &mean, &rstd);
    float s1 = 0.0f, s2 = 0.0f;
    for (int j = lane; j < c; j += 32) {
        float xhat = (xr[j] - mean) * rstd;
        float ghat = gr[j] * gamma[j];
        s1 += ghat;
        s2 += ghat * xhat;
    }
    float m1 = warp_sum(s1) / c, m2 = warp_sum(s2) / c;
    for (int j = lane; j < c; j += 32) {
        float xhat = (xr[j] - mean) * rstd;
        dx[row * c + j] = rstd * (gr[j] * gamma[j] - m1 - xhat * m2);
        gx[row * c + j] = gr[j] * xhat;
    }
}
