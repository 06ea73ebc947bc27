/* Paged decode attention for the CPU, float32: one query token per sequence attends to its cached
 * keys/values directly through the block table, so no gathered copy of the K/V is ever made (torch
 * alone must gather them first, which costs more than the attention itself).
 *
 * Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Work is split over sequences; each
 * scores all its heads in one sequential pass over its K rows (a token's keys for every head are one
 * contiguous row), then accumulates V in one pass (two-pass softmax, scores in a small workspace).
 * With fewer sequences than threads (one stream: one sequence, two cores) each sequence's tokens are
 * split into parts instead, one thread a part, and the parts' partial softmaxes are merged at the end
 * (as flash-decoding does): otherwise a lone sequence runs on one core while the others wait.
 * Built and loaded at run time by kernels/cpu/__init__.py.
 *
 * With AVX2 and FMA (and head_dim a multiple of 8) a vector path does the same two passes with the
 * dot products of 8 tokens in flight at once: the plain loop's one dot at a time waits on its single
 * accumulator's FMA chain and a horizontal sum per score, and its expf is scalar. The vector path
 * is ~1.5x faster at batch 1-64 (docs/decode-speed.md) and agrees with the reference to float rounding.
 *
 * The cache may be float16 (--kv-cache-dtype float16; vector path, F16C): the same passes convert each
 * 8 values as they load them, and read half the bytes.
 *
 * Attention sinks (gpt-oss; paged_decode_attention_sinks_f32): a logit per query head that joins each
 * softmax's maximum and denominator and attends to nothing. The passes are unchanged; the sink enters
 * where a head's output is normalised (`normaliser`).
 *
 * Attention logit soft-capping (Gemma 2; the same entry, `softcap` > 0): each scaled score s becomes
 * softcap * tanh(s / softcap) before the softmax (`cap_scores`, between the two passes).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const float *q;
    const void *k_cache, *v_cache; /* float32, or float16 where kv_half */
    const int64_t *block_tables, *seq_lens;
    float *out;
    int64_t batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_len, window;
    float scale;
    int64_t first_seq, last_seq; /* the range of sequences to run */
    int64_t kv_half, element;    /* a float16 cache (vector path only); the cache's bytes per element */
    const float *sinks;          /* [num_heads] attention sinks, or NULL */
    float softcap;               /* attention logit soft-capping, or 0 */
} Job;

/* s[0:n] -> softcap * tanh(s / softcap), where the Job soft-caps its scores. */
static inline void cap_scores(const Job *j, float *s, int64_t n) {
    if (j->softcap <= 0.f) return;
    const float cap = j->softcap, inverse = 1.f / j->softcap;
    for (int64_t t = 0; t < n; t++) s[t] = cap * tanhf(s[t] * inverse);
}

/* What head h's unnormalised output (the sum over its keys of e^(s_t - max) v_t, where the e^(s_t - max)
 * add up to `sum`) is multiplied by: 1 / sum, or with a sink the softmax's denominator grown by e^sink,
 * both taken relative to the larger of `max` and the sink so that nothing overflows. */
static inline float normaliser(const Job *j, int64_t h, float max, float sum) {
    if (j->sinks == NULL) return 1.f / sum;
    const float sink = j->sinks[h];
    if (sink <= max) return 1.f / (sum + expf(sink - max));
    const float shrink = expf(max - sink); /* e^(max - sink): the keys' terms relative to the sink */
    return shrink / (sum * shrink + 1.f);
}

/* Where a thread's workspace (thread_workspace floats of the caller's buffer) puts its parts. */
typedef struct {
    float *scores;     /* num_heads rows of max_len + 8 floats (rows of n rounded up to 8 in use) */
    float *maxes;      /* [num_heads] (whole sequences) */
    float *sums;       /* [num_heads] (whole sequences) */
    int64_t *offsets;  /* [max_len]: a sequence's token offsets in the cache (elements) */
} Scratch;

static int64_t thread_workspace(int64_t num_heads, int64_t max_len) {
    return (num_heads * (max_len + 8) + 2 * num_heads + 2 * max_len + 2) & ~(int64_t)1;
}

static Scratch scratch_of(const Job *j, float *workspace, int64_t thread) {
    Scratch s;
    s.scores = workspace + thread * thread_workspace(j->num_heads, j->max_len);
    s.maxes = s.scores + ((j->num_heads * (j->max_len + 8) + 1) & ~(int64_t)1); /* (even: int64s follow) */
    s.sums = s.maxes + j->num_heads;
    s.offsets = (int64_t *)(s.sums + j->num_heads);
    return s;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline const float *row(const Job *j, const void *cache, const int64_t *table, int64_t pos) {
    return (const float *)cache + (table[pos / j->block_size] * j->block_size + pos % j->block_size) * j->num_kv_heads * j->head_dim;
}

/* Element offset of each of a sequence's tokens [start, start + n) in the cache (K and V alike): one
 * block-table lookup per block instead of a division per token. */
static void token_offsets(const Job *j, const int64_t *table, int64_t start, int64_t n, int64_t *offsets) {
    const int64_t row_size = j->num_kv_heads * j->head_dim, bs = j->block_size;
    for (int64_t t = 0; t < n;) {
        const int64_t pos = start + t, off = pos % bs;
        const int64_t count = (bs - off < n - t) ? bs - off : n - t;
        const int64_t base = (table[pos / bs] * bs + off) * row_size;
        for (int64_t i = 0; i < count; i++) offsets[t + i] = base + i * row_size;
        t += count;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vector_exp.h"
#define HAVE_VECTOR_PATH 1

/* r[i] = the sum of a[i]'s 8 lanes. */
static inline __m256 sum_each(const __m256 a[8]) {
    const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* e^x for x <= 0 (softmax after subtracting the max), within 2 ulp of expf; below -87 it returns
 * ~1e-38, not 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    __m256 n;
    const __m256 y = exp_mantissa(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), &n);
    return _mm256_mul_ps(y, exp2_integral(_mm256_cvtps_epi32(n)));
}

static inline float max_lane(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* In place: s[0:n] -> e^(s[0:n] - max), not normalised; returns the max, and the sum in *total_out.
 * s has room for n rounded up to 8. */
static float exponentials(float *s, int64_t n, float *total_out) {
    const int64_t full = n & ~7;
    float m = -FLT_MAX;
    __m256 mv = _mm256_set1_ps(-FLT_MAX);
    for (int64_t t = 0; t < full; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    m = max_lane(mv);
    for (int64_t t = full; t < n; t++) m = s[t] > m ? s[t] : m;
    for (int64_t t = n; t < ((n + 7) & ~7); t++) s[t] = -FLT_MAX; /* padding lanes: e^-87, then dropped */
    const __m256 max = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < n; t += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), max));
        _mm256_storeu_ps(s + t, e);
        sum = _mm256_add_ps(sum, t + 8 <= n ? e : _mm256_setzero_ps());
    }
    float total = sum_lanes(sum);
    for (int64_t t = full; t < n; t++) total += s[t];
    *total_out = total;
    return m;
}

/* 8 floats of the cache `base` from element `at`: float32, or float16 converted (`half` is a constant
 * in every use, so each caller is compiled once per cache type with no test in its loops). */
static inline __attribute__((always_inline)) __m256 load8(const void *base, int64_t at, const int half) {
#ifdef __F16C__
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
#endif
    (void)half;
    return _mm256_loadu_ps((const float *)base + at);
}

/* o[0:8 * width] += sum_t p[t] * v_t[0:8 * width] over tokens [t0, t1) (v_t: the cache v from element
 * offsets[t] + first). Always called with a constant width, so that the accumulators stay in registers:
 * with a variable width the compiler kept them on the stack, a store and a reload around every FMA (2x
 * slower overall). */
static inline __attribute__((always_inline)) void accumulate_v(const float *p, const void *v, int64_t first,
                                                               const int64_t *offsets, int64_t t0, int64_t t1, float *o,
                                                               const int width, const int half) {
    __m256 acc[8];
    for (int i = 0; i < width; i++) acc[i] = _mm256_loadu_ps(o + 8 * i);
    for (int64_t t = t0; t < t1; t++) {
        const __m256 pv = _mm256_broadcast_ss(p + t);
        const int64_t row = offsets[t] + first;
        for (int i = 0; i < width; i++) acc[i] = _mm256_fmadd_ps(pv, load8(v, row + 8 * i, half), acc[i]);
    }
    for (int i = 0; i < width; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
}

/* Pass 2 for up to three query heads of one KV group and 32 of their dimensions: o_h[0:32] += sum_t
 * p_h[t] * v_t[0:32] over tokens [t0, t1), for heads h < H (p_h = p + h * stride, o_h = o + h * d; v_t as
 * above). Each V row's 32 floats are loaded once for all H heads (one head at a time loaded each row once
 * per head, and ran at a quarter of the FMA rate: docs/decode-speed.md). H is a constant in each use, so
 * that the 4H accumulators stay in registers. */
static inline __attribute__((always_inline)) void accumulate_v_heads(const float *p, int64_t stride, const void *v,
                                                                     int64_t first, const int64_t *offsets, int64_t t0,
                                                                     int64_t t1, float *o, int64_t d, const int H,
                                                                     const int half) {
    __m256 acc[3][4];
    for (int h = 0; h < H; h++)
        for (int i = 0; i < 4; i++) acc[h][i] = _mm256_loadu_ps(o + h * d + 8 * i);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t row = offsets[t] + first;
        const __m256 x0 = load8(v, row, half), x1 = load8(v, row + 8, half), x2 = load8(v, row + 16, half),
                     x3 = load8(v, row + 24, half);
        for (int h = 0; h < H; h++) {
            const __m256 pv = _mm256_broadcast_ss(p + h * stride + t);
            acc[h][0] = _mm256_fmadd_ps(pv, x0, acc[h][0]);
            acc[h][1] = _mm256_fmadd_ps(pv, x1, acc[h][1]);
            acc[h][2] = _mm256_fmadd_ps(pv, x2, acc[h][2]);
            acc[h][3] = _mm256_fmadd_ps(pv, x3, acc[h][3]);
        }
    }
    for (int h = 0; h < H; h++)
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(o + h * d + 8 * i, acc[h][i]);
}

/* The passes read K and V in segments of SEGMENT tokens (a multiple of 8 and of 32): each segment's rows
 * are first loaded whole, row after row in address order, so that the passes then find them in L1/L2.
 * Read in the passes' own order (8 rows x one head's 64 floats at a time), the rows came from DRAM at
 * ~7 GB/s a thread, where a plain sequential read gets ~21: the hardware prefetcher does not follow the
 * block table, nor that order within a block, and software prefetches a chunk ahead did not keep enough
 * lines in flight. Loading each segment first: 1.3-1.8x faster from DRAM (docs/decode-speed.md). Pass 1
 * used to prefetch its tokens' V rows into L2 as well; without that (V is loaded by pass 2's own segment
 * reads) 30 layers of 64 x 192 tokens took 30.2-31.4 instead of 31.9-32.8 ms, of 16 x 1,000 41.4 instead
 * of 47.6 (Intel Xeon host, 2026-12-03): the prefetches competed with the K reads pass 1 waits on.
 * Prefetching the next segment (32-128 tokens ahead, into L1 or L2) instead of loading it first, or the
 * next sequence's rows while this one computes, was level or up to 1.2x slower. */
#define SEGMENT 128

/* The first byte of each cache line [from, from + bytes) touches: the row's own first byte, then each
 * later line's start (rows need not start on a line: a float16 row of 40 x 2 heads is 160 bytes). */
#define FOR_EACH_LINE(p, from, bytes)                                                                         \
    for (const char *p = (from), *line_end_ = (from) + (bytes); p < line_end_;                                \
         p = (const char *)(((uintptr_t)p & ~(uintptr_t)63) + 64))

/* Loads every cache line of the rows of tokens [t0, t1) (row_bytes each), in address order within a
 * block, one byte of each: never a byte outside the rows. */
static inline void load_rows(const void *cache, int64_t element, const int64_t *offsets, int64_t t0, int64_t t1,
                             int64_t row_bytes) {
    int sink = 0;
    for (int64_t t = t0; t < t1; t++) FOR_EACH_LINE(p, (const char *)cache + offsets[t] * element, row_bytes) sink |= *p;
    __asm__ volatile("" : : "r"(sink)); /* (the loads are their own purpose) */
}

/* Sequence b's tokens [start, start + n), n > 0: out[h] = sum_t e^(s_ht - max_h) v_t (not normalised),
 * with max_h and sum_h = sum_t e^(s_ht - max_h) in maxes[h] and sums[h]; ws: the thread's scratch. The
 * cache is float16 where `half` (a constant: see attend_part_vector). */
static inline __attribute__((always_inline)) void attend_part(const Job *j, int64_t b, int64_t start, int64_t n,
                                                              const Scratch *ws, float *out, float *maxes, float *sums,
                                                              const int half) {
    const int64_t group = j->num_heads / j->num_kv_heads, d = j->head_dim, heads = j->num_heads;
    const int64_t stride = (n + 7) & ~7, row_bytes = j->num_kv_heads * d * j->element;
    float *scores = ws->scores;
    int64_t *offsets = ws->offsets;
    token_offsets(j, j->block_tables + b * j->max_blocks, start, n, offsets);
    const float *q = j->q + b * heads * d;
    const __m256 scale = _mm256_set1_ps(j->scale);
    /* pass 1: 8 tokens' keys at a time, each scored against every query head (each K row read once) */
    for (int64_t t = 0; t < n; t += 8) {
        int64_t k[8];
        for (int64_t i = 0; i < 8; i++) k[i] = offsets[t + i < n ? t + i : t];
        if (t % SEGMENT == 0) load_rows(j->k_cache, j->element, offsets, t, t + SEGMENT < n ? t + SEGMENT : n, row_bytes);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t kv = (h / group) * d;
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t c = 0; c < d; c += 8) {
                const __m256 qv = _mm256_loadu_ps(q + h * d + c);
                for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, load8(j->k_cache, k[i] + kv + c, half), acc[i]);
            }
            _mm256_storeu_ps(scores + h * stride + t, _mm256_mul_ps(sum_each(acc), scale));
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        cap_scores(j, scores + h * stride, n);
        maxes[h] = exponentials(scores + h * stride, n, sums + h);
    }
    /* pass 2: out_h += sum_t p[h][t] * v_t over chunks of 32 tokens (their V rows stay in L1 while every
     * head uses them): three heads of a group x 32 dimensions at a time in registers, or (head sizes that
     * are not a multiple of 32) one head x 64 dimensions */
    memset(out, 0, sizeof(float) * heads * d);
    const void *v = j->v_cache;
    for (int64_t t0 = 0; t0 < n; t0 += 32) {
        const int64_t t1 = t0 + 32 < n ? t0 + 32 : n;
        if (t0 % SEGMENT == 0) load_rows(v, j->element, offsets, t0, t0 + SEGMENT < n ? t0 + SEGMENT : n, row_bytes);
        if (d % 32 == 0) { /* three heads of a group at a time, 32 dimensions at a time */
            int64_t count; /* heads in this slice: up to 3, all of one group */
            for (int64_t h0 = 0; h0 < heads; h0 += count) {
                const int64_t group_end = (h0 / group + 1) * group;
                count = group_end - h0 < 3 ? group_end - h0 : 3;
                const float *p = scores + h0 * stride;
                for (int64_t c0 = 0; c0 < d; c0 += 32) {
                    const int64_t first = (h0 / group) * d + c0;
                    float *o = out + h0 * d + c0;
                    if (count == 3) accumulate_v_heads(p, stride, v, first, offsets, t0, t1, o, d, 3, half);
                    else if (count == 2) accumulate_v_heads(p, stride, v, first, offsets, t0, t1, o, d, 2, half);
                    else accumulate_v_heads(p, stride, v, first, offsets, t0, t1, o, d, 1, half);
                }
            }
            continue;
        }
        for (int64_t h = 0; h < heads; h++) {
            const float *p = scores + h * stride;
            const int64_t head = (h / group) * d;
            for (int64_t c0 = 0; c0 + 64 <= d; c0 += 64)
                accumulate_v(p, v, head + c0, offsets, t0, t1, out + h * d + c0, 8, half);
            if (d % 64) /* (d is a multiple of 8) */
                switch (d % 64 / 8) {
#define REST(w) case w: accumulate_v(p, v, head + d - 8 * w, offsets, t0, t1, out + h * d + d - 8 * w, w, half); break;
                    REST(1) REST(2) REST(3) REST(4) REST(5) REST(6) REST(7)
#undef REST
                }
        }
    }
}

/* attend_part for the Job's cache type, compiled once for each. */
static void attend_part_vector(const Job *j, int64_t b, int64_t start, int64_t n, const Scratch *ws, float *out,
                               float *maxes, float *sums) {
#ifdef __F16C__
    if (j->kv_half) {
        attend_part(j, b, start, n, ws, out, maxes, sums, 1);
        return;
    }
#endif
    attend_part(j, b, start, n, ws, out, maxes, sums, 0);
}

/* The tokens sequence b attends to: [*start, *start + n). */
static int64_t attended(const Job *j, int64_t b, int64_t *start) {
    const int64_t len = j->seq_lens[b];
    *start = (j->window > 0 && len > j->window) ? len - j->window : 0;
    return len - *start;
}

/* One whole sequence, normalised into its rows of out. */
static void run_sequence_vector(const Job *j, int64_t b, const Scratch *ws) {
    const int64_t heads = j->num_heads, d = j->head_dim;
    int64_t start;
    const int64_t n = attended(j, b, &start);
    float *out = j->out + b * heads * d, *sums = ws->sums;
    attend_part_vector(j, b, start, n, ws, out, ws->maxes, sums);
    for (int64_t h = 0; h < heads; h++) {
        const float factor = normaliser(j, h, ws->maxes[h], sums[h]);
        for (int64_t i = 0; i < d; i++) out[h * d + i] *= factor;
    }
}

/* Tokens [*first, *first + count) of part p of `parts` of an n-token range: equal parts, multiples of 8
 * tokens (the last part takes the rest; trailing parts may be empty). */
static int64_t part_range(int64_t n, int64_t parts, int64_t p, int64_t *first) {
    const int64_t size = ((n + parts - 1) / parts + 7) & ~(int64_t)7;
    *first = p * size;
    if (*first >= n) return 0;
    return n - *first < size ? n - *first : size;
}

/* Fewer sequences than threads: `parts` parts of each sequence's tokens, one (sequence, part) per loop
 * iteration; each part's unnormalised output, max and sum per head go to `partial`, and are merged:
 * out_h = sum_p e^(max_p - M) out_p / sum_p e^(max_p - M) sum_p, with M the largest max_p. */
static void run_split_vector(const Job *j, float *workspace, int64_t parts, int64_t num_threads, float *partial) {
    const int64_t heads = j->num_heads, d = j->head_dim, unit = heads * (d + 2);
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
    for (int64_t u = 0; u < j->batch * parts; u++) {
        const int64_t b = u / parts;
        int64_t start, first;
        const int64_t n = part_range(attended(j, b, &start), parts, u % parts, &first);
        float *out = partial + u * unit, *maxes = out + heads * d, *sums = maxes + heads;
        if (n == 0) { /* an empty part weighs nothing in the merge */
            for (int64_t h = 0; h < heads; h++) maxes[h] = -FLT_MAX, sums[h] = 0.f;
            continue;
        }
        const Scratch ws = scratch_of(j, workspace, omp_get_thread_num());
        attend_part_vector(j, b, start + first, n, &ws, out, maxes, sums);
    }
    for (int64_t b = 0; b < j->batch; b++)
        for (int64_t h = 0; h < heads; h++) {
            float top = -FLT_MAX, total = 0.f;
            for (int64_t p = 0; p < parts; p++) {
                const float m = partial[(b * parts + p) * unit + heads * d + h];
                top = m > top ? m : top;
            }
            float *o = j->out + (b * heads + h) * d;
            memset(o, 0, sizeof(float) * d);
            for (int64_t p = 0; p < parts; p++) {
                const float *part = partial + (b * parts + p) * unit;
                const float sum = part[heads * d + heads + h];
                if (sum == 0.f) continue;
                const float weight = expf(part[heads * d + h] - top);
                total += weight * sum;
                for (int64_t i = 0; i < d; i++) o[i] += weight * part[h * d + i];
            }
            const float factor = normaliser(j, h, top, total);
            for (int64_t i = 0; i < d; i++) o[i] *= factor;
        }
}
#endif

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
            cap_scores(j, s, n);
            for (int64_t t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - m); sum += s[t]; }
            const float inv = normaliser(j, h, m, sum);
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

/* Floats of workspace the attention below needs. */
int64_t paged_decode_attention_workspace(int64_t num_heads, int64_t max_len, int64_t num_threads) {
    return (num_threads < 1 ? 1 : num_threads) * thread_workspace(num_heads, max_len);
}

/* Sequences are shared out over OpenMP threads. Built with -fopenmp, this library binds to the libgomp
 * that torch has already loaded, so it runs on torch's own thread pool: threads of a private pool would
 * compete for the cores with torch's threads, which spin for a while after every matmul. */
static int attention(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                     const int64_t *seq_lens, float *out, float *workspace, int64_t batch, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t max_len,
                     int64_t window, float scale, int64_t num_threads, int64_t kv_half, const float *sinks,
                     float softcap) {
    if (num_threads < 1) num_threads = 1;
    const Job job = {q, k_cache, v_cache, block_tables, seq_lens, out,
                     batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, max_len, window, scale,
                     0, batch, kv_half, kv_half ? 2 : 4, sinks, softcap};
#ifdef HAVE_VECTOR_PATH
    if (head_dim % 8 == 0 && batch < num_threads) {
        const int64_t parts = (num_threads + batch - 1) / batch;
        /* the parts' outputs, maxes and sums; without them (no memory), whole sequences as below */
        float *partial = malloc(sizeof(float) * batch * parts * num_heads * (head_dim + 2));
        if (partial != NULL) {
            run_split_vector(&job, workspace, parts, num_threads, partial);
            free(partial);
            return 0;
        }
    }
#endif
    if (num_threads > batch) num_threads = batch;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; b++) {
        Job j = job;
        j.first_seq = b, j.last_seq = b + 1;
        const Scratch ws = scratch_of(&j, workspace, omp_get_thread_num());
#ifdef HAVE_VECTOR_PATH
        if (head_dim % 8 == 0) {
            run_sequence_vector(&j, b, &ws);
            continue;
        }
#endif
        run_sequences(&j, ws.scores);
    }
    return 0;
}

/* workspace: paged_decode_attention_workspace(...) floats. Returns 0. */
int paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, const int64_t *seq_lens, float *out,
                               float *workspace, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t max_len,
                               int64_t window, float scale, int64_t num_threads) {
    return attention(q, k_cache, v_cache, block_tables, seq_lens, out, workspace, batch, num_heads, num_kv_heads,
                     head_dim, block_size, max_blocks, max_len, window, scale, num_threads, 0, NULL, 0.f);
}

/* paged_decode_attention_f32 with its options: attention sinks `sinks` [num_heads] (or NULL) and logit
 * soft-capping `softcap` (or 0). (The fused decoder calls the one above, whose signature it holds.)
 * Returns 0. */
int paged_decode_attention_options_f32(const float *q, const float *k_cache, const float *v_cache,
                                       const int64_t *block_tables, const int64_t *seq_lens, float *out,
                                       float *workspace, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                                       int64_t head_dim, int64_t block_size, int64_t max_blocks, int64_t max_len,
                                       int64_t window, float scale, int64_t num_threads, const float *sinks,
                                       float softcap) {
    return attention(q, k_cache, v_cache, block_tables, seq_lens, out, workspace, batch, num_heads, num_kv_heads,
                     head_dim, block_size, max_blocks, max_len, window, scale, num_threads, 0, sinks, softcap);
}

#if defined(HAVE_VECTOR_PATH) && defined(__F16C__)
/* The same over a float16 cache (its rows converted to float32 as they are read); head_dim a multiple
 * of 8, or it returns 1 and does nothing. Only where the CPU has F16C. */
int paged_decode_attention_f16kv(const float *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                 const int64_t *block_tables, const int64_t *seq_lens, float *out, float *workspace,
                                 int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, int64_t max_blocks, int64_t max_len, int64_t window, float scale,
                                 int64_t num_threads) {
    if (head_dim % 8) return 1;
    return attention(q, k_cache, v_cache, block_tables, seq_lens, out, workspace, batch, num_heads, num_kv_heads,
                     head_dim, block_size, max_blocks, max_len, window, scale, num_threads, 1, NULL, 0.f);
}
#endif
