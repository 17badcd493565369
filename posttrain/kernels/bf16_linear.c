/* bf16 linear layers over a packed weight (the engine's bf16 compute, at every batch size):
 * y = bf16(x) W^T, rounded to bf16, widened back to fp32 (+ b), where W (N, K) was packed by bf16_pack.
 *
 * Why: the engine in bf16 (EngineConfig.compute_dtype) keeps a bf16 copy of each fp32 linear weight
 * (posttrain/engine/bf16_weights.py). oneDNN's bf16 GEMM over a row-major copy runs far below the CPU's bf16 rate
 * at the engine's sizes: on an AVX512-BF16 EPYC, 2 threads, over the default model's 210 decoder weights it took
 * 200 GFLOP/s at 64 rows (a GRPO rollout's decode step), 87 at 16 and 6 at one row (one thread, the weights read as
 * if cache-resident); this kernel 301 / 227 / 24 (1.5x / 2.6x / 3.9x; 1.6x the former row-by-row kernel at one
 * row). One kernel serves batch-1 decode, batched decode, prefill and the native decode step (decode_step.c).
 *
 * The packed layout (`pairs` = ceil(K / 2), `blocks` = ceil(N / 64)): (blocks, pairs, 64, 2) bf16, element
 * [b][p][j][t] = W[64 b + j][2 p + t], zero past N and K. A block's panel is one stream of 256-byte lines, each the
 * 2 adjacent inputs of 64 outputs: the operand of 4 vdpbf16ps, and what the hardware prefetcher reads best.
 *
 * The microkernel holds a tile of up to 6 input rows x 64 outputs in 24 fp32 registers; for each pair of inputs
 * it loads 4 vectors of the panel and broadcasts each row's pair (2 bf16 as one 32-bit lane). Rows are taken in
 * chunks of 192 (their rounded inputs stay in L2 while every panel passes). Every output's sum runs over the pairs in order whatever M or the thread count, so a row's result does
 * not depend on the batch it came in.
 *
 * It computes what the module path does, up to the order of the sum: the input rounded to bf16 (round to nearest
 * even, as torch's cast), every product of two bf16s (exact in fp32) summed in fp32, the sum rounded to bf16 (the
 * GEMM's bf16 output) and widened to fp32, then the fp32 bias added (Bf16Weights.linear adds it after the
 * product). With AVX512-BF16 (-march=native on such a CPU): vdpbf16ps, which flushes denormals. Elsewhere the same
 * sums in plain C over widened bf16s (exact: a shift), in the instruction's order (the odd input of a pair first).
 */

#include <stdint.h>
#include <string.h>

#include "linear_outputs.h"

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

/* Two adjacent bf16 inputs read as one 32-bit lane (the scratch is written as uint16). */
typedef uint32_t bf16_pair __attribute__((may_alias));

#define COLS 64        /* outputs per packed block: 4 vectors of 16 fp32 */
#define TILE_ROWS 6    /* input rows per microkernel tile: 6 x 4 accumulators (24 of the 32 zmm registers) */
#define CHUNK_ROWS 192 /* input rows per task (32 tiles): 192 x 1536 bf16 inputs = 576 KB, within L2 */

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

/* Round n fp32s to bf16 (the K/V a bf16 pool stores). */
void round_to_bf16(const float* x, uint16_t* out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX512BF16__
    for (; i + 16 <= n; i += 16) /* round to nearest even, as round_bf16 (a denormal flushed to zero) */
        _mm256_storeu_si256((__m256i*)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = round_bf16(x[i]);
}

/* W (N, K) fp32 rounded to bf16 into the packed layout above; out holds blocks * pairs * COLS * 2 bf16s. */
void bf16_pack(const float* w, uint16_t* out, int64_t N, int64_t K, int threads) {
    const int64_t pairs = (K + 1) / 2, blocks = (N + COLS - 1) / COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        uint16_t* panel = out + b * pairs * COLS * 2;
        const int rows = N - b * COLS < COLS ? (int)(N - b * COLS) : COLS;
        for (int64_t p = 0; p < pairs; p++) { /* written in order; the block's 64 rows read 8 pairs a cache line */
            uint16_t* line = panel + p * COLS * 2;
            for (int j = 0; j < COLS; j++) {
                const float* row = w + (b * COLS + j) * K;
                line[2 * j] = j < rows ? round_bf16(row[2 * p]) : 0;
                line[2 * j + 1] = j < rows && 2 * p + 1 < K ? round_bf16(row[2 * p + 1]) : 0;
            }
        }
    }
}

/* y (rows, cols) = a tile of x16 (rows, pairs pairs, row stride `pairs` pairs) times one panel; rows <= TILE_ROWS,
 * cols <= COLS (less in the last block's tail); the sum rounded to bf16, widened, plus b (cols,) if any. */
static inline __attribute__((always_inline)) void tile(const bf16_pair* x16, int64_t pairs, const uint16_t* panel,
                                                         const int rows, int cols, const float* b, float* y,
                                                         int64_t ldy) {
#ifdef __AVX512BF16__
    __m512 acc[TILE_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t* line = panel + p * COLS * 2;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(line), w1 = (__m512bh)_mm512_loadu_si512(line + 32),
                       w2 = (__m512bh)_mm512_loadu_si512(line + 64), w3 = (__m512bh)_mm512_loadu_si512(line + 96);
        for (int r = 0; r < rows; r++) {
            const __m512bh xr = (__m512bh)_mm512_set1_epi32((int)x16[r * pairs + p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xr, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xr, w3);
        }
    }
    for (int v = 0; v < 4 && v * 16 < cols; v++) {
        const int left = cols - v * 16;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const __m512 bias = b != NULL ? _mm512_maskz_loadu_ps(mask, b + v * 16) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) { /* the GEMM's bf16 output, widened, then the fp32 bias */
            const __m512 out = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(acc[r][v]));
            _mm512_mask_storeu_ps(y + r * ldy + v * 16, mask, b != NULL ? _mm512_add_ps(out, bias) : out);
        }
    }
#else
    float acc[TILE_ROWS][COLS];
    memset(acc, 0, sizeof(acc));
    for (int64_t p = 0; p < pairs; p++) {
        const uint16_t* line = panel + p * COLS * 2;
        float even[COLS], odd[COLS];
        for (int j = 0; j < COLS; j++) even[j] = widen_bf16(line[2 * j]), odd[j] = widen_bf16(line[2 * j + 1]);
        for (int r = 0; r < rows; r++) {
            const uint32_t pair = x16[r * pairs + p];
            const float x0 = widen_bf16((uint16_t)pair), x1 = widen_bf16((uint16_t)(pair >> 16));
            for (int j = 0; j < COLS; j++) acc[r][j] = (acc[r][j] + x1 * odd[j]) + x0 * even[j];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < cols; j++) {
            const float out = widen_bf16(round_bf16(acc[r][j]));
            y[r * ldy + j] = b != NULL ? out + b[j] : out;
        }
#endif
}

typedef struct {
    const uint16_t* x16;
    int64_t pairs, M;
    const Bf16Output* outs;
} Units;

/* Unit u of output j's (chunk, block, tile) units (bf16_linear_many's comment): one tile times one panel. */
static void run_unit(const void* context, int64_t j, int64_t u) {
    const Units* c = context;
    const Bf16Output* out = c->outs + j;
    const int64_t M = c->M, pairs = c->pairs, N = out->N, blocks = (N + COLS - 1) / COLS;
    const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t chunk_tiles = CHUNK_ROWS / TILE_ROWS, full_chunks = tiles / chunk_tiles;
    const int64_t last_tiles = tiles - full_chunks * chunk_tiles, full_units = full_chunks * chunk_tiles * blocks;
    const int64_t in_chunk = u < full_units ? chunk_tiles : last_tiles; /* tiles in this unit's chunk */
    const int64_t chunk = u < full_units ? u / (chunk_tiles * blocks) : full_chunks;
    const int64_t rest = u < full_units ? u % (chunk_tiles * blocks) : u - full_units;
    const int64_t blk = rest / in_chunk, m = (chunk * chunk_tiles + rest % in_chunk) * TILE_ROWS;
    const uint16_t* panel = out->packed + blk * pairs * COLS * 2;
    const int cols = N - blk * COLS < COLS ? (int)(N - blk * COLS) : COLS;
    const bf16_pair* xs = (const bf16_pair*)(c->x16 + m * 2 * pairs);
    const float* bias = out->bias != NULL ? out->bias + blk * COLS : NULL;
    float* ys = out->y + m * N + blk * COLS;
    switch (M - m < TILE_ROWS ? (int)(M - m) : TILE_ROWS) { /* constant rows: registers */
        case 6: tile(xs, pairs, panel, 6, cols, bias, ys, N); break;
        case 5: tile(xs, pairs, panel, 5, cols, bias, ys, N); break;
        case 4: tile(xs, pairs, panel, 4, cols, bias, ys, N); break;
        case 3: tile(xs, pairs, panel, 3, cols, bias, ys, N); break;
        case 2: tile(xs, pairs, panel, 2, cols, bias, ys, N); break;
        default: tile(xs, pairs, panel, 1, cols, bias, ys, N); break;
    }
}

/* Several layers over the same input x (M, K) (a decoder layer's q, k and v): x rounded once into x16 (M * 2 *
 * ceil(K / 2) bf16s, each row padded to whole pairs), then all outputs' units under one fork, each computed as
 * bf16_linear computes it alone.
 *
 * An output's work is (chunk, block, tile) units in that order, and the threads take equal contiguous runs of all
 * the outputs' units (run_thread_share): a thread's tiles mostly share their block's panel and their chunk's
 * inputs, and a short last chunk costs no thread more than its share. */
void bf16_linear_many(const float* x, const Bf16Output* outs, int64_t count, int64_t M, int64_t K, uint16_t* x16,
                      int threads) {
    const int64_t pairs = (K + 1) / 2, tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
    int64_t units[count];
    for (int64_t j = 0; j < count; j++) units[j] = tiles * ((outs[j].N + COLS - 1) / COLS);
    const Units context = {x16, pairs, M, outs};
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            round_to_bf16(x + m * K, x16 + m * 2 * pairs, K);
            if (K % 2) x16[m * 2 * pairs + K] = 0; /* the padded input: 0 times the packed zero */
        }
        run_thread_share(units, count, run_unit, &context);
    }
}

/* x (M, K) fp32, packed from bf16_pack(W (N, K)), b (N,) fp32 or NULL, y (M, N) fp32; x16 scratch for
 * M * 2 * ceil(K / 2) bf16s (the rounded inputs, each row padded to whole pairs). */
void bf16_linear(const float* x, const uint16_t* packed, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                 uint16_t* x16, int threads) {
    const Bf16Output out = {packed, b, y, N};
    bf16_linear_many(x, &out, 1, M, K, x16, threads);
}
