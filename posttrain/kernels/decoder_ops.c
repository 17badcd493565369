/* The decoder layer's elementwise work on the engine's CPU forward, one pass each: RMSNorm (alone and
 * after the residual add), the rotary embedding, and SwiGLU's silu(gate) * up.
 *
 * Why: in PyTorch each of these is several ops (RMSNorm: pow, mean, add, rsqrt, mul, mul; RoPE: neg, cat,
 * mul, mul, add), each one a pass over the rows and a fresh tensor. At 512 decoding rows that is ~10% of
 * a rollout step; here each is one pass. The arithmetic is PyTorch's, in the same order, except that
 * sums run in another order and a*b + c*d may become one FMA: results agree to float rounding.
 *
 * All tensors are fp32 and contiguous (posttrain/kernels/fused.py checks before calling).
 * Rows are independent; OpenMP splits them over `threads` (torch's intra-op threads).
 */

#include <math.h>
#include <stdint.h>

#include "vec_math.h"

/* 1 / sqrt(mean(x^2) + eps) over one row of d floats. */
static inline float inverse_rms(const float* x, int64_t d, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < d; j++) sum += x[j] * x[j];
    return 1.0f / sqrtf(sum / (float)d + eps);
}

/* out = weight * (x / rms(x)); x, out (rows, d), weight (d,). */
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float* xi = x + i * d;
        float* oi = out + i * d;
        const float r = inverse_rms(xi, d, eps);
        for (int64_t j = 0; j < d; j++) oi[j] = weight[j] * (xi[j] * r);
    }
}

/* The residual add and the next norm: sum = x + delta, out = weight * (sum / rms(sum)); all (rows, d). */
void add_rms_norm(const float* x, const float* delta, const float* weight, float* sum, float* out, int64_t rows,
                  int64_t d, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        float* si = sum + i * d;
        float* oi = out + i * d;
        for (int64_t j = 0; j < d; j++) si[j] = x[i * d + j] + delta[i * d + j];
        const float r = inverse_rms(si, d, eps);
        for (int64_t j = 0; j < d; j++) oi[j] = weight[j] * (si[j] * r);
    }
}

/* HF Llama's rotate-half RoPE: x, out (n, heads, d); cos, sin (n, d), one row per token for all its heads.
 * out[:half] = x[:half] * cos[:half] - x[half:] * sin[:half], out[half:] = x[half:] * cos[half:] +
 * x[:half] * sin[half:]. */
void rotary(const float* x, const float* cos, const float* sin, float* out, int64_t n, int64_t heads, int64_t d,
            int threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const float* c = cos + i * d;
        const float* s = sin + i * d;
        for (int64_t h = 0; h < heads; h++) {
            const float* xh = x + (i * heads + h) * d;
            float* oh = out + (i * heads + h) * d;
            for (int64_t j = 0; j < half; j++) {
                oh[j] = xh[j] * c[j] - xh[j + half] * s[j];
                oh[j + half] = xh[j + half] * c[j + half] + xh[j] * s[j + half];
            }
        }
    }
}

/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up over n floats. Past |gate| = 87 the exp is
 * clamped: silu is then gate itself above, and gate * 6e-39 below (PyTorch's gate * exp(gate) is
 * smaller still; both are nothing against the other terms of the down projection). */
void silu_mul(const float* gate, const float* up, float* out, int64_t n, int threads) {
    const int64_t chunk = 4096;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t start = 0; start < n; start += chunk) {
        const int64_t end = start + chunk < n ? start + chunk : n;
#pragma omp simd
        for (int64_t j = start; j < end; j++) out[j] = gate[j] / (1.0f + clamped_exp(-gate[j])) * up[j];
    }
}
