// Broadcast adds and their gradient (column sums), the CUDA side of add.rs.

#include "common.cuh"

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
