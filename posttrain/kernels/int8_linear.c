/* Weight-only int8 linear layers for decode-sized inputs: y = (x W^T) with W = codes * scale, one scale per
 * output row or per group of `group` weights along a row (llama.cpp's Q8_0 has groups of 32), fp32 activations,
 * fp32 accumulation.
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
 * With groups the scale cannot wait for the end of the row: each group's products are summed apart and scaled
 * into the row's sums at the group's end (`tile_grouped`). `group` is a multiple of LANES, so a code vector never
 * straddles two groups.
 *
 * x (M, K) fp32, codes (N, K) int8, scales (N, G) fp32 with G = ceil(K / group) (group >= K: one per row),
 * y (M, N) fp32; all contiguous. OpenMP splits the output rows over `threads` in blocks of ROW_BLOCK; a block's
 * codes (a few KB) stay in L1 across the M inputs.
 */

#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "vec_math.h"

#define ROW_BLOCK 4   /* weight rows that share each load of x: 4 independent sums hide the FMA latency */
#define INPUT_BLOCK 2 /* inputs that share each widened code vector */
/* Rows are short (K bytes: 576 for SmolLM2) and four are read side by side, which the hardware prefetcher follows
 * poorly: without the explicit prefetch the codes streamed from memory at a quarter of the fp32 matmul's bytes/s,
 * and the int8 layer ran no faster than the fp32 one. Eight blocks ahead (18 KB at K = 576) measured best of 2 and 8:
 * 1.7x the fp32 matmul over SmolLM2's 210 decoder linears at batch 1, weights from memory. (Reading
 * past the last row is harmless: a prefetch never faults.) */
#define PREFETCH_BLOCKS 8

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

/* y[m0 .. m0 + inputs, n0 .. n0 + rows): each widened code vector serves `inputs` rows of x. `inputs` and `rows`
 * are constants where this is inlined, so the loops over them unroll and the inputs x rows sums stay in
 * registers (2 x 4 sums + 4 codes + 2 inputs: 14 of AVX2's 16). */
static inline void tile(const float* x, const int8_t* codes, const float* scales, float* y, int64_t N, int64_t K,
                        int64_t m0, int64_t n0, const int inputs, const int rows) {
    const int64_t body = K - K % LANES;
    vec acc[INPUT_BLOCK][ROW_BLOCK] = {{{0}}};
    for (int64_t k = 0; k < body; k += LANES) {
        if (k % 64 == 0) /* a cache line of each row PREFETCH_BLOCKS blocks ahead (see the top) */
            for (int r = 0; r < ROW_BLOCK; r++) __builtin_prefetch(codes + (n0 + PREFETCH_BLOCKS * ROW_BLOCK + r) * K + k);
        vec w[ROW_BLOCK];
        for (int r = 0; r < rows; r++) w[r] = widen(codes + (n0 + r) * K + k);
        for (int i = 0; i < inputs; i++) {
            const vec xv = load(x + (m0 + i) * K + k);
            for (int r = 0; r < rows; r++) acc[i][r] += xv * w[r];
        }
    }
    for (int i = 0; i < inputs; i++) {
        const float* xm = x + (m0 + i) * K;
        for (int r = 0; r < rows; r++) {
            const int8_t* row = codes + (n0 + r) * K;
            float sum = lane_sum(acc[i][r]);
            for (int64_t k = body; k < K; k++) sum += xm[k] * (float)row[k];
            y[(m0 + i) * N + n0 + r] = sum * scales[n0 + r];
        }
    }
}

/* `tile` for one input with a scale per group of `group` codes along each row (G groups per row): a group's
 * products gather in their own sums, which are scaled into the row's sums at the group's end (one FMA per row and
 * group; scaling each code vector instead ran at 14.6 against 21.0 tokens/s, SmolLM2 at batch 1 on AVX2).
 * One input at a time: the sums of two (2 x 4 x 2 vectors) would not fit AVX2's 16 registers, and a block's
 * codes come from L1 for the next input. */
static inline void tile_grouped(const float* x, const int8_t* codes, const float* scales, float* y, int64_t N,
                                int64_t K, int64_t group, int64_t G, int64_t m, int64_t n0, const int rows) {
    const int64_t body = K - K % LANES;
    const float* xm = x + m * K;
    vec acc[ROW_BLOCK] = {{0}};
    for (int64_t g = 0, k0 = 0; k0 < body; g++, k0 += group) {
        const int64_t end = k0 + group < body ? k0 + group : body;
        vec part[ROW_BLOCK] = {{0}};
        for (int64_t k = k0; k < end; k += LANES) {
            if (k % 64 == 0)
                for (int r = 0; r < ROW_BLOCK; r++)
                    __builtin_prefetch(codes + (n0 + PREFETCH_BLOCKS * ROW_BLOCK + r) * K + k);
            const vec xv = load(xm + k);
            for (int r = 0; r < rows; r++) part[r] += xv * widen(codes + (n0 + r) * K + k);
        }
        for (int r = 0; r < rows; r++) acc[r] += part[r] * scales[(n0 + r) * G + g];
    }
    for (int r = 0; r < rows; r++) {
        const int8_t* row = codes + (n0 + r) * K;
        float sum = lane_sum(acc[r]);
        for (int64_t k = body; k < K; k++) sum += xm[k] * ((float)row[k] * scales[(n0 + r) * G + k / group]);
        y[m * N + n0 + r] = sum;
    }
}

/* Every input against weight rows n0 .. n0 + rows. */
static inline void row_block(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N,
                             int64_t K, int64_t group, int64_t n0, const int rows) {
    int64_t m = 0;
    if (group >= K) { /* one scale per row, applied to the finished sums */
        for (; m + INPUT_BLOCK <= M; m += INPUT_BLOCK) tile(x, codes, scales, y, N, K, m, n0, INPUT_BLOCK, rows);
        for (; m < M; m++) tile(x, codes, scales, y, N, K, m, n0, 1, rows);
        return;
    }
    const int64_t G = (K + group - 1) / group;
    for (; m < M; m++) tile_grouped(x, codes, scales, y, N, K, group, G, m, n0, rows);
}

/* group: codes per scale along a row, a multiple of LANES, or >= K for one scale per row (checked by the caller). */
void int8_linear(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t group, int threads) {
    const int64_t blocks = N / ROW_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) row_block(x, codes, scales, y, M, N, K, group, b * ROW_BLOCK, ROW_BLOCK);
    for (int64_t n = blocks * ROW_BLOCK; n < N; n++) row_block(x, codes, scales, y, M, N, K, group, n, 1);
}
