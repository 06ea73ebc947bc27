/* Prefill attention for the CPU, float32, over keys in one of two places:
 * - varlen_attention_f32: no KV cache; every sequence of the batch is whole in q/k/v (a prompt prefilled
 *   in one step, and pooling models), attending causally (decoders, decoder embedders) or bidirectionally
 *   (BERT-style encoders);
 * - paged_prefill_attention_f32: a chunk of each sequence's last tokens attends causally to all of its
 *   keys in the paged KV cache (a prompt's later chunks, or the rest of a prompt after a prefix-cache hit).
 *
 * Layouts: q [T, H, D], k/v [T, Hkv, D], each token's heads contiguous with any token stride (views of a
 * fused QKV output); caches [blocks, block_size, Hkv, D] contiguous, block_tables [B, max_blocks]; out
 * [T, H, D] contiguous; cu_seqlens [B + 1] (sequence b owns query rows cu_seqlens[b]..cu_seqlens[b+1]),
 * seq_lens [B] (paged: its keys, the query rows being its last ones).
 *
 * Work is one job per (block of 64 query rows of a sequence, KV head), shared out over OpenMP threads. A
 * job copies the keys its rows see transposed ([D, L], so one key column per lane; paged, each key
 * through its block table) and then, for every query head of the group, takes query rows eight at a
 * time: scores for a tile of 8 rows x 32 keys stay in registers while the D products are summed (each
 * key element loaded once per 8 rows), a two-pass softmax per row (with an exp that vectorizes), then the
 * eight output rows accumulate V rows in tiles of 8 x 32 columns (each V row loaded once per 8 rows, from
 * its own slot). A tile's rows past the job's last are computed from stand-in rows and dropped, so that
 * the inner loops test no row. Single-threaded, MiniLM's shapes (12 heads of 32, 16 inputs of 120
 * tokens): 90 GFLOP/s here, where the first version (4 x 16 tiles, libm's scalar expf) ran at 22. Tiles
 * of 8 rows instead of 4 (30 layers of SmolLM2's heads, two threads): 2,048 tokens 1,058 -> 891 ms, 512
 * tokens 62 -> 60 ms. Paged, against the torch reference (a gather of the cache, then torch's attention
 * with a mask): see docs/decode-speed.md.
 * Attention sinks (gpt-oss; `sinks` [H], or NULL): a logit per query head that starts each row's maximum
 * and adds its e^(sink - max) to the row's denominator, attending to nothing.
 * Attention logit soft-capping (Gemma 2; `softcap` > 0, else 0): each row's scaled scores s become
 * softcap * tanh(s / softcap) before its softmax.
 * Built and loaded at run time by kernels/cpu/__init__.py.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 8  /* query rows per tile: 8 x 2 zmm accumulators (4 rows left half the registers idle) */
#define COLS 32 /* keys (and output columns) per tile row: two AVX-512 vectors; 1.5x faster than 16 here */
/* (Rechecked once the loops were built 512 bits wide, kernels/cpu/__init__.py: 30 layers of a 512-token
 * prompt, 8 x 32 took 43-48 ms; 12 x 32 46-51, 8 x 48 65-70, 8 x 64 66-71, 16 x 32 87-96.) */

typedef struct {
    const float *q, *k, *v; /* (paged: k and v are the caches, their strides a slot's) */
    const int64_t *cu;
    float *out;
    int64_t num_heads, num_kv_heads, head_dim, stride_q, stride_k, stride_v, causal, window;
    float scale;
    const int64_t *block_tables, *seq_lens; /* NULL unless paged */
    int64_t block_size, max_blocks;
    const float *sinks; /* [num_heads], or NULL */
    float softcap;      /* attention logit soft-capping, or 0 */
} Args;

/* Key j of sequence `seq` (its row in k/v, or its slot in the cache); an offset in k/v rows. */
static inline int64_t key_slot(const Args *a, int64_t seq, int64_t j) {
    if (a->block_tables == NULL) return a->cu[seq] + j;
    return a->block_tables[seq * a->max_blocks + j / a->block_size] * a->block_size + j % a->block_size;
}

/* The number of keys of sequence `seq`: its own rows, or (paged) its whole context. */
static inline int64_t key_count(const Args *a, int64_t seq) {
    return a->seq_lens == NULL ? a->cu[seq + 1] - a->cu[seq] : a->seq_lens[seq];
}

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* e^x for x <= 0 (a score minus its row's maximum), to about 2e-7 relative, in plain arithmetic so that
 * loops over it vectorize: libm's expf does not (its vector variants need -ffast-math, which this
 * library avoids: see kernels/cpu/__init__.py), and one scalar expf per score costs more than the score's
 * whole dot product. 2^y with y = x log2(e) split into n + f (|f| <= 1/2): 2^f by its Taylor series to
 * f^7 (error below 2e-7), 2^n put into the exponent bits. */
static inline float exp_nonpositive(float x) {
    const float y = (x < -87.0f ? -87.0f : x) * 1.44269504088896341f;
    const float n = floorf(y + 0.5f);
    const float f = (y - n) * 0.693147180559945309f; /* 2^(y-n) = e^f */
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    union {
        float f;
        int32_t i;
    } u = {p};
    u.i += (int32_t)n * (1 << 23);
    return u.f;
}

/* scores[r][j] = scale * q_r . k_j for rows r < rows and keys lo <= j < hi (hi - lo padded to COLS);
 * kt is [D, ld] (keys transposed). */
static void score_tile(const Args *a, const float *q_rows[ROWS], int64_t rows, const float *kt, int64_t ld,
                       int64_t lo, int64_t hi, float *scores) {
    const int64_t d = a->head_dim;
    for (int64_t jb = lo; jb < hi; jb += COLS) {
        float acc[ROWS][COLS];
        memset(acc, 0, sizeof(acc));
        for (int64_t x = 0; x < d; x++) {
            const float *kcol = kt + x * ld + jb;
            for (int64_t r = 0; r < ROWS; r++) {
                const float qv = q_rows[r][x]; /* (rows past `rows` repeat row 0: computed, never stored) */
#pragma omp simd
                for (int64_t c = 0; c < COLS; c++) acc[r][c] += qv * kcol[c];
            }
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < COLS; c++) scores[r * ld + jb + c] = acc[r][c] * a->scale;
    }
}

/* out[r][xb + c] = sum_j p[r][j] * v_j[xb + c] for keys lo <= j < hi, columns xb.. of the head (a whole
 * tile of COLS, or the head's last columns); p is [ROWS, ld], key j's row is at slots[j]. */
static void pv_tile(const Args *a, const float *p, int64_t ld, int64_t rows, const int64_t *slots,
                    const float *v_head, int64_t lo, int64_t hi, int64_t xb, float *o[ROWS]) {
    const int64_t cols = a->head_dim - xb < COLS ? a->head_dim - xb : COLS;
    float acc[ROWS][COLS];
    memset(acc, 0, sizeof(acc));
    if (cols == COLS) {
        for (int64_t j = lo; j < hi; j++) {
            const float *v_row = v_head + slots[j] * a->stride_v + xb;
            for (int64_t r = 0; r < ROWS; r++) {
                const float pr = p[r * ld + j]; /* (rows past `rows` hold stale values: never stored) */
#pragma omp simd
                for (int64_t c = 0; c < COLS; c++) acc[r][c] += pr * v_row[c];
            }
        }
    } else {
        for (int64_t j = lo; j < hi; j++) {
            const float *v_row = v_head + slots[j] * a->stride_v + xb;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) acc[r][c] += p[r * ld + j] * v_row[c];
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) o[r][xb + c] = acc[r][c];
}

/* One job: query rows [r0, r1) of sequence `seq` (counted from its first query row), for the query heads
 * of KV head `kv_head`. Query row i is at position off + i, off being the keys before the query rows
 * (paged: the cached context before the chunk; varlen: none), and sees the keys at positions up to its
 * own (causal; within the window, if any) or all of its sequence's. */
static void run_job(const Args *a, int64_t seq, int64_t kv_head, int64_t r0, int64_t r1, float *kt, float *scores,
                    int64_t *slots) {
    const int64_t start = a->cu[seq], len = key_count(a, seq), off = len - (a->cu[seq + 1] - start);
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t ld = round_up(len, COLS);
    /* the keys these rows see: [k_lo, k_hi), at their own columns of kt */
    const int64_t k_hi = a->causal ? off + r1 : len;
    int64_t k_lo = 0;
    if (a->window > 0 && off + r0 - a->window + 1 > 0) k_lo = (off + r0 - a->window + 1) / COLS * COLS;
    /* keys transposed, padded with zeros to a whole score tile; 16 keys at a time, so that each row of kt
     * is written a cache line at a time (key by key, the stores' stride of ld floats missed the cache
     * for every element: a fifth of a 512-token prompt's attention time) */
    const float *k_head = a->k + kv_head * d, *v_head = a->v + kv_head * d;
    for (int64_t j = k_lo; j < k_hi; j++) slots[j] = key_slot(a, seq, j); /* (once per key, not per tile) */
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += 16) {
        const int64_t count = k_hi - j0 < 16 ? k_hi - j0 : 16;
        const float *k_rows[16];
        for (int64_t j = 0; j < count; j++) k_rows[j] = k_head + slots[j0 + j] * a->stride_k;
        for (int64_t x = 0; x < d; x++)
            for (int64_t j = 0; j < count; j++) kt[x * ld + j0 + j] = k_rows[j][x];
    }
    const int64_t padded = round_up(k_hi, COLS) < ld ? round_up(k_hi, COLS) : ld;
    for (int64_t x = 0; x < d; x++)
        for (int64_t j = k_hi; j < padded; j++) kt[x * ld + j] = 0.f;

    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
        for (int64_t i0 = r0; i0 < r1; i0 += ROWS) {
            const int64_t rows = r1 - i0 < ROWS ? r1 - i0 : ROWS;
            const float *q_rows[ROWS];
            for (int64_t r = 0; r < ROWS; r++)
                q_rows[r] = a->q + (start + i0 + (r < rows ? r : 0)) * a->stride_q + h * d;
            /* keys any row of the tile sees: [lo, hi) */
            const int64_t hi = a->causal ? off + i0 + rows : len;
            int64_t lo = 0;
            if (a->window > 0 && off + i0 - a->window + 1 > 0) lo = (off + i0 - a->window + 1) / COLS * COLS;
            score_tile(a, q_rows, rows, kt, ld, lo, round_up(hi, COLS) < ld ? round_up(hi, COLS) : ld, scores);
            float sums[ROWS];
            int64_t first[ROWS], last[ROWS];
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = off + i0 + r; /* the row's position */
                first[r] = (a->window > 0 && i - a->window + 1 > 0) ? i - a->window + 1 : 0;
                last[r] = a->causal ? i + 1 : len;
                float *s = scores + r * ld, m = a->sinks != NULL ? a->sinks[h] : -FLT_MAX, sum = 0.f;
                if (a->softcap > 0.f) {
                    const float cap = a->softcap, inverse = 1.f / a->softcap;
                    for (int64_t j = first[r]; j < last[r]; j++) s[j] = cap * tanhf(s[j] * inverse);
                }
                for (int64_t j = first[r]; j < last[r]; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = first[r]; j < last[r]; j++) {
                    s[j] = exp_nonpositive(s[j] - m);
                    sum += s[j];
                }
                sums[r] = a->sinks != NULL ? sum + exp_nonpositive(a->sinks[h] - m) : sum;
            }
            /* probabilities of the tile's key range, zero outside each row's own range */
            const int64_t lo_all = first[0], hi_all = last[rows - 1];
            for (int64_t r = 0; r < rows; r++) {
                float *p = scores + r * ld;
                const float inv = 1.f / sums[r];
                for (int64_t j = lo_all; j < first[r]; j++) p[j] = 0.f;
                for (int64_t j = first[r]; j < last[r]; j++) p[j] *= inv;
                for (int64_t j = last[r]; j < hi_all; j++) p[j] = 0.f;
            }
            float *o[ROWS];
            for (int64_t r = 0; r < ROWS; r++) o[r] = a->out + (start + i0 + r) * a->num_heads * d + h * d;
            for (int64_t xb = 0; xb < d; xb += COLS) pv_tile(a, scores, ld, rows, slots, v_head, lo_all, hi_all, xb, o);
        }
    }
}

/* Rows per job: a sequence's rows are split so that two threads share even a single sequence of few KV
 * heads (one job per KV head left a thread idle for a third of a 512-token prompt's attention with 3
 * KV heads on 2 threads). A multiple of ROWS. */
#define JOB_ROWS 64

/* Floats of workspace per thread: the transposed keys, a tile's scores and the keys' slots (int64). */
static int64_t thread_workspace(int64_t head_dim, int64_t max_len) {
    return (head_dim + ROWS + 2) * round_up(max_len, COLS);
}

/* The floats of workspace both functions below need. */
int64_t varlen_attention_workspace(int64_t head_dim, int64_t max_len, int64_t num_threads) {
    return num_threads * thread_workspace(head_dim, max_len);
}

/* Every job of the batch: max_len is its most keys of a sequence; workspace as the functions below say.
 * Returns 0 (1: out of memory). Built with -fopenmp, this library binds to the libgomp torch has already
 * loaded, so it runs on torch's own thread pool (see paged_attention.c). */
static int run_jobs(const Args *a, float *workspace, int64_t num_seqs, int64_t max_len, int64_t num_threads) {
    const int64_t ld = round_up(max_len, COLS);
    const int64_t *cu = a->cu;
    /* first_block[b]: the number of row blocks before sequence b's; a job is one block of one KV head */
    int64_t *first_block = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (first_block == NULL) return 1;
    first_block[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        first_block[b + 1] = first_block[b] + (cu[b + 1] - cu[b] + JOB_ROWS - 1) / JOB_ROWS;
    const int64_t blocks = first_block[num_seqs], jobs = blocks * a->num_kv_heads;
    if (num_threads > jobs) num_threads = jobs;
    if (num_threads < 1) num_threads = 1;
    /* Blocks are taken from the last backwards: under causal attention a sequence's later rows see more
     * keys, and a dynamic schedule balances best when the longest jobs start first. */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        float *kt = workspace + (int64_t)omp_get_thread_num() * thread_workspace(a->head_dim, max_len);
        const int64_t block = blocks - 1 - job / a->num_kv_heads;
        int64_t lo = 0, hi = num_seqs - 1; /* the sequence whose blocks hold `block` */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (first_block[mid] <= block) lo = mid;
            else hi = mid - 1;
        }
        const int64_t r0 = (block - first_block[lo]) * JOB_ROWS, rows = cu[lo + 1] - cu[lo];
        float *scores = kt + a->head_dim * ld;
        run_job(a, lo, job % a->num_kv_heads, r0, r0 + JOB_ROWS < rows ? r0 + JOB_ROWS : rows, kt, scores,
                (int64_t *)(scores + ROWS * ld));
    }
    free(first_block);
    return 0;
}

/* workspace: varlen_attention_workspace(head_dim, max_len, num_threads) floats, max_len the longest
 * sequence; sinks: [num_heads] or NULL; softcap: > 0 to soft-cap the scores, else 0. Returns 0 (1: out of memory). */
int varlen_attention_f32(const float *q, const float *k, const float *v, const int64_t *cu_seqlens, float *out,
                         float *workspace, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t stride_q, int64_t stride_k, int64_t stride_v, int64_t max_len,
                         int64_t causal, int64_t window, float scale, int64_t num_threads, const float *sinks,
                         float softcap) {
    const Args a = {.q = q, .k = k, .v = v, .cu = cu_seqlens, .out = out, .num_heads = num_heads,
                    .num_kv_heads = num_kv_heads, .head_dim = head_dim, .stride_q = stride_q, .stride_k = stride_k,
                    .stride_v = stride_v, .causal = causal, .window = window, .scale = scale, .sinks = sinks,
                    .softcap = softcap};
    return run_jobs(&a, workspace, num_seqs, max_len, num_threads);
}

/* Causal attention of each sequence's last cu_seqlens[b+1] - cu_seqlens[b] tokens (q) to its seq_lens[b]
 * keys, all of which the caches hold already (this step's too). workspace: varlen_attention_workspace(
 * head_dim, max_len, num_threads) floats, max_len the most keys of a sequence; sinks: [num_heads] or NULL;
 * softcap as above.
 * Returns 0 (1: out of memory). */
int paged_prefill_attention_f32(const float *q, const float *key_cache, const float *value_cache,
                                const int64_t *block_tables, const int64_t *cu_seqlens, const int64_t *seq_lens,
                                float *out, float *workspace, int64_t num_seqs, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t stride_q, int64_t block_size,
                                int64_t max_blocks, int64_t max_len, int64_t window, float scale,
                                int64_t num_threads, const float *sinks, float softcap) {
    const int64_t slot = num_kv_heads * head_dim; /* (the caches' row stride) */
    const Args a = {.q = q, .k = key_cache, .v = value_cache, .cu = cu_seqlens, .out = out, .num_heads = num_heads,
                    .num_kv_heads = num_kv_heads, .head_dim = head_dim, .stride_q = stride_q, .stride_k = slot,
                    .stride_v = slot, .causal = 1, .window = window, .scale = scale, .block_tables = block_tables,
                    .seq_lens = seq_lens, .block_size = block_size, .max_blocks = max_blocks, .sinks = sinks,
                    .softcap = softcap};
    return run_jobs(&a, workspace, num_seqs, max_len, num_threads);
}
