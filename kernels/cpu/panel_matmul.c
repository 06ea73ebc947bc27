/* Dense float32 linear for the CPU, y[M,N] = x[M,K] @ W^T (+ bias), with W kept in panels of 16 output
 * columns: Wp[N/16][K][16] (N padded with zero rows to a multiple of 32; kernels/cpu/__init__.py packs
 * it once at load time). Built and loaded at run time by kernels/cpu/__init__.py.
 *
 * Why its own layout: decode multiplies a few rows by every weight of the model, so a step is the time
 * to stream the weights once. Panels make that one sequential read per tile of output columns, each
 * k step a whole cache line of each panel, and a tile covers two panels, two streams for the hardware
 * prefetchers. Against oneDNN's packed matmul on this machine kind (same run, a model's weights
 * streamed): 1.36x as fast at one row, 1.02-1.20x at 4-64 rows, level within the noise from 512 rows
 * on (docs/decode-speed.md), so one copy of the weights serves decode and prefill.
 *
 * A tile is ROWS rows x 32 columns of accumulators held in registers (16 zmm with AVX-512, 12 ymm
 * with AVX2), the k loop unrolled 8 times. With many rows, a chunk of ~1 MiB of x stays in L2 while
 * every panel passes over it. Threads split the tiles of output columns, so each weight is read once
 * per chunk of rows, by one thread.
 *
 * With more rows than one tile takes (a batch of 9-47 decodes), the first pass over a tile's panels
 * waits on DRAM and the later ones compute from L2. The last pass therefore prefetches the next tile's
 * panels into L2, so that the memory streams while the FMAs run instead of between them: 16 rows
 * through a model's weights from DRAM, 26.4-31.1 -> 24.2-26.5 ms on two threads (docs/decode-speed.md).
 *
 * From PACKED_MIN_ROWS rows on (a loaded server's decode batch, a prefill), each tile's rows of x (8, or
 * AVX2's 6) are first copied into one interleaved stream, xp[k * 8 + r], so that a tile's broadcasts
 * read one sequential stream instead of eight rows K floats apart; on AVX-512 a packed tile then takes
 * three panels. Same sums in the same order, so the same bits. A layer's four projections at 512 rows,
 * 30 layers: 632 -> 589 ms (median) for the packing, 590 -> 571 more for the third panel. Every pass
 * after a tile's first prefetches a share of the next tile's panels (struct Prefetch), and a chunk's
 * last few rows are a tile padded with zero rows rather than an unpacked pass that streams every weight
 * from DRAM again: a decode step's projections at 64 rows, 30 layers, 61-64 -> 52-53 ms (AVX2 build:
 * 84.5 -> 80.6); at 272 rows, AVX2, 356 -> 319 (docs/decode-speed.md).
 */
#include "panel_tiles.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HAVE_PACKED_PATH 1
#define PACKED_MIN_ROWS 48 /* (below it, unpacked tiles were as fast or faster: 16-40 rows, docs/decode-speed.md) */
#define PACKED_CHUNK_BYTES (1 << 19) /* packed rows of x per pass over the weights: with a tile's panels, in L2 */
#define PACKED_MIN_CHUNK 64          /* rows, whatever K: each pass reads every weight */
#if defined(__AVX512F__)
#define WIDE_PANELS 3 /* a packed tile's panels: 8 rows x 48 columns, 24 of the 32 zmm registers */
#else
#define WIDE_PANELS 2 /* (AVX2: two passes of one panel, below) */
#endif

/* The next tile's panels, prefetched into L2 while this tile's row groups compute from the cache: the
 * first group's pass reads a tile's panels from DRAM, the later ones from L2. Group g (1..groups-1)
 * prefetches the lines k = phase, phase + every, ... of each of the next tile's `panels` panels (phase =
 * g - 1, every = groups - 1), so that the whole tile arrives spread over the passes instead of in
 * bursts the memory cannot serve. */
typedef struct {
    const float *next; /* NULL: nothing to prefetch */
    int64_t panels, every, phase;
} Prefetch;

static inline __attribute__((always_inline)) void prefetch_lines(const Prefetch *pf, int64_t K, int64_t k) {
    /* (a constant trip count: a loop of unknown length here kept GCC from unrolling the tile's k loop,
     * which cost the whole gain) */
    for (int v = 0; v < WIDE_PANELS; v++)
        if (v < pf->panels) __builtin_prefetch(pf->next + (v * K + k) * PANEL, 0, 2);
}

#if defined(__AVX512F__)
/* One tile from packed rows: ROWS rows of x, xp[k * ROWS + r], times P panels from p (columns [0, width)
 * of them). P is a constant in each copy, so that the accumulators stay in registers. With 3 panels, each
 * broadcast feeds 3 FMAs instead of 2: a layer's projections at 512 rows, 628 -> 575 ms (median of 16,
 * alternated; 272 rows: 317 -> 294). */
#define PACKED_TILE(P)                                                                                       \
    static void packed_tile_##P(const float *restrict xp, int64_t K, const float *restrict p,                \
                                const float *restrict bias, float *restrict y, int64_t N, int64_t width,     \
                                int64_t rows, const Prefetch *pf) {                                          \
        vec acc[ROWS][P];                                                                                    \
        for (int r = 0; r < ROWS; r++)                                                                       \
            for (int v = 0; v < P; v++) acc[r][v] = (vec){0};                                                \
        int64_t due = pf->next != NULL ? pf->phase : K;                                                      \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) {                                            \
            if (k == due) prefetch_lines(pf, K, k), due += pf->every;                                        \
            vec b[P];                                                                                        \
            for (int v = 0; v < P; v++) b[v] = *(const vecu *)(p + v * K * PANEL + k * PANEL);              \
            for (int r = 0; r < ROWS; r++) {                                                                 \
                const vec s = broadcast(xp + k * ROWS + r);                                                  \
                for (int v = 0; v < P; v++) acc[r][v] += s * b[v];                                           \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < ROWS; r++) { /* (to ROWS: a constant trip count keeps acc in registers) */       \
            if (r >= rows) break;                                                                            \
            vec out[P];                                                                                      \
            for (int v = 0; v < P; v++) out[v] = acc[r][v];                                                  \
            store(out, P, bias, y + r * N, width);                                                           \
        }                                                                                                    \
    }
PACKED_TILE(2)
PACKED_TILE(3)
static void packed_tile(int64_t panels, const float *restrict xp, int64_t K, const float *restrict p,
                        const float *restrict bias, float *restrict y, int64_t N, int64_t width, int64_t rows,
                        const Prefetch *pf) {
    if (panels == 3) packed_tile_3(xp, K, p, bias, y, N, width, rows, pf);
    else packed_tile_2(xp, K, p, bias, y, N, width, rows, pf);
}

#else
/* AVX2: ROWS (6) packed rows times one panel, with named accumulators as panel_tile_6 has. */
#define PACKED_FMA_ROW(r)                                                                     \
    {                                                                                         \
        const __m256 s = _mm256_broadcast_ss(xp + k * ROWS + r);                              \
        c##r##0 = _mm256_fmadd_ps(s, b0, c##r##0), c##r##1 = _mm256_fmadd_ps(s, b1, c##r##1); \
    }
static void packed_panel_tile(const float *restrict xp, int64_t K, const float *restrict p,
                              const float *restrict bias, float *restrict y, int64_t N, int64_t width, int64_t rows,
                              const Prefetch *pf) {
    const int64_t rows_ = rows; /* (the rows stored; padding rows are computed and dropped) */
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
           c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    int64_t due = pf != NULL && pf->next != NULL ? pf->phase : K;
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) {
        if (k == due) prefetch_lines(pf, K, k), due += pf->every;
        const __m256 b0 = _mm256_loadu_ps(p + k * PANEL), b1 = _mm256_loadu_ps(p + k * PANEL + 8);
        PACKED_FMA_ROW(0) PACKED_FMA_ROW(1) PACKED_FMA_ROW(2) PACKED_FMA_ROW(3) PACKED_FMA_ROW(4) PACKED_FMA_ROW(5)
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
}
static void packed_tile(int64_t panels, const float *restrict xp, int64_t K, const float *restrict p,
                        const float *restrict bias, float *restrict y, int64_t N, int64_t width, int64_t rows,
                        const Prefetch *pf) {
    (void)panels; /* (always 2; the first panel's pass issues the whole share of prefetches) */
    packed_panel_tile(xp, K, p, bias, y, N, width < PANEL ? width : PANEL, rows, pf);
    if (width > PANEL)
        packed_panel_tile(xp, K, p + K * PANEL, bias == NULL ? NULL : bias + PANEL, y + PANEL, N, width - PANEL,
                          rows, NULL);
}
#endif

/* The calling thread's buffer for packed rows, grown as needed and kept (NULL: no memory). */
static float *packed_buffer(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t size = 0;
    if (size < floats) {
        free(buffer);
        size = (floats + 15) / 16 * 16;
        buffer = aligned_alloc(64, size * sizeof(float));
        if (buffer == NULL) size = 0;
    }
    return buffer;
}

/* panel_linear_f32 from packed rows of x (see the top); returns 0 where there is no memory to pack. */
static int packed_linear(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                         int64_t N, int64_t threads) {
    const int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS, panels = 2 * tiles;
    /* tiles of WIDE_PANELS panels, then two-panel ones for the rest (the panel count is even) */
    int64_t wide = panels / WIDE_PANELS, narrow = panels % WIDE_PANELS;
    if (narrow % 2) wide -= 1, narrow += WIDE_PANELS;
    narrow /= 2;
    int64_t chunk = PACKED_CHUNK_BYTES / (K * (int64_t)sizeof(float)) / ROWS * ROWS;
    if (chunk < PACKED_MIN_CHUNK) chunk = PACKED_MIN_CHUNK / ROWS * ROWS; /* (a long K: fewer passes over the weights) */
    float *xp = packed_buffer(chunk * K);
    if (xp == NULL) return 0;
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        /* the last group's missing rows are packed as zeros, computed and not stored: one more pass over a
         * tile's panels from L2, where unpacked tiles for them would stream every weight from DRAM again */
        const int64_t m1 = m0 + chunk < M ? m0 + chunk : M, groups = (m1 - m0 + ROWS - 1) / ROWS;
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++)
                for (int64_t k = 0; k < K; k++)
                    for (int r = 0; r < ROWS; r++) {
                        const int64_t m = m0 + g * ROWS + r;
                        xp[(g * K + k) * ROWS + r] = m < m1 ? x[m * K + k] : 0.f;
                    }
#pragma omp for schedule(static)
            for (int64_t u = 0; u < wide + narrow; u++) {
                const int64_t panels = u < wide ? WIDE_PANELS : 2, next_panels = u + 1 < wide ? WIDE_PANELS : 2;
                const int64_t n0 = (u < wide ? u * WIDE_PANELS : wide * WIDE_PANELS + (u - wide) * 2) * PANEL;
                const int64_t width = N - n0 < panels * PANEL ? N - n0 : panels * PANEL;
                const float *b = bias == NULL ? NULL : bias + n0;
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t rows = m1 - m0 - g * ROWS < ROWS ? m1 - m0 - g * ROWS : ROWS;
                    const Prefetch pf = {g > 0 && u + 1 < wide + narrow ? wp + (n0 + panels * PANEL) * K : NULL,
                                         next_panels, groups - 1, g - 1};
                    packed_tile(panels, xp + g * ROWS * K, K, wp + n0 * K, b, y + (m0 + g * ROWS) * N + n0, N, width,
                                rows, &pf);
                }
            }
        }
    }
    return 1;
}
#endif

/* x [M, K], wp the panels of W [N, K] (N padded to 32), bias [N] or NULL, y [M, N]. */
void panel_linear_f32(const float *x, const float *wp, const float *bias, float *y, int64_t M, int64_t K,
                      int64_t N, int64_t threads) {
    const int64_t tiles = (N + TILE_COLS - 1) / TILE_COLS;
    int64_t chunk = (1 << 20) / (K * (int64_t)sizeof(float)) / ROWS * ROWS; /* rows of x kept in L2 */
    if (chunk < ROWS) chunk = ROWS;
    if (threads > tiles) threads = tiles;
#ifdef HAVE_PACKED_PATH
    if (M >= PACKED_MIN_ROWS && packed_linear(x, wp, bias, y, M, K, N, threads)) return;
#endif
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
        const int64_t m1 = m0 + chunk < M ? m0 + chunk : M;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t u = 0; u < tiles; u++) {
            const int64_t n0 = u * TILE_COLS, width = N - n0 < TILE_COLS ? N - n0 : TILE_COLS;
            for (int64_t m = m0; m < m1; m += ROWS) {
                const int64_t rows = m1 - m < ROWS ? m1 - m : ROWS;
                /* (the last of two or more passes: see the top) */
                const int prefetch = m > m0 && m + ROWS >= m1 && u + 1 < tiles;
                run_tile(rows, x + m * K, K, wp + n0 * K, bias == NULL ? NULL : bias + n0, y + m * N + n0, N, width,
                         prefetch ? wp + (n0 + TILE_COLS) * K : NULL);
            }
        }
    }
}
