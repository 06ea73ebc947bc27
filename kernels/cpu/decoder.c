/* A whole decode step of a Llama-family model's decoder layers in one call, float32 activations, CPU;
 * the projections' weights float32 panels or quantized (8- or 4-bit, kernels/quantized.py PackedWeight).
 *
 * Called once per decode step instead of ~17 torch ops and ctypes calls per layer: between two
 * projections, each of those ops found its Python, dispatcher and tensor bookkeeping evicted from the
 * caches by the weights the projection streamed, and paid for it (docs/decode-speed.md: the small ops
 * of a one-stream step took a fifth of it, though each costs 1-10 us when timed alone).
 *
 * The projections, rotary embedding, KV-cache write and attention are the other libraries' kernels,
 * reached through the function pointers in `Model` (each keeps the compiler flags it is built with);
 * the residual adds, the RMSNorms and SiLU-and-mul between them are layer_math.h's (the standalone
 * kernels' own math). A row's results do not depend on the batch it is in: each is computed from that
 * row alone, in a fixed order.
 * Built and loaded at run time by kernels/cpu/__init__.py; driven by kernels/cpu/decoder.py.
 */
#include "layer_math.h"

typedef void (*LinearFn)(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                         int64_t N, int64_t threads);
/* quantized_matmul.c's float-activation paths (batched 0: one row at a time, 1: register tiles of rows) */
typedef void (*QuantizedFn)(const float *x, const uint8_t *data, const uint16_t *scales, const void *mins,
                            const float *bias, float *out, float *workspace, int64_t M, int64_t N, int64_t Kp,
                            int64_t G, int64_t group, int64_t bits, int64_t ldx, int64_t ldo, int64_t batched,
                            int64_t num_threads, int64_t mins_f32);
/* ... and its int8-activation path (NULL where the CPU has no VNNI) */
typedef void (*QuantizedQ8Fn)(const float *x, const uint8_t *data, const uint16_t *scales, const void *mins,
                              const float *bias, float *out, float *workspace, int64_t M, int64_t N, int64_t Kp,
                              int64_t G, int64_t group, int64_t bits, int64_t ldx, int64_t ldo, int64_t num_threads,
                              int64_t mins_f32);
/* (caches: float32, or float16 with the float16 cache's kernels) */
typedef int (*AttentionFn)(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                           const int64_t *seq_lens, float *out, float *workspace, int64_t batch, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           int64_t max_len, int64_t window, float scale, int64_t num_threads);
typedef void (*RotaryFn)(const int64_t *positions, float *q, float *k, const float *cos_sin, int64_t num_tokens,
                         int64_t num_q_heads, int64_t num_k_heads, int64_t head_dim, int64_t rot, int64_t q_stride,
                         int64_t k_stride, int64_t is_neox);
typedef int64_t (*AttentionWorkspaceFn)(int64_t num_heads, int64_t max_len, int64_t num_threads);
typedef void (*CacheFn)(const float *key, const float *value, void *key_cache, void *value_cache,
                        const int64_t *slot_mapping, int64_t num_tokens, int64_t row, int64_t key_stride,
                        int64_t value_stride);

/* A projection's weight [N, K]: float32 panels (kernels/panels.py), or quantized (kernels/quantized.py
 * PackedWeight, its padded width equal to K: the rows it reads are the scratch buffers' rows). */
typedef struct {
    const void *data;       /* the panels, or the packed integers */
    const uint16_t *scales; /* float16 [N, G]; NULL for panels */
    const void *mins;       /* float16 or (mins_f32) float32 [N, G], or NULL */
    int64_t groups, group, bits, mins_f32;
    /* Which quantized path a batch of M rows takes (quantized_matmul.py `RowPlan`, the layer-by-layer
     * forward's choice; the decoder runs only below its oneDNN tiles): int8 activations where int8 is set,
     * else register tiles from batch_from rows on, else one row at a time. */
    int64_t int8, batch_from;
} Weight;

/* One decoder layer's weights and KV cache. */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL (only Qwen3 has them) */
    Weight qkv;                          /* [(Hq + 2 Hkv) D, hidden] */
    const float *qkv_bias;               /* or NULL */
    Weight o;                            /* [hidden, Hq D] */
    const float *o_bias;                 /* or NULL */
    Weight gate_up, down;                /* [2 I, hidden], [hidden, I] */
    void *key_cache, *value_cache;       /* [blocks, block_size, Hkv, D], float32 or float16 */
} Layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, window, rot, is_neox;
    float eps, scale;
    const float *cos_sin; /* [max_position, rot] */
    LinearFn linear;
    QuantizedFn quantized;
    QuantizedQ8Fn quantized_q8;
    AttentionFn attention;
    AttentionWorkspaceFn attention_workspace;
    RotaryFn rotary;
    CacheFn cache;
} Model;

typedef struct {
    int64_t batch, max_blocks, threads, attention_threads, has_residual;
    const int64_t *positions, *slot_mapping, *block_tables, *seq_lens; /* [batch], [batch, max_blocks] */
    float *hidden;   /* [batch, hidden]: the layers' input, then their output */
    float *residual; /* [batch, hidden]: the residual stream (read only if has_residual) */
    float *scratch;  /* decoder_scratch_floats(...) floats */
    float *quantized_workspace; /* what the quantized projections' paths need for this batch (or NULL) */
} Step;

/* Buffers start on 64-byte boundaries (the attention workspace holds int64 offsets, and vector loads
 * prefer whole cache lines). */
static inline int64_t lines(int64_t floats) { return (floats + 15) & ~(int64_t)15; }

int64_t decoder_scratch_floats(const Model *m, int64_t batch, int64_t max_blocks, int64_t attention_threads) {
    const int64_t q = m->num_heads * m->head_dim, qkv = q + 2 * m->num_kv_heads * m->head_dim;
    return 16 + lines(batch * m->hidden) + lines(batch * qkv) + 2 * lines(batch * q) +
           lines(batch * 2 * m->intermediate) + lines(batch * m->intermediate) +
           m->attention_workspace(m->num_heads, max_blocks * m->block_size, attention_threads);
}

/* y [M, N] = x [M, K] W^T (+ bias), by the weight's kind and, if quantized, the path its plan picks. */
static void project(const Model *m, const Weight *w, const float *x, const float *bias, float *y, int64_t M,
                    int64_t K, int64_t N, int64_t threads, float *workspace) {
    if (w->scales == NULL) {
        m->linear(x, (const float *)w->data, bias, y, M, K, N, threads);
    } else if (w->int8 && m->quantized_q8 != NULL) {
        m->quantized_q8(x, (const uint8_t *)w->data, w->scales, w->mins, bias, y, workspace, M, N, K, w->groups,
                        w->group, w->bits, K, N, threads, w->mins_f32);
    } else {
        m->quantized(x, (const uint8_t *)w->data, w->scales, w->mins, bias, y, workspace, M, N, K, w->groups,
                     w->group, w->bits, K, N, M >= w->batch_from, threads, w->mins_f32);
    }
}

/* Runs `num_layers` layers on a batch of single-token decodes; step->hidden then holds the last
 * layer's output and step->residual the residual stream (the final norm is the caller's). */
void decode_layers_f32(const Model *m, const Layer *layers, int64_t num_layers, const Step *s) {
    const int64_t B = s->batch, H = m->hidden, D = m->head_dim, I = m->intermediate, T = s->threads;
    const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D, qkv_size = q_size + 2 * kv_size;
    float *normed = s->scratch + ((16 - ((uintptr_t)s->scratch / sizeof(float)) % 16) % 16); /* [B, H] */
    float *qkv = normed + lines(B * H);              /* [B, qkv_size] */
    float *query = qkv + lines(B * qkv_size);        /* [B, q_size]: attention takes contiguous queries */
    float *attended = query + lines(B * q_size);     /* [B, q_size] */
    float *gu = attended + lines(B * q_size);        /* [B, 2 I] */
    float *act = gu + lines(B * 2 * I);              /* [B, I] */
    float *workspace = act + lines(B * I);
    const int64_t max_len = s->max_blocks * m->block_size;
    float *qw = s->quantized_workspace;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *w = layers + l;
        add_rms_norm(s->hidden, l == 0 && !s->has_residual ? NULL : s->residual, s->residual, w->input_norm, normed, B,
                     H, m->eps, T);
        project(m, &w->qkv, normed, w->qkv_bias, qkv, B, H, qkv_size, T, qw);
        if (w->q_norm != NULL) {
            rms_norm_rows(qkv, w->q_norm, qkv, B, m->num_heads, D, qkv_size, qkv_size, m->eps, T);
            rms_norm_rows(qkv + q_size, w->k_norm, qkv + q_size, B, m->num_kv_heads, D, qkv_size, qkv_size, m->eps, T);
        }
        m->rotary(s->positions, qkv, qkv + q_size, m->cos_sin, B, m->num_heads, m->num_kv_heads, D, m->rot, qkv_size,
                  qkv_size, m->is_neox);
        m->cache(qkv + q_size, qkv + q_size + kv_size, w->key_cache, w->value_cache, s->slot_mapping, B, kv_size,
                 qkv_size, qkv_size);
        for (int64_t b = 0; b < B; b++) memcpy(query + b * q_size, qkv + b * qkv_size, sizeof(float) * q_size);
        m->attention(query, w->key_cache, w->value_cache, s->block_tables, s->seq_lens, attended, workspace, B,
                     m->num_heads, m->num_kv_heads, D, m->block_size, s->max_blocks, max_len, m->window, m->scale,
                     s->attention_threads);
        project(m, &w->o, attended, w->o_bias, normed, B, q_size, H, T, qw); /* (normed is free again) */
        add_rms_norm(normed, s->residual, s->residual, w->post_norm, normed, B, H, m->eps, T);
        project(m, &w->gate_up, normed, NULL, gu, B, H, 2 * I, T, qw);
        silu_and_mul(gu, act, B, I, T);
        project(m, &w->down, act, NULL, s->hidden, B, I, H, T, qw);
    }
}
