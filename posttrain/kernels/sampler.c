/* The engine's plain draw on CPU in one pass over the logits: rows that sample from the full softmax of
 * their (already penalised and temperature-scaled) logits, with no top-k / top-p / min-p filter.
 *
 * Why: PyTorch does this in four passes over the (rows, vocab) logits (softmax's max, exp and normalise,
 * then the block sums that the CDF inversion searches), each a round trip through memory at 100 MB a
 * step for 512 rows of a 49152-token vocabulary. Here a row's max and its exp sums are taken while the
 * row sits in the core's cache, and nothing (rows, vocab)-sized is written.
 *
 * The draw is the one posttrain/engine/sampler.py documents: one uniform u per row inverts the CDF of
 * softmax(z), in two levels as sample_from_weights does (sums of `block` consecutive weights, searched in
 * fp64; then the tokens of the chosen block). The weights here are exp(z - max), unnormalised; the
 * normalisation cancels in the inversion, so a token differs from PyTorch's draw only when u falls within
 * float rounding of a step of the CDF. The logprob is z[token] - max - log(sum).
 *
 *   z (rows, V) fp32 contiguous; uniforms (rows,) fp64 in [0, 1); tokens (rows,) int64; logprobs (rows,)
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec_math.h"

/* exp(x) for x = z - max <= 0, exactly 0 below -87: a token masked with -inf (or 38 orders of magnitude
 * below the top one) is never drawn. */
static inline float weight_of(float x) { return x < -87.0f ? 0.0f : clamped_exp(x); }

static int64_t draw_row(const float* z, int64_t V, int64_t block, double u, float* block_sums, float* logprob) {
    float m = z[0];
#pragma omp simd reduction(max : m)
    for (int64_t j = 1; j < V; j++) m = z[j] > m ? z[j] : m;
    const int64_t num_blocks = (V + block - 1) / block;
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t end = (b + 1) * block < V ? (b + 1) * block : V;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t j = b * block; j < end; j++) s += weight_of(z[j] - m);
        block_sums[b] = s;
        total += s;
    }
    /* The target mass, strictly below the total: the first block whose running sum passes it has weight. */
    double target = u * total;
    if (target >= total) target = nextafter(total, 0.0);
    double before = 0.0;
    int64_t b = 0;
    while (b < num_blocks - 1 && before + block_sums[b] <= target) before += block_sums[b++];
    /* Inside the block, in fp64: the first token whose running sum passes the target. The block's fp32 sum
     * rounds differently from this one; if the target is not passed, the block's last token with weight. */
    const int64_t start = b * block, end = start + block < V ? start + block : V;
    int64_t token = -1;
    for (int64_t j = start; j < end; j++) {
        const float w = weight_of(z[j] - m);
        if (w == 0.0f) continue;
        token = j;
        before += w;
        if (before > target) break;
    }
    *logprob = (float)((double)(z[token] - m) - log(total));
    return token;
}

void sample_rows(const float* z, int64_t rows, int64_t V, int64_t block, const double* uniforms, int64_t* tokens,
                 float* logprobs, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float* block_sums = malloc(sizeof(float) * ((V + block - 1) / block));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < rows; i++)
            tokens[i] = draw_row(z + i * V, V, block, uniforms[i], block_sums, logprobs + i);
        free(block_sums);
    }
}
