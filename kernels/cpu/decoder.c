/* A whole decode step of a Llama-family model's decoder layers in one call, float32, CPU.
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

/* One decoder layer's weights (projections as kernels/panels.py packs them) and KV cache. */
typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL (only Qwen3 has them) */
    const float *qkv, *qkv_bias;         /* [(Hq + 2 Hkv) D, hidden]; bias or NULL */
    const float *o, *o_bias;             /* [hidden, Hq D] */
    const float *gate_up, *down;         /* [2 I, hidden], [hidden, I] */
    void *key_cache, *value_cache;       /* [blocks, block_size, Hkv, D], float32 or float16 */
} Layer;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t block_size, window, rot, is_neox;
    float eps, scale;
    const float *cos_sin; /* [max_position, rot] */
    LinearFn linear;
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
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *w = layers + l;
        add_rms_norm(s->hidden, l == 0 && !s->has_residual ? NULL : s->residual, s->residual, w->input_norm, normed, B,
                     H, m->eps, T);
        m->linear(normed, w->qkv, w->qkv_bias, qkv, B, H, qkv_size, T);
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
        m->linear(attended, w->o, w->o_bias, normed, B, q_size, H, T); /* (normed is free again) */
        add_rms_norm(normed, s->residual, s->residual, w->post_norm, normed, B, H, m->eps, T);
        m->linear(normed, w->gate_up, NULL, gu, B, H, 2 * I, T);
        silu_and_mul(gu, act, B, I, T);
        m->linear(act, w->down, NULL, s->hidden, B, I, H, T);
    }
}
