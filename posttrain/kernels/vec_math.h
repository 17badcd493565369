/* What the kernels share: an 8-float vector type built on GCC vector extensions, and a branch-free exp.
 * Both are written so that GCC vectorizes the loops that use them without -ffast-math. */
#ifndef POSTTRAIN_VEC_MATH_H
#define POSTTRAIN_VEC_MATH_H

#include <stdint.h>
#include <string.h>

typedef float vec __attribute__((vector_size(32))); /* 8 floats: one AVX register where there is one */
#define LANES 8 /* head_dim must be a multiple of it (checked by the caller) */

static inline vec load(const float* p) {
    vec v;
    memcpy(&v, p, sizeof(v)); /* an unaligned load */
    return v;
}

/* LANES bf16 values (the top 16 bits of fp32s, as uint16) at p, widened to fp32 exactly. */
static inline vec load_bf16(const uint16_t* p) {
    typedef uint16_t half_lanes __attribute__((vector_size(LANES * 2)));
    typedef uint32_t word_lanes __attribute__((vector_size(LANES * 4)));
    half_lanes h;
    memcpy(&h, p, sizeof(h));
    word_lanes w = __builtin_convertvector(h, word_lanes) << 16;
    vec v;
    memcpy(&v, &w, sizeof(v));
    return v;
}

static inline void store(float* p, vec v) { memcpy(p, &v, sizeof(v)); }

static inline vec splat(float x) {
    vec v = {0};
    return v + x;
}

static inline float lane_sum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* The lane sums of eight vectors at once: lane i of the result is the sum of a[i]'s lanes. Each round adds
 * two shuffles of a pair (the low halves side by side plus the high halves side by side), halving the
 * partial sums per vector: 7 adds and 14 shuffles in all, where eight lane_sum calls take 56 dependent
 * scalar adds (a quarter of the decode attention's instructions, at D = 64). */
static inline vec lane_sums(const vec a[LANES]) {
    vec t[4], u[2];
    for (int i = 0; i < 4; i++) /* t[i]: 4 partials of a[2i], then 4 of a[2i+1] */
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* u[i]: 2 partials each of a[4i], a[4i+1], a[4i+2], a[4i+3] */
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(u[0], u[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* 16 floats: one AVX-512 register. Only code built for AVX-512 uses it (WIDE_VEC below): on AVX2 GCC would split
 * each operation in two and spell the shuffles out lane by lane. */
#ifdef __AVX512F__
#define WIDE_VEC 1
#endif
typedef float vec16 __attribute__((vector_size(64)));
#define LANES16 16

static inline vec16 load16(const float* p) {
    vec16 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store16(float* p, vec16 v) { memcpy(p, &v, sizeof(v)); }

static inline vec16 splat16(float x) {
    vec16 v = {0};
    return v + x;
}

static inline float lane_sum16(vec16 v) {
    float s = 0.0f;
    for (int i = 0; i < LANES16; i++) s += v[i];
    return s;
}

/* lane_sums for sixteen vec16s: lane i of the result is the sum of a[i]'s lanes; each round halves the partial
 * sums per vector by adding two shuffles of a pair (15 adds and 30 shuffles for the sixteen sums). */
static inline vec16 lane_sums16(const vec16 a[LANES16]) {
    vec16 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* t[i]: 8 partials of a[2i], then 8 of a[2i+1] */
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* u[i]: 4 partials each of a[4i] .. a[4i+3] */
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* v[i]: 2 partials each of a[8i] .. a[8i+7] */
        v[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* exp(x) to about 2 ulp, for x in [-87, 88] (clamped there: exp(-87) = 1.6e-38 is nothing against the
 * sums it joins, and exp(88) = 1.7e38 still fits a float). exp(x) = 2^n * exp(f) with n = round(x / ln 2),
 * |f| <= ln(2) / 2, exp(f) from its degree-7 Taylor-like minimax polynomial (Cephes' coefficients). No
 * branches or calls, so that the loops over it vectorize. */
static inline float clamped_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest via 1.5 * 2^23 */
    float f = x - n * 0.693359375f + n * 2.12194440e-4f;              /* x - n ln 2, ln 2 split in two */
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    float y = p * f * f + f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n as a float's exponent field */
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return y * scale;
}

#endif
