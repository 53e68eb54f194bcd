#include "common.cuh"

// Decode attention for a batch of sequences, one new token each, in one launch (inference):
// block (h, b) appends head h of sequence b's new key and value to that sequence's cache and
// attends over everything it holds. table[4b..4b+4]: the key buffer's and the value buffer's
// address ((nh, cap, hs) each, in T), the positions held before this token, cap. qkv (B, 3C):
// each row's query, key and value; y (B, C). Shared memory: hs + len + 1 floats.
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
