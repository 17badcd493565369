/* Weight-only int8 linear layers for decode-sized inputs: y = (x W^T) with W = codes * scale per output row,
 * fp32 activations, fp32 accumulation.
 *
 * Why: at batch 1 a decode step streams every weight once per token, so its time is the weights' bytes; int8
 * codes are a quarter of fp32's. torch's own int8 weight-only kernel (`_weight_int8pack_mm`) takes bf16
 * activations, which CPUs without AVX512-BF16 / AMX emulate (slower than the fp32 matmul it replaces). Here
 * each code is widened to float in registers and multiplied into fp32 sums: the weight crosses memory as int8,
 * the arithmetic is fp32's, the activations are never rounded.
 *
 * y[m, n] = scale[n] * sum_k x[m, k] * code[n, k]: the products are exact in fp32 (|code| <= 128 times a
 * float), the sums run in LANES partial sums per row, then the scale: within fp32 rounding of the
 * dequantized weight's F.linear (posttrain/quant/linear.py's reference kernel).
 *
 * x (M, K) fp32, codes (N, K) int8, scales (N,) fp32, y (M, N) fp32; all contiguous. OpenMP splits the output
 * rows over `threads` in blocks of ROW_BLOCK; a block's codes (a few KB) stay in L1 across the M inputs.
 */

#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vec_math.h"

#define ROW_BLOCK 4 /* weight rows that share each load of x: 4 independent sums hide the FMA latency */

/* LANES codes of a weight row widened to floats. With AVX2 one sign-extending load and one conversion: GCC
 * lowers the portable loop (and __builtin_convertvector from 8 bytes) to a scalar insert per code. */
static inline vec widen(const int8_t* codes) {
#ifdef __AVX2__
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)codes)));
#else
    vec v;
    for (int i = 0; i < LANES; i++) v[i] = (float)codes[i];
    return v;
#endif
}

/* y[m, n0 .. n0 + rows) for every input m; `rows` is a constant where this is inlined, so the loops over it
 * unroll and the sums stay in registers. */
static inline void row_block(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N,
                             int64_t K, int64_t n0, const int rows) {
    const int64_t body = K - K % LANES;
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        vec acc[ROW_BLOCK] = {{0}};
        for (int64_t k = 0; k < body; k += LANES) {
            const vec xv = load(xm + k);
            for (int r = 0; r < rows; r++) acc[r] += xv * widen(codes + (n0 + r) * K + k);
        }
        for (int r = 0; r < rows; r++) {
            const int8_t* row = codes + (n0 + r) * K;
            float sum = lane_sum(acc[r]);
            for (int64_t k = body; k < K; k++) sum += xm[k] * (float)row[k];
            y[m * N + n0 + r] = sum * scales[n0 + r];
        }
    }
}

void int8_linear(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N, int64_t K,
                 int threads) {
    const int64_t blocks = N / ROW_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) row_block(x, codes, scales, y, M, N, K, b * ROW_BLOCK, ROW_BLOCK);
    for (int64_t n = blocks * ROW_BLOCK; n < N; n++) row_block(x, codes, scales, y, M, N, K, n, 1);
}
