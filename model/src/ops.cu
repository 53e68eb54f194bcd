// CUDA versions of the fused ops in ops.rs (f32, contiguous inputs). Compiled to PTX by build.rs
// when the `cuda` feature is on; each kernel computes what the `cpu_fwd` of the same name does.
//
// Row-wise kernels (softmax, LayerNorm) give one warp to a row: rows are at most a few thousand
// elements (attention keys, the embedding width), so 32 lanes striding over a row and combining
// with shuffles keep every load coalesced without shared memory.

#include <stdint.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define GELU_K0 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_K1 0.044715f
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

// Dropout with masks from SplitMix64 run as a counter (crate::rng, the same on the CPU): element i
// is kept when the top 24 bits of mix(key + (first + i + 1) * GOLDEN), as a fraction, are >= p.
__device__ __forceinline__ unsigned long long splitmix_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void dropout_fwd(const float* x, float* y, size_t n, unsigned long long key,
                                       unsigned long long first, float p, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned long long z = key + (first + i + 1ULL) * 0x9E3779B97F4A7C15ULL;
        float u = (float)(splitmix_mix(z) >> 40) * (1.0f / 16777216.0f);
        y[i] = u >= p ? x[i] * scale : 0.0f;
    }
}

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

// y = x + b, b repeated over x (nb = b's length divides n).
extern "C" __global__ void add_tiled(const float* x, const float* b, float* y, size_t n, size_t nb) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        y[i] = x[i] + b[i % nb];
    }
}

// Column sums of a (rows, cols) matrix over the row chunk blockIdx.y (chunk rows each), into
// out[out_offset + blockIdx.y * cols + col]. Called twice (chunks, then their partial sums) so
// that the order of additions, and so the result, is the same from run to run.
extern "C" __global__ void column_sum(const float* a, float* out, size_t out_offset, size_t rows, size_t cols,
                                      size_t chunk) {
    size_t col = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= cols) return;
    size_t lo = (size_t)blockIdx.y * chunk;
    size_t hi = min(rows, lo + chunk);
    float s = 0.0f;
    for (size_t r = lo; r < hi; r++) s += a[r * cols + col];
    out[out_offset + (size_t)blockIdx.y * cols + col] = s;
}

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

// Decode attention for a batch of sequences, one new token each, in one launch (inference):
// block (h, b) appends head h of sequence b's new key and value to that sequence's cache and
// attends over everything it holds. table[4b..4b+4]: the key buffer's and the value buffer's
// address ((nh, cap, hs) each, in T), the positions held before this token, cap. qkv (B, 3C):
// each row's query, key and value; y (B, C). Shared memory: hs + len + 1 floats.
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

template <typename T>
__device__ void decode_attention(const T* qkv, const unsigned long long* table, T* y, int nh, int hs,
                                 float scale) {
    extern __shared__ float smem[];
    __shared__ float red[32];
    int h = blockIdx.x, b = blockIdx.y, c = nh * hs;
    size_t len = (size_t)table[4 * b + 2], cap = (size_t)table[4 * b + 3];
    T* kb = (T*)table[4 * b] + h * cap * hs;
    T* vb = (T*)table[4 * b + 1] + h * cap * hs;
    const T* row = qkv + (size_t)b * 3 * c + h * hs;
    float* q = smem;
    float* p = smem + hs;
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        q[d] = to_f(row[d]);
        kb[len * hs + d] = row[c + d];
        vb[len * hs + d] = row[2 * c + d];
    }
    __syncthreads();
    int n = (int)len + 1;
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const T* kr = kb + (size_t)j * hs;
        float s = 0.0f;
        for (int d = 0; d < hs; d++) s += q[d] * to_f(kr[d]);
        p[j] = s * scale;
        m = fmaxf(m, p[j]);
    }
    m = block_reduce<true>(m, red);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        p[j] = expf(p[j] - m);
        sum += p[j];
    }
    float inv = 1.0f / block_reduce<false>(sum, red);  // its barriers also publish p
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += p[j] * to_f(vb[(size_t)j * hs + d]);
        y[(size_t)b * c + h * hs + d] = from_f<T>(acc * inv);
    }
}

extern "C" __global__ void decode_attention_f32(const float* qkv, const unsigned long long* table, float* y,
                                                int nh, int hs, float scale) {
    decode_attention(qkv, table, y, nh, hs, scale);
}
extern "C" __global__ void decode_attention_bf16(const __nv_bfloat16* qkv, const unsigned long long* table,
                                                 __nv_bfloat16* y, int nh, int hs, float scale) {
    decode_attention(qkv, table, y, nh, hs, scale);
}
extern "C" __global__ void decode_attention_f16(const __half* qkv, const unsigned long long* table, __half* y,
                                                int nh, int hs, float scale) {
    decode_attention(qkv, table, y, nh, hs, scale);
}
