#include "common.cuh"

// Causal self-attention over whole windows (training and evaluation), the CUDA side of
// window_attention/mod.rs: qkv (B * T, 3C), y (B * T, C), heads of HS floats at most (a multiple
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
