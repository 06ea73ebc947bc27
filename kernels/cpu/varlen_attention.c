/* Variable-length attention for the CPU, float32, with no KV cache: every sequence of the batch is
 * whole in q/k/v (pooling models run each prompt in one step), attending causally (decoder
 * embedders) or bidirectionally (BERT-style encoders).
 *
 * Layouts: q [T, H, D], k/v [T, Hkv, D], each token's heads contiguous with any token stride (views of a
 * fused QKV output); out [T, H, D] contiguous; cu_seqlens [B + 1] (sequence b owns rows
 * cu_seqlens[b]..cu_seqlens[b+1]). Work is one job per (block of 64 query rows of a sequence, KV head),
 * shared out over OpenMP threads. A job copies the keys its rows see transposed ([D, L], so one key
 * column per lane) and then, for every query head of the group, takes query rows eight at a time: scores
 * for a tile of 8 rows x 32 keys stay in registers while the D products are summed (each key element
 * loaded once per 8 rows), a two-pass softmax per row (with an exp that vectorizes), then the eight
 * output rows accumulate V rows in tiles of 8 x 32 columns (each V row loaded once per 8 rows). A tile's
 * rows past the job's last are computed from stand-in rows and dropped, so that the inner loops test no
 * row. Single-threaded, MiniLM's shapes (12 heads of 32, 16 inputs of 120 tokens): 90 GFLOP/s here, where
 * the first version (4 x 16 tiles, libm's scalar expf) ran at 22. Tiles of 8 rows instead of 4 (30
 * layers of SmolLM2's heads, two threads): 2,048 tokens 1,058 -> 891 ms, 512 tokens 62 -> 60 ms.
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

typedef struct {
    const float *q, *k, *v;
    const int64_t *cu;
    float *out;
    int64_t num_heads, num_kv_heads, head_dim, stride_q, stride_k, stride_v, causal, window;
    float scale;
} Args;

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
 * tile of COLS, or the head's last columns); p is [ROWS, ld]. */
static void pv_tile(const Args *a, const float *p, int64_t ld, int64_t rows, const float *v_base, int64_t lo,
                    int64_t hi, int64_t xb, float *o[ROWS]) {
    const int64_t cols = a->head_dim - xb < COLS ? a->head_dim - xb : COLS;
    float acc[ROWS][COLS];
    memset(acc, 0, sizeof(acc));
    if (cols == COLS) {
        for (int64_t j = lo; j < hi; j++) {
            const float *v_row = v_base + j * a->stride_v + xb;
            for (int64_t r = 0; r < ROWS; r++) {
                const float pr = p[r * ld + j]; /* (rows past `rows` hold stale values: never stored) */
#pragma omp simd
                for (int64_t c = 0; c < COLS; c++) acc[r][c] += pr * v_row[c];
            }
        }
    } else {
        for (int64_t j = lo; j < hi; j++) {
            const float *v_row = v_base + j * a->stride_v + xb;
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++) acc[r][c] += p[r * ld + j] * v_row[c];
        }
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) o[r][xb + c] = acc[r][c];
}

/* One job: query rows [r0, r1) of sequence `seq`, for the query heads of KV head `kv_head`. */
static void run_job(const Args *a, int64_t seq, int64_t kv_head, int64_t r0, int64_t r1, float *kt, float *scores) {
    const int64_t start = a->cu[seq], len = a->cu[seq + 1] - start;
    const int64_t d = a->head_dim, group = a->num_heads / a->num_kv_heads;
    const int64_t ld = round_up(len, COLS);
    /* the keys these rows see: [k_lo, k_hi), at their own columns of kt */
    const int64_t k_hi = a->causal ? r1 : len;
    int64_t k_lo = 0;
    if (a->window > 0 && r0 - a->window + 1 > 0) k_lo = (r0 - a->window + 1) / COLS * COLS;
    /* keys transposed, padded with zeros to a whole score tile; 16 keys at a time, so that each row of kt
     * is written a cache line at a time (key by key, the stores' stride of ld floats missed the cache
     * for every element: a fifth of a 512-token prompt's attention time) */
    for (int64_t j0 = k_lo; j0 < k_hi; j0 += 16) {
        const int64_t count = k_hi - j0 < 16 ? k_hi - j0 : 16;
        const float *k_rows = a->k + (start + j0) * a->stride_k + kv_head * d;
        for (int64_t x = 0; x < d; x++)
            for (int64_t j = 0; j < count; j++) kt[x * ld + j0 + j] = k_rows[j * a->stride_k + x];
    }
    const int64_t padded = round_up(k_hi, COLS) < ld ? round_up(k_hi, COLS) : ld;
    for (int64_t x = 0; x < d; x++)
        for (int64_t j = k_hi; j < padded; j++) kt[x * ld + j] = 0.f;

    for (int64_t h = kv_head * group; h < (kv_head + 1) * group; h++) {
        for (int64_t i0 = r0; i0 < r1; i0 += ROWS) {
            const int64_t rows = r1 - i0 < ROWS ? r1 - i0 : ROWS;
            const float *q_rows[ROWS];
            for (int64_t r = 0; r < ROWS; r++) q_rows[r] = a->q + (start + i0 + (r < rows ? r : 0)) * a->stride_q + h * d;
            /* keys any row of the tile sees: [lo, hi) */
            const int64_t hi = a->causal ? i0 + rows : len;
            int64_t lo = 0;
            if (a->window > 0 && i0 - a->window + 1 > 0) lo = (i0 - a->window + 1) / COLS * COLS;
            score_tile(a, q_rows, rows, kt, ld, lo, round_up(hi, COLS) < ld ? round_up(hi, COLS) : ld, scores);
            float sums[ROWS];
            int64_t first[ROWS], last[ROWS];
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = i0 + r;
                first[r] = (a->window > 0 && i - a->window + 1 > 0) ? i - a->window + 1 : 0;
                last[r] = a->causal ? i + 1 : len;
                float *s = scores + r * ld, m = -FLT_MAX, sum = 0.f;
                for (int64_t j = first[r]; j < last[r]; j++) m = s[j] > m ? s[j] : m;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = first[r]; j < last[r]; j++) {
                    s[j] = exp_nonpositive(s[j] - m);
                    sum += s[j];
                }
                sums[r] = sum;
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
            const float *v_base = a->v + start * a->stride_v + kv_head * d;
            for (int64_t xb = 0; xb < d; xb += COLS)
                pv_tile(a, scores, ld, rows, v_base, lo_all, hi_all, xb, o);
        }
    }
}

/* Rows per job: a sequence's rows are split so that two threads share even a single sequence of few KV
 * heads (one job per KV head left a thread idle for a third of a 512-token prompt's attention with 3
 * KV heads on 2 threads). A multiple of ROWS. */
#define JOB_ROWS 64

/* The floats of workspace `varlen_attention_f32` needs: per thread, the transposed keys and a tile's scores. */
int64_t varlen_attention_workspace(int64_t head_dim, int64_t max_len, int64_t num_threads) {
    return num_threads * (head_dim + ROWS) * round_up(max_len, COLS);
}

/* workspace: varlen_attention_workspace(...) floats. Returns 0 (1: out of memory).
 * Built with -fopenmp, this library binds to the libgomp torch has already loaded, so it runs on
 * torch's own thread pool (see paged_attention.c). */
int varlen_attention_f32(const float *q, const float *k, const float *v, const int64_t *cu_seqlens, float *out,
                         float *workspace, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, int64_t stride_q, int64_t stride_k, int64_t stride_v, int64_t max_len,
                         int64_t causal, int64_t window, float scale, int64_t num_threads) {
    const Args a = {q, k, v, cu_seqlens, out, num_heads, num_kv_heads, head_dim, stride_q, stride_k, stride_v,
                    causal, window, scale};
    const int64_t ld = round_up(max_len, COLS);
    /* first_block[b]: the number of row blocks before sequence b's; a job is one block of one KV head */
    int64_t *first_block = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (first_block == NULL) return 1;
    first_block[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        first_block[b + 1] = first_block[b] + (cu_seqlens[b + 1] - cu_seqlens[b] + JOB_ROWS - 1) / JOB_ROWS;
    const int64_t blocks = first_block[num_seqs], jobs = blocks * num_kv_heads;
    if (num_threads > jobs) num_threads = jobs;
    if (num_threads < 1) num_threads = 1;
    /* Blocks are taken from the last backwards: under causal attention a sequence's later rows see more
     * keys, and a dynamic schedule balances best when the longest jobs start first. */
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        float *kt = workspace + (int64_t)omp_get_thread_num() * (head_dim + ROWS) * ld;
        const int64_t block = blocks - 1 - job / num_kv_heads;
        int64_t lo = 0, hi = num_seqs - 1; /* the sequence whose blocks hold `block` */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (first_block[mid] <= block) lo = mid;
            else hi = mid - 1;
        }
        const int64_t r0 = (block - first_block[lo]) * JOB_ROWS, len = cu_seqlens[lo + 1] - cu_seqlens[lo];
        run_job(&a, lo, job % num_kv_heads, r0, r0 + JOB_ROWS < len ? r0 + JOB_ROWS : len, kt, kt + head_dim * ld);
    }
    free(first_block);
    return 0;
}
