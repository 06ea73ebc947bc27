/* Paged decode attention for the CPU, float32: one query token per sequence attends to its cached
 * keys/values directly through the block table, so no gathered copy of the K/V is ever made (torch
 * alone must gather them first, which costs more than the attention itself).
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Work is split over sequences; each
 * scores all its heads in one sequential pass over its K rows (a token's keys for every head are one
 * contiguous row), then accumulates V in one pass (two-pass softmax, scores in a small workspace).
 * Built and loaded at run time by kernels/cpu/__init__.py.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_len, window;
    float scale;
    int64_t first_seq, last_seq; /* the range of sequences to run */
} Job;

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline const float *row(const Job *j, const float *cache, const int64_t *table, int64_t pos) {
    return cache + (table[pos / j->block_size] * j->block_size + pos % j->block_size) * j->num_kv_heads * j->head_dim;
}

static void run_sequences(const Job *j, float *scores) {
    const int64_t group = j->num_heads / j->num_kv_heads, d = j->head_dim, heads = j->num_heads;
    for (int64_t b = j->first_seq; b < j->last_seq; b++) {
        const int64_t len = j->seq_lens[b];
        const int64_t start = (j->window > 0 && len > j->window) ? len - j->window : 0;
        const int64_t n = len - start;
        const int64_t *table = j->block_tables + b * j->max_blocks;
        const float *q = j->q + b * heads * d;
        float *out = j->out + b * heads * d;
        /* pass 1: scores[h][t] = q_h . k_t * scale; a token's keys for all heads are one contiguous row */
        for (int64_t t = 0; t < n; t++) {
            const float *k_row = row(j, j->k_cache, table, start + t);
            for (int64_t h = 0; h < heads; h++)
                scores[h * j->max_len + t] = dot(q + h * d, k_row + (h / group) * d, d) * j->scale;
        }
        /* softmax per query head */
        for (int64_t h = 0; h < heads; h++) {
            float *s = scores + h * j->max_len, m = -FLT_MAX, sum = 0.f;
            for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < n; t++) s[t] *= inv;
        }
        memset(out, 0, sizeof(float) * heads * d);
        /* pass 2: out_h = sum_t p[h][t] * v_t */
        for (int64_t t = 0; t < n; t++) {
            const float *v_row = row(j, j->v_cache, table, start + t);
            for (int64_t h = 0; h < heads; h++) {
                const float p = scores[h * j->max_len + t];
                const float *v = v_row + (h / group) * d;
                float *o = out + h * d;
#pragma omp simd
                for (int64_t i = 0; i < d; i++) o[i] += p * v[i];
            }
        }
    }
}

/* workspace: num_threads * num_heads * max_len floats. Returns 0 on success.
 * Sequences are shared out over OpenMP threads. Built with -fopenmp, this library binds to the
 * libgomp that torch has already loaded, so it runs on torch's own thread pool: threads of a private
 * pool would compete for the cores with torch's threads, which spin for a while after every matmul. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, const int64_t *seq_lens, float *out,
                               float *workspace, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t max_len,
                               int64_t window, float scale, int64_t num_threads) {
    if (num_threads > batch) num_threads = batch;
    if (num_threads < 1) num_threads = 1;
    const int64_t ws_stride = num_heads * max_len;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; b++) {
        Job j = {q, k_cache, v_cache, block_tables, seq_lens, out,
                 batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_len, window, scale,
                 b, b + 1};
        run_sequences(&j, workspace + omp_get_thread_num() * ws_stride);
    }
    return 0;
}
