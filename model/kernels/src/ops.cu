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

// The uniform in [0, 1) of element `index` of the masks keyed by `key`.
__device__ __forceinline__ float counter_uniform(unsigned long long key, unsigned long long index) {
    unsigned long long z = key + (index + 1ULL) * 0x9E3779B97F4A7C15ULL;
    return (float)(splitmix_mix(z) >> 40) * (1.0f / 16777216.0f);
}

extern "C" __global__ void dropout_fwd(const float* x, float* y, size_t n, unsigned long long key,
                                       unsigned long long first, float p, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        y[i] = counter_uniform(key, first + i) >= p ? x[i] * scale : 0.0f;
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

// Causal self-attention over whole windows (training and evaluation), the CUDA side of
// ops/window_attention.rs: qkv (B * T, 3C), y (B * T, C), heads of HS floats at most (a multiple
// of 4). Block (x, h, b) takes WARPS * R consecutive rows of window b, head h, R rows per warp.
// Keys and values come through shared memory 32 positions at a time, shared by the block's
// warps; a lane holds one key's scores against the warp's R rows (dot products over the head,
// 16-byte loads: each key value loaded serves R rows), then the lanes together hold the R rows'
// outputs (HS / 32 values each). Softmax online (running maximum and sum, as FlashAttention);
// the (T, T) scores are never stored. Dropout of the attention weights uses the masks of
// dropout_fwd at the weight's index in the (B, nh, T, T) probabilities, plus `first`.
// Instances: R = 4 rows per warp for heads of up to 64 (GPT-2's), R = 1 up to 128.
#define ATT_WARPS 8
#define ATT_TILE 32

__device__ __forceinline__ float drop_factor(unsigned long long key, unsigned long long index, float p,
                                             float keep_scale) {
    if (p <= 0.0f) return 1.0f;
    return counter_uniform(key, index) >= p ? keep_scale : 0.0f;
}

// Rows [t0, t0 + n) (those below t) of columns [col, col + hs) of the rows at `base` (row stride
// ld) into dst (row stride ld_dst), by the whole block.
__device__ __forceinline__ void load_rows(const float* base, size_t ld, int col, int t0, int n, int t, int hs,
                                          float* dst, int ld_dst) {
    for (int e = threadIdx.x; e < n * hs; e += blockDim.x) {
        int r = e / hs, d = e % hs;
        if (t0 + r < t) dst[r * ld_dst + d] = base[(size_t)(t0 + r) * ld + col + d];
    }
}

// out[r] = Σ_d a[d] * rows[r][d] for R rows `rows_stride` apart (all in shared memory, 16-byte
// aligned, hs a multiple of 4).
template <int R>
__device__ __forceinline__ void dots(const float* a, const float* rows, int rows_stride, int hs, float* out) {
#pragma unroll
    for (int r = 0; r < R; r++) out[r] = 0.0f;
    for (int d = 0; d < hs; d += 4) {
        float4 x = *(const float4*)(a + d);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float4 y = *(const float4*)(rows + r * rows_stride + d);
            out[r] += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
        }
    }
}

template <int R, int HS>
__device__ void attention_fwd(const float* qkv, float* y, int t, int nh, int hs, float scale, float p,
                              float keep_scale, unsigned long long key, unsigned long long first) {
    constexpr int ROWS = ATT_WARPS * R, LD = HS + 4, DV = HS / 32;
    __shared__ __align__(16) float q_s[ROWS][LD];
    __shared__ __align__(16) float k_s[ATT_TILE][LD];
    __shared__ __align__(16) float v_s[ATT_TILE][LD];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int h = blockIdx.y, b = blockIdx.z, c = nh * hs;
    int i0 = blockIdx.x * ROWS, iw = i0 + warp * R;  // the warp's rows: iw .. iw + R - 1
    size_t ld = 3 * (size_t)c;
    const float* base = qkv + (size_t)b * t * ld + h * hs;
    load_rows(base, ld, 0, i0, ROWS, t, hs, &q_s[0][0], LD);
    float m[R], l[R], o[R][DV];
#pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int k = 0; k < DV; k++) o[r][k] = 0.0f;
    }
    int last = min(t - 1, i0 + ROWS - 1);
    for (int t0 = 0; t0 <= last; t0 += ATT_TILE) {
        __syncthreads();  // the previous tile is read (and q_s written)
        load_rows(base, ld, c, t0, ATT_TILE, t, hs, &k_s[0][0], LD);
        load_rows(base, ld, 2 * c, t0, ATT_TILE, t, hs, &v_s[0][0], LD);
        __syncthreads();
        if (iw >= t || t0 > iw + R - 1) continue;  // the whole warp together
        int j = t0 + lane;
        float s[R], w[R];
        dots<R>(k_s[lane], q_s[warp * R], LD, hs, s);
#pragma unroll
        for (int r = 0; r < R; r++) {
            int i = iw + r;
            bool seen = j <= i && i < t;
            s[r] = seen ? s[r] * scale : -INFINITY;
            float m_new = fmaxf(m[r], warp_max(s[r]));
            if (m_new == -INFINITY) {  // a row this tile lies wholly after (or past the window)
                w[r] = 0.0f;
                continue;
            }
            float e = seen ? expf(s[r] - m_new) : 0.0f;
            float corr = expf(m[r] - m_new);
            l[r] = l[r] * corr + warp_sum(e);
            w[r] = seen ? e * drop_factor(key, first + (((unsigned long long)b * nh + h) * t + i) * t + j, p,
                                          keep_scale)
                        : 0.0f;
#pragma unroll
            for (int k = 0; k < DV; k++) o[r][k] *= corr;
            m[r] = m_new;
        }
        int n = min(ATT_TILE, min(t, iw + R) - t0);
        for (int jj = 0; jj < n; jj++) {
            float vj[DV];
#pragma unroll
            for (int k = 0; k < DV; k++) vj[k] = lane + 32 * k < hs ? v_s[jj][lane + 32 * k] : 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                float wj = __shfl_sync(0xffffffff, w[r], jj);
#pragma unroll
                for (int k = 0; k < DV; k++) o[r][k] += wj * vj[k];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        int i = iw + r;
        if (i >= t) break;
        float inv = 1.0f / l[r];
        float* yr = y + ((size_t)b * t + i) * c + h * hs;
#pragma unroll
        for (int k = 0; k < DV; k++) {
            int d = lane + 32 * k;
            if (d < hs) yr[d] = o[r][k] * inv;
        }
    }
}

// Backward, part 1 (R query rows per warp): each row's log-sum-exp L_i of its scaled scores and
// D_i = dy_i · y_i into lse_d[2 * row], then dq_i = scale Σ_j dS_ij k_j with
// dS_ij = P_ij (f_ij dy_i · v_j - D_i), P the softmax, f the dropout factor, into dqkv's q columns.
template <int R, int HS>
__device__ void attention_bwd_q(const float* qkv, const float* y, const float* dy, float* dqkv, float* lse_d, int t,
                                int nh, int hs, float scale, float p, float keep_scale, unsigned long long key,
                                unsigned long long first) {
    constexpr int ROWS = ATT_WARPS * R, LD = HS + 4, DV = HS / 32;
    __shared__ __align__(16) float q_s[ROWS][LD];
    __shared__ __align__(16) float g_s[ROWS][LD];
    __shared__ __align__(16) float k_s[ATT_TILE][LD];
    __shared__ __align__(16) float v_s[ATT_TILE][LD];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int h = blockIdx.y, b = blockIdx.z, c = nh * hs;
    int i0 = blockIdx.x * ROWS, iw = i0 + warp * R;
    size_t ld = 3 * (size_t)c;
    const float* base = qkv + (size_t)b * t * ld + h * hs;
    load_rows(base, ld, 0, i0, ROWS, t, hs, &q_s[0][0], LD);
    load_rows(dy + (size_t)b * t * c + h * hs, c, 0, i0, ROWS, t, hs, &g_s[0][0], LD);
    float dd[R], lse[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int i = iw + r;
        float acc = 0.0f;
        if (i < t) {
            const float* yr = y + ((size_t)b * t + i) * c + h * hs;
            const float* gr = dy + ((size_t)b * t + i) * c + h * hs;
            for (int d = lane; d < hs; d += 32) acc += gr[d] * yr[d];
        }
        dd[r] = warp_sum(acc);
    }
    int last = min(t - 1, i0 + ROWS - 1);
    bool active = iw < t;
    // Pass 1: the log-sum-exp of each row's scores.
    {
        float m[R], l[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            m[r] = -INFINITY;
            l[r] = 0.0f;
        }
        for (int t0 = 0; t0 <= last; t0 += ATT_TILE) {
            __syncthreads();
            load_rows(base, ld, c, t0, ATT_TILE, t, hs, &k_s[0][0], LD);
            __syncthreads();
            if (!active || t0 > iw + R - 1) continue;
            int j = t0 + lane;
            float s[R];
            dots<R>(k_s[lane], q_s[warp * R], LD, hs, s);
#pragma unroll
            for (int r = 0; r < R; r++) {
                int i = iw + r;
                bool seen = j <= i && i < t;
                float sr = seen ? s[r] * scale : -INFINITY;
                float m_new = fmaxf(m[r], warp_max(sr));
                if (m_new == -INFINITY) continue;
                float e = seen ? expf(sr - m_new) : 0.0f;
                l[r] = l[r] * expf(m[r] - m_new) + warp_sum(e);
                m[r] = m_new;
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) lse[r] = m[r] + logf(l[r]);
    }
    // Pass 2: dq.
    float acc[R][DV];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int k = 0; k < DV; k++) acc[r][k] = 0.0f;
    for (int t0 = 0; t0 <= last; t0 += ATT_TILE) {
        __syncthreads();
        load_rows(base, ld, c, t0, ATT_TILE, t, hs, &k_s[0][0], LD);
        load_rows(base, ld, 2 * c, t0, ATT_TILE, t, hs, &v_s[0][0], LD);
        __syncthreads();
        if (!active || t0 > iw + R - 1) continue;
        int j = t0 + lane;
        float s[R], dp[R], ds[R];
        dots<R>(k_s[lane], q_s[warp * R], LD, hs, s);
        dots<R>(v_s[lane], g_s[warp * R], LD, hs, dp);
#pragma unroll
        for (int r = 0; r < R; r++) {
            int i = iw + r;
            ds[r] = 0.0f;
            if (j <= i && i < t) {
                float pij = expf(s[r] * scale - lse[r]);
                float f = drop_factor(key, first + (((unsigned long long)b * nh + h) * t + i) * t + j, p, keep_scale);
                ds[r] = pij * (f * dp[r] - dd[r]);
            }
        }
        int n = min(ATT_TILE, min(t, iw + R) - t0);
        for (int jj = 0; jj < n; jj++) {
            float kj[DV];
#pragma unroll
            for (int k = 0; k < DV; k++) kj[k] = lane + 32 * k < hs ? k_s[jj][lane + 32 * k] : 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                float w = __shfl_sync(0xffffffff, ds[r], jj);
#pragma unroll
                for (int k = 0; k < DV; k++) acc[r][k] += w * kj[k];
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        int i = iw + r;
        if (i >= t) break;
        float* dq = dqkv + ((size_t)b * t + i) * ld + h * hs;
#pragma unroll
        for (int k = 0; k < DV; k++) {
            int d = lane + 32 * k;
            if (d < hs) dq[d] = acc[r][k] * scale;
        }
        if (lane == 0) {
            size_t row = ((size_t)b * nh + h) * t + i;
            lse_d[2 * row] = lse[r];
            lse_d[2 * row + 1] = dd[r];
        }
    }
}

// Backward, part 2 (R key rows per warp, after part 1): dv_j = Σ_i f_ij P_ij dy_i and
// dk_j = scale Σ_i dS_ij q_i over the queries i >= j, into dqkv's k and v columns. A lane holds
// one query of the tile.
template <int R, int HS>
__device__ void attention_bwd_kv(const float* qkv, const float* dy, const float* lse_d, float* dqkv, int t, int nh,
                                 int hs, float scale, float p, float keep_scale, unsigned long long key,
                                 unsigned long long first) {
    constexpr int ROWS = ATT_WARPS * R, LD = HS + 4, DV = HS / 32;
    __shared__ __align__(16) float k_s[ROWS][LD];
    __shared__ __align__(16) float v_s[ROWS][LD];
    __shared__ __align__(16) float q_s[ATT_TILE][LD];
    __shared__ __align__(16) float g_s[ATT_TILE][LD];
    __shared__ float lse_s[ATT_TILE], d_s[ATT_TILE];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int h = blockIdx.y, b = blockIdx.z, c = nh * hs;
    int j0 = blockIdx.x * ROWS, jw = j0 + warp * R;  // the warp's keys: jw .. jw + R - 1
    size_t ld = 3 * (size_t)c;
    const float* base = qkv + (size_t)b * t * ld + h * hs;
    const float* gbase = dy + (size_t)b * t * c + h * hs;
    size_t row0 = ((size_t)b * nh + h) * t;
    load_rows(base, ld, c, j0, ROWS, t, hs, &k_s[0][0], LD);
    load_rows(base, ld, 2 * c, j0, ROWS, t, hs, &v_s[0][0], LD);
    float dk[R][DV], dv[R][DV];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int k = 0; k < DV; k++) dk[r][k] = dv[r][k] = 0.0f;
    bool active = jw < t;
    for (int t0 = j0; t0 < t; t0 += ATT_TILE) {
        __syncthreads();
        load_rows(base, ld, 0, t0, ATT_TILE, t, hs, &q_s[0][0], LD);
        load_rows(gbase, c, 0, t0, ATT_TILE, t, hs, &g_s[0][0], LD);
        if (threadIdx.x < ATT_TILE && t0 + threadIdx.x < t) {
            lse_s[threadIdx.x] = lse_d[2 * (row0 + t0 + threadIdx.x)];
            d_s[threadIdx.x] = lse_d[2 * (row0 + t0 + threadIdx.x) + 1];
        }
        __syncthreads();
        if (!active || t0 + ATT_TILE - 1 < jw) continue;
        int i = t0 + lane;
        float s[R], dp[R], pf[R], ds[R];
        dots<R>(q_s[lane], k_s[warp * R], LD, hs, s);
        dots<R>(g_s[lane], v_s[warp * R], LD, hs, dp);
#pragma unroll
        for (int r = 0; r < R; r++) {
            int j = jw + r;
            pf[r] = ds[r] = 0.0f;
            if (i < t && i >= j && j < t) {
                float pij = expf(s[r] * scale - lse_s[lane]);
                float f = drop_factor(key, first + (row0 + i) * t + j, p, keep_scale);
                pf[r] = pij * f;
                ds[r] = pij * (f * dp[r] - d_s[lane]);
            }
        }
        int n = min(ATT_TILE, t - t0);
        for (int ii = 0; ii < n; ii++) {
            float gi[DV], qi[DV];
#pragma unroll
            for (int k = 0; k < DV; k++) {
                bool in = lane + 32 * k < hs;
                gi[k] = in ? g_s[ii][lane + 32 * k] : 0.0f;
                qi[k] = in ? q_s[ii][lane + 32 * k] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                float wv = __shfl_sync(0xffffffff, pf[r], ii);
                float wk = __shfl_sync(0xffffffff, ds[r], ii);
#pragma unroll
                for (int k = 0; k < DV; k++) {
                    dv[r][k] += wv * gi[k];
                    dk[r][k] += wk * qi[k];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        int j = jw + r;
        if (j >= t) break;
        float* out = dqkv + ((size_t)b * t + j) * ld + h * hs;
#pragma unroll
        for (int k = 0; k < DV; k++) {
            int d = lane + 32 * k;
            if (d < hs) {
                out[c + d] = dk[r][k] * scale;
                out[2 * c + d] = dv[r][k];
            }
        }
    }
}

#define ATTENTION_KERNELS(SUFFIX, R, HS)                                                                         \
    extern "C" __global__ void window_attention_fwd##SUFFIX(const float* qkv, float* y, int t, int nh, int hs,    \
                                                            float scale, float p, float keep_scale,              \
                                                            unsigned long long key, unsigned long long first) {  \
        attention_fwd<R, HS>(qkv, y, t, nh, hs, scale, p, keep_scale, key, first);                               \
    }                                                                                                             \
    extern "C" __global__ void window_attention_bwd_q##SUFFIX(                                                   \
        const float* qkv, const float* y, const float* dy, float* dqkv, float* lse_d, int t, int nh, int hs,     \
        float scale, float p, float keep_scale, unsigned long long key, unsigned long long first) {              \
        attention_bwd_q<R, HS>(qkv, y, dy, dqkv, lse_d, t, nh, hs, scale, p, keep_scale, key, first);            \
    }                                                                                                             \
    extern "C" __global__ void window_attention_bwd_kv##SUFFIX(                                                  \
        const float* qkv, const float* dy, const float* lse_d, float* dqkv, int t, int nh, int hs, float scale,  \
        float p, float keep_scale, unsigned long long key, unsigned long long first) {                           \
        attention_bwd_kv<R, HS>(qkv, dy, lse_d, dqkv, t, nh, hs, scale, p, keep_scale, key, first);              \
    }

ATTENTION_KERNELS(_h64, 4, 64)
ATTENTION_KERNELS(_h128, 1, 128)
