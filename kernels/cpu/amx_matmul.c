/* Float32 linear on Intel AMX, for a step's bulk rows (long prompts'): y[M,N] = x[M,K] @ W^T (+ bias),
 * W in the panels of kernels/cpu/panel_matmul.c (Wp[N/16][K][16], N padded to 32). Built and loaded at
 * run time by kernels/cpu/__init__.py; where the compiler does not target AMX, or Linux refuses the process
 * the tile registers, amx_linear_f32 returns 0 and the caller uses the panel matmul.
 *
 * Why: a prompt's projections are compute-bound, and the panel matmul's fp32 FMAs run at ~400 GFLOP/s on
 * this host's two cores (~81 % of their peak), where AMX's bf16 tile multiply reaches ~2.5 TFLOP/s per
 * core with its operands in cache. Bf16 alone would change the model's numbers, so each float is split
 * into three bf16 pieces that sum to it exactly (each piece is the bf16 nearest to what the ones before it
 * left: 8 significant bits at a time), and a product x*w is taken as the six products of pieces whose
 * indices add up to at most 2. The three left out are below 2^-24 of x*w, fp32's own rounding; a product
 * of two bf16 is exact in fp32, and AMX adds them into fp32 accumulators. The result is fp32's to within
 * its rounding, summed in another order, as any other fp32 matmul's is (max error against float64 at 512
 * x 576 -> 960: 2.9e-6 here, the panel matmul's 6.7e-6). Six multiplies where fp32 takes one, and the
 * weights split on every call (kernels/cpu/__init__.py has the speeds: faster from ~96 rows on).
 *
 * Each row's sums run in one fixed order (k tiles in turn, the six products of each in a fixed order),
 * whatever the other rows, the row count and the threads: a row gets the same bits alone as in any batch.
 * Rows run in chunks whose pieces stay in L2; each thread takes a share of the 32-column blocks and
 * passes each block's weight pieces (in AMX's pair layout) over every 32 rows of the chunk, while it
 * splits the next block's weights between the tile multiplies (two buffers in turn): the vector units
 * convert while the tile unit multiplies. Against splitting each block first: a model's projections at
 * 512 rows 204 -> 187 ms, at 128 rows 58.9 -> 53.6. A tile is 16 rows x 32 bf16 (x) or 16 k-pairs x 16
 * columns (weights); four fp32 accumulator tiles hold a 32 x 32 block of y.
 *
 * Out of range: |x| within ~0.4 % of FLT_MAX (its first piece rounds to infinity), and subnormals (the
 * conversion and the tile multiply treat them as zero: a piece product below ~2^-126 is lost, so products
 * under ~2^-100 lose the last bits fp32 would keep, an absolute error below 2^-120). An infinite input
 * gives NaN where it meets a weight (its second piece is inf - inf); NaN stays NaN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PANEL 16      /* output columns per panel */
#define BLOCK_COLS 32 /* output columns per block: two panels, two weight tiles */
#define BLOCK_ROWS 32 /* rows per block: two x tiles */
#define TILE_K 32     /* k per tile: 16 pairs of bf16 */
#define PIECES 3
#define X_TILE 512 /* uint16s in an x tile: 16 rows x 32 */
#define W_TILE 256 /* uint32s (bf16 pairs) in a weight tile: 16 pairs x 16 columns */
/* A chunk's x pieces, kept in L2 beside a block's weight pieces (2 MiB per core here): 512 KiB, 1 and
 * 2 MiB per chunk, 512 rows through a model's projections: 229, 204, 215 ms. */
#define CHUNK_BYTES (1 << 20)
/* Weight rows read ahead of the split (two panels, two streams): 12.1 -> 15.4 GB/s from DRAM, one thread */
#define PREFETCH_ROWS 16

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* Linux hands out the tile registers' state only to a process that asks (once, for all its threads). */
static int amx_permitted(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof(config));
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

/* Up to 16 floats from p (the rest zero). */
static inline __m512 load16(const float *p, int64_t count) {
    return count >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
}

/* x's rows [0, rows) of a chunk (row stride K) into pieces: xp[piece][row block][k tile][16][32] uint16
 * (rows up to `padded` and k up to kp zero). Each piece is the bf16 nearest to what the pieces before it
 * left (VCVTNEPS2BF16 rounds to nearest even), and that rest is exact in fp32. Rows split among the
 * threads of the enclosing region. */
static void split_rows(const float *x, int64_t rows, int64_t padded, int64_t K, int64_t kp, uint16_t *xp) {
    const int64_t k_tiles = kp / TILE_K, blocks = padded / 16;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < padded; r++)
        for (int64_t k = 0; k < kp; k += 16) {
            __m512 rest = load16(x + r * K + k, r < rows && k < K ? K - k : 0);
            for (int t = 0; t < PIECES; t++) {
                const __m256bh piece = _mm512_cvtneps_pbh(rest);
                rest = _mm512_sub_ps(rest, _mm512_cvtpbh_ps(piece));
                uint16_t *tile = xp + ((t * blocks + r / 16) * k_tiles + k / TILE_K) * X_TILE;
                _mm256_storeu_si256((__m256i *)(tile + (r % 16) * TILE_K + k % TILE_K), (__m256i)piece);
            }
        }
}

/* Pair rows [from, to) of the two panels at p (K rows of 16 floats each, the second K * 16 floats on)
 * into pieces in AMX's pair layout: wp[piece][panel][k tile][16 pairs][16 columns], each uint32 the bf16
 * of rows 2i (low half) and 2i + 1 (high half) of a column; k from K to kp zero. */
static void split_weights(const float *p, int64_t K, int64_t kp, uint32_t *wp, int64_t from, int64_t to) {
    const int64_t k_tiles = kp / TILE_K;
    /* word 2i of a pair row: the low row's column i (word i of the two rows converted together), 2i + 1 the
     * high row's (word 16 + i) */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int64_t pair = from; pair < to; pair++) {
        const int64_t k = 2 * pair;
        for (int j = 0; j < 2; j++) { /* (both panels in turn: two streams for the hardware prefetchers) */
            const float *panel = p + j * K * PANEL;
            __builtin_prefetch(panel + (k + PREFETCH_ROWS) * PANEL, 0, 3);
            __builtin_prefetch(panel + (k + PREFETCH_ROWS + 1) * PANEL, 0, 3);
            __m512 low = load16(panel + k * PANEL, k < K ? 16 : 0);
            __m512 high = load16(panel + (k + 1) * PANEL, k + 1 < K ? 16 : 0);
            for (int t = 0; t < PIECES; t++) {
                const __m512i words =
                    _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(high, low));
                low = _mm512_sub_ps(low, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
                high = _mm512_sub_ps(high, _mm512_castsi512_ps(_mm512_and_si512(words, high_half)));
                _mm512_store_si512((__m512i *)(wp + ((t * 2 + j) * k_tiles + pair / 16) * W_TILE + (pair % 16) * 16),
                                   words);
            }
        }
    }
}

/* A share of the next column block's weights to split while tiles multiply (see multiply_block). */
typedef struct {
    const float *p; /* the next block's two panels; NULL: nothing to split */
    uint32_t *wp;   /* where its pieces go */
    int64_t from, to; /* its pair rows to split now */
} SplitShare;

/* out[32][32] = rows [32 * block, +32) of the chunk's x times the block of weights in wp. Tiles 0-3
 * accumulate (rows 0-15 | 16-31) x (columns 0-15 | 16-31), 4-5 hold x, 6-7 the weights. Between k tiles
 * it splits `share`'s pair rows of the next block, a few at a time: the vector units convert while the
 * tile unit multiplies, instead of each waiting for the other. */
static void multiply_block(const uint16_t *xp, int64_t blocks, int64_t block, const uint32_t *wp, int64_t k_tiles,
                           float *out, const SplitShare *share, int64_t K, int64_t kp) {
    const int64_t per_tile = share->p == NULL ? 0 : (share->to - share->from + k_tiles - 1) / k_tiles;
    int64_t next_pair = share->from;
#define X(t, half) (xp + ((t) * blocks + block + (half)) * k_tiles * X_TILE + kt * X_TILE)
#define W(t, j) (wp + ((t) * 2 + (j)) * k_tiles * W_TILE + kt * W_TILE)
#define LOAD_X(t) _tile_loadd(4, X(t, 0), 64); _tile_loadd(5, X(t, 1), 64)
#define LOAD_W(t) _tile_loadd(6, W(t, 0), 64); _tile_loadd(7, W(t, 1), 64)
#define MULTIPLY() \
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7)
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kt = 0; kt < k_tiles; kt++) {
        /* x0w0 x0w1 x0w2 x1w1 x1w0 x2w0: ten weight-tile loads instead of twelve */
        LOAD_X(0);
        LOAD_W(0);
        MULTIPLY();
        LOAD_W(1);
        MULTIPLY();
        LOAD_W(2);
        MULTIPLY();
        LOAD_X(1);
        LOAD_W(1);
        MULTIPLY();
        LOAD_W(0);
        MULTIPLY();
        LOAD_X(2);
        MULTIPLY();
        if (per_tile > 0 && next_pair < share->to) {
            const int64_t end = next_pair + per_tile < share->to ? next_pair + per_tile : share->to;
            split_weights(share->p, K, kp, share->wp, next_pair, end);
            next_pair = end;
        }
    }
    _tile_stored(0, out, BLOCK_COLS * 4);
    _tile_stored(1, out + 16, BLOCK_COLS * 4);
    _tile_stored(2, out + 16 * BLOCK_COLS, BLOCK_COLS * 4);
    _tile_stored(3, out + 16 * BLOCK_COLS + 16, BLOCK_COLS * 4);
#undef X
#undef W
#undef LOAD_X
#undef LOAD_W
#undef MULTIPLY
}

/* y[0:width] = row (+ bias), width <= 32. */
static inline void store_row(const float *row, const float *bias, float *y, int64_t width) {
    if (width == BLOCK_COLS) {
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_loadu_ps(row + 16 * h);
            if (bias != NULL) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * h));
            _mm512_storeu_ps(y + 16 * h, v);
        }
        return;
    }
    for (int64_t col = 0; col < width; col++) y[col] = row[col] + (bias != NULL ? bias[col] : 0.f);
}

enum { X_PIECES, W_PIECES }; /* a thread's two buffers */

/* The calling thread's buffer `which` of at least `bytes`, grown as needed and kept (NULL: no memory). */
static void *thread_buffer(int which, int64_t bytes) {
    static __thread void *buffer[2] = {NULL, NULL};
    static __thread int64_t size[2] = {0, 0};
    if (size[which] < bytes) {
        free(buffer[which]);
        size[which] = (bytes + 63) / 64 * 64;
        buffer[which] = aligned_alloc(64, size[which]);
        if (buffer[which] == NULL) size[which] = 0;
    }
    return buffer[which];
}

/* x [M, K], wp the panels of W [N, K] (N padded to 32), bias [N] or NULL, y [M, N]. Returns 1, or 0
 * (nothing written) where the process may not use AMX or there is no memory. */
int amx_linear_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                   int64_t threads) {
    if (!amx_permitted()) return 0;
    const int64_t kp = (K + TILE_K - 1) / TILE_K * TILE_K, k_tiles = kp / TILE_K;
    const int64_t col_blocks = (N + BLOCK_COLS - 1) / BLOCK_COLS;
    const int64_t padded_m = (M + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
    int64_t chunk = CHUNK_BYTES / (PIECES * kp * 2) / BLOCK_ROWS * BLOCK_ROWS;
    if (chunk < BLOCK_ROWS) chunk = BLOCK_ROWS;
    if (chunk > padded_m) chunk = padded_m;
    uint16_t *pieces = thread_buffer(X_PIECES, PIECES * chunk * kp * 2); /* (the caller's: the team's) */
    if (pieces == NULL) return 0;
    if (threads > col_blocks) threads = col_blocks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* this thread's column blocks, the same in every chunk; their pieces in turns of two buffers */
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = col_blocks * me / team, last = col_blocks * (me + 1) / team;
        const int64_t block_words = PIECES * 2 * (kp / TILE_K) * W_TILE, pairs = kp / 2;
        uint32_t *w = thread_buffer(W_PIECES, 2 * block_words * 4);
        float out[BLOCK_ROWS * BLOCK_COLS] __attribute__((aligned(64)));
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        configure_tiles();
#pragma omp barrier
        for (int64_t m0 = 0; m0 < M && !failed; m0 += chunk) {
            const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
            const int64_t padded = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS, blocks = padded / 16;
            const int64_t passes = blocks / 2; /* row blocks of 32 */
            split_rows(x + m0 * K, rows, padded, K, kp, pieces); /* (an omp for: its barrier ends it) */
            if (first < last) split_weights(wp + first * BLOCK_COLS * K, K, kp, w, 0, pairs);
            for (int64_t c = first; c < last; c++) {
                const int64_t n0 = c * BLOCK_COLS, width = N - n0 < BLOCK_COLS ? N - n0 : BLOCK_COLS;
                uint32_t *current = w + ((c - first) % 2) * block_words, *next = w + ((c - first + 1) % 2) * block_words;
                for (int64_t b = 0; b < blocks; b += 2) {
                    const int64_t pass = b / 2;
                    const SplitShare share = {c + 1 < last ? wp + (n0 + BLOCK_COLS) * K : NULL, next,
                                              pairs * pass / passes, pairs * (pass + 1) / passes};
                    multiply_block(pieces, blocks, b, current, k_tiles, out, &share, K, kp);
                    for (int64_t r = 0; r < BLOCK_ROWS && 16 * b + r < rows; r++)
                        store_row(out + r * BLOCK_COLS, bias == NULL ? NULL : bias + n0, y + (m0 + 16 * b + r) * N + n0,
                                  width);
                }
            }
#pragma omp barrier /* (before the next chunk's pieces replace these) */
        }
        _tile_release();
    }
    return !failed;
}

#else
int amx_linear_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K, int64_t N,
                   int64_t threads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)threads;
    return 0; /* (no AMX in what the compiler targets) */
}
#endif
