/* fp32 linear layers for a few input rows (batch-1 and small-batch decode): y = x W^T (+ b), W (N, K) row-major.
 *
 * Why: with one or a few input rows a linear layer is a matrix-vector product, bound by the weight's bytes through
 * memory. MKL's sgemm runs it on one thread at these sizes: measured on a 2-core AVX2 machine, 60 SmolLM2-sized
 * (1536 x 576) weights from memory at M = 1 went through at 10.7 GB/s with 1 thread and 10.1 GB/s with 2, about
 * half of what two cores stream (llama.cpp's F32 decode reaches ~21 GB/s on the same machine). Here OpenMP splits
 * the output rows over the threads, so every core streams its share of the weight.
 *
 * y[m, n] = b[n] + sum_k x[m, k] * w[n, k] in fp32, LANES partial sums per (input, row) added at the end: one
 * sum of K products in another order than sgemm's (within fp32 rounding of it). Each output's order depends on
 * nothing but K, so a row's result is the same whatever M and whichever rows share its call.
 *
 * x (M, K), w (N, K), b (N,) or NULL, y (M, N); all fp32 and contiguous. Blocks of ROW_BLOCK weight rows, each
 * read once from memory for all M inputs (a block is 4 x K floats: in L1 for the next inputs).
 */

#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

#define F32_ROW_BLOCK 4   /* weight rows that share each load of x: 4 independent sums hide the FMA latency */
#define F32_INPUT_BLOCK 2 /* inputs that share each weight vector: 2 x 4 sums + 4 weights + 2 inputs in 16 registers */
#define F32_PREFETCH_BLOCKS 4 /* row blocks ahead: four rows side by side are streams the hardware prefetcher follows poorly */

static inline void f32_tile(const float* x, const float* w, const float* b, float* y, int64_t N, int64_t K, int64_t m0,
                            int64_t n0, const int inputs, const int rows) {
    const int64_t body = K - K % LANES;
    vec acc[F32_INPUT_BLOCK][F32_ROW_BLOCK] = {{{0}}};
    for (int64_t k = 0; k < body; k += LANES) {
        if (k % 16 == 0) /* one cache line of each row, F32_PREFETCH_BLOCKS blocks ahead */
            for (int r = 0; r < F32_ROW_BLOCK; r++)
                __builtin_prefetch(w + (n0 + F32_PREFETCH_BLOCKS * F32_ROW_BLOCK + r) * K + k);
        vec wv[F32_ROW_BLOCK];
        for (int r = 0; r < rows; r++) wv[r] = load(w + (n0 + r) * K + k);
        for (int i = 0; i < inputs; i++) {
            const vec xv = load(x + (m0 + i) * K + k);
            for (int r = 0; r < rows; r++) acc[i][r] += xv * wv[r];
        }
    }
    for (int i = 0; i < inputs; i++) {
        const float* xm = x + (m0 + i) * K;
        for (int r = 0; r < rows; r++) {
            const float* row = w + (n0 + r) * K;
            float sum = lane_sum(acc[i][r]);
            for (int64_t k = body; k < K; k++) sum += xm[k] * row[k];
            y[(m0 + i) * N + n0 + r] = b != NULL ? sum + b[n0 + r] : sum;
        }
    }
}

static inline void f32_row_block(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N,
                                 int64_t K, int64_t n0, const int rows) {
    int64_t m = 0;
    for (; m + F32_INPUT_BLOCK <= M; m += F32_INPUT_BLOCK) f32_tile(x, w, b, y, N, K, m, n0, F32_INPUT_BLOCK, rows);
    for (; m < M; m++) f32_tile(x, w, b, y, N, K, m, n0, 1, rows);
}

void f32_linear(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                int threads) {
    const int64_t blocks = N / F32_ROW_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) f32_row_block(x, w, b, y, M, N, K, blk * F32_ROW_BLOCK, F32_ROW_BLOCK);
    for (int64_t n = blocks * F32_ROW_BLOCK; n < N; n++) f32_row_block(x, w, b, y, M, N, K, n, 1);
}
