/* llama.cpp's Q8_0 product for decode-sized inputs: int8 weights in groups of 32 times activations rounded to
 * int8 in the same groups of 32, integer dot products, fp32 scales (the `q8_0` scheme, posttrain/quant/schemes.py).
 *
 * Why: int8_linear.c widens each weight code to a float and multiplies in fp32: 3 instructions per 8 codes, and at
 * batch 1 that arithmetic, not memory, is its limit (~10 GB/s of codes on a 2-core AVX2 machine). With the
 * activations rounded to int8 too, AVX2 multiplies 32 code pairs in a few integer instructions (no VNNI needed):
 * the product of a group is exact in int32, and only its scaling is floating point. llama.cpp's CPU backend runs
 * its Q8_0 matrices this way (activations quantized to Q8_0 blocks first), so this is the like-for-like product.
 *
 * Semantics, per input row m and group g (32 inputs k):
 *     d[m, g] = max(max_k |x[m, k]| / 127, 1e-12)          the activations' scale (fp32)
 *     a[m, k] = round_half_even(x[m, k] / d[m, g])          in [-127, 127]
 *     y[m, n] = sum_g (sum_k a[m, k] * code[n, k]) * (d[m, g] * scale[n, g])
 * `posttrain.quant.codec.quantize_per_group` computes the same codes and scales bit for bit (the same fp32
 * division and rounding), and the reference kernel the same y up to the order of the fp32 sum over groups.
 *
 * The integer dot of a group on AVX2 (`group_dot`): _mm256_maddubs_epi16 multiplies unsigned by signed bytes, so
 * the signs move onto the activations: |code| * (sign(code) * a). |code| <= 128 is exact as an unsigned byte (a
 * code of -128 too) and |a| <= 127 so the negation cannot overflow; each pair sums to at most 2 * 128 * 127 =
 * 32512 < 32767, so the int16 step never saturates. _mm256_madd_epi16 then widens to 8 int32 sums.
 *
 * With AVX512-VNNI (`tile_vnni`) two groups go through one vpdpbusd: 64 products summed four to an int32 lane,
 * lanes 0-7 the first group's and 8-15 the second's. Its first operand is unsigned, so each code goes in as
 * code + 128 (the sign bit flipped: exact) against the signed activations, and the extra 128 * sum_k a[m, k] of
 * each group (an exact int32, the same for every weight row) is subtracted up front: the accumulator starts at
 * -128 * that sum in lane 0 of the group. Each lane's sum is exact (at most 4 * 255 * 127 + 128 * 32 * 127 in
 * magnitude), and the rest is as above: the lanes converted to float, times d[m, g] * scale[n, g], summed.
 *
 * x (M, K) fp32, codes (N, K) int8, scales (N, K / 32) fp32, y (M, N) fp32; all contiguous; K a multiple of 32
 * (checked by the caller). OpenMP splits the output rows over `threads` (in blocks of ROW_BLOCK for several inputs).
 * `q8_linear_many` runs several layers over the same input (a decoder layer's q, k and v) with the activations
 * rounded once and all their rows under one fork; each output is computed as `q8_linear` computes it alone.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512VNNI__)
#include <immintrin.h>
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI 1
#endif

#include "linear_outputs.h"
#include "vec_math.h"

#define GROUP 32
/* Weight rows that share each load of an activation group, for inputs of several rows; the codes of the block this
 * many blocks ahead are prefetched (as in int8_linear.c: four short rows side by side are a pattern the hardware
 * prefetcher follows poorly). An input of at most STREAM_ROWS rows (batch-1 decode, a speculative check of one or two
 * drafts, two or three chats) reads the codes row after row instead, one sequential stream per thread, which the
 * hardware prefetcher does follow, every input against each row as it passes: on a 2-core Zen 5 the blocks streamed
 * at ~16 GB/s, rows at ~39 GB/s (batch-1 q8_0 decode of SmolLM2: the decoder's step 8.5 -> 6.5 ms; SmolLM2's 211
 * weights at 2 / 3 input rows 9.3 -> 7.7 / 9.6 -> 8.7 ms, medians of three A/B pairs). With more input rows the
 * arithmetic is the limit, and the blocks' shared activation loads win (1.4-1.6x at 5-256 rows; at 4 rows the stream
 * was already slower). */
#define ROW_BLOCK 4
#define PREFETCH_BLOCKS 8
#define STREAM_ROWS 3
/* Inputs of more rows than this round their activations on all threads; a decode step's few on one, where the
 * fork would cost more than the rounding. */
#define SERIAL_QUANTIZE_ROWS 16

/* One group of 32 inputs -> its codes, scale and code sum (quantize_groups). */
static inline void quantize_group(const float* xg, int8_t* ag, float* dg, int32_t* sg) {
#ifdef __AVX2__
    /* Vectorized: a scalar loop here (fmaxf is a libm call, which also keeps GCC from vectorizing it) cost ~3 us a
     * row of 576 inputs, ~0.6 ms a SmolLM2 token at batch 1 and 5x that in a 5-row speculative check. The max of
     * |x| is exact in any order, the division is IEEE's as in the scalar loop, and _mm256_round_ps with
     * _MM_FROUND_TO_NEAREST_INT rounds half to even as nearbyintf does in the default mode: the same codes. */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xg + 8 * i);
        top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float scale = fmaxf(_mm_cvtss_f32(h) / 127.0f, 1e-12f);
    const __m256 s = _mm256_set1_ps(scale);
    __m256i q[4];
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(v[i], s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* the packs work within 128-bit lanes: lane 0 ends up with elements 0-3 of each q, lane 1 with 4-7 */
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i*)ag, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4e));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0xb1));
    *dg = scale;
    *sg = _mm_cvtsi128_si32(u);
#else
    float amax = 0.0f;
    for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
    const float scale = fmaxf(amax / 127.0f, 1e-12f);
    int32_t sum = 0;
    for (int i = 0; i < GROUP; i++) {
        ag[i] = (int8_t)nearbyintf(xg[i] / scale);
        sum += ag[i];
    }
    *dg = scale;
    *sg = sum;
#endif
}

/* x (M, K) -> codes a (M, K), scales d (M, K / GROUP) as the top comment defines them, and each group's code sum
 * (M, K / GROUP) (the VNNI tile's correction). */
static void quantize_groups(const float* x, int8_t* a, float* d, int32_t* sums, int64_t M, int64_t K, int threads) {
#pragma omp parallel for num_threads(M > SERIAL_QUANTIZE_ROWS ? threads : 1) schedule(static)
    for (int64_t g = 0; g < M * (K / GROUP); g++) quantize_group(x + g * GROUP, a + g * GROUP, d + g, sums + g);
}

/* The 32 products of one group, summed exactly, in LANES partial sums converted to float. */
static inline vec group_dot(const int8_t* codes, const int8_t* a) {
#ifdef __AVX2__
    const __m256i w = _mm256_loadu_si256((const __m256i*)codes);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)a), w));
    return (vec)_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
    vec sums;
    for (int l = 0; l < LANES; l++) {
        int32_t s = 0;
        for (int i = l * (GROUP / LANES); i < (l + 1) * (GROUP / LANES); i++) s += (int32_t)codes[i] * a[i];
        sums[l] = (float)s;
    }
    return sums;
#endif
}

/* y[m, n0 .. n0 + rows) for one input row: each group's activations serve `rows` weight rows. */
static inline void tile(const int8_t* a, const float* d, const int8_t* codes, const float* scales, float* y,
                        int64_t N, int64_t K, int64_t m, int64_t n0, const int rows) {
    const int64_t G = K / GROUP;
    vec acc[ROW_BLOCK] = {{0}};
    for (int64_t g = 0; g < G; g++) {
        if (rows > 1 && g % 2 == 0) /* a cache line (two groups) of each row PREFETCH_BLOCKS blocks ahead */
            for (int r = 0; r < ROW_BLOCK; r++)
                __builtin_prefetch(codes + (n0 + PREFETCH_BLOCKS * ROW_BLOCK + r) * K + g * GROUP);
        const int8_t* ag = a + m * K + g * GROUP;
        const float dg = d[m * G + g];
        for (int r = 0; r < rows; r++)
            acc[r] += group_dot(codes + (n0 + r) * K + g * GROUP, ag) * splat(dg * scales[(n0 + r) * G + g]);
    }
    for (int r = 0; r < rows; r++) y[m * N + n0 + r] = lane_sum(acc[r]);
}

#ifdef Q8_VNNI
#define INPUT_BLOCK 2 /* inputs that share each load of a weight line (prefill and batched decode) */
#define TILE_INPUTS 3 /* the most inputs a tile takes: INPUT_BLOCK, or STREAM_ROWS in one pass over a streamed row */

/* What a pair of groups of one input row brings to every weight row's vpdpbusd, made once per call (the tiles
 * would otherwise rebuild it for each weight row): the accumulator's start, -128 * the group's code sum in lane 0
 * of each group (top comment), and the two groups' activation scales, lanes 0-7 and 8-15. */
typedef struct {
    __m512i start;
    __m512 d;
} PairInput;

static void prepare_pairs(const float* d, const int32_t* sums, PairInput* out, int64_t M, int64_t G) {
    const int64_t pairs = G / 2;
    for (int64_t m = 0; m < M; m++)
        for (int64_t p = 0; p < pairs; p++) {
            const int64_t mg = m * G + 2 * p;
            out[m * pairs + p].start = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(0x0001, -128 * sums[mg]), 0x0100,
                                                              -128 * sums[mg + 1]);
            out[m * pairs + p].d = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d[mg]), _mm512_set1_ps(d[mg + 1]));
        }
}

/* `tile` with AVX512-VNNI for `inputs` (1 .. TILE_INPUTS) input rows from m: two groups a vpdpbusd (top comment);
 * an odd last group through group_dot. Always inlined: each call site's constant inputs and rows keep the
 * accumulators in registers. */
static inline __attribute__((always_inline)) void tile_vnni(const int8_t* a, const float* d, const PairInput* prep, const int8_t* codes,
                             const float* scales, float* y, int64_t N, int64_t K, int64_t m, int64_t n0,
                             const int inputs, const int rows) {
    const int64_t G = K / GROUP, pairs = G / 2;
    const __m512i flip = _mm512_set1_epi8((char)0x80); /* code ^ 0x80 = code + 128 as an unsigned byte */
    __m512 acc[TILE_INPUTS][ROW_BLOCK];
    for (int i = 0; i < TILE_INPUTS; i++)
        for (int r = 0; r < ROW_BLOCK; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t g = 2 * p;
        for (int r = 0; rows > 1 && r < ROW_BLOCK; r++) /* a cache line (two groups) of each row PREFETCH_BLOCKS ahead */
            __builtin_prefetch(codes + (n0 + PREFETCH_BLOCKS * ROW_BLOCK + r) * K + g * GROUP);
        __m512i av[TILE_INPUTS]; /* each input's two groups of codes, for every weight row of the tile */
        const PairInput* in[TILE_INPUTS];
        for (int i = 0; i < inputs; i++) {
            av[i] = _mm512_loadu_si512((const void*)(a + (m + i) * K + g * GROUP));
            in[i] = prep + (m + i) * pairs + p;
        }
        for (int r = 0; r < rows; r++) {
            const int8_t* row = codes + (n0 + r) * K + g * GROUP;
            const float* sr = scales + (n0 + r) * G + g;
            const __m512i w = _mm512_xor_si512(_mm512_loadu_si512((const void*)row), flip);
            /* the row's two group scales, lanes 0-7 and 8-15 */
            const __m512 sv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(sr[0]), 0xff00, _mm_load_ss(sr + 1));
            for (int i = 0; i < inputs; i++) {
                const __m512i dots = _mm512_dpbusd_epi32(in[i]->start, w, av[i]); /* exact int32 lane sums */
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(in[i]->d, sv), acc[i][r]);
            }
        }
    }
    for (int i = 0; i < inputs; i++)
        for (int r = 0; r < rows; r++) {
            float sum = _mm512_reduce_add_ps(acc[i][r]);
            for (int64_t g = 2 * pairs; g < G; g++) /* the odd last group */
                sum += lane_sum(group_dot(codes + (n0 + r) * K + g * GROUP, a + (m + i) * K + g * GROUP) *
                                splat(d[(m + i) * G + g] * scales[(n0 + r) * G + g]));
            y[(m + i) * N + n0 + r] = sum;
        }
}

/* y[:, n0 .. n0 + rows) for all M inputs: a streamed row (rows 1) against all of at most STREAM_ROWS inputs in one
 * pass, else INPUT_BLOCK inputs at a time. */
static inline void rows_vnni(const int8_t* a, const float* d, const PairInput* prep, const int8_t* codes,
                             const float* scales, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                             const int rows) {
    if (rows == 1 && M == 2) { /* (constant input counts: the tile's loops unroll) */
        tile_vnni(a, d, prep, codes, scales, y, N, K, 0, n0, 2, 1);
        return;
    }
    if (rows == 1 && M == 3) {
        tile_vnni(a, d, prep, codes, scales, y, N, K, 0, n0, 3, 1);
        return;
    }
    int64_t m = 0;
    for (; m + INPUT_BLOCK <= M; m += INPUT_BLOCK)
        tile_vnni(a, d, prep, codes, scales, y, N, K, m, n0, INPUT_BLOCK, rows);
    for (; m < M; m++) tile_vnni(a, d, prep, codes, scales, y, N, K, m, n0, 1, rows);
}
#endif

#ifndef Q8_VNNI
typedef struct PairInput PairInput; /* the VNNI tiles' per-call inputs: none without them */
#endif

/* y[:, n0 .. n0 + rows) for all M inputs: the VNNI tiles where the CPU has them, else each input through `tile`. */
static inline void output_rows(const int8_t* a, const float* d, const PairInput* prep, const int8_t* codes,
                               const float* scales, float* y, int64_t M, int64_t N, int64_t K, int64_t n0,
                               const int rows) {
#ifdef Q8_VNNI
    rows_vnni(a, d, prep, codes, scales, y, M, N, K, n0, rows);
#else
    (void)prep;
    for (int64_t m = 0; m < M; m++) tile(a, d, codes, scales, y, N, K, m, n0, rows);
#endif
}

typedef struct {
    const int8_t* a;
    const float* d;
    const PairInput* prep;
    const Q8Output* outs;
    int64_t M, K;
} Units;

/* Unit u of output j: one row at a time for an input of at most STREAM_ROWS rows (ROW_BLOCK's comment), else blocks
 * of ROW_BLOCK rows and then the rows past the last whole block one by one. */
static inline int64_t units_of(int64_t N, int64_t M) { return M <= STREAM_ROWS ? N : N / ROW_BLOCK + N % ROW_BLOCK; }

static void run_unit(const void* context, int64_t j, int64_t u) {
    const Units* c = context;
    const Q8Output* out = c->outs + j;
    const int64_t M = c->M, N = out->N, K = c->K, blocks = N / ROW_BLOCK;
    if (M <= STREAM_ROWS) /* constant row counts at each call: the tiles' loops unroll */
        output_rows(c->a, c->d, c->prep, out->codes, out->scales, out->y, M, N, K, u, 1);
    else if (u < blocks)
        output_rows(c->a, c->d, c->prep, out->codes, out->scales, out->y, M, N, K, u * ROW_BLOCK, ROW_BLOCK);
    else
        output_rows(c->a, c->d, c->prep, out->codes, out->scales, out->y, M, N, K, blocks * ROW_BLOCK + (u - blocks), 1);
}

void q8_linear_many(const float* x, const Q8Output* outs, int64_t count, int64_t M, int64_t K, int threads) {
    const int64_t G = K / GROUP;
    int8_t* a = malloc((size_t)(M * K)); /* the rounded activations: a few KB for a decode step */
    float* d = malloc(sizeof(float) * (size_t)(M * G));
    int32_t* sums = malloc(sizeof(int32_t) * (size_t)(M * G));
    quantize_groups(x, a, d, sums, M, K, threads);
    PairInput* prep = NULL;
#ifdef Q8_VNNI
    prep = aligned_alloc(64, sizeof(PairInput) * (size_t)(M * (G / 2) + 1)); /* + 1: never a size of 0 */
    prepare_pairs(d, sums, prep, M, G);
#endif
    int64_t units[count];
    for (int64_t j = 0; j < count; j++) units[j] = units_of(outs[j].N, M);
    const Units context = {a, d, prep, outs, M, K};
#pragma omp parallel num_threads(threads)
    run_guided_share(units, count, run_unit, &context); /* one fork for all the outputs' rows */
    free(a);
    free(d);
    free(sums);
    free(prep);
}

void q8_linear(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N, int64_t K,
               int threads) {
    const Q8Output out = {codes, scales, y, N};
    q8_linear_many(x, &out, 1, M, K, threads);
}
