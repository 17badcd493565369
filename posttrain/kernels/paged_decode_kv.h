/* The decode attention of paged_decode.c over a pool of K/V elements of type KV_T, included once per pool dtype.
 * The includer defines KV_T (the pool's element type), KV_LOAD(p) (LANES elements at p as a vec of floats) and
 * KV_FN(name) (the name of this instance's function `name`). Queries, scores, softmax and outputs are fp32
 * whatever KV_T is: only the K/V reads convert. */

/* out[t] = q . k_t for the n keys at k + t * stride: LANES keys at a time (independent FMA chains), their
 * dot products summed across lanes together. */
static void KV_FN(scores_of_row)(const float* q, const KV_T* k, int64_t n, int64_t stride, int64_t D, float* out) {
    int64_t t = 0;
    for (; t + LANES <= n; t += LANES) {
        const KV_T* kt = k + t * stride;
        vec a[LANES] = {{0}};
        for (int64_t d = 0; d < D; d += LANES) {
            vec qd = load(q + d);
            for (int i = 0; i < LANES; i++) a[i] += qd * KV_LOAD(kt + i * stride + d);
        }
        store(out + t, lane_sums(a));
    }
    for (; t < n; t++) {
        vec a = {0};
        for (int64_t d = 0; d < D; d += LANES) a += load(q + d) * KV_LOAD(k + t * stride + d);
        out[t] = lane_sum(a);
    }
}

/* acc (D,) += sum_t p[t] * v_t over the n values at v + t * stride; 64 dims at a time stay in registers. */
static void KV_FN(accumulate_row)(float* acc, const float* p, const KV_T* v, int64_t n, int64_t stride, int64_t D) {
    int64_t d0 = 0;
    for (; d0 + 8 * LANES <= D; d0 += 8 * LANES) {
        vec a[8];
        for (int i = 0; i < 8; i++) a[i] = load(acc + d0 + i * LANES);
        for (int64_t t = 0; t < n; t++) {
            const KV_T* vt = v + t * stride + d0;
            vec pt = splat(p[t]);
            for (int i = 0; i < 8; i++) a[i] += pt * KV_LOAD(vt + i * LANES);
        }
        for (int i = 0; i < 8; i++) store(acc + d0 + i * LANES, a[i]);
    }
    for (; d0 < D; d0 += LANES) {
        vec a = load(acc + d0);
        for (int64_t t = 0; t < n; t++) a += splat(p[t]) * KV_LOAD(v + t * stride + d0);
        store(acc + d0, a);
    }
}

typedef struct {
    const KV_T* keys;   /* cache[0] */
    const KV_T* values; /* cache[1] */
    int64_t bs, stride, D, H, heads_per_kv; /* stride: elements from one token's K/V to the next's (Hkv * D) */
} KV_FN(Pool);

/* Rows r = 0..R-1 (query head r % H, pre-scaled q at qs + r * D) attend the tokens [first, last) of the
 * block table `table`, continuing their running max mx, sum sm and accumulator acc (R, D). */
static void KV_FN(attend)(const KV_FN(Pool)* pool, const int64_t* table, int64_t first, int64_t last, const float* qs, int64_t R,
                   float* acc, float* mx, float* sm, float* p) {
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
        for (int64_t r = 0; r < R; r++) {
            if (next_k != NULL)
                for (int64_t line = r * lines / R; line < (r + 1) * lines / R; line++) {
                    __builtin_prefetch(next_k + line * 64);
                    __builtin_prefetch(next_v + line * 64);
                }
            const int64_t head = (r % pool->H) / pool->heads_per_kv;
            KV_FN(scores_of_row)(qs + r * D, pool->keys + start + head * D, n, stride, D, p);
            float m = mx[r];
#pragma omp simd reduction(max : m)
            for (int64_t t = 0; t < n; t++) m = p[t] > m ? p[t] : m;
            const float rescale = clamped_exp(mx[r] - m);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t t = 0; t < n; t++) {
                p[t] = clamped_exp(p[t] - m);
                sum += p[t];
            }
            sm[r] = sm[r] * rescale + sum;
            mx[r] = m;
            float* acc_r = acc + r * D;
            if (rescale != 1.0f)
                for (int64_t d = 0; d < D; d++) acc_r[d] *= rescale;
            KV_FN(accumulate_row)(acc_r, p, pool->values + start + head * D, n, stride, D);
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
            if (shared > 0) KV_FN(attend)(&pool, tables + first * width, 0, shared, qs, members * H, acc, mx, sm, p);
            for (int64_t m = 0; m < members; m++) {
                const int64_t s = first + m, r0 = m * H;
                KV_FN(attend)(&pool, tables + s * width, shared, ctx[s], qs + r0 * D, H, acc + r0 * D, mx + r0, sm + r0, p);
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
    }
}
