/* The whole decoder for a decode step of a few sequences in one native call (batch-1 serving, small batches).
 *
 * Why: with one to a few rows a decode step is bound by the weights' bytes (SmolLM2-135M: ~30 ms a token in fp32
 * on a 2-core AVX2 machine), and the PyTorch module path adds ~14 ms of Python on top: ~210 linear layers and
 * ~150 fused ops a token, each a module call, a dispatch through the engine's TorchFunctionMode, a few checks and
 * a fresh tensor. Here the same kernels run back to back from C over preallocated scratch.
 *
 * It computes what the engine's module path computes with the native kernels on, op for op and in the same
 * order, by calling the very same functions (f32_linear, int8_linear, q8_linear, rms_norm, add_rms_norm, rotary,
 * silu_mul, paged_write_kv, paged_decode_attention; q8_0 and bf16 layers over one input through the multi-output
 * forms of their kernels, linear_outputs.h, which compute each output as the one-layer call does): the hidden
 * states are bit for bit the module path's (tested).
 *
 * Per layer, x (M, d) the residual stream, updated in place:
 *     h = rms_norm(x)                                      input_layernorm
 *     q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)     (M, H*D), (M, Hkv*D), (M, Hkv*D)
 *     q, k = rms_norm per head (Qwen3's q_norm / k_norm, when given)
 *     q, k = rotary(q), rotary(k)                          cos, sin (M, D)
 *     cache[slot] = k, v; a = attention(q, cache)          the paged pool, the step's decode plan
 *     x, h = x + a Wo^T, rms_norm(x + a Wo^T)              post_attention_layernorm
 *     x = x + (silu(h Wg^T) * h Wu^T) Wd^T
 * then out = rms_norm(x) with the final norm.
 *
 * A linear layer is fp32 (group 0), weight-only int8 (codes with `group` codes per scale, >= K: one per row),
 * q8_0 (int8 codes and activations by 32: q8_linear.c) or bf16 (group BF16_WEIGHT: the engine's bf16 copy of an
 * fp32 weight packed by bf16_pack, bf16_linear.c), with an fp32 bias or none; an int8 layer's bias is added after its product, as
 * QuantizedLinear does.
 *
 * The engine's bf16 compute (kv_bf16): the K/V pool is bf16, so k and v are rounded to bf16 (round to nearest
 * even, as the module path's cast) before they are written, and the attention reads the bf16 pool. The linear
 * layers are bf16_linear.c, as on the module path with the native kernels.
 */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear_outputs.h"

#define BF16_WEIGHT (-1) /* DecodeLinear.group of a bf16 weight */
/* The row-wise ops (norms, rotary, SwiGLU, K/V writes) over fewer floats than this run on the calling thread: at a
 * few rows their work (~1 us a thousand floats) is less than a fork and join of the team, which they would pay six
 * times a layer (180 times a token for SmolLM2 at batch 1). Each row's result does not depend on the thread that
 * computes it, so this changes nothing in the output. The linear layers and the attention keep every thread. */
#define SERIAL_FLOATS 8192

static inline int row_threads(int64_t floats, int threads) { return floats <= SERIAL_FLOATS ? 1 : threads; }

/* The kernels this step chains (the other sources of the library). */
void f32_linear(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                int threads);
void bf16_linear(const float* x, const uint16_t* w, const float* b, float* y, int64_t M, int64_t N, int64_t K,
                 uint16_t* x16, int threads);
void round_to_bf16(const float* x, uint16_t* out, int64_t n);
void int8_linear(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t group, int threads);
void q8_linear(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N, int64_t K,
               int threads);
void rms_norm(const float* x, const float* weight, float* out, int64_t rows, int64_t d, float eps, int threads);
void add_rms_norm(const float* x, const float* delta, const float* weight, float* sum, float* out, int64_t rows,
                  int64_t d, float eps, int threads);
void rotary(const float* x, const float* cos, const float* sin, float* out, int64_t n, int64_t heads, int64_t d,
            int threads);
void silu_mul(const float* gate, const float* up, float* out, int64_t n, int threads);
void paged_write_kv(char* cache, const char* k, const char* v, const int64_t* slots, int64_t n, int64_t num_slots,
                    int64_t row_bytes, int threads);
void paged_decode_attention(const float* q, const float* cache, float* out, int64_t num_blocks, int64_t bs,
                            int64_t hkv, int64_t group, int64_t d, const int64_t* tables, int64_t width,
                            const int64_t* ctx, const int64_t* rows, const int64_t* group_starts,
                            const int64_t* group_shared, int64_t num_groups, int64_t max_members, float scale,
                            int threads);
void paged_decode_attention_bf16(const float* q, const uint16_t* cache, float* out, int64_t num_blocks, int64_t bs,
                                 int64_t hkv, int64_t group, int64_t d, const int64_t* tables, int64_t width,
                                 const int64_t* ctx, const int64_t* rows, const int64_t* group_starts,
                                 const int64_t* group_shared, int64_t num_groups, int64_t max_members, float scale,
                                 int threads);

typedef struct {
    const void* weight;  /* fp32 (N, K), int8 codes (N, K) or bf16 packed by bf16_pack */
    const float* scales; /* int8: (N, ceil(K / group)) fp32; NULL for fp32 */
    const float* bias;   /* (N,) fp32 or NULL */
    int64_t out_features, in_features;
    int64_t group;          /* 0: fp32 weight; BF16_WEIGHT: bf16; else int8 codes per scale along a row */
    int64_t quantize_input; /* int8: 1 for q8_linear (activations rounded to int8 by 32), 0 for int8_linear */
} DecodeLinear;

typedef struct {
    const float* input_norm;          /* (d,) */
    const float* post_attention_norm; /* (d,) */
    const float* q_norm;              /* (D,) or NULL */
    const float* k_norm;              /* (D,) or NULL */
    DecodeLinear q, k, v, o, gate, up, down;
    void* kv_cache; /* (2, num_blocks, block_size, Hkv, D) fp32, or bf16 with DecodeStep.kv_bf16 */
} DecodeLayer;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale; /* the norms' epsilon; the attention's 1 / sqrt(D) */
    int64_t num_blocks, block_size;
    const float* cos; /* (rows, D) */
    const float* sin;
    const int64_t* slots; /* (rows,) flat K/V slot of each row's new token */
    /* the decode plan (posttrain/models/paged_plan.py NativeDecodePlan): S = rows sequences */
    const int64_t* tables; /* (S, width) */
    int64_t width;
    const int64_t* context_lens; /* (S,) */
    const int64_t* seq_rows;     /* (S,) */
    const int64_t* group_starts; /* (G + 1,) */
    const int64_t* group_shared; /* (G,) */
    int64_t num_groups, max_members;
    int64_t kv_bf16; /* 1: the pools are bf16 (the engine's bf16 compute) */
} DecodeStep;

static void add_bias(const DecodeLinear* l, float* y, int64_t M) {
    if (l->bias == NULL) return;
    const int64_t N = l->out_features;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * N + n] += l->bias[n];
}

/* y (M, N) = x (M, K) through one linear layer; x16 (M, K) scratch for a bf16 layer's rounded inputs. */
static void linear(const DecodeLinear* l, const float* x, float* y, int64_t M, uint16_t* x16, int threads) {
    const int64_t N = l->out_features, K = l->in_features;
    if (l->group == 0) {
        f32_linear(x, (const float*)l->weight, l->bias, y, M, N, K, threads);
        return;
    }
    if (l->group == BF16_WEIGHT) {
        bf16_linear(x, (const uint16_t*)l->weight, l->bias, y, M, N, K, x16, threads);
        return;
    }
    if (l->quantize_input)
        q8_linear(x, (const int8_t*)l->weight, l->scales, y, M, N, K, threads);
    else
        int8_linear(x, (const int8_t*)l->weight, l->scales, y, M, N, K, l->group, threads);
    add_bias(l, y, M); /* after the product, as QuantizedLinear adds it */
}

/* ys[j] = x through ls[j] for `count` (<= 3) layers over the same input (q, k, v; gate, up). Where all are q8_0, or
 * all bf16, the input is rounded once and all their rows run under one fork (linear_outputs.h): at batch 1 a
 * separate call for k and for v (110 KB of q8_0 codes each) costs about as much in rounding and forking as in
 * streaming, and a layer of a few 64-output blocks leaves one of two threads idle for a block. */
static void linears(const DecodeLinear* const* ls, float* const* ys, int count, const float* x, int64_t M,
                    uint16_t* x16, int threads) {
    int q8 = 1, bf16 = 1;
    for (int j = 0; j < count; j++) {
        q8 &= ls[j]->group > 0 && ls[j]->quantize_input;
        bf16 &= ls[j]->group == BF16_WEIGHT;
    }
    const int64_t K = ls[0]->in_features;
    if (q8) {
        Q8Output outs[3];
        for (int j = 0; j < count; j++)
            outs[j] = (Q8Output){(const int8_t*)ls[j]->weight, ls[j]->scales, ys[j], ls[j]->out_features};
        q8_linear_many(x, outs, count, M, K, threads);
        for (int j = 0; j < count; j++) add_bias(ls[j], ys[j], M);
    } else if (bf16) {
        Bf16Output outs[3];
        for (int j = 0; j < count; j++)
            outs[j] = (Bf16Output){(const uint16_t*)ls[j]->weight, ls[j]->bias, ys[j], ls[j]->out_features};
        bf16_linear_many(x, outs, count, M, K, x16, threads);
    } else {
        for (int j = 0; j < count; j++) linear(ls[j], x, ys[j], M, x16, threads);
    }
}

/* x (M, d): the step's embeddings in, the residual stream after the last layer out; out (M, d): the final
 * norm's output (the hidden states the LM head projects). scratch: M * (2 d + 3 H*D + 4 Hkv*D + 3 I + W) floats
 * with W = max(d, H*D, I), carved below (posttrain/engine/native_decode.py allocates it). */
void decode_layers(const DecodeLayer* layers, int64_t num_layers, const DecodeStep* s, float* x, float* out,
                   const float* final_norm, float* scratch, int threads) {
    const int64_t M = s->rows, d = s->hidden, D = s->head_dim, H = s->heads, Hkv = s->kv_heads;
    const int64_t q_size = H * D, kv_size = Hkv * D, I = s->intermediate;
    float* h = scratch;                  /* (M, d) the normed input of the attention, then of the MLP */
    float* q = h + M * d;                /* (M, H*D) two buffers for the queries: each op writes the other */
    float* q_other = q + M * q_size;
    float* k = q_other + M * q_size;     /* (M, Hkv*D) two for the keys */
    float* k_other = k + M * kv_size;
    float* v = k_other + M * kv_size;    /* (M, Hkv*D) */
    float* attended = v + M * kv_size;   /* (M, H*D) */
    float* gate = attended + M * q_size; /* (M, I) */
    float* up = gate + M * I;
    float* act = up + M * I;
    float* delta = act + M * I; /* (M, d) the output projection, then the MLP's */
    uint16_t* kv16 = (uint16_t*)(delta + M * d);         /* (2, M, Hkv*D) bf16: k and v for a bf16 pool */
    uint16_t* x16 = (uint16_t*)(delta + M * d + M * kv_size); /* (M, <= W) bf16: a bf16 layer's inputs */
    const int64_t num_slots = s->num_blocks * s->block_size;
    for (int64_t i = 0; i < num_layers; i++) {
        const DecodeLayer* L = layers + i;
        float *qa = q, *qb = q_other, *ka = k, *kb = k_other, *swap;
        rms_norm(x, L->input_norm, h, M, d, s->eps, row_threads(M * d, threads));
        linears((const DecodeLinear* const[]){&L->q, &L->k, &L->v}, (float* const[]){qa, ka, v}, 3, h, M, x16, threads);
        if (L->q_norm != NULL) { /* Qwen3: each head of q and k normed before the rotary embedding */
            rms_norm(qa, L->q_norm, qb, M * H, D, s->eps, row_threads(M * q_size, threads));
            rms_norm(ka, L->k_norm, kb, M * Hkv, D, s->eps, row_threads(M * kv_size, threads));
            swap = qa, qa = qb, qb = swap;
            swap = ka, ka = kb, kb = swap;
        }
        rotary(qa, s->cos, s->sin, qb, M, H, D, row_threads(M * q_size, threads));
        rotary(ka, s->cos, s->sin, kb, M, Hkv, D, row_threads(M * kv_size, threads));
        if (s->kv_bf16) {
            round_to_bf16(kb, kv16, M * kv_size);
            round_to_bf16(v, kv16 + M * kv_size, M * kv_size);
            paged_write_kv((char*)L->kv_cache, (const char*)kv16, (const char*)(kv16 + M * kv_size), s->slots, M,
                           num_slots, kv_size * (int64_t)sizeof(uint16_t), row_threads(M * kv_size, threads));
            paged_decode_attention_bf16(qb, (const uint16_t*)L->kv_cache, attended, s->num_blocks, s->block_size, Hkv,
                                        H / Hkv, D, s->tables, s->width, s->context_lens, s->seq_rows,
                                        s->group_starts, s->group_shared, s->num_groups, s->max_members, s->scale,
                                        threads);
        } else {
            paged_write_kv((char*)L->kv_cache, (const char*)kb, (const char*)v, s->slots, M, num_slots,
                           kv_size * (int64_t)sizeof(float), row_threads(M * kv_size, threads));
            paged_decode_attention(qb, (const float*)L->kv_cache, attended, s->num_blocks, s->block_size, Hkv,
                                   H / Hkv, D, s->tables, s->width, s->context_lens, s->seq_rows, s->group_starts,
                                   s->group_shared, s->num_groups, s->max_members, s->scale, threads);
        }
        linear(&L->o, attended, delta, M, x16, threads);
        add_rms_norm(x, delta, L->post_attention_norm, x, h, M, d, s->eps, row_threads(M * d, threads));
        linears((const DecodeLinear* const[]){&L->gate, &L->up}, (float* const[]){gate, up}, 2, h, M, x16, threads);
        silu_mul(gate, up, act, M * I, row_threads(M * I, threads));
        linear(&L->down, act, delta, M, x16, threads);
        for (int64_t j = 0; j < M * d; j++) x[j] += delta[j];
    }
    rms_norm(x, final_norm, out, M, d, s->eps, row_threads(M * d, threads));
}

void sample_rows(const float* z, int64_t rows, int64_t V, int64_t block, const double* uniforms, int64_t* tokens,
                 float* logprobs, int threads);

/* `steps` decode steps of the same M sequences in one call (the engine's chained decode steps,
 * posttrain/engine/chained_steps.py): each step is decode_layers, then the LM head, then each row's draw, whose
 * token's embedding row is the next step's input. Per step j (0-based):
 *     hidden = decode_layers(x)                     with cos/sin rows j * M .., slots j * M .., context_lens + j
 *     logits[j] (M, V) = hidden head^T               the head as `linear` runs any layer (fp32, q8_0, int8, bf16)
 *     tokens[j, m] = argmax_v logits[j, m, v]        every temperature 0: the first of equal maxima, as torch's
 *                                                    max(dim=-1).indices
 *                  = draw(logits[j, m] / T, u[j, m]) none 0: sampler.c's draw (its logprob into logprobs[j, m])
 *     x[m] = embedding[tokens[j, m]]                 (V, d) fp32 rows, as nn.Embedding copies them
 * and it stops after the step where any row's token is one of `halt` (an EOS or stop token of some row, which ends
 * that row: the engine drops what would follow it). Each step computes what a plain one-step call followed by the
 * module path's LM head and the sampler's draw would: the same functions on the same inputs (the temperature an
 * IEEE division, as torch's), so the tokens and logits are bit for bit the single steps'.
 *
 * s: the first step's DecodeStep, its context_lens pointing at `context_lens` (S = M,), which this call moves up
 * by one per step; cos, sin (steps, M, D); slots (steps, M); x (M, d) the first step's embeddings; hidden (M, d)
 * scratch; logits (steps, M, V); tokens (steps, M); logprobs (steps, M); temperatures (M,), all 0 or none (the
 * engine never chains greedy and sampled rows together); uniforms (steps, M) fp64 in [0, 1); sum_block: the
 * sampler's block of summed weights. Returns the steps run (1 .. steps). */
int64_t decode_chained_steps(const DecodeLayer* layers, int64_t num_layers, DecodeStep* s, int64_t* context_lens,
                             const DecodeLinear* head, const float* embedding, const float* final_norm, float* x,
                             float* hidden, float* logits, int64_t* tokens, float* logprobs, const float* temperatures,
                             const double* uniforms, int64_t sum_block, const int64_t* halt, int64_t num_halt,
                             int64_t steps, float* scratch, int threads) {
    const int64_t M = s->rows, d = s->hidden, D = s->head_dim, V = head->out_features;
    const float *cos = s->cos, *sin = s->sin;
    const int64_t* slots = s->slots;
    uint16_t* x16 = malloc(sizeof(uint16_t) * (size_t)(M * (d + 1))); /* a bf16 head's rounded input */
    float* scaled = malloc(sizeof(float) * (size_t)(M * V));           /* the sampled rows' logits / temperature */
    int sampled = 0;
    for (int64_t m = 0; m < M; m++) sampled |= temperatures[m] != 0.0f;
    int64_t j = 0;
    int halted = 0;
    while (j < steps && !halted) {
        s->cos = cos + j * M * D;
        s->sin = sin + j * M * D;
        s->slots = slots + j * M; /* (s->context_lens is `context_lens`, moved up below) */
        decode_layers(layers, num_layers, s, x, hidden, final_norm, scratch, threads);
        float* row_logits = logits + j * M * V;
        linear(head, hidden, row_logits, M, x16, threads);
        int64_t* drawn = tokens + j * M;
        if (sampled) { /* every row samples (the engine chains greedy or sampled rows, never both) */
            for (int64_t m = 0; m < M; m++)
                for (int64_t v = 0; v < V; v++) scaled[m * V + v] = row_logits[m * V + v] / temperatures[m];
            sample_rows(scaled, M, V, sum_block, uniforms + j * M, drawn, logprobs + j * M, threads);
        } else { /* every row's argmax */
            for (int64_t m = 0; m < M; m++) {
                const float* z = row_logits + m * V;
                drawn[m] = 0;
                for (int64_t v = 1; v < V; v++)
                    if (z[v] > z[drawn[m]]) drawn[m] = v;
            }
        }
        for (int64_t m = 0; m < M; m++) {
            const int64_t token = drawn[m];
            for (int64_t h = 0; h < num_halt; h++) halted |= token == halt[h];
            memcpy(x + m * d, embedding + token * d, sizeof(float) * (size_t)d);
            context_lens[m] += 1;
        }
        j++;
    }
    s->cos = cos, s->sin = sin, s->slots = slots;
    free(x16);
    free(scaled);
    return j;
}
