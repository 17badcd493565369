/* Several linear layers over the same input in one call (a decoder layer's q, k and v; its gate and up): the input
 * prepared once (rounded to int8 groups or to bf16) and all the layers' rows under one fork, each output computed
 * as the one-layer call computes it. What each output is, for q8_linear_many (q8_linear.c) and bf16_linear_many
 * (bf16_linear.c); decode_step.c calls both. */
#ifndef POSTTRAIN_LINEAR_OUTPUTS_H
#define POSTTRAIN_LINEAR_OUTPUTS_H

#include <omp.h>
#include <stdint.h>

typedef struct {
    const int8_t* codes; /* (N, K) int8 */
    const float* scales; /* (N, K / 32) fp32 */
    float* y;            /* (M, N) */
    int64_t N;
} Q8Output;

typedef struct {
    const uint16_t* packed; /* bf16_pack(W (N, K)) */
    const float* bias;      /* (N,) fp32 or NULL */
    float* y;               /* (M, N) */
    int64_t N;
} Bf16Output;

/* Inside a parallel region: the calling thread's share of the work of `count` outputs, output j in units[j] units,
 * as one equal contiguous run of all the units in order, output after output (to within one unit): run(ctx, j, u)
 * for each of its units u of output j. */
static inline void run_thread_share(const int64_t* units, int64_t count, void (*run)(const void*, int64_t, int64_t),
                                    const void* ctx) {
    int64_t total = 0;
    for (int64_t j = 0; j < count; j++) total += units[j];
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t lo = total * me / team, hi = total * (me + 1) / team;
    int64_t first = 0; /* the first unit of output j, counted over all outputs */
    for (int64_t j = 0; j < count && first < hi; j++) {
        for (int64_t u = (lo > first ? lo - first : 0); u < units[j] && first + u < hi; u++) run(ctx, j, u);
        first += units[j];
    }
}

/* The same units handed out as the threads come for them: guided, so the first runs are large (about half the
 * remaining units each) and the last ones GUIDED_MIN units, and a thread that a moment's stall on this VM (the other
 * vCPU's neighbour, a page fault) slowed hands its tail to the one waiting at the join. Used where a unit is one
 * weight row or block of the q8_0 kernel: at batch 1 a layer's whole product is ~0.1 ms, so a 10 us stall was a tenth
 * of it on one side (perf: the calling thread waited at joins ~1.8 ms of a ~11 ms token). Which thread computes a
 * unit never changes what it computes. */
#define GUIDED_MIN 16
static inline void run_guided_share(const int64_t* units, int64_t count, void (*run)(const void*, int64_t, int64_t),
                                    const void* ctx) {
    int64_t total = 0;
    for (int64_t j = 0; j < count; j++) total += units[j];
#pragma omp for schedule(guided, GUIDED_MIN) nowait
    for (int64_t t = 0; t < total; t++) {
        int64_t j = 0, u = t; /* unit t over all outputs -> unit u of output j */
        while (u >= units[j]) u -= units[j++];
        run(ctx, j, u);
    }
}

void q8_linear_many(const float* x, const Q8Output* outs, int64_t count, int64_t M, int64_t K, int threads);
/* x16: scratch for M * 2 * ceil(K / 2) bf16s */
void bf16_linear_many(const float* x, const Bf16Output* outs, int64_t count, int64_t M, int64_t K, uint16_t* x16,
                      int threads);

#endif
