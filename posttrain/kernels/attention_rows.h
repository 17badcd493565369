/* One query row against a block of fp32 keys / values (paged_decode.c's decode attention), written once for any
 * vector width. The includer defines ROW_SUFFIX (the functions' name suffix), ROW_VEC (the vector type), ROW_LANES
 * (its floats), ROW_LOAD / ROW_STORE / ROW_SPLAT, ROW_LANE_SUM (one vector's lanes summed) and ROW_LANE_SUMS
 * (ROW_LANES vectors' lane sums as one vector); this header undefines them. D is a multiple of ROW_LANES. */

#define ROW_CAT_(name, suffix) name##suffix
#define ROW_CAT(name, suffix) ROW_CAT_(name, suffix)
#define ROW_ACC_VECS (64 / ROW_LANES) /* the accumulator's registers: 64 dims at a time */

/* out[t] = q . k_t for the n keys at k + t * stride: ROW_LANES keys at a time (independent FMA chains), their
 * dot products summed across lanes together. */
static void ROW_CAT(scores_of_row, ROW_SUFFIX)(const float* q, const float* k, int64_t n, int64_t stride, int64_t D,
                                               float* out) {
    int64_t t = 0;
    for (; t + ROW_LANES <= n; t += ROW_LANES) {
        const float* kt = k + t * stride;
        ROW_VEC a[ROW_LANES] = {{0}};
        for (int64_t d = 0; d < D; d += ROW_LANES) {
            ROW_VEC qd = ROW_LOAD(q + d);
            for (int i = 0; i < ROW_LANES; i++) a[i] += qd * ROW_LOAD(kt + i * stride + d);
        }
        ROW_STORE(out + t, ROW_LANE_SUMS(a));
    }
    for (; t < n; t++) {
        ROW_VEC a = {0};
        for (int64_t d = 0; d < D; d += ROW_LANES) a += ROW_LOAD(q + d) * ROW_LOAD(k + t * stride + d);
        out[t] = ROW_LANE_SUM(a);
    }
}

/* acc (D,) += sum_t p[t] * v_t over the n values at v + t * stride; 64 dims at a time stay in registers. */
static void ROW_CAT(accumulate_row, ROW_SUFFIX)(float* acc, const float* p, const float* v, int64_t n, int64_t stride,
                                                int64_t D) {
    int64_t d0 = 0;
    for (; d0 + ROW_ACC_VECS * ROW_LANES <= D; d0 += ROW_ACC_VECS * ROW_LANES) {
        ROW_VEC a[ROW_ACC_VECS];
        for (int i = 0; i < ROW_ACC_VECS; i++) a[i] = ROW_LOAD(acc + d0 + i * ROW_LANES);
        for (int64_t t = 0; t < n; t++) {
            const float* vt = v + t * stride + d0;
            ROW_VEC pt = ROW_SPLAT(p[t]);
            for (int i = 0; i < ROW_ACC_VECS; i++) a[i] += pt * ROW_LOAD(vt + i * ROW_LANES);
        }
        for (int i = 0; i < ROW_ACC_VECS; i++) ROW_STORE(acc + d0 + i * ROW_LANES, a[i]);
    }
    for (; d0 < D; d0 += ROW_LANES) {
        ROW_VEC a = ROW_LOAD(acc + d0);
        for (int64_t t = 0; t < n; t++) a += ROW_SPLAT(p[t]) * ROW_LOAD(v + t * stride + d0);
        ROW_STORE(acc + d0, a);
    }
}

#undef ROW_CAT_
#undef ROW_CAT
#undef ROW_ACC_VECS
#undef ROW_SUFFIX
#undef ROW_VEC
#undef ROW_LANES
#undef ROW_LOAD
#undef ROW_STORE
#undef ROW_SPLAT
#undef ROW_LANE_SUM
#undef ROW_LANE_SUMS
