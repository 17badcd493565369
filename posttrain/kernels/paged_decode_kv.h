/* The decode attention of paged_decode.c over a pool of K/V elements of type KV_T, included once per pool dtype.
 * The includer defines KV_T (the pool's element type), KV_FN(name) (the name of this instance's function `name`)
 * and KV_BLOCK(scratch, src, count): the `count` pool elements at src as fp32, either src itself (an fp32 pool) or
 * widened into `scratch` (room for a block of every KV head's K or V) and returned. Queries, scores, softmax and
 * outputs are fp32 whatever KV_T is: a block is widened once, before all the rows that read it (the n samples of a
 * prompt times the query heads of each KV head: up to 72 rows of SmolLM2 read each shared block). */

typedef struct {
    const KV_T* keys;   /* cache[0] */
    const KV_T* values; /* cache[1] */
    int64_t bs, stride, D, H, heads_per_kv; /* stride: elements from one token's K/V to the next's (Hkv * D) */
} KV_FN(Pool);

/* Rows r = 0..R-1 (query head r % H, pre-scaled q at qs + r * D) attend the tokens [first, last) of the
 * block table `table`, continuing their running max mx, sum sm and accumulator acc (R, D). */
static void KV_FN(attend)(const KV_FN(Pool)* pool, const int64_t* table, int64_t first, int64_t last, const float* qs, int64_t R,
                   float* acc, float* mx, float* sm, float* p, float* k_scratch, float* v_scratch) {
    const int64_t bs = pool->bs, stride = pool->stride, D = pool->D;
    for (int64_t pos = first; pos < last;) {
        const int64_t offset = pos % bs;
        int64_t n = bs - offset;
        if (n > last - pos) n = last - pos;
        const int64_t start = (table[pos / bs] * bs + offset) * stride;
        /* The next block lies elsewhere in the pool: ask for it ahead of time, a slice of its cache lines
         * before each row below. (All at once, the requests would outnumber the core's line-fill buffers
         * and stall it until most had arrived: 10% slower in a rollout-like benchmark.) */
        const char *next_k = NULL, *next_v = NULL;
        if (pos + n < last) {
            next_k = (const char*)(pool->keys + table[(pos + n) / bs] * bs * stride);
            next_v = (const char*)(pool->values + table[(pos + n) / bs] * bs * stride);
        }
        const int64_t lines = bs * stride * (int64_t)sizeof(KV_T) / 64; /* per block, of K and of V */
        const float* keys = KV_BLOCK(k_scratch, pool->keys + start, n * stride);   /* (n, Hkv, D) */
        const float* values = KV_BLOCK(v_scratch, pool->values + start, n * stride); /* (n, Hkv, D) */
        for (int64_t r = 0; r < R; r++) {
            if (next_k != NULL)
                for (int64_t line = r * lines / R; line < (r + 1) * lines / R; line++) {
                    __builtin_prefetch(next_k + line * 64);
                    __builtin_prefetch(next_v + line * 64);
                }
            const int64_t head = (r % pool->H) / pool->heads_per_kv;
            scores_of_row(qs + r * D, keys + head * D, n, stride, D, p);
            const float rescale = softmax_block(p, n, mx + r, sm + r);
            float* acc_r = acc + r * D;
            if (rescale != 1.0f)
                for (int64_t d = 0; d < D; d++) acc_r[d] *= rescale;
            accumulate_row(acc_r, p, values + head * D, n, stride, D);
        }
        pos += n;
    }
}

void KV_FN(paged_decode_attention)(const float* q, const KV_T* cache, float* out, int64_t num_blocks, int64_t bs,
                            int64_t num_kv_heads, int64_t heads_per_kv, int64_t D, const int64_t* tables,
                            int64_t width, const int64_t* ctx, const int64_t* rows, const int64_t* group_starts,
                            const int64_t* group_shared, int64_t num_groups, int64_t max_members, float scale,
                            int num_threads) {
    const int64_t H = num_kv_heads * heads_per_kv;
    const KV_FN(Pool) pool = {cache, cache + num_blocks * bs * num_kv_heads * D, bs, num_kv_heads * D, D, H, heads_per_kv};
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t max_rows = max_members * H;
        float* qs = malloc(sizeof(float) * max_rows * D);  /* the group's queries, times scale */
        float* acc = malloc(sizeof(float) * max_rows * D); /* unnormalised outputs */
        float* mx = malloc(sizeof(float) * max_rows);
        float* sm = malloc(sizeof(float) * max_rows);
        float* p = malloc(sizeof(float) * bs); /* one row's scores, then weights, over one block */
        float* k_scratch = malloc(sizeof(float) * bs * num_kv_heads * D); /* a block's K / V widened (KV_BLOCK) */
        float* v_scratch = malloc(sizeof(float) * bs * num_kv_heads * D);
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; g++) {
            const int64_t first = group_starts[g], members = group_starts[g + 1] - first;
            for (int64_t m = 0; m < members; m++) {
                const float* src = q + rows[first + m] * H * D;
                for (int64_t j = 0; j < H * D; j++) qs[m * H * D + j] = src[j] * scale;
            }
            memset(acc, 0, sizeof(float) * members * H * D);
            for (int64_t r = 0; r < members * H; r++) {
                mx[r] = -FLT_MAX;
                sm[r] = 0.0f;
            }
            const int64_t shared = group_shared[g] * bs; /* tokens */
            if (shared > 0) KV_FN(attend)(&pool, tables + first * width, 0, shared, qs, members * H, acc, mx, sm, p, k_scratch, v_scratch);
            for (int64_t m = 0; m < members; m++) {
                const int64_t s = first + m, r0 = m * H;
                KV_FN(attend)(&pool, tables + s * width, shared, ctx[s], qs + r0 * D, H, acc + r0 * D, mx + r0, sm + r0, p, k_scratch, v_scratch);
                float* dst = out + rows[s] * H * D;
                for (int64_t h = 0; h < H; h++) {
                    const float inv = 1.0f / sm[r0 + h];
                    for (int64_t d = 0; d < D; d++) dst[h * D + d] = acc[(r0 + h) * D + d] * inv;
                }
            }
        }
        free(qs);
        free(acc);
        free(mx);
        free(sm);
        free(p);
        free(k_scratch);
        free(v_scratch);
    }
}
