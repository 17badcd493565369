/* The paged path's decode step on CPU, in C: attention of one new token per sequence over its KV blocks,
 * read where they lie in the pool, and the write of the new tokens' K/V into their slots.
 *
 * Why C: at 512 decoding sequences the attention is bound by reading the K/V (tens of MB per layer per
 * step) and PyTorch has no op that reads a block table. The pure-PyTorch path gathers the blocks into a
 * contiguous tensor first (a copy as large as the read) and merges the shared-prefix and own-suffix parts
 * in separate ops. Here every K/V byte is read once, from the pool, into a streaming online softmax.
 *
 * Layouts (contiguous; posttrain/kernels/__init__.py checks them before calling):
 *   q, out   (N, H, D) fp32                 queries of the step's new tokens, and the attention outputs
 *   cache    (2, num_blocks, bs, Hkv, D)    K at [0], V at [1]; query head h reads K/V head h / (H / Hkv);
 *                                           fp32 (paged_decode_attention) or bf16 (paged_decode_attention_bf16)
 *   tables   (S, width) int64               block table of each decoding sequence
 *   ctx      (S,) int64                     tokens each sequence attends (its newest one included)
 *   rows     (S,) int64                     row of q / out of each sequence
 *   group_starts (G + 1,), group_shared (G,) int64
 *       Sequences come in groups of consecutive indices [group_starts[g], group_starts[g + 1]) whose
 *       first group_shared[g] blocks are the same blocks (the n samples of one prompt). Those blocks are
 *       read once for the whole group, with the members' query heads as rows (cascade attention); each
 *       member then continues its own softmax over its remaining tokens. A lone sequence is a group of
 *       one that shares nothing.
 *
 * Every row keeps a running max, a running sum of exp(score - max) and an output accumulator; each block
 * of tokens rescales them once, so the result is the exact softmax (up to float rounding). The body is
 * paged_decode_kv.h, included below once per pool dtype.
 */

#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* scores_of_row8 / accumulate_row8 on 8-lane vectors, and on AVX-512 their 16-lane twins (half the instructions per
 * element), from one body (attention_rows.h). */
#define ROW_SUFFIX 8
#define ROW_VEC vec
#define ROW_LANES LANES
#define ROW_LOAD load
#define ROW_STORE store
#define ROW_SPLAT splat
#define ROW_LANE_SUM lane_sum
#define ROW_LANE_SUMS lane_sums
#include "attention_rows.h"
#ifdef WIDE_VEC
#define ROW_SUFFIX 16
#define ROW_VEC vec16
#define ROW_LANES LANES16
#define ROW_LOAD load16
#define ROW_STORE store16
#define ROW_SPLAT splat16
#define ROW_LANE_SUM lane_sum16
#define ROW_LANE_SUMS lane_sums16
#include "attention_rows.h"
#endif

/* One row's scores / accumulation over a block of fp32 K / V: 16 lanes wide where the build and D allow. */
static inline void scores_of_row(const float* q, const float* k, int64_t n, int64_t stride, int64_t D, float* out) {
#ifdef WIDE_VEC
    if (D % LANES16 == 0) {
        scores_of_row16(q, k, n, stride, D, out);
        return;
    }
#endif
    scores_of_row8(q, k, n, stride, D, out);
}

static inline void accumulate_row(float* acc, const float* p, const float* v, int64_t n, int64_t stride, int64_t D) {
#ifdef WIDE_VEC
    if (D % LANES16 == 0) {
        accumulate_row16(acc, p, v, n, stride, D);
        return;
    }
#endif
    accumulate_row8(acc, p, v, n, stride, D);
}

#ifdef WIDE_VEC
/* clamped_exp on 16 lanes, the same steps (vec_math.h). */
static inline __m512 clamped_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const vec16 v = x;
    const vec16 n = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const vec16 f = v - n * 0.693359375f + n * 2.12194440e-4f;
    vec16 poly = splat16(1.9875691500e-4f);
    poly = poly * f + 1.3981999507e-3f;
    poly = poly * f + 8.3334519073e-3f;
    poly = poly * f + 4.1665795894e-2f;
    poly = poly * f + 1.6666665459e-1f;
    poly = poly * f + 5.0000001201e-1f;
    const vec16 y = poly * f * f + f + 1.0f;
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return y * (vec16)_mm512_castsi512_ps(bits);
}
#endif

/* One block of a row's online softmax: its scores p[0..n) become exp(p - m), m the row's running max *mx taken
 * over them too; *mx and the running sum *sm are updated, and the factor the row's accumulator must be rescaled by
 * (exp(old max - m)) is returned. On AVX-512, 16 scores a vector with the tail masked off: the horizontal max and
 * sum of the scalar loops (`omp simd` reductions that GCC finishes with 16 dependent scalar adds) were half the
 * attention's time once the dot products ran 16 lanes wide. */
static inline float softmax_block(float* p, int64_t n, float* mx, float* sm) {
#ifdef WIDE_VEC
    __m512 top = _mm512_set1_ps(*mx);
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, live, p + t));
    }
    const float m = _mm512_reduce_max_ps(top);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sums = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 live = n - t >= 16 ? 0xffff : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = clamped_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p + t), mv));
        _mm512_mask_storeu_ps(p + t, live, e);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(live, e));
    }
    const float sum = _mm512_reduce_add_ps(sums);
#else
    float m = *mx;
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < n; t++) m = p[t] > m ? p[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        p[t] = clamped_exp(p[t] - m);
        sum += p[t];
    }
#endif
    const float rescale = clamped_exp(*mx - m);
    *sm = *sm * rescale + sum;
    *mx = m;
    return rescale;
}

/* dst[i] = src[i] widened to fp32 (exact: a bf16 is the top half of an fp32); count a multiple of LANES. */
static const float* widen_block_bf16(float* dst, const uint16_t* src, int64_t count) {
    int64_t i = 0;
#ifdef __AVX512F__
    for (; i + 16 <= count; i += 16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + i)));
        _mm512_storeu_si512((void*)(dst + i), _mm512_slli_epi32(wide, 16));
    }
#endif
    for (; i < count; i += LANES) store(dst + i, load_bf16(src + i));
    return dst;
}

/* fp32 pool: paged_decode_attention, straight from the pool. */
#define KV_T float
#define KV_BLOCK(scratch, src, count) (src)
#define KV_FN(name) name
#include "paged_decode_kv.h"
#undef KV_T
#undef KV_BLOCK
#undef KV_FN

/* bf16 pool (the engine's compute_dtype=bfloat16): paged_decode_attention_bf16; each block widened to fp32 once
 * (exactly), so this computes what the fp32 kernel does on the widened pool. */
#define KV_T uint16_t
#define KV_BLOCK(scratch, src, count) widen_block_bf16(scratch, src, count)
#define KV_FN(name) name##_bf16
#include "paged_decode_kv.h"
#undef KV_T
#undef KV_BLOCK
#undef KV_FN

/* cache[0][slot] = k[i], cache[1][slot] = v[i] for slot = slots[i] >= 0; k, v (n, row) with row = Hkv * D
 * elements of the pool's dtype (row_bytes bytes), the pool (2, num_slots, row). The slots lie scattered over the
 * pool, so each row waits on its lines: a few rows ahead are prefetched for writing, and the rows are split over
 * threads (512 rows of SmolLM2, 30 pools in turn: 0.10 ms a layer against 0.28 for one thread without). */
void paged_write_kv(char* cache, const char* k, const char* v, const int64_t* slots, int64_t n, int64_t num_slots,
                    int64_t row_bytes, int threads) {
    char* keys = cache;
    char* values = cache + num_slots * row_bytes;
    const int64_t ahead = 8, bytes = row_bytes;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        if (i + ahead < n && slots[i + ahead] >= 0)
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(keys + slots[i + ahead] * bytes + b, 1);
                __builtin_prefetch(values + slots[i + ahead] * bytes + b, 1);
            }
        if (slots[i] < 0) continue;
        memcpy(keys + slots[i] * bytes, k + i * bytes, bytes);
        memcpy(values + slots[i] * bytes, v + i * bytes, bytes);
    }
}
