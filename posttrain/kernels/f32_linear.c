/* fp32 linear layers for a few input rows (batch-1 and small-batch decode): y = x W^T (+ b), W (N, K) row-major.
 *
 * Why: with one or a few input rows a linear layer is a matrix-vector product, bound by the weight's bytes through
 * memory. MKL's sgemm runs it on one thread at these sizes: measured on a 2-core AVX2 machine, 60 SmolLM2-sized
 * (1536 x 576) weights from memory at M = 1 went through at 10.7 GB/s with 1 thread and 10.1 GB/s with 2, about
 * half of what two cores stream (llama.cpp's F32 decode reaches ~21 GB/s on the same machine). Here OpenMP splits
 * the output rows over the threads, so every core streams its share of the weight.
 *
 * y[m, n] = b[n] + sum_k x[m, k] * w[n, k] in fp32: two chains of LANES partial sums (even and odd vectors along
 * k) added at the end, then the tail: one sum of K products in another order than sgemm's (within fp32 rounding of
 * it). Each output's order depends on nothing but K, so a row's result is the same whatever M and whichever rows
 * share its call.
 *
 * The weight is read row after row, each row's K floats in order: one sequential stream per thread. Reading a
 * block of rows side by side (a vector of each in turn, sharing each load of x) streamed SmolLM2's weights at
 * ~26 GB/s on a 2-core Zen 5 even with software prefetches; row after row, 34 GB/s (its 211 weights, 538 MB, at
 * M = 1: 20.6 -> 15.5 ms). The inputs share each row in blocks of F32_INPUT_BLOCK (the row stays in L1 for the
 * next block).
 *
 * x (M, K), w (N, K), b (N,) or NULL, y (M, N); all fp32 and contiguous.
 */

#include <stddef.h>
#include <stdint.h>

#include "vec_math.h"

#define F32_INPUT_BLOCK 4 /* inputs that share each weight vector: 4 x 2 sums + 2 weights + 4 inputs in 16 registers */

/* y[m0 .. m0 + inputs, n] = x[m0 .. m0 + inputs] . row (+ bias). */
static inline void f32_row(const float* x, const float* row, const float* b, float* y, int64_t N, int64_t K,
                           int64_t m0, int64_t n, const int inputs) {
    const int64_t pairs = K - K % (2 * LANES), body = K - K % LANES;
    vec even[F32_INPUT_BLOCK] = {{0}}, odd[F32_INPUT_BLOCK] = {{0}};
    int64_t k = 0;
    for (; k < pairs; k += 2 * LANES) {
        const vec w0 = load(row + k), w1 = load(row + k + LANES);
        for (int i = 0; i < inputs; i++) {
            even[i] += load(x + (m0 + i) * K + k) * w0;
            odd[i] += load(x + (m0 + i) * K + k + LANES) * w1;
        }
    }
    if (k < body) {
        const vec w0 = load(row + k);
        for (int i = 0; i < inputs; i++) even[i] += load(x + (m0 + i) * K + k) * w0;
    }
    for (int i = 0; i < inputs; i++) {
        const float* xm = x + (m0 + i) * K;
        float sum = lane_sum(even[i] + odd[i]);
        for (k = body; k < K; k++) sum += xm[k] * row[k];
        y[(m0 + i) * N + n] = b != NULL ? sum + b[n] : sum;
    }
}

void f32_linear(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        int64_t m = 0;
        for (; m + F32_INPUT_BLOCK <= M; m += F32_INPUT_BLOCK) f32_row(x, w + n * K, b, y, N, K, m, n, F32_INPUT_BLOCK);
        for (; m < M; m++) f32_row(x, w + n * K, b, y, N, K, m, n, 1);
    }
}
