/* bf16 linear layers for a few input rows (the engine's bf16 compute at batch 1 and small batches):
 * y = bf16(x) W^T, rounded to bf16, widened back to fp32 (+ b); W (N, K) bf16 row-major.
 *
 * Why: the engine in bf16 (EngineConfig.compute_dtype) runs each linear layer as oneDNN's bf16 GEMM over a bf16
 * copy of the weight (posttrain/engine/bf16_weights.py). With one or a few rows that is a matrix-vector product
 * bound by the weight's bytes (half of fp32's), and the module path around it adds the per-layer Python the native
 * decode step (decode_step.c) exists to remove. This kernel is that step's bf16 linear layer.
 *
 * It computes what the module path does, up to the order of the sum: the input rounded to bf16 (round to nearest
 * even, as torch's cast), every product of two bf16s (exact in fp32) summed in fp32, the sum rounded to bf16 (the
 * GEMM's bf16 output) and widened to fp32, then the fp32 bias added (Bf16Weights.linear adds it after the
 * product). Each output's order depends on nothing but K, so a row's result is the same whatever M.
 *
 * With AVX512-BF16 (-march=native on such a CPU): vdpbf16ps, 32 products per instruction into 16 fp32 lanes (a
 * pair of adjacent products summed, then added to the lane; denormals flushed, as the instruction does).
 * Elsewhere: each bf16 widened to fp32 exactly (a shift) and multiplied in 8-float vectors.
 *
 * x (M, K) fp32, w (N, K) bf16 as uint16, b (N,) fp32 or NULL, y (M, N) fp32, x16 (M, K) scratch for the rounded
 * inputs; all contiguous.
 */

#include <stdint.h>
#include <string.h>

#include "vec_math.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#define BF16_STEP 32 /* bf16 pairs per vdpbf16ps */
#else
#define BF16_STEP LANES
#endif
#define BF16_ROW_BLOCK 8 /* weight rows that share each load of an input (measured best of 2, 4, 8 at batch 1) */
#define BF16_PREFETCH_BLOCKS 4 /* row blocks ahead (as f32_linear.c: side-by-side rows defeat the prefetcher) */
#define BF16_LINE 32           /* bf16s in a 64-byte cache line */

/* fp32 -> bf16, round to nearest even (NaN stays a NaN). */
static inline uint16_t round_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
}

/* The vector body: acc[r] += the products of x and weight row r over [0, body). */
static inline void bf16_dots(const uint16_t* xm, const uint16_t* w, int64_t K, int64_t n0, int rows, int64_t body,
                             float* sums) {
#ifdef __AVX512BF16__
    __m512 acc[BF16_ROW_BLOCK];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < body; k += BF16_STEP) {
        for (int r = 0; r < BF16_ROW_BLOCK; r++) /* one line of each row BF16_PREFETCH_BLOCKS blocks ahead */
            __builtin_prefetch(w + (n0 + BF16_PREFETCH_BLOCKS * BF16_ROW_BLOCK + r) * K + k);
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void*)(xm + k));
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512((const void*)(w + (n0 + r) * K + k)));
    }
    for (int r = 0; r < rows; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
#else
    vec acc[BF16_ROW_BLOCK] = {{0}};
    for (int64_t k = 0; k < body; k += BF16_STEP) {
        if (k % BF16_LINE == 0)
            for (int r = 0; r < BF16_ROW_BLOCK; r++)
                __builtin_prefetch(w + (n0 + BF16_PREFETCH_BLOCKS * BF16_ROW_BLOCK + r) * K + k);
        const vec xv = load_bf16(xm + k);
        for (int r = 0; r < rows; r++) acc[r] += xv * load_bf16(w + (n0 + r) * K + k);
    }
    for (int r = 0; r < rows; r++) sums[r] = lane_sum(acc[r]);
#endif
}

static inline void bf16_row_block(const uint16_t* x16, const uint16_t* w, const float* b, float* y, int64_t M,
                                  int64_t N, int64_t K, int64_t n0, const int rows) {
    const int64_t body = K - K % BF16_STEP;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xm = x16 + m * K;
        float sums[BF16_ROW_BLOCK];
        bf16_dots(xm, w, K, n0, rows, body, sums);
        for (int r = 0; r < rows; r++) {
            const uint16_t* row = w + (n0 + r) * K;
            float sum = sums[r];
            for (int64_t k = body; k < K; k++) sum += widen_bf16(xm[k]) * widen_bf16(row[k]);
            const float out = widen_bf16(round_bf16(sum));
            y[m * N + n0 + r] = b != NULL ? out + b[n0 + r] : out;
        }
    }
}

void bf16_linear(const float* x, const uint16_t* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                 uint16_t* x16, int threads) {
    for (int64_t i = 0; i < M * K; i++) x16[i] = round_bf16(x[i]);
    const int64_t blocks = N / BF16_ROW_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++)
        bf16_row_block(x16, w, b, y, M, N, K, blk * BF16_ROW_BLOCK, BF16_ROW_BLOCK);
    for (int64_t n = blocks * BF16_ROW_BLOCK; n < N; n++) bf16_row_block(x16, w, b, y, M, N, K, n, 1);
}

/* Round n fp32s to bf16 (the K/V a bf16 pool stores). */
void round_to_bf16(const float* x, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = round_bf16(x[i]);
}
