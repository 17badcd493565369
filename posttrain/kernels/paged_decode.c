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

/* fp32 pool: paged_decode_attention. */
#define KV_T float
#define KV_LOAD load
#define KV_FN(name) name
#include "paged_decode_kv.h"
#undef KV_T
#undef KV_LOAD
#undef KV_FN

/* bf16 pool (the engine's compute_dtype=bfloat16): paged_decode_attention_bf16; each K/V element widens to fp32
 * exactly (a bf16 is the top half of an fp32), so this computes what the fp32 kernel does on the widened pool. */
#define KV_T uint16_t
#define KV_LOAD load_bf16
#define KV_FN(name) name##_bf16
#include "paged_decode_kv.h"
#undef KV_T
#undef KV_LOAD
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
