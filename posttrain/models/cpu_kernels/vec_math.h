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
