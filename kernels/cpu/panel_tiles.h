/* The register tiles of the float32 panel matmul (weights in panels of 16 output columns, kernels/panels.py):
 * `run_tile` multiplies up to ROWS rows of x by the two panels of one 32-column tile. Shared by the dense
 * linear (panel_matmul.c, whose top comment says why the layout and the tile shapes are what they are) and
 * the fused mixture-of-experts (moe.c), so that both compute a column's sum in the same order. The build's
 * cache key covers this header (kernels/cpu/loader.py). */
#ifndef PAGODA_PANEL_TILES_H
#define PAGODA_PANEL_TILES_H
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16     /* output columns per panel */
#define TILE_COLS 32 /* two panels per tile */

/* ROWS: the rows of x a tile takes at most; GENERIC_ROWS: those of the two-panel tile below. */
#if defined(__AVX512F__)
#define ROWS 8 /* 8 x 2 zmm accumulators */
#define GENERIC_ROWS 8
#elif defined(__AVX2__) && defined(__FMA__)
#define ROWS 6 /* 6 x 16 columns from 4 rows on (AVX2 below), 3 x 32 below 4 */
#define GENERIC_ROWS 3
#else
#define ROWS 2 /* 2 x 8 xmm (SSE2, NEON) */
#define GENERIC_ROWS 2
#endif

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define VPT (TILE_COLS / VW) /* vectors per tile row */
#define VPP (PANEL / VW)     /* vectors per panel row */

typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vecu __attribute__((vector_size(VW * 4), aligned(4)));

/* A float in every lane, loaded straight into a register (`(vec){0} + f` would hold a zero register). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define broadcast(f) ((vec)_mm512_set1_ps(*(f)))
#elif defined(__AVX__)
#include <immintrin.h>
#define broadcast(f) ((vec)_mm256_broadcast_ss(f))
#else
#define broadcast(f) ((vec){0} + *(f))
#endif

/* One tile: R rows of x (row stride K) times the two panels at p, into R rows of y (row stride N) at
 * columns [0, width). R is a constant in each copy, so that the accumulators stay in registers. */
#define TILE(R)                                                                                                   \
    static void tile_##R(const float *restrict x, int64_t K, const float *restrict p, const float *restrict bias, \
                         float *restrict y, int64_t N, int64_t width, const float *restrict next) {               \
        vec acc[R][VPT];                                                                                          \
        for (int r = 0; r < R; r++)                                                                               \
            for (int v = 0; v < VPT; v++) acc[r][v] = (vec){0};                                                   \
        const float *restrict p1 = p + K * PANEL;                                                                 \
        _Pragma("GCC unroll 8") for (int64_t k = 0; k < K; k++) {                                                 \
            if (next != NULL) { /* (the next tile's two panels, a line of each, as its first pass reads them) */  \
                __builtin_prefetch(next + k * PANEL, 0, 2);                                                       \
                __builtin_prefetch(next + K * PANEL + k * PANEL, 0, 2);                                           \
            }                                                                                                     \
            vec s[R];                                                                                             \
            for (int r = 0; r < R; r++) s[r] = broadcast(x + r * K + k);                                          \
            for (int v = 0; v < VPT; v++) {                                                                       \
                const vec b = *(const vecu *)((v < VPP ? p : p1) + k * PANEL + (v % VPP) * VW);                  \
                for (int r = 0; r < R; r++) acc[r][v] += s[r] * b;                                                \
            }                                                                                                     \
        }                                                                                                         \
        for (int r = 0; r < R; r++) {                                                                             \
            vec out[VPT]; /* (a copy: the accumulators' own address would keep them in memory) */                 \
            for (int v = 0; v < VPT; v++) out[v] = acc[r][v];                                                     \
            store(out, VPT, bias, y + r * N, width);                                                              \
        }                                                                                                         \
    }

/* y[0:width] = acc (+ bias), one vector at a time: copies of the accumulators, never their address,
 * which would keep them in memory instead of registers. */
static inline __attribute__((always_inline)) void store(const vec *acc, const int count, const float *restrict bias,
                                                        float *restrict y, int64_t width) {
    for (int v = 0; v < count; v++) {
        vec t = acc[v];
        const int64_t c0 = v * VW;
        if (width >= c0 + VW) {
            if (bias != NULL) t += *(const vecu *)(bias + c0);
            *(vecu *)(y + c0) = t;
        } else {
            for (int64_t c = c0; c < width; c++) y[c] = t[c - c0] + (bias != NULL ? bias[c] : 0.f);
        }
    }
}

TILE(1)
TILE(2)
#if GENERIC_ROWS > 2
TILE(3)
#endif
#if GENERIC_ROWS > 3
TILE(4)
TILE(5)
TILE(6)
TILE(7)
TILE(8)
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* AVX2's 16 ymm registers hold at most 12 accumulators beside the weights and a broadcast: a tile of
 * 3 rows x 32 columns leaves its accumulators in memory (GCC keeps the generic arrays there), so from 4
 * rows on, a tile is 6 rows x 16 columns (one panel) with named accumulators, as BLIS's haswell kernel
 * is shaped. */
#define FMA_ROW(r)                                                                            \
    if (rows_ > r) {                                                                            \
        const __m256 s = _mm256_broadcast_ss(x + r * K + k);                                  \
        c##r##0 = _mm256_fmadd_ps(s, b0, c##r##0), c##r##1 = _mm256_fmadd_ps(s, b1, c##r##1); \
    }
#define STORE_ROW(r)                                                                                  \
    if (rows_ > r) {                                                                                    \
        const vec acc[2] = {(vec)c##r##0, (vec)c##r##1};                                              \
        store(acc, 2, bias, y + r * N, width);                                                        \
    }
#define PANEL_TILE(R)                                                                                          \
    static void panel_tile_##R(const float *restrict x, int64_t K, const float *restrict p,                    \
                               const float *restrict bias, float *restrict y, int64_t N, int64_t width,       \
                               const float *restrict next) {                                                  \
        const int rows_ = R;                                                                                   \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,    \
               c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;                                          \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) {                                              \
            if (next != NULL) __builtin_prefetch(next + k * PANEL, 0, 2);                                      \
            const __m256 b0 = _mm256_loadu_ps(p + k * PANEL), b1 = _mm256_loadu_ps(p + k * PANEL + 8);         \
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5)                                  \
        }                                                                                                      \
        STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)                          \
    }
PANEL_TILE(4)
PANEL_TILE(5)
PANEL_TILE(6)
#endif

typedef void (*tile_fn)(const float *, int64_t, const float *, const float *, float *, int64_t, int64_t,
                        const float *);
static const tile_fn TILES[] = {0, tile_1, tile_2,
#if GENERIC_ROWS > 2
                                tile_3,
#endif
#if GENERIC_ROWS > 3
                                tile_4, tile_5, tile_6, tile_7, tile_8
#endif
};

/* `rows` rows of x times the two panels at p (output columns [0, width) of them), prefetching the two
 * panels at `next` into L2 unless it is NULL. */
static inline void run_tile(int64_t rows, const float *x, int64_t K, const float *p, const float *bias, float *y,
                           int64_t N, int64_t width, const float *next) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (rows > GENERIC_ROWS) {
        static const tile_fn PANEL_TILES[] = {0, 0, 0, 0, panel_tile_4, panel_tile_5, panel_tile_6};
        PANEL_TILES[rows](x, K, p, bias, y, N, width < PANEL ? width : PANEL, next);
        if (width > PANEL)
            PANEL_TILES[rows](x, K, p + K * PANEL, bias == NULL ? NULL : bias + PANEL, y + PANEL, N, width - PANEL,
                              next == NULL ? NULL : next + K * PANEL);
        return;
    }
#endif
    TILES[rows](x, K, p, bias, y, N, width, next);
}

#endif
